"""featcache's engine-side lmdeploy hooks on lmdeploy's real CPU code.

Per-image dicts come from lmdeploy's real prompt path with featcache's frontend installed (tiny
InternVL-HF and Qwen2-VL checkpoints built in the session). From there:

- ``KeyedInputProcessor`` around the model's real input processor (``InternVLProcessor`` /
  ``Qwen2VLInputProcessor`` of ``lmdeploy.pytorch.models``) and lmdeploy's
  ``ensure_multimodal_content_hashes``;
- the patched ``prepare_inputs_for_generation`` and lmdeploy's real ``forward`` of the model
  class, called on a stand-in model object (its vision tower, embeddings and language model are
  fakes: the real ones need CUDA kernels and weights) and a stand-in ``StepContext`` holding the
  real ``MultiModalData`` (as the engine's ``StepContext.new`` would);
- ``featcache.lmdeploy.pytorch.models._serve`` directly.

The fake vision tower computes each image's features from its own pixels, so which rows it was
given, and where its output lands in the token embeddings, can be checked exactly.
"""

from __future__ import annotations

import gc
import json
import types

import _lmdeploy_stack
import numpy as np
import pytest
import torch
from torch import nn

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402
from lmdeploy.pytorch.models import internvl3_hf, qwen2_vl  # noqa: E402
from lmdeploy.pytorch.multimodal import data_type  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy.pytorch import models  # noqa: E402
from featcache.lmdeploy.pytorch.engine import KeyedInputProcessor  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION, install_frontend  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402

HIDDEN = 256  # the tiny LLMs' hidden size
PATCH_ROW = 3 * 2 * 14 * 14  # one Qwen2-VL patch row: channels * temporal * patch * patch
MERGE = 4  # Qwen2-VL: 2x2 patches merge into one image token
INTERNVLS = (tiny.INTERNVL, tiny.INTERNS1)  # Intern-S1: InternVL-HF's classes in lmdeploy
CLASSES = {tiny.INTERNVL: internvl3_hf.InternVLForConditionalGeneration,
           tiny.INTERNS1: internvl3_hf.InternVLForConditionalGeneration,  # lmdeploy's class for Intern-S1
           tiny.QWEN2VL: qwen2_vl.Qwen2VLForConditionalGeneration}


# -- the fake vision towers: features are a function of each image's own pixels -----------------

def internvl_features(pixel_values: torch.Tensor) -> torch.Tensor:
    """[tiles, 4 tokens, HIDDEN] like ``get_image_features`` of the tiny InternVL-HF."""
    return pixel_values.float().reshape(pixel_values.shape[0], -1)[:, :4 * HIDDEN].reshape(-1, 4, HIDDEN)


def qwen2_features(pixel_values: torch.Tensor) -> torch.Tensor:
    """[tokens, HIDDEN] like Qwen2-VL's ``visual``: each token from its 4 merged patches."""
    return pixel_values.float().reshape(-1, MERGE * PATCH_ROW)[:, :HIDDEN]


def per_image(arch: str, data: torch.Tensor) -> torch.Tensor:
    """The fake tower's features of one image, as [image tokens, HIDDEN]."""
    f = internvl_features(data) if arch in INTERNVLS else qwen2_features(data)
    return f.reshape(-1, HIDDEN)


class FakeInternVL:
    """Stands in for an ``InternVLForConditionalGeneration`` in its own ``prepare``/``forward``."""

    compile_vit = False
    has_compiled_vit = False
    vision_feature_layer = -1
    vision_feature_select_strategy = "default"

    def __init__(self, vocab: int) -> None:
        self.embed = nn.Embedding(vocab, HIDDEN)
        self.vision_inputs: list[torch.Tensor] = []
        self.llm_inputs: list[torch.Tensor] = []
        self._mark_dynamic_once = types.MethodType(
            internvl3_hf.InternVLForConditionalGeneration._mark_dynamic_once, self)
        self.language_model = types.SimpleNamespace(forward=self._language_model)

    def get_image_features(self, pixel_values, vision_feature_layer, vision_feature_select_strategy):
        self.vision_inputs.append(pixel_values)
        return internvl_features(pixel_values)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def _language_model(self, input_ids, inputs_embeds, past_key_values, position_ids, attn_metadata):
        assert input_ids is None
        self.llm_inputs.append(inputs_embeds)
        return inputs_embeds


class FakeQwen2Visual(nn.Module):
    """Stands in for Qwen2-VL's vision tower: lmdeploy's own ``rot_pos_emb``, a fake forward."""

    rot_pos_emb = qwen2_vl.Qwen2VisionTransformerPretrainedModel.__wrapped__.rot_pos_emb

    def __init__(self, config) -> None:
        super().__init__()
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        head_dim = config.vision_config.embed_dim // config.vision_config.num_heads
        self.rotary_pos_emb = qwen2_vl.VisionRotaryEmbedding(head_dim // 2)
        self.calls: list[dict] = []

    def forward(self, hidden_states, cu_seqlens, rotary_pos_emb):
        self.calls.append(dict(pixel_values=hidden_states, cu_seqlens=cu_seqlens, rotary=rotary_pos_emb))
        return qwen2_features(hidden_states)


class FakeQwen2VL:
    """Stands in for a ``Qwen2VLForConditionalGeneration`` in its own ``prepare``/``forward``."""

    def __init__(self, config) -> None:
        self.embed = nn.Embedding(config.text_config.vocab_size, HIDDEN)
        self.visual = FakeQwen2Visual(config)
        self.llm_inputs: list[torch.Tensor] = []

    @property
    def vision_inputs(self) -> list[torch.Tensor]:
        return [c["pixel_values"] for c in self.visual.calls]

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def model(self, input_ids, position_ids, past_key_values, attn_metadata, inputs_embeds,
              mrope_position_ids):
        self.llm_inputs.append(inputs_embeds)
        return inputs_embeds


def step_context(input_ids: list[int], multimodals: list[dict] | None) -> types.SimpleNamespace:
    """The fields of lmdeploy's ``StepContext`` that the models' ``prepare`` reads."""
    return types.SimpleNamespace(
        input_ids=torch.tensor([input_ids]), position_ids=None, attn_metadata=None,
        input_embeddings=None, input_embedding_indexing=None, input_multimodals=multimodals,
        mrope_position_ids=None)


# -- the rig: a frontend with featcache, the model's real input processor ------------------------

class Rig:
    def __init__(self, arch: str, path: str) -> None:
        self.arch = arch
        self.config = AutoConfig.from_pretrained(path)
        self.cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        self.plain = tiny.PromptPath(path)  # lmdeploy alone
        self.frontend = tiny.PromptPath(path)  # lmdeploy + featcache
        install_frontend(self.frontend.model, self.cache, f"test:{arch}")
        if arch in INTERNVLS:  # as the engine builds it for PytorchEngineConfig(dtype='float16')
            self.inner = internvl3_hf.InternVLProcessor(self.config, torch.float16)
        else:
            self.inner = qwen2_vl.Qwen2VLInputProcessor(self.config)
        self.processor = KeyedInputProcessor(self.inner)
        self.token_id = self.frontend.model.image_token_id

    def close(self) -> None:
        self.plain.close()
        self.frontend.close()
        gc.collect()  # release what the test's requests leased before the cache goes
        self.cache.close()

    def prompt(self, *images, plain: bool = False) -> dict:
        path = self.plain if plain else self.frontend
        return path.prompt(tiny.messages(*(tiny.image_item(i) for i in images)))

    def seed(self, *images) -> dict[bytes, torch.Tensor]:
        """Cache features for ``images`` (what a previous step's model would have stored)."""
        stored = {}
        for item in self.prompt(*images)["multimodal"]:
            ref = item[REF_KEY]
            stored[ref.key] = torch.randn(int(item["image_tokens"]), HIDDEN)
            self.cache.put(ref.key, stored[ref.key], meta=ref.meta)
        return stored

    def fake_model(self):
        return FakeInternVL(self.config.text_config.vocab_size) if self.arch in INTERNVLS \
            else FakeQwen2VL(self.config)

    def stats(self) -> dict[str, int]:
        return self.cache.stats().get(SECTION, {})


@pytest.fixture(params=[tiny.INTERNVL, tiny.QWEN2VL, tiny.INTERNS1],
                ids=["internvl_hf", "qwen2vl", "interns1"])
def rig(request, tmp_path_factory):
    r = Rig(request.param, tiny.checkpoint(request.param, tmp_path_factory))
    yield r
    r.close()


@pytest.fixture
def patched(rig, monkeypatch):
    """The rig's model class with featcache's ``prepare`` (lmdeploy's own restored afterwards)."""
    cls = CLASSES[rig.arch]
    assert tiny.featcache_prepare(monkeypatch, cls, models.SPECS[rig.arch]) is cls
    return cls


def images(*seeds: int):
    sizes = {1: (100, 80), 2: (60, 130), 3: (90, 90), 4: (120, 50)}
    return [tiny.noise_image(*sizes[s], seed=s) for s in seeds]


# -- the input processor -------------------------------------------------------------------------

def test_keyed_input_processor_puts_the_ref_and_key_in_multimodal_data(rig):
    a, b = images(1, 2)
    rig.seed(a)
    out = rig.prompt(a, b)  # a hits, b misses
    hit, miss = out["multimodal"]
    assert hit[REF_KEY].hit and not miss[REF_KEY].hit

    got = rig.processor.preprocess_input(out["input_ids"], out["multimodal"])
    want = rig.prompt(a, b, plain=True)
    plain = rig.inner.preprocess_input(want["input_ids"], want["multimodal"])

    assert got.input_ids == out["input_ids"] == want["input_ids"]
    datas = got.input_multimodals["image"]
    for data, item, want in zip(datas, out["multimodal"], plain.input_multimodals["image"], strict=True):
        assert data.meta[REF_KEY] is item[REF_KEY]
        assert data.content_hash == "featcache:" + item[REF_KEY].key.hex()
        assert (data.start, data.end) == (want.start, want.end)
        assert {k: v for k, v in data.meta.items() if k != REF_KEY}.keys() == want.meta.keys()
        for k, v in want.meta.items():
            assert torch.equal(data.meta[k], v) if isinstance(v, torch.Tensor) else data.meta[k] == v
        if want.mrope_pos_ids is not None:  # Qwen2-VL: M-RoPE positions from the hit's own grid
            assert np.array_equal(data.mrope_pos_ids, want.mrope_pos_ids)
    assert datas[0].data.shape[0] == 0  # the hit carries no pixels
    assert torch.equal(datas[1].data, plain.input_multimodals["image"][1].data)

    # the agent's H2D copy passes the FeatRef (and its lease) through by reference
    moved = datas[0].to_device("cpu")
    assert moved.meta[REF_KEY] is datas[0].meta[REF_KEY]
    # attributes of lmdeploy's processor stay reachable
    assert rig.processor.config is rig.inner.config


def test_content_hashes_are_kept_without_hashing_pixels(rig, monkeypatch):
    a, b = images(1, 2)
    rig.seed(a)
    out = rig.prompt(a, b)
    (untagged,) = rig.prompt(b, plain=True)["multimodal"]
    got = rig.processor.preprocess_input(out["input_ids"], out["multimodal"])
    plain = rig.inner.preprocess_input(out["input_ids"], [{**untagged, "offset": 0}])
    mms = {"image": got.input_multimodals["image"] + plain.input_multimodals["image"]}
    before = [d.content_hash for d in mms["image"]]
    hashed = []
    original = data_type.make_multimodal_content_hash
    monkeypatch.setattr(data_type, "make_multimodal_content_hash",
                        lambda *a: hashed.append(a) or original(*a))

    data_type.ensure_multimodal_content_hashes(mms)

    after = [d.content_hash for d in mms["image"]]
    assert after[:2] == before[:2] and all(h.startswith("featcache:") for h in after[:2])
    assert len(hashed) == 1 and before[2] is None and len(after[2]) == 64  # lmdeploy's sha256


def test_input_processor_without_images_passes_through(rig):
    ids = rig.frontend.processor.tokenizer.encode("hello")
    assert rig.processor.preprocess_input(ids, None) == rig.inner.preprocess_input(ids, None)
    assert rig.processor.preprocess_input(ids, []) == rig.inner.preprocess_input(ids, [])


# -- the model hook ------------------------------------------------------------------------------

def _sequence(rig, *imgs):
    out = rig.prompt(*imgs)
    return out["input_ids"], rig.processor.preprocess_input(out["input_ids"], out["multimodal"])


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
    ctx = step_context(ids, mms)
    misses = [d for d in datas if not d.meta[REF_KEY].hit]
    assert len(datas) == 5 and len(misses) == 2
    model = rig.fake_model()

    inputs = patched.prepare_inputs_for_generation(model, None, context=ctx)

    assert ctx.input_multimodals is mms  # the step's inputs are left as they were
    assert torch.equal(inputs["pixel_values"], torch.cat([d.data for d in misses]))
    assert torch.equal(inputs["image_mask"], ctx.input_ids == rig.token_id)
    if rig.arch == tiny.QWEN2VL:  # grid-derived inputs: exactly lmdeploy's for the misses alone
        alone = patched.prepare_inputs_for_generation.__wrapped__(
            model, None, None, step_context(ids, [{"image": misses}]))
        assert torch.equal(inputs["vis_cu_seqlens"], alone["vis_cu_seqlens"])
        thw = torch.cat([d.meta["grid_thw"] for d in misses])
        # cos/sin of the misses' float32 angles (lmdeploy's rot_pos_emb, the same module and
        # grid on both paths), each within an ulp of the exact cos/sin of those angles, whatever
        # kernel path torch takes (vector body or tail, thread chunks, alignment: 3.6e-8 at most
        # measured on angles under 9 rad), so within 2**-23 of each other. Checked against the
        # float64 values first, so that a failure says which path is off. (5e-4 was allowed after
        # one unexplained 1.5e-4 in a full run, which rounding cannot make; issue 32 item 4.)
        angles = model.visual.rot_pos_emb(thw).repeat(1, 2).double()
        for fn, got, want in zip((torch.cos, torch.sin), inputs["vis_pos_emb"], alone["vis_pos_emb"],
                                 strict=True):
            exact = fn(angles)
            for path, t in (("featcache's prepare", got), ("lmdeploy's prepare", want)):
                off = (t.double() - exact).abs().max().item()
                assert off <= 2**-24, f"{path}: {fn.__name__} is {off:.2e} off its angles' value"
            torch.testing.assert_close(got, want, rtol=0, atol=2**-23)
        assert inputs["vis_cu_seqlens"][-1] == int(thw.prod(dim=1).sum()) == inputs["pixel_values"].shape[0]

    embeds = patched.forward(model, **inputs)  # lmdeploy's own forward

    # one vision call, on the misses' pixels
    assert len(model.vision_inputs) == 1
    assert torch.equal(model.vision_inputs[0], inputs["pixel_values"])
    # image rows in token order: a from the cache, b and c from the vision tower, a twice more
    (a_features,) = stored.values()
    want = torch.cat([a_features, per_image(rig.arch, datas[1].data), per_image(rig.arch, datas[2].data),
                      a_features, a_features])
    mask = ctx.input_ids[0] == rig.token_id
    assert torch.equal(embeds[0][mask], want)
    assert torch.equal(embeds[0][~mask], model.embed(ctx.input_ids[0][~mask]))
    # the misses' features are cached with their metadata: b is a hit next time, no preprocess
    for d in misses:
        ref = d.meta[REF_KEY]
        with rig.cache.lease(ref.key) as features:
            assert torch.equal(features, per_image(rig.arch, d.data))
    calls = len(rig.frontend.calls)
    again = rig.prompt(b)["multimodal"][0]
    assert again[REF_KEY].hit and len(rig.frontend.calls) == calls
    # the same metadata, and the vision model's time for it (what a hit saves: value eviction)
    recorded = json.loads(again[REF_KEY].meta)
    assert recorded.pop("cost_s") > 0
    assert recorded == json.loads(datas[1].meta[REF_KEY].meta)
    stats = rig.stats()
    assert (stats["vision_calls"], stats["vision_images"], stats["vision_skipped"]) == (1, 2, 3)


def test_all_hit_step_skips_the_vision_tower(rig, patched):
    a, c = images(1, 3)
    stored = rig.seed(a, c)
    ids, res = _sequence(rig, c, a)
    datas = res.input_multimodals["image"]
    assert all(d.meta[REF_KEY].hit for d in datas)
    ctx = step_context(ids, [{"image": datas}])
    model = rig.fake_model()

    inputs = patched.prepare_inputs_for_generation(model, None, context=ctx)

    for name in models.SPECS[rig.arch].placeholders:
        assert inputs[name] is not None  # so that lmdeploy's forward reaches the vision call
    assert inputs["pixel_values"].numel() == 0
    assert torch.equal(inputs["image_mask"], ctx.input_ids == rig.token_id)

    embeds = patched.forward(model, **inputs)

    assert model.vision_inputs == []
    mask = ctx.input_ids[0] == rig.token_id
    want = torch.cat([stored[d.meta[REF_KEY].key] for d in datas])
    assert torch.equal(embeds[0][mask], want)
    stats = rig.stats()
    assert stats["vision_skipped"] == 2 and "vision_calls" not in stats


def test_step_without_featcache_refs_is_plain_lmdeploy(rig, patched):
    b = images(2)[0]
    out = rig.prompt(b, plain=True)
    res = rig.processor.preprocess_input(out["input_ids"], out["multimodal"])
    ctx = step_context(out["input_ids"], [res.input_multimodals])
    model = rig.fake_model()

    inputs = patched.prepare_inputs_for_generation(model, None, context=ctx)
    want = patched.prepare_inputs_for_generation.__wrapped__(model, None, None, ctx)

    assert inputs.keys() == want.keys()
    assert torch.equal(inputs["pixel_values"], want["pixel_values"])
    embeds = patched.forward(model, **inputs)
    mask = ctx.input_ids[0] == rig.token_id
    assert torch.equal(embeds[0][mask], per_image(rig.arch, res.input_multimodals["image"][0].data))
    assert "vision_calls" not in rig.stats()


# -- _serve --------------------------------------------------------------------------------------

def test_serve_orders_hits_and_misses_and_stores_the_misses(rig):
    a, b, c = images(1, 2, 3)
    stored = rig.seed(a)
    out = rig.prompt(b, a, c)
    items = out["multimodal"]
    refs = [items[0][REF_KEY], items[1][REF_KEY], None]  # c: an image featcache could not key
    tokens = [int(m["image_tokens"]) for m in items]
    miss_rows = [torch.full((tokens[0], HIDDEN), 1.0), torch.full((tokens[2], HIDDEN), 3.0)]
    calls = []

    def vision():
        calls.append(1)
        return torch.cat(miss_rows)

    got = models._serve(models._Plan(refs, tokens), vision)

    assert len(calls) == 1
    assert torch.equal(got, torch.cat([miss_rows[0], stored[refs[1].key], miss_rows[1]]))
    with rig.cache.lease(refs[0].key) as features:
        assert torch.equal(features, miss_rows[0])
    lease = rig.cache.acquire(refs[0].key)
    assert lease.meta == refs[0].meta
    lease.release()
    assert items[2][REF_KEY].key not in rig.cache  # no ref, nothing stored
    stats = rig.stats()
    assert (stats["vision_calls"], stats["vision_images"], stats["vision_skipped"]) == (1, 2, 1)

    # a vision output that does not split into the images' token counts is an error, not a guess
    with pytest.raises(RuntimeError, match="does not split per image"):
        models._serve(models._Plan([refs[0]], [tokens[0]]), lambda: torch.zeros(tokens[0] + 1, HIDDEN))


def test_leases_live_as_long_as_the_multimodal_data(rig):
    a = images(1)[0]
    rig.seed(a)
    _, res = _sequence(rig, a)
    key = res.input_multimodals["image"][0].meta[REF_KEY].key
    gc.collect()
    assert rig.cache._chain.top._books.pinned(key)  # the engine still holds the sequence's image
    del res
    gc.collect()
    assert not rig.cache._chain.top._books.pinned(key)
