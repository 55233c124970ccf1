"""The seed models' checkpoints (issue 13; bench/device/make_seed_models.py) as lmdeploy 0.18 reads them.

On the CPU: the tiny variants (``internvl2_2b_tiny``: layer-norm InternViT with qkv bias, as
InternViT-300M; ``internvl2_26b_tiny``: RMS-norm InternViT with qk normalization and no qkv bias, as
InternViT-6B; both with an InternLM2 LLM) are built with weights, the real-shape InternVL2-2B and
-26B without (``dry_run``: config, remote code, tokenizer). Then what lmdeploy does with them before
any GPU work:

- ``lmdeploy.archs.get_model_arch`` with ``trust_remote_code`` (the checkpoint's own config
  classes), ``check_vl_llm``, the PyTorch engine's ``ModelConfig.from_pretrained``;
- TurboMind's source-model registry (``is_supported``, ``INPUT_MODELS['internvl']`` with its
  InternLM2 text model and legacy InternViT vision model) over the recording stand-in binding
  (tests/turbomind_binding.py), and its legacy weight-name mapping over every vision key;
- lmdeploy's real prompt path (``ImageEncoder`` + ``MultimodalProcessor``, the ``hf`` chat template
  from the tokenizer) with featcache's frontend installed, as tests/test_lmdeploy_frontend.py does:
  the same prompt and per-image dicts as plain lmdeploy, and a second request a hit that skips
  lmdeploy's preprocessing.

lmdeploy's InternVL V1-5 preprocessing (dynamic tiling) imports torchvision's transforms, which
have no build that loads beside this machine's CPU torch. Where torchvision is missing, a stand-in
of the five transforms it uses (``Compose``, ``Lambda``, ``Resize`` with bicubic, ``ToTensor``,
``Normalize``) is put in ``sys.modules`` for the test: on PIL images these are PIL's bicubic
resize, a /255 float CHW tensor and (x - mean) / std, as torchvision computes them.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import types

import _lmdeploy_stack
import pytest
import torch

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402
import turbomind_binding  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "bench", "device"))
import make_seed_models as seed  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION, install_frontend  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers: rope_scaling
TINY = ["tiny2b", "tiny26b"]
TILES = 7  # a 170x120 image in 56 px tiles: 3 x 2 crops + a thumbnail


def IMAGE():  # noqa: N802
    return tiny.noise_image(170, 120, seed=7)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("seed_models"))
    built = {k: seed.build(k, root, device="cpu") for k in TINY}
    built.update({k: seed.build(k, root, dry_run=True) for k in ("2b", "26b")})
    return built


def _torchvision_stand_in() -> dict[str, types.ModuleType]:
    import numpy as np
    from PIL import Image

    class Compose:
        def __init__(self, transforms):
            self.transforms = transforms

        def __call__(self, x):
            for t in self.transforms:
                x = t(x)
            return x

    class Lambda:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, x):
            return self.fn(x)

    class Resize:
        def __init__(self, size, interpolation=None):
            self.size, self.interpolation = size, interpolation

        def __call__(self, img):
            h, w = self.size
            return img.resize((w, h), self.interpolation)

    class ToTensor:
        def __call__(self, img):
            return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()

    class Normalize:
        def __init__(self, mean, std):
            self.mean = torch.tensor(mean).view(-1, 1, 1)
            self.std = torch.tensor(std).view(-1, 1, 1)

        def __call__(self, x):
            return (x - self.mean) / self.std

    root = types.ModuleType("torchvision")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.InterpolationMode = types.SimpleNamespace(BICUBIC=Image.BICUBIC)
    for cls in (Compose, Lambda, Resize, ToTensor, Normalize):
        setattr(transforms, cls.__name__, cls)
    transforms.functional = functional
    root.transforms = transforms
    return {"torchvision": root, "torchvision.transforms": transforms,
            "torchvision.transforms.functional": functional}


@pytest.fixture
def torchvision(monkeypatch):
    if importlib.util.find_spec("torchvision") is None:
        for name, module in _torchvision_stand_in().items():
            monkeypatch.setitem(sys.modules, name, module)


# -- configs as lmdeploy reads them --------------------------------------------------------------

@pytest.mark.parametrize("key", [*TINY, "2b", "26b"])
def test_config_loads_as_lmdeploy_reads_it(models, key, monkeypatch):
    import lmdeploy.pytorch.config as pt_config
    from lmdeploy.archs import check_vl_llm, get_model_arch
    from lmdeploy.pytorch.config import ModelConfig

    # the real-shape configs are bf16: lmdeploy asks CUDA whether bf16 works (an H200: yes)
    monkeypatch.setattr(pt_config, "is_bf16_supported", lambda *a, **k: True)

    spec, path = seed.SPECS[key], models[key]["path"]
    arch, cfg = get_model_arch(path, trust_remote_code=True)
    assert arch == "InternVLChatModel" and check_vl_llm("pytorch", cfg.to_dict())
    assert type(cfg).__name__ == "InternVLChatConfig"
    assert type(cfg.llm_config).__name__ == "InternLM2Config"
    assert cfg.llm_config.architectures == ["InternLM2ForCausalLM"]
    v = cfg.vision_config
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "norm_type",
              "qk_normalization", "qkv_bias"):
        assert getattr(v, k) == spec.vit[k], k
    tiling = (cfg.ps_version, cfg.downsample_ratio, cfg.dynamic_image_size, cfg.use_thumbnail)
    assert tiling == ("v2", 0.5, True, True)
    assert cfg.max_dynamic_patch == 12 and cfg.force_image_size == v.image_size == spec.image_size

    mc = ModelConfig.from_pretrained(path, trust_remote_code=True, dtype="float16")
    llm = spec.llm
    assert (mc.hidden_size, mc.num_layers, mc.num_attention_heads, mc.num_key_value_heads) == (
        llm["hidden_size"], llm["num_hidden_layers"], llm["num_attention_heads"], llm["num_key_value_heads"])
    assert mc.head_dim == llm["hidden_size"] // llm["num_attention_heads"]
    if spec.real_ids:
        assert mc.vocab_size == 92553 and mc.bos_token_id == 1
        if key == "26b":
            assert mc.head_dim == 128 and v.hidden_size // v.num_attention_heads == 128
        # 448 px, patch 14, pixel shuffle 0.5: 256 tokens a tile
        assert (v.image_size // v.patch_size) ** 2 * cfg.downsample_ratio ** 2 == 256


def test_real_shapes_are_the_seed_models(models):
    """Parameter counts of the plans (no weights written here): InternVL2-2B 2.2B, -26B 25.5B."""
    assert round(models["2b"]["params"] / 1e9, 2) == 2.21
    assert round(models["26b"]["params"] / 1e9, 1) == 25.5
    assert 50e9 < models["26b"]["tensor_bytes"] < 53e9  # bf16, about 51 GB in ~13 shards of 4 GB
    for key in ("2b", "26b"):
        with open(os.path.join(models[key]["path"], "config.json")) as f:
            c = json.load(f)
        assert c["llm_config"]["vocab_size"] == 92553 and c["template"] == "internlm2-chat"


@pytest.mark.parametrize("key", [*TINY, "2b", "26b"])
def test_turbomind_source_model_accepts_it(models, key, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))
    spec, path = seed.SPECS[key], models[key]["path"]
    with turbomind_binding.installed() as binding:
        from lmdeploy.archs import get_model_arch
        from lmdeploy.turbomind.models.base import INPUT_MODELS
        from lmdeploy.turbomind.models.internvl import map_legacy_internvl_keys
        from lmdeploy.turbomind.supported_models import SUPPORTED_ARCHS, is_supported

        assert is_supported(path, trust_remote_code=True)
        _, cfg = get_model_arch(path, trust_remote_code=True)
        model = INPUT_MODELS.get(SUPPORTED_ARCHS["InternVLChatModel"])(
            cfg, resolver=None, vision_resolver=None, vision_data_type=torch.float16)
        assert type(model.text_model).__name__ == "InternLM2Model"
        vm = model.vision_model
        assert type(vm).__name__ == "LegacyInternVitVisionModel"
        assert vm._norm_type is getattr(binding.NormType, spec.vit["norm_type"].upper())
        assert vm._use_qk_norm is spec.vit["qk_normalization"]
        assert vm._image_seq_length == (256 if spec.real_ids else 4)
        assert vm._out_hidden == spec.llm["hidden_size"]
        assert vm._projector_in_dim == 4 * spec.vit["hidden_size"]
        assert model._vocab_size == (92553 if spec.real_ids else models[key]["vocab"])
        names = [n for n, _, _ in seed.tensors(cfg.to_dict())]
        vision = [n for n in names if not n.startswith("language_model.")]
        assert all(map_legacy_internvl_keys(n).startswith("model.") for n in vision)


@pytest.mark.parametrize("key", TINY)
def test_checkpoint_holds_the_planned_weights(models, key):
    from safetensors import safe_open

    path = models[key]["path"]
    with open(os.path.join(path, "config.json")) as f:
        plan = {n: s for n, s, _ in seed.tensors(json.load(f))}
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(plan)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == plan
    spec = seed.SPECS[key]
    assert ("vision_model.encoder.layers.0.attn.q_norm.weight" in plan) is spec.vit["qk_normalization"]
    assert ("vision_model.encoder.layers.0.attn.qkv.bias" in plan) is spec.vit["qkv_bias"]
    assert ("vision_model.encoder.layers.0.norm1.bias" in plan) is (spec.vit["norm_type"] == "layer_norm")


# -- featcache's frontend on lmdeploy's prompt path ----------------------------------------------

@pytest.mark.parametrize("key", TINY)
def test_frontend_on_lmdeploy_prompt_path(models, key, torchvision):
    """PyTorch engine: featcache's frontend against plain lmdeploy, miss then hit."""
    path = models[key]["path"]
    cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
    plain = tiny.PromptPath(path, trust_remote_code=True)
    cached = tiny.PromptPath(path, trust_remote_code=True)
    try:
        install_frontend(cached.model, cache, f"test:{key}")
        msgs = tiny.messages(tiny.image_item(IMAGE()))
        out, want = cached.prompt(msgs), plain.prompt(msgs)
        assert out["prompt"] == want["prompt"] and out["input_ids"] == want["input_ids"]
        assert "<|im_start|>user\n" in want["prompt"] and "<img><IMG_CONTEXT></img>" in want["prompt"]
        item, real = out["multimodal"][0], want["multimodal"][0]
        assert real["pixel_values"].shape == (TILES, 3, 56, 56) and real["image_tokens"] == TILES * 4
        assert want["input_ids"].count(real["image_token_id"]) == TILES * 4
        assert torch.equal(item["pixel_values"], real["pixel_values"]) and not item[REF_KEY].hit
        # the engine stores the features (one row a token, LLM hidden 256); the same image hits
        cache.put(item[REF_KEY].key, torch.randn(TILES * 4, 256), meta=item[REF_KEY].meta)
        again, want2 = cached.prompt(msgs), plain.prompt(msgs)
        # the miss preprocessed by featcache (exactly: the pixels above), the hit not at all;
        # lmdeploy's own preprocessing ran for plain only
        assert len(cached.calls) == 0 and len(plain.calls) == 2
        assert cache.stats()[SECTION]["preprocess_fast"] == 1
        assert again["input_ids"] == want2["input_ids"] and again["multimodal"][0][REF_KEY].hit
        assert again["multimodal"][0]["pixel_values"].shape[0] == 0
        stats = cache.stats()[SECTION]
        assert stats["hits"] == 1 and stats["misses"] == 1 and not stats.get("frontend_errors")
        del out, again, item
    finally:
        plain.close()
        cached.close()
        gc.collect()
        cache.close()


@pytest.mark.parametrize("key", TINY)
def test_turbomind_native_path(models, key, torchvision, monkeypatch):
    """TurboMind: featcache's native path against plain lmdeploy at the C++ boundary (stand-in
    binding): the same token span and pixels, miss then hit, the hit without preprocessing."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))
    path = models[key]["path"]
    with turbomind_binding.installed():
        from lmdeploy.messages import TurbomindEngineConfig
        from lmdeploy.turbomind.builders._base import Context, _torch_dtype_to_cpp
        from lmdeploy.turbomind.models.base import INPUT_MODELS
        from lmdeploy.turbomind.turbomind import TurboMind
        from transformers import AutoConfig

        from featcache.lmdeploy.turbomind.native import install_native

        model = INPUT_MODELS.get("internvl")(AutoConfig.from_pretrained(path, trust_remote_code=True),
                                             resolver=None, vision_resolver=None,
                                             vision_data_type=torch.float16)
        model.vision_model.bind_runtime(ctx=Context([0], None, _torch_dtype_to_cpp(torch.float16), None),
                                        root_handles=None, model_tp=None)
        tm = object.__new__(TurboMind)
        tm.engine_config = TurbomindEngineConfig(dtype="float16")
        tm.source_model = model
        cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        plain = tiny.PromptPath(path, "float16", backend="turbomind", trust_remote_code=True)
        cached = tiny.PromptPath(path, "float16", backend="turbomind", trust_remote_code=True)
        try:
            install_native(cached.model, cache, f"test-tm:{key}", vision_dtype=torch.float16)
            msgs = tiny.messages(tiny.image_item(IMAGE()))
            want = plain.prompt(msgs)
            (w,) = tm.mm_input_converter(want["multimodal"]).args[0]
            for _ in range(2):  # a miss, then a hit
                got = cached.prompt(msgs)
                (g,) = tm.mm_input_converter(got["multimodal"]).args[0]
                assert got["input_ids"] == want["input_ids"]
                assert (g.kwargs["token_begin"], g.kwargs["token_end"]) == (
                    w.kwargs["token_begin"], w.kwargs["token_end"])
                assert w.kwargs["token_end"] - w.kwargs["token_begin"] == TILES * 4
                assert torch.equal(g.kwargs["data"].args[0], w.kwargs["data"].args[0])
                assert len(g.kwargs["fingerprint"]) == 32
            stats = cache.stats()[SECTION]
            # the miss preprocessed by featcache, the second request not at all
            assert len(cached.calls) == 0 and stats["preprocess_fast"] == 1
            assert stats["hits"] == 1 and stats["tm_pixels_served"] == 1
        finally:
            plain.close()
            cached.close()
            gc.collect()
            cache.close()


# -- the TurboMind features path's tower for legacy InternVLChatModel checkpoints ---------------------

def _legacy_features_by_hand(path: str, pixels: torch.Tensor) -> torch.Tensor:
    """InternVL's legacy vision computation written out from its published modelling code
    (InternViT: patch conv + CLS + positions; per layer x += ls1 * attn(norm1 x), x += ls2 *
    mlp(norm2 x), q/k RMS-normalised over the whole width; last layer, CLS dropped, 2x2 pixel
    shuffle, mlp1), in float32, straight from the checkpoint's tensors."""
    from safetensors.torch import load_file

    w = load_file(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    v = cfg["vision_config"]
    eps, heads, width = v["layer_norm_eps"], v["num_attention_heads"], v["hidden_size"]
    F = torch.nn.functional  # noqa: N806

    def norm(x, prefix):
        if v["norm_type"] == "rms_norm":
            return w[prefix + ".weight"] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        return F.layer_norm(x, (x.shape[-1],), w[prefix + ".weight"], w[prefix + ".bias"], eps)

    e = "vision_model.embeddings."
    x = F.conv2d(pixels, w[e + "patch_embedding.weight"], w[e + "patch_embedding.bias"],
                 stride=v["patch_size"])
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([w[e + "class_embedding"].expand(x.shape[0], 1, -1), x], 1) + w[e + "position_embedding"]
    for i in range(v["num_hidden_layers"]):
        p = f"vision_model.encoder.layers.{i}."
        h = norm(x, p + "norm1")
        qkv = F.linear(h, w[p + "attn.qkv.weight"], w.get(p + "attn.qkv.bias"))
        q, k, val = qkv.chunk(3, dim=-1)
        if v["qk_normalization"]:
            q, k = norm(q, p + "attn.q_norm"), norm(k, p + "attn.k_norm")
        b, n, _ = q.shape
        q, k, val = (t.view(b, n, heads, width // heads).transpose(1, 2) for t in (q, k, val))
        a = F.scaled_dot_product_attention(q, k, val).transpose(1, 2).reshape(b, n, width)
        x = x + w[p + "ls1"] * F.linear(a, w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
        h = norm(x, p + "norm2")
        h = F.linear(F.gelu(F.linear(h, w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"])),
                     w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"])
        x = x + w[p + "ls2"] * h
    x = x[:, 1:, :]
    side = int(x.shape[1] ** 0.5)
    x = x.reshape(x.shape[0], side, side, -1)  # pixel shuffle 0.5 (InternVL's, as published)
    n, ww, hh, c = x.shape
    x = x.view(n, ww, hh // 2, c * 2).permute(0, 2, 1, 3).contiguous()
    x = x.view(n, hh // 2, ww // 2, c * 4).permute(0, 2, 1, 3).contiguous()
    x = x.reshape(n, -1, c * 4)
    x = F.layer_norm(x, (x.shape[-1],), w["mlp1.0.weight"], w["mlp1.0.bias"], 1e-5)
    x = F.linear(F.gelu(F.linear(x, w["mlp1.1.weight"], w["mlp1.1.bias"])), w["mlp1.3.weight"],
                 w["mlp1.3.bias"])
    return x


GPU_RUN_LIST = "on the GPU run list (docs/benchmarks.md, 'The GPU run list')"


@pytest.mark.parametrize("key", TINY)
def test_legacy_tower_computes_the_published_internvit(models, key, monkeypatch):
    """The features path's tower for InternVLChatModel (lmdeploy's PyTorch-engine InternViT and
    mlp1 with the checkpoint's weights, no LLM) gives the published computation's features.

    The layer-norm tower (InternViT-300M shape) runs on the CPU, in CI. The RMS-norm tower
    (InternViT-6B shape) uses lmdeploy's RMSNorm, a Triton kernel: it runs on CUDA, on the GPU
    run list (docs/benchmarks.md), and skips elsewhere."""
    import importlib.util

    from featcache.lmdeploy.turbomind.features import LegacyInternVLTower, check_features_arch

    check_features_arch("InternVLChatModel")  # served by the features path now
    device = "cpu"
    if seed.SPECS[key].vit["norm_type"] == "rms_norm":  # lmdeploy's RMSNorm is a Triton kernel
        if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
            pytest.skip(f"lmdeploy's RMSNorm is a Triton kernel (needs CUDA and Triton): {GPU_RUN_LIST}")
        device = "cuda"
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the patch conv in float32
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    path = models[key]["path"]
    tower = LegacyInternVLTower.from_pretrained(path, torch.float32, device)
    pixels = torch.randn(TILES, 3, 56, 56, generator=torch.Generator().manual_seed(3))
    got = tower(pixels).cpu()
    want = _legacy_features_by_hand(path, pixels)
    assert got.shape == want.shape == (TILES, 4, tower.config.llm_config.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got[0], got[1])  # tiles differ: the weights reach the output


def test_turbomind_features_path_serves_the_legacy_models_features(models, torchvision, monkeypatch):
    """The features path on a legacy checkpoint (the layer-norm InternViT-300M shape), on lmdeploy's
    real TurboMind prompt path: a miss runs the tower once, a hit hands TurboMind the cached host
    tensor itself, with no preprocessing and no tower."""
    from lmdeploy.messages import TurbomindEngineConfig

    from featcache.lmdeploy import wrap
    from featcache.lmdeploy.turbomind.features import LegacyInternVLTower

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))
    path = models["tiny2b"]["path"]
    with turbomind_binding.installed():
        prompt = tiny.PromptPath(path, "float16", backend="turbomind", trust_remote_code=True)
        plain = tiny.PromptPath(path, "float16", backend="turbomind", trust_remote_code=True)
        engine = types.SimpleNamespace(vl_encoder=prompt.encoder, prompt_processor=prompt.processor,
                                       backend_config=TurbomindEngineConfig(dtype="float16"))
        cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        try:
            wrap(types.SimpleNamespace(async_engine=engine), cache, turbomind="features")
            msgs = tiny.messages(tiny.image_item(IMAGE()))
            pixels = plain.prompt(msgs)["multimodal"][0]["pixel_values"]
            first = prompt.prompt(msgs)
            (feats,) = first["input_embeddings"]
            tower = LegacyInternVLTower.from_pretrained(path, torch.float16, "cpu")
            assert torch.equal(feats, tower(pixels).reshape(-1, feats.shape[-1]))
            assert feats.shape[0] == TILES * 4 and feats.dtype == torch.float16
            second = prompt.prompt(msgs)
            # the miss preprocessed by featcache, the hit not at all
            assert len(prompt.calls) == 0 and cache.stats()[SECTION]["preprocess_fast"] == 1
            assert second["input_embeddings"][0].data_ptr() == feats.data_ptr()
            assert second["input_ids"] == first["input_ids"]
            stats = cache.stats()[SECTION]
            assert stats["vision_images"] == 1 and stats["tm_features_served"] == 1
        finally:
            prompt.close()
            plain.close()
            gc.collect()
            cache.close()
