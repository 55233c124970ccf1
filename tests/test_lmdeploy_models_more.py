"""featcache's model hook on Qwen2.5-VL and InternVL (legacy ``InternVLChatModel``), on lmdeploy's
real CPU code, in the style of ``test_lmdeploy_engine``.

Per-image dicts come from lmdeploy's real prompt path (``ImageEncoder`` + ``MultimodalProcessor``)
with featcache's frontend installed, on tiny checkpoints built here:

- Qwen2.5-VL: a real ``Qwen2_5_VLConfig`` (window size 112: 4x4 merged tokens a window), the
  Qwen2-VL tokens and ``Qwen2VLImageProcessorPil`` (lmdeploy's ``Qwen2VLModel`` serves both archs);
- InternVL: ``config.json`` of ``model_type`` ``internvl_chat`` without its remote code, so
  lmdeploy reads it as a generic ``PretrainedConfig`` (``vision_config`` a dict, which lmdeploy's
  ``InternVLVisionModel`` normalizes); ``CLIPImageProcessorPil``, 56 px, one tile (4 tokens) an
  image: ``dynamic_image_size`` (several tiles) needs torchvision, which these tests run without.

From there, lmdeploy's real input processor (``Qwen2VLInputProcessor``, which ``qwen2_5_vl``
imports as its own; ``internvl.InternVLInputProcessor``) inside featcache's
``KeyedInputProcessor``, and the patched real ``prepare_inputs_for_generation`` and real
``forward`` of each class, on an instance of the real class (``object.__new__`` plus
``nn.Module.__init__``: the real ``__init__`` builds CUDA-kernel layers and, for InternVL, needs
the remote ``InternVLChatConfig``) holding only what prepare/forward touch. Faked:

- Qwen2.5-VL: ``visual`` runs lmdeploy's own ``rot_pos_emb`` and ``get_window_index`` (from the
  real class) and a fake ``forward`` that windows and un-windows its rows by ``window_index`` as
  the real one does, but computes each token from its own 4 merged patches instead of attention;
  ``model`` (the LLM) is an embedding plus a recorder;
- InternVL: lmdeploy's own ``extract_feature`` and ``pixel_shuffle`` run over a fake
  ``vision_model`` (each tile's 16 patch rows from its own pixels, plus a class token) and
  ``mlp1 = Identity``; ``language_model`` is an embedding plus a recorder; ``flash_mode`` is None
  (featcache's ``wrap`` passes flash-mode models through untouched: checked below).
"""

from __future__ import annotations

import json
import os
import types

import _lmdeploy_stack
import pytest
import torch
from torch import nn

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402
from lmdeploy.pytorch.models import internvl, qwen2_5_vl  # noqa: E402
from test_lmdeploy_engine import HIDDEN, MERGE, PATCH_ROW, Rig, step_context  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy import wrap  # noqa: E402
from featcache.lmdeploy.pytorch import models  # noqa: E402
from featcache.lmdeploy.pytorch.engine import KeyedInputProcessor  # noqa: E402
from featcache.lmdeploy.request.frontend import install_frontend  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402

QWEN25 = "Qwen2_5_VLForConditionalGeneration"
INTERNVL_CHAT = "InternVLChatModel"
CLASSES = {QWEN25: qwen2_5_vl.Qwen2_5_VLForConditionalGeneration, INTERNVL_CHAT: internvl.InternVLChatModel}
VOCAB = 512  # above every token id of the tiny tokenizers (256 bytes + a few special tokens)
VIT_DIM = HIDDEN // 4  # InternVL: the ViT width; pixel shuffle 0.5 makes tokens of 4 * VIT_DIM


# -- tiny checkpoints ----------------------------------------------------------------------------

_built: dict[str, str] = {}


def checkpoint(arch: str, tmp_path_factory) -> str:
    if arch not in _built:
        tiny.register_processors()
        out = str(tmp_path_factory.mktemp("lmdeploy_tiny_more") / arch)
        os.makedirs(out)
        (_qwen25 if arch == QWEN25 else _internvl_chat)(out)
        _built[arch] = out
    return _built[arch]


def _qwen25(out: str) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessorPil

    tok = tiny._tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                           "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(out)
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        vocab_size=len(tok), rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
        vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2,
                           out_hidden_size=HIDDEN, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1],
                           in_channels=3),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id,
        tie_word_embeddings=False, **tiny._LLM)
    tiny._finish(out, cfg, QWEN25, tok, {"processor_class": "NoVideoQwen2VLProcessor"})


def _internvl_chat(out: str) -> None:
    from transformers import CLIPImageProcessorPil

    tok = tiny._tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>",
                           "<IMG_CONTEXT>"])
    tok.save_pretrained(out)
    CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
                          ).save_pretrained(out)
    config = dict(
        model_type="internvl_chat", architectures=[INTERNVL_CHAT], select_layer=-1,
        vision_config=dict(image_size=56, patch_size=14, hidden_size=VIT_DIM, num_hidden_layers=2,
                           num_attention_heads=2),
        llm_config=dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=len(tok),
                        **tiny._LLM),
        force_image_size=56, downsample_ratio=0.5, dynamic_image_size=False, use_thumbnail=False,
        pad_token_id=tok.pad_token_id, torch_dtype="float32")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


# -- the stand-in models: real classes, fake towers and LLMs ------------------------------------

class FakeLLM(nn.Module):
    """The language model: lmdeploy's forward hands it the embeddings; it returns them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.inputs: list[torch.Tensor] = []

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids, inputs_embeds, past_key_values, position_ids, attn_metadata,
                mrope_position_ids=None):
        self.inputs.append(inputs_embeds)
        return inputs_embeds


_Qwen25Visual = qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel.__wrapped__  # under @vlm_model


class FakeQwen25Visual(nn.Module):
    """Qwen2.5-VL's vision tower: lmdeploy's own rotary and window helpers, a fake forward."""

    rot_pos_emb = _Qwen25Visual.rot_pos_emb
    get_window_index = _Qwen25Visual.get_window_index

    def __init__(self, config) -> None:
        super().__init__()
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.window_size = config.window_size
        self.spatial_merge_unit = self.spatial_merge_size ** 2
        head_dim = config.hidden_size // config.num_heads
        self.rotary_pos_emb = qwen2_5_vl.Qwen2_5_VisionRotaryEmbedding(head_dim // 2)
        self.calls: list[dict] = []

    def forward(self, hidden_states, cu_seqlens, rotary_pos_emb, window_index=None, cu_window_seqlens=None):
        self.calls.append(dict(pixel_values=hidden_states, cu_seqlens=cu_seqlens, rotary=rotary_pos_emb,
                               window_index=window_index, cu_window_seqlens=cu_window_seqlens))
        seq_len, unit = hidden_states.shape[0], self.spatial_merge_unit
        # as the real forward: rows and rotary into window order (the attention it would run there,
        # within the windows of cu_window_seqlens or the images of cu_seqlens, is left out), each
        # token from its 4 merged patch rows, then back to image order
        assert int(cu_seqlens[-1]) == int(cu_window_seqlens[-1]) == seq_len
        assert rotary_pos_emb.shape[0] == seq_len
        x = hidden_states.reshape(seq_len // unit, unit, -1)[window_index]
        rotary = rotary_pos_emb.reshape(seq_len // unit, unit, -1)[window_index]
        assert rotary.shape[:2] == x.shape[:2]
        merged = x.float().reshape(seq_len // unit, -1)[:, :HIDDEN]  # each token from its 4 patches
        return merged[torch.argsort(window_index)]


class FakeInternViT(nn.Module):
    """InternVL's ``vision_model``: [tiles, 3, 56, 56] -> [tiles, class token + 16 patches, VIT_DIM],
    each patch row from the tile's own pixels."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[torch.Tensor] = []

    def forward(self, pixel_values):
        self.calls.append(pixel_values)
        n = pixel_values.shape[0]
        patches = pixel_values.float().reshape(n, 3, 4, 14, 4, 14).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(n, 16, 3 * 14 * 14)[..., :VIT_DIM]
        return torch.cat([torch.zeros(n, 1, VIT_DIM), patches], dim=1)


def qwen25_model(config):
    model = object.__new__(qwen2_5_vl.Qwen2_5_VLForConditionalGeneration)
    nn.Module.__init__(model)
    model.config = config
    model.visual = FakeQwen25Visual(config.vision_config)
    model.model = FakeLLM()
    return model


def internvl_model():
    model = object.__new__(internvl.InternVLChatModel)
    nn.Module.__init__(model)
    # what forward, prepare and lmdeploy's own extract_feature read
    model.select_layer = -1
    model.downsample_ratio = 0.5
    model.flash_mode = None
    model.compile_vit = False
    model.ctx_mgr = None
    model.vision_model = FakeInternViT()
    model.mlp1 = nn.Identity()
    model.language_model = FakeLLM()
    return model


def vision_inputs(model) -> list[torch.Tensor]:
    """The pixels of each call of the (fake) vision tower."""
    if isinstance(model, internvl.InternVLChatModel):
        return model.vision_model.calls
    return [c["pixel_values"] for c in model.visual.calls]


def llm(model) -> FakeLLM:
    return model.language_model if isinstance(model, internvl.InternVLChatModel) else model.model


def chat_step_context(input_ids, multimodals):
    """``step_context`` plus the fields ``InternVLChatModel.prepare`` reads (a prefill step)."""
    ctx = step_context(input_ids, multimodals)
    ctx.model_metas = None
    ctx.is_decoding = False
    return ctx


# -- the rig -------------------------------------------------------------------------------------

class MoreRig(Rig):
    """``test_lmdeploy_engine.Rig`` (prompt, seed, stats, close) for the two architectures here."""

    def __init__(self, arch: str, path: str) -> None:
        self.arch = arch
        self.cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        self.plain = tiny.PromptPath(path)  # lmdeploy alone
        self.frontend = tiny.PromptPath(path)  # lmdeploy + featcache
        install_frontend(self.frontend.model, self.cache, f"test:{arch}")
        self.config = self.frontend.model.hf_config
        if arch == QWEN25:
            self.inner = qwen2_5_vl.Qwen2_5_VLInputProcessor(self.config)
        else:  # InternVLChatConfig stand-in: its vision_config as an object, all the processor reads
            config = types.SimpleNamespace(vision_config=self.frontend.model.vision_config)
            self.inner = internvl.InternVLInputProcessor(config, torch.float16)
        self.processor = KeyedInputProcessor(self.inner)
        self.token_id = self.frontend.model.image_token_id

    def fake_model(self):
        return qwen25_model(self.config) if self.arch == QWEN25 else internvl_model()

    def features(self, data: torch.Tensor) -> torch.Tensor:
        """The fake tower's features of one image's pixels alone, as [image tokens, HIDDEN]."""
        if self.arch == QWEN25:
            return data.float().reshape(-1, MERGE * PATCH_ROW)[:, :HIDDEN]
        reference = internvl_model()
        return internvl.InternVLChatModel.extract_feature(reference, data).reshape(-1, HIDDEN)


@pytest.fixture(params=[QWEN25, INTERNVL_CHAT], ids=["qwen2_5_vl", "internvl_chat"])
def rig(request, tmp_path_factory):
    r = MoreRig(request.param, checkpoint(request.param, tmp_path_factory))
    yield r
    r.close()


@pytest.fixture
def patched(rig, monkeypatch):
    """The rig's model class with featcache's ``prepare`` (lmdeploy's own restored afterwards)."""
    cls = CLASSES[rig.arch]
    assert tiny.featcache_prepare(monkeypatch, cls, models.SPECS[rig.arch]) is cls
    return cls


def images(*seeds: int):
    # 200x150: Qwen2.5 makes it 10x14 patches, 5x7 tokens, 4 windows (a real window reorder)
    sizes = {1: (100, 80), 2: (200, 150), 3: (90, 90)}
    return [tiny.noise_image(*sizes[s], seed=s) for s in seeds]


def _sequence(rig, *imgs, plain: bool = False):
    out = rig.prompt(*imgs, plain=plain)
    return out["input_ids"], rig.processor.preprocess_input(out["input_ids"], out["multimodal"])


def _assert_same(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same(g, w)
    else:
        assert got is want or got == want


# -- the tests -----------------------------------------------------------------------------------

def _without_cost(meta: bytes) -> dict:
    """A miss's stored metadata as the frontend made it: its recorded vision time taken out."""
    record = json.loads(meta)
    assert record.pop("cost_s") > 0
    return record


def test_mixed_step_runs_vision_on_the_misses_only(rig, patched):
    a, b, c = images(1, 2, 3)
    stored = rig.seed(a)
    # a prefill step over four sequences: [a (hit), b (miss)], text only, [c (miss), a (hit)], [a (hit)]
    ids1, res1 = _sequence(rig, a, b)
    text = rig.frontend.processor.tokenizer.encode("no image here")
    ids2, res2 = _sequence(rig, c, a)
    ids3, res3 = _sequence(rig, a)
    mms = [res1.input_multimodals, {}, res2.input_multimodals, res3.input_multimodals]
    datas = [d for mm in mms for d in mm.get("image", [])]
    ids = ids1 + text + ids2 + ids3
    ctx = chat_step_context(ids, mms)
    misses = [d for d in datas if not d.meta[REF_KEY].hit]
    assert len(datas) == 5 and [d.meta[REF_KEY].hit for d in datas] == [True, False, False, True, True]
    model = rig.fake_model()

    inputs = patched.prepare_inputs_for_generation(model, None, context=ctx)

    assert ctx.input_multimodals is mms  # the step's inputs are left as they were
    assert torch.equal(inputs["pixel_values"], torch.cat([d.data for d in misses]))
    assert torch.equal(inputs["image_mask"], ctx.input_ids == rig.token_id)
    # every input is exactly what lmdeploy's own prepare gives for the misses alone (for Qwen2.5:
    # cu_seqlens, rotary, window_index, cu_window_seqlens; for InternVL: image_token_id)
    alone = patched.prepare_inputs_for_generation.__wrapped__(
        model, None, None, chat_step_context(ids, [{"image": misses}]))
    assert inputs.keys() == alone.keys()
    for name, want in alone.items():
        if name != "context":  # InternVL hands forward the step context itself
            _assert_same(inputs[name], want)
    assert inputs.get("context", ctx) is ctx
    if rig.arch == QWEN25:
        thw = torch.cat([d.meta["grid_thw"] for d in misses])
        tokens = int(thw.prod(dim=1).sum()) // MERGE
        assert inputs["vis_cu_seqlens"].tolist() == thw.prod(dim=1).cumsum(0).tolist()
        assert sorted(inputs["window_index"].tolist()) == list(range(tokens))
        assert inputs["window_index"].tolist() != list(range(tokens))  # b's windows reorder it
        assert inputs["vis_pos_emb"].shape[0] == inputs["pixel_values"].shape[0]
    else:
        assert inputs["image_token_id"] == rig.token_id

    embeds = model(**inputs)  # lmdeploy's own forward

    # one vision call, on the misses' pixels (and for Qwen2.5 with their window/rotary inputs)
    assert len(vision_inputs(model)) == 1
    assert torch.equal(vision_inputs(model)[0], inputs["pixel_values"].to(vision_inputs(model)[0].dtype))
    if rig.arch == QWEN25:
        (call,) = model.visual.calls
        assert torch.equal(call["cu_seqlens"], inputs["vis_cu_seqlens"])
        assert torch.equal(call["rotary"], inputs["vis_pos_emb"])
        assert torch.equal(call["window_index"], inputs["window_index"])
        assert torch.equal(call["cu_window_seqlens"], inputs["cu_window_seqlens"])
    # image rows in token order: a from the cache, b and c from the vision tower, a twice more
    (a_features,) = stored.values()
    want = torch.cat([a_features, rig.features(datas[1].data), rig.features(datas[2].data),
                      a_features, a_features])
    mask = ctx.input_ids[0] == rig.token_id
    assert int(mask.sum()) == want.shape[0]
    assert torch.equal(embeds[0][mask], want)
    assert torch.equal(embeds[0][~mask], llm(model).embed(ctx.input_ids[0][~mask]))
    assert llm(model).inputs == [embeds]
    # the misses' features are cached with their metadata: b is a hit next time, no preprocess
    for d in misses:
        ref = d.meta[REF_KEY]
        lease = rig.cache.acquire(ref.key)
        # the same metadata, and the vision model's time for it (what a hit saves)
        assert lease is not None and _without_cost(lease.meta) == json.loads(ref.meta)
        assert torch.equal(lease.ready(), rig.features(d.data))
        lease.release()
    calls = len(rig.frontend.calls)
    again = rig.prompt(b)["multimodal"][0]
    assert again[REF_KEY].hit and len(rig.frontend.calls) == calls
    assert _without_cost(again[REF_KEY].meta) == json.loads(datas[1].meta[REF_KEY].meta)
    stats = rig.stats()
    assert (stats["vision_calls"], stats["vision_images"], stats["vision_skipped"]) == (1, 2, 3)


def test_all_hit_step_skips_the_vision_tower(rig, patched):
    a, b, c = images(1, 2, 3)
    stored = rig.seed(a, b, c)
    ids1, res1 = _sequence(rig, c, a)
    ids2, res2 = _sequence(rig, b)
    mms = [res1.input_multimodals, res2.input_multimodals]
    datas = [d for mm in mms for d in mm["image"]]
    assert all(d.meta[REF_KEY].hit for d in datas)
    ctx = chat_step_context(ids1 + ids2, mms)
    model = rig.fake_model()

    inputs = patched.prepare_inputs_for_generation(model, None, context=ctx)

    assert ctx.input_multimodals is mms
    for name in models.SPECS[rig.arch].placeholders:
        assert inputs[name] is not None  # so that lmdeploy's forward reaches the vision call
    assert inputs["pixel_values"].numel() == 0
    assert torch.equal(inputs["image_mask"], ctx.input_ids == rig.token_id)

    # lmdeploy's own forward on the placeholders (Qwen2.5 casts pixel_values and vis_pos_emb with
    # .to(dtype); InternVL marks pixel_values dynamic and calls extract_feature)
    embeds = model(**inputs)

    assert vision_inputs(model) == []
    mask = ctx.input_ids[0] == rig.token_id
    want = torch.cat([stored[d.meta[REF_KEY].key] for d in datas])
    assert torch.equal(embeds[0][mask], want)
    assert torch.equal(embeds[0][~mask], llm(model).embed(ctx.input_ids[0][~mask]))
    stats = rig.stats()
    assert stats["vision_skipped"] == 3 and "vision_calls" not in stats and "vision_images" not in stats


def test_step_without_featcache_refs_is_plain_lmdeploy(rig, patched):
    a, b = images(1, 2)
    ids, res = _sequence(rig, a, b, plain=True)  # no frontend: no FeatRef anywhere
    datas = res.input_multimodals["image"]
    assert all(REF_KEY not in d.meta for d in datas)
    ctx = chat_step_context(ids, [res.input_multimodals])
    model = rig.fake_model()

    inputs = patched.prepare_inputs_for_generation(model, None, context=ctx)
    want = patched.prepare_inputs_for_generation.__wrapped__(model, None, None, ctx)

    assert inputs.keys() == want.keys()
    for name, value in want.items():
        _assert_same(inputs[name], value)
    embeds = model(**inputs)
    # the vision call was never wrapped, and saw every image's pixels
    owner, attr = (model, "extract_feature") if rig.arch == INTERNVL_CHAT else (model.visual, "forward")
    assert attr not in vars(owner)
    assert len(vision_inputs(model)) == 1
    assert torch.equal(vision_inputs(model)[0], inputs["pixel_values"].to(vision_inputs(model)[0].dtype))
    mask = ctx.input_ids[0] == rig.token_id
    assert torch.equal(embeds[0][mask], torch.cat([rig.features(d.data) for d in datas]))
    assert rig.stats().get("vision_calls") is None and rig.stats().get("vision_skipped") is None


def test_internvl_flash_mode_passes_through(monkeypatch):
    """``flash_mode`` InternVL compresses visual tokens inside the forward (a path featcache does
    not wrap): ``wrap`` leaves such a pipeline, and the model class, untouched."""
    from lmdeploy import PytorchEngineConfig

    cls = internvl.InternVLChatModel
    monkeypatch.setattr(cls, "prepare_inputs_for_generation", cls.prepare_inputs_for_generation)
    original = cls.prepare_inputs_for_generation
    hf_config = types.SimpleNamespace(architectures=[INTERNVL_CHAT], flash_mode="flash")
    inner = object()
    engine = types.SimpleNamespace(
        vl_encoder=types.SimpleNamespace(model=types.SimpleNamespace(hf_config=hf_config)),
        backend_config=PytorchEngineConfig(), engine=types.SimpleNamespace(input_processor=inner))
    pipe = types.SimpleNamespace(async_engine=engine)

    assert wrap(pipe, cache=None) is pipe

    assert engine.engine.input_processor is inner and not hasattr(pipe, "featcache")
    assert cls.prepare_inputs_for_generation is original


def test_a_prefix_match_inside_a_held_image_serves_its_tail_rows(rig, patched, monkeypatch):
    """Issue 15 on legacy InternVL and Qwen2.5-VL: the prefix hook keeps a match that ends inside
    an image featcache holds, and the forward gets that image's tail rows (test_lmdeploy_prefix's
    check, with lmdeploy's own SchedulerSequence under the hook)."""
    import test_lmdeploy_prefix as tp
    from lmdeploy.pytorch.messages import SchedulerSequence

    from featcache.lmdeploy.pytorch import prefix

    for name, method in (prefix._installed[0] if prefix._installed else {}).items():
        monkeypatch.setattr(SchedulerSequence, name, method)
    monkeypatch.setattr(prefix, "_installed", [])
    monkeypatch.setattr(prefix, "_users", 0)
    remove = prefix.install_prefix_hook()
    try:
        tp.check_tail_rows(rig, patched, vision_inputs)
    finally:
        remove()
