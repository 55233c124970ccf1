"""featcache on lmdeploy's TurboMind prompt path, up to the C++ boundary, on the CPU.

lmdeploy's real ``ImageEncoder`` + ``MultimodalProcessor`` (backend "turbomind") build what
``VLAsyncEngine`` hands TurboMind; lmdeploy's real ``TurboMind.mm_input_converter`` and the real
source models' ``to_turbomind_multimodal`` (``lmdeploy/turbomind/models/internvl.py``,
``qwen2_vl.py``) turn it into the binding's items. Only the compiled binding is a stand-in
(tests/turbomind_binding.py): it records what would cross into C++.

One CUDA query is answered: ``load_vl_model`` asks ``torch.cuda.mem_get_info`` for a ``max_memory``
that native-vision models never use.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys
import types

import _lmdeploy_stack
import pytest
import torch

# a skip naming the missing module (CI fails instead); lmdeploy.turbomind.turbomind imports shortuuid
_lmdeploy_stack.require("shortuuid")

import lmdeploy_tiny as tiny  # noqa: E402
import turbomind_binding  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy import wrap  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402
from featcache.lmdeploy.turbomind.common import check_host_cache  # noqa: E402
from featcache.lmdeploy.turbomind.native import fingerprint, install_native  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")

ENGINE_DTYPE = "float16"  # bfloat16 would ask CUDA whether it is supported


@pytest.fixture(scope="module")
def binding():
    with turbomind_binding.installed() as b:
        yield b


@pytest.fixture(autouse=True)
def no_cuda_query(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))


def source_model(arch: str, path: str):
    """lmdeploy's TurboMind source model for the checkpoint, bound like TurboMind binds it, inside
    a ``TurboMind`` whose ``mm_input_converter`` is the real one."""
    from lmdeploy.messages import TurbomindEngineConfig
    from lmdeploy.turbomind.builders._base import Context, _torch_dtype_to_cpp
    from lmdeploy.turbomind.models.base import INPUT_MODELS
    from lmdeploy.turbomind.supported_models import SUPPORTED_ARCHS
    from lmdeploy.turbomind.turbomind import TurboMind
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    model = INPUT_MODELS.get(SUPPORTED_ARCHS[arch])(
        cfg, resolver=None, vision_resolver=None, vision_data_type=torch.float16)
    ctx = Context([0], None, _torch_dtype_to_cpp(torch.float16), None)
    model.vision_model.bind_runtime(ctx=ctx, root_handles=None, model_tp=None)
    tm = object.__new__(TurboMind)  # no engine: only its Python input handling runs
    tm.engine_config = TurbomindEngineConfig(dtype=ENGINE_DTYPE)
    tm.source_model = model
    return tm


class Sha256Counter:
    """Counts sha256 objects made while installed (lmdeploy's pixel fingerprints use them)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        real = hashlib.sha256

        def sha256(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(hashlib, "sha256", sha256)


class Rig:
    def __init__(self, arch: str, path: str, cache: FeatureCache | None = None) -> None:
        self.arch = arch
        self.cache = cache or FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        self.plain = tiny.PromptPath(path, ENGINE_DTYPE, backend="turbomind")
        self.cached = tiny.PromptPath(path, ENGINE_DTYPE, backend="turbomind")
        install_native(self.cached.model, self.cache, f"test-tm:{arch}", vision_dtype=torch.float16)
        self.cached.record_featcache()  # calls: featcache's preprocessing too (Qwen2-VL's, InternVL-HF's)
        self.tm = source_model(arch, path)

    def items(self, out: dict) -> list:
        """What crosses into C++ for ``out['multimodal']``: one binding item per image."""
        converted = self.tm.mm_input_converter(out["multimodal"])
        return list(converted.args[0])

    def close(self) -> None:
        self.plain.close()
        self.cached.close()
        gc.collect()
        self.cache.close()


@pytest.fixture(params=[tiny.INTERNVL, tiny.QWEN2VL, tiny.QWEN3_5], ids=["internvl_hf", "qwen2vl", "qwen3_5"])
def rig(request, tmp_path_factory, binding):
    r = Rig(request.param, tiny.checkpoint(request.param, tmp_path_factory))
    yield r
    r.close()


def request_of(*seeds: int):
    return tiny.messages(*[tiny.image_item(tiny.noise_image(120, 90, seed=s)) for s in seeds])


def tensor_of(item) -> torch.Tensor:
    """The torch tensor an item hands the binding (``_tm.from_dlpack(tensor)``)."""
    return item.kwargs["data"].args[0]


def assert_accepted_like_plain(got_items, want_items, got, want) -> None:
    """Same token spans and same pixels as plain lmdeploy's, for every image, at the boundary."""
    assert len(got_items) == len(want_items) == len(want["multimodal"])
    for g, w in zip(got_items, want_items, strict=True):
        assert type(g) is type(w)
        assert (g.kwargs["token_begin"], g.kwargs["token_end"]) == (
            w.kwargs["token_begin"], w.kwargs["token_end"])
        pg, pw = tensor_of(g), tensor_of(w)
        assert pg.device.type == "cpu" and pg.is_contiguous()
        assert pg.dtype == pw.dtype and torch.equal(pg, pw)
        assert isinstance(g.kwargs["fingerprint"], bytes) and len(g.kwargs["fingerprint"]) == 32
    assert got["input_ids"] == want["input_ids"]


def test_hit_skips_preprocessing_and_pixel_hashing(rig, monkeypatch):
    sha = Sha256Counter(monkeypatch)
    want = rig.plain.prompt(request_of(1))
    want_items = rig.items(want)
    assert sha.calls == 1  # plain lmdeploy hashes the pixels of every image, every request

    sha.calls = 0
    first = rig.cached.prompt(request_of(1))
    first_items = rig.items(first)
    assert rig.cached.calls == [[(120, 90)]]  # a miss: lmdeploy preprocessed it once
    assert sha.calls == 0  # its fingerprint comes from the key
    assert_accepted_like_plain(first_items, want_items, first, want)

    second = rig.cached.prompt(request_of(1))
    second_items = rig.items(second)
    assert rig.cached.calls == [[(120, 90)]]  # a hit: no preprocessing
    assert sha.calls == 0
    assert_accepted_like_plain(second_items, want_items, second, want)
    key = second["multimodal"][0][REF_KEY].key
    assert second_items[0].kwargs["fingerprint"] == first_items[0].kwargs["fingerprint"]
    assert second_items[0].kwargs["fingerprint"] == fingerprint(key)
    with rig.cache.lease(key) as cached:  # served as stored: no copy on the way
        assert tensor_of(second_items[0]).data_ptr() == cached.data_ptr()
    stats = rig.cache.stats()[SECTION]
    assert stats["tm_pixels_stored"] == 1 and stats["tm_pixels_served"] == 1


def test_mixed_request_keeps_order_and_fingerprints_tell_images_apart(rig, monkeypatch):
    rig.cached.prompt(request_of(1))
    sha = Sha256Counter(monkeypatch)
    want = rig.plain.prompt(request_of(2, 1, 3))
    want_items = rig.items(want)
    sha.calls = 0
    got = rig.cached.prompt(request_of(2, 1, 3))
    got_items = rig.items(got)
    assert rig.cached.calls[-1] == [(120, 90), (120, 90)]  # only images 2 and 3
    assert sha.calls == 0
    assert_accepted_like_plain(got_items, want_items, got, want)
    fps = [i.kwargs["fingerprint"] for i in got_items]
    assert len(set(fps)) == 3


def test_cached_pixels_are_budgeted(tmp_path_factory, binding):
    path = tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)
    probe = Rig(tiny.INTERNVL, path)
    nbytes = tensor_of(probe.items(probe.cached.prompt(request_of(1)))[0]).nbytes
    probe.close()
    rig = Rig(tiny.INTERNVL, path, FeatureCache(device="cpu", device_bytes=nbytes, host_bytes=0))
    try:
        rig.cached.prompt(request_of(1))
        gc.collect()  # the request's lease is gone
        rig.cached.prompt(request_of(2))  # evicts image 1: one image fits the budget
        gc.collect()
        assert rig.cache.stats()["device"]["bytes"] <= nbytes
        rig.cached.prompt(request_of(1))
        assert len(rig.cached.calls) == 3  # image 1 was evicted: preprocessed again
    finally:
        rig.close()


def test_failure_serves_plain_lmdeploy(rig, monkeypatch):
    want_items = rig.items(rig.plain.prompt(request_of(1)))

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(rig.cache, "put", broken)
    got = rig.cached.prompt(request_of(1))
    got_items = rig.items(got)
    assert REF_KEY not in got["multimodal"][0] and "fingerprint" not in got["multimodal"][0]
    assert got_items[0].kwargs["fingerprint"] == want_items[0].kwargs["fingerprint"]  # lmdeploy's
    assert rig.cache.stats()[SECTION]["frontend_errors"] == 1


_PROCESS = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
torch.cuda.mem_get_info = lambda *a: (0, 0)
import lmdeploy_tiny as tiny
from featcache import FeatureCache
from featcache.lmdeploy.turbomind.native import install_native
tiny.register_processors()
cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0, disk_path=sys.argv[3],
                     disk_bytes="64MiB")
path = tiny.PromptPath(sys.argv[2], "float16", backend="turbomind")
install_native(path.model, cache, "test-tm:restart")
path.record_featcache()  # calls: featcache's preprocessing too (InternVL-HF's)
out = [path.prompt(tiny.messages(tiny.image_item(tiny.noise_image(120, 90, seed=s))))
       for s in (1, 2)]
print(json.dumps({"fingerprints": [o["multimodal"][0]["fingerprint"].hex() for o in out],
                  "preprocessed": len(path.calls)}))
del out
path.close()
cache.close()
"""


def test_fingerprints_are_stable_across_processes_and_restarts(tmp_path, tmp_path_factory):
    path = tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)
    here = os.path.dirname(__file__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))

    def run() -> dict:
        proc = subprocess.run([sys.executable, "-c", _PROCESS, here, path, str(tmp_path / "store")],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["preprocessed"] == 2  # a fresh store: both images missed
    assert second["preprocessed"] == 0  # a restart over the same store: both hit on disk
    assert first["fingerprints"] == second["fingerprints"]
    assert first["fingerprints"][0] != first["fingerprints"][1]


def test_wrap_routes_turbomind_and_refuses_a_device_cache(tmp_path_factory, binding):
    from lmdeploy.messages import TurbomindEngineConfig

    path = tiny.checkpoint(tiny.QWEN2VL, tmp_path_factory)
    prompt = tiny.PromptPath(path, ENGINE_DTYPE, backend="turbomind")
    engine = types.SimpleNamespace(vl_encoder=prompt.encoder, prompt_processor=prompt.processor,
                                   backend_config=TurbomindEngineConfig(dtype=ENGINE_DTYPE))
    pipe = types.SimpleNamespace(async_engine=engine)
    with FeatureCache(device="cpu", device_bytes="8MiB", host_bytes=0) as cache:
        with pytest.raises(ValueError, match="M-RoPE"):
            wrap(pipe, cache, turbomind="features")
        assert wrap(pipe, cache) is pipe and pipe.featcache is cache
        assert getattr(prompt.model.preprocess, "_featcache", False)
    prompt.close()
    with pytest.raises(ValueError, match="host tensors"):
        check_host_cache(types.SimpleNamespace(device=torch.device("cuda")))


# -- the features path (opt-in, InternVL-HF) ------------------------------------------------------

def weighted_checkpoint(tmp_path_factory) -> str:
    """The tiny InternVL-HF checkpoint plus random weights (the features path loads its tower)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoConfig, InternVLForConditionalGeneration

    out = str(tmp_path_factory.mktemp("tm_features") / "internvl_hf_weights")
    shutil.copytree(tiny.checkpoint(tiny.INTERNVL, tmp_path_factory), out)
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(AutoConfig.from_pretrained(out))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(out, "model.safetensors"))
    return out


@pytest.fixture
def features_rig(tmp_path_factory, binding):
    from lmdeploy.messages import TurbomindEngineConfig

    path = weighted_checkpoint(tmp_path_factory)
    prompt = tiny.PromptPath(path, ENGINE_DTYPE, backend="turbomind")
    plain = tiny.PromptPath(path, ENGINE_DTYPE, backend="turbomind")
    engine = types.SimpleNamespace(vl_encoder=prompt.encoder, prompt_processor=prompt.processor,
                                   backend_config=TurbomindEngineConfig(dtype=ENGINE_DTYPE))
    cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
    wrap(types.SimpleNamespace(async_engine=engine), cache, turbomind="features")
    prompt.record_featcache()  # calls: featcache's preprocessing too (InternVL-HF's)
    yield types.SimpleNamespace(path=path, prompt=prompt, plain=plain, cache=cache)
    prompt.close()
    plain.close()
    gc.collect()
    cache.close()


def reference_features(path: str, pixel_values: torch.Tensor) -> torch.Tensor:
    """transformers' whole InternVL-HF model's features for lmdeploy's pixels (engine dtype)."""
    from transformers import InternVLForConditionalGeneration

    model = InternVLForConditionalGeneration.from_pretrained(path, dtype=torch.float16).eval()
    with torch.no_grad():
        out = model.get_image_features(pixel_values=pixel_values, vision_feature_layer=-1,
                                       vision_feature_select_strategy="default")
    out = out if isinstance(out, torch.Tensor) else out.pooler_output
    return out.reshape(-1, out.shape[-1])


def prepare(out: dict):
    """lmdeploy's real TurboMindInstance.prepare_inputs over what the prompt path produced."""
    from lmdeploy.messages import GenerationConfig, TurbomindEngineConfig
    from lmdeploy.turbomind.turbomind import TurboMindInstance

    instance = object.__new__(TurboMindInstance)  # no engine: only its Python input handling
    instance.tm_model = types.SimpleNamespace(engine_config=TurbomindEngineConfig(dtype=ENGINE_DTYPE))
    inputs, _ = instance.prepare_inputs(out["input_ids"], GenerationConfig(),
                                        out["input_embeddings"], out["input_embedding_ranges"])
    return inputs


def test_features_path_serves_host_features_in_the_engine_dtype(features_rig):
    rig = features_rig
    want = rig.plain.prompt(request_of(1, 2))  # lmdeploy's own preprocessing of the same images
    pixels = [m["pixel_values"] for m in want["multimodal"]]

    first = rig.prompt.prompt(request_of(1, 2))
    assert "multimodal" not in first and len(first["input_embeddings"]) == 2
    assert rig.prompt.calls == [[(120, 90), (120, 90)]]
    for feats, px in zip(first["input_embeddings"], pixels, strict=True):
        assert feats.device.type == "cpu" and feats.dtype == torch.float16
        assert torch.equal(feats, reference_features(rig.path, px))  # the checkpoint's features

    second = rig.prompt.prompt(request_of(1, 2))
    assert rig.prompt.calls == [[(120, 90), (120, 90)]]  # hits: no preprocessing, no tower
    stats = rig.cache.stats()[SECTION]
    assert stats["vision_images"] == 2 and stats["tm_features_served"] == 2
    assert second["input_ids"] == first["input_ids"]
    assert second["input_embedding_ranges"] == first["input_embedding_ranges"]
    for a, b in zip(second["input_embeddings"], first["input_embeddings"], strict=True):
        assert a.data_ptr() == b.data_ptr()  # the cached host tensor itself: no copy of any kind

    inputs = prepare(second)
    values, ranges = inputs["input_embeddings"], inputs["input_embedding_ranges"]
    assert values.device.type == "cpu" and values.dtype == torch.float16
    assert torch.equal(values, torch.cat(first["input_embeddings"]))
    ids = torch.tensor(second["input_ids"])
    for begin, end in ranges.tolist():
        assert bool((ids[begin:end] == rig.prompt.model.image_token_id).all())
    assert sum(e - b for b, e in ranges.tolist()) == values.shape[0]


def test_tower_matches_lmdeploys_reference(tmp_path_factory):
    """featcache's InternVLTower against lmdeploy's PyTorch-engine InternVL-HF code, float32 CPU."""
    import importlib.util

    bench = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "checks",
                         "turbomind_features.py")
    spec = importlib.util.spec_from_file_location("turbomind_features", bench)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--device", "cpu", "--dtype", "float32", "--repeat", "1",
                          "--model", weighted_checkpoint(tmp_path_factory)])
    assert result["max_abs_diff"] <= 1e-5 * max(1.0, result["max_abs_value"])
    path = result["features_path"]
    assert path["hit_identical_to_miss"] and path["hit_same_tensor"]
    assert path["served_device"] == "cpu" and path["served_dtype"] == "float32"


def test_tower_runs_in_turbomind_vision_dtype(tmp_path_factory, binding):
    """TurboMind runs its ViT in the vision dtype it resolves (``engine_vision_dtype``) and casts the
    features to the engine dtype: the features path's tower does the same, under its own
    namespace; with equal dtypes the namespace is unchanged."""
    from lmdeploy.messages import TurbomindEngineConfig

    from featcache.lmdeploy.turbomind.features import InternVLTower

    path = weighted_checkpoint(tmp_path_factory)
    namespaces = {}
    for vision in (torch.float32, torch.float16, None):
        prompt = tiny.PromptPath(path, ENGINE_DTYPE, backend="turbomind")
        ctx = types.SimpleNamespace(dtype=vision)
        tm = types.SimpleNamespace(source_model=types.SimpleNamespace(
            vision_model=types.SimpleNamespace(_ctx=ctx))) if vision is not None else None
        engine = types.SimpleNamespace(vl_encoder=prompt.encoder, prompt_processor=prompt.processor,
                                       backend_config=TurbomindEngineConfig(dtype=ENGINE_DTYPE),
                                       engine=tm)
        with FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0) as cache:
            wrap(types.SimpleNamespace(async_engine=engine), cache, turbomind="features")
            namespaces[vision] = prompt.model.preprocess.frontend.namespace
            out = prompt.prompt(request_of(1))
            feats = out["input_embeddings"][0]
            assert feats.dtype == torch.float16 and feats.device.type == "cpu"
            px = tiny.PromptPath(path, ENGINE_DTYPE, backend="turbomind")
            pixels = px.prompt(request_of(1))["multimodal"][0]["pixel_values"]
            px.close()
            tower = InternVLTower.from_pretrained(path, vision or torch.float16, "cpu")
            want = tower(pixels)
            assert torch.equal(feats, want.reshape(-1, want.shape[-1]).to(torch.float16))
        prompt.close()
        gc.collect()
    assert namespaces[torch.float16] == namespaces[None] != namespaces[torch.float32]


def test_turbomind_vit_differences_in_kind():
    """Checkpoint settings under which TurboMind's C++ ViT computes another function (not only
    other rounding) than the checkpoint's own code; none for the InternVL3 defaults."""
    from transformers import InternVLConfig

    from featcache.lmdeploy.turbomind.features import turbomind_vit_differences

    assert turbomind_vit_differences(InternVLConfig()) == []
    cfg = InternVLConfig(vision_feature_layer=-2, vision_feature_select_strategy="full",
                         projector_hidden_act="gelu_pytorch_tanh",
                         vision_config=dict(use_mean_pooling=False, hidden_act="silu"))
    got = " | ".join(turbomind_vit_differences(cfg))
    for word in ("vision_feature_layer=-2", "CLS", "hidden_act='silu'", "projector_hidden_act"):
        assert word in got
    assert "use_mean_pooling" not in got  # the final norm only applies to the last layer
    cfg = InternVLConfig(vision_config=dict(use_mean_pooling=False))
    assert "final LayerNorm" in turbomind_vit_differences(cfg)[0]


def turbomind_pixel_shuffle(hidden: torch.Tensor, grid: int) -> torch.Tensor:
    """lmdeploy 0.18's ``pixelShuffleKernel`` (src/turbomind/models/internvit/internvit_kernels.cu)
    index for index: hidden [batch, 1 + grid*grid, C] (CLS first) -> [batch, (grid/2)^2, 4C]."""
    batch, seq, c = hidden.shape
    out_grid = grid // 2
    out = hidden.new_empty(batch, out_grid * out_grid, 4 * c)
    for token in range(out_grid * out_grid):
        ow, oh = token // out_grid, token % out_grid
        t = 1 + (ow * 2) * grid + oh * 2
        for k, src in enumerate((t, t + 1, t + grid, t + grid + 1)):
            out[:, token, k * c:(k + 1) * c] = hidden[:, src]
    return out


def test_pixel_shuffle_order_matches_turbomind_kernel():
    """transformers' ``InternVLModel.pixel_shuffle`` (ps_version v2), as ``get_image_features``
    applies it after dropping CLS, is a permutation equal to TurboMind's kernel."""
    from transformers import InternVLModel

    grid, c = 8, 6
    hidden = torch.randn(3, 1 + grid * grid, c)
    ours = InternVLModel.pixel_shuffle(None, hidden[:, 1:].reshape(3, grid, grid, c), 0.5)
    assert torch.equal(ours.reshape(3, -1, 4 * c), turbomind_pixel_shuffle(hidden, grid))


def test_features_diff_bench_dry_run():
    """bench/checks/turbomind_features_diff.py's CPU dry-run: the pass-through checkpoint (checked with
    transformers), the request loops and the comparisons on stand-in pipelines."""
    bench = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "checks")
    out = subprocess.run([sys.executable, os.path.join(bench, "turbomind_features_diff.py"),
                          "dry-run"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(bench)})
    assert out.returncode == 0 and "DRY-RUN OK" in out.stdout, out.stderr[-3000:]


def test_envelope_bench_dry_run():
    """bench/checks/turbomind_envelope.py's CPU dry-run: the request loops (one at a time, batched,
    prefix cache filled then read) on stand-in pipelines, and the envelope verdict."""
    bench = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "checks")
    out = subprocess.run([sys.executable, os.path.join(bench, "turbomind_envelope.py"), "dry-run"],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(bench)})
    assert out.returncode == 0 and "DRY-RUN OK" in out.stdout, out.stderr[-3000:]
