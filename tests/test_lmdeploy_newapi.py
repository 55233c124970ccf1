"""featcache on lmdeploy 0.18's processor-level preprocessing API and the Qwen3 lineage, on
lmdeploy's real CPU code.

Tiny Qwen3-VL and Qwen3.5 checkpoints (and their MoE variants; ``lmdeploy_tiny``) go through
lmdeploy's real prompt path (``ImageEncoder`` + ``MultimodalProcessor``, the new-API
``VisionModel.preprocess`` over transformers' ``Qwen3VLProcessor``), once plain and once with
featcache's frontend (``ProcessorFrontend``): the two outputs must be equal (input ids, offsets,
every per-image field; a miss's pixels ``torch.equal``) for requests that mix hits and misses,
images of several sizes, text between them and a per-request size override, while a hit is
never given to the image processor.

From there the engine side: lmdeploy's real input processor (``Qwen3VLInputProcessor``, which
Qwen3.5 uses too) inside ``KeyedInputProcessor``, the patched real
``prepare_inputs_for_generation`` and the real forward of each class (Qwen3-VL: the top-level
``forward``, deepstack included; Qwen3.5: the inner ``Qwen3_5Model.forward`` behind ``model.visual``),
on stand-in model objects: the vision tower is a fake that computes each image's features (and
each deepstack level) from its own pixels and lmdeploy's own position helpers; the language model
is a recorder. So which pixels the tower was given and what lands where in the token embeddings
(and in every deepstack level) is checked exactly, hits from the cache and misses computed.
"""

from __future__ import annotations

import gc
import types

import _lmdeploy_stack
import pytest
import torch
from torch import nn

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402
from _family_rig import model_cache_stats, tag_mode  # noqa: E402
from lmdeploy.pytorch.models import (  # noqa: E402
    glm4_1v,
    interns1_pro,
    qwen3_5,
    qwen3_5_moe,
    qwen3_omni_moe_thinker,
    qwen3_vl,
    qwen3_vl_moe,
)
from lmdeploy.pytorch.models.utils.model import DeployModelMixinV1  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy import families  # noqa: E402
from featcache.lmdeploy.pytorch.engine import KeyedInputProcessor  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION, install_frontend  # noqa: E402
from featcache.lmdeploy.request.media import MediaOptionError  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402

HIDDEN = 256  # the tiny LLMs' hidden size
MERGE = 4  # 2x2 patches merge into one image token
LEVELS = 3  # the tiny Qwen3-VL: main output plus two deepstack levels
FAMILIES = [tiny.QWEN3VL, tiny.QWEN3_5, tiny.GLM4V, tiny.INTERNS1PRO, tiny.QWEN3_OMNI, tiny.QWEN3VL_MOE,
            tiny.QWEN3_5_MOE]
OMNI_CLASS = qwen3_omni_moe_thinker.Qwen3OmniMoeThinkerForConditionalGeneration
# each family's size override for one request: (min_pixels, max_pixels) a quarter of the default
SMALL = {tiny.QWEN3VL: (tiny.QWEN3_MIN_PIXELS, 32 * 32 * 16),
         tiny.QWEN3_5: (tiny.QWEN3_MIN_PIXELS, 32 * 32 * 16),
         tiny.GLM4V: (tiny.GLM4V_MIN_PIXELS, 28 * 28 * 2 * 16),
         tiny.INTERNS1PRO: (tiny.QWEN3_MIN_PIXELS, 32 * 32 * 16),
         tiny.QWEN3_OMNI: (tiny.QWEN3_MIN_PIXELS, 32 * 32 * 16),
         tiny.QWEN3VL_MOE: (tiny.QWEN3_MIN_PIXELS, 32 * 32 * 16),
         tiny.QWEN3_5_MOE: (tiny.QWEN3_MIN_PIXELS, 32 * 32 * 16)}


def features(pixel_values: torch.Tensor) -> torch.Tensor:
    """[tokens, HIDDEN]: each token from its own 4 merged patch rows (a Qwen3 patch row is
    3 * 2 * 16 * 16 values, a GLM-4.1V one 3 * 2 * 14 * 14: either holds HIDDEN)."""
    return pixel_values.float().reshape(-1, MERGE * pixel_values.shape[-1])[:, :HIDDEN]


def n_levels(arch: str) -> int:
    return LEVELS if families.SPECS[arch].output == families.DEEPSTACK else 1


def levels(pixel_values: torch.Tensor) -> list[torch.Tensor]:
    """The fake Qwen3-VL tower's outputs: main, then each deepstack level (distinct values)."""
    main = features(pixel_values)
    return [main * (k + 1) + k for k in range(LEVELS)]


class FakeVisual(nn.Module):
    """Stands in for ``Qwen3VLVisionModel`` / ``Qwen3_5VisionModel``: lmdeploy's own position
    helpers (``rot_pos_emb``, ``fast_pos_embed_interpolate``), a fake forward."""

    rot_pos_ids = qwen3_vl.Qwen3VLVisionModel.rot_pos_ids
    rot_pos_emb = qwen3_vl.Qwen3VLVisionModel.rot_pos_emb
    fast_pos_embed_interpolate = qwen3_vl.Qwen3VLVisionModel.fast_pos_embed_interpolate

    def __init__(self, config, deepstack: bool) -> None:
        super().__init__()
        vision = config.vision_config
        self.spatial_merge_size = vision.spatial_merge_size
        self.pos_embed = nn.Embedding(vision.num_position_embeddings, vision.hidden_size)
        self.num_grid_per_side = int(vision.num_position_embeddings ** 0.5)
        head = vision.hidden_size // vision.num_heads
        self.rotary_pos_emb = qwen3_vl.Qwen3VLVisionRotaryEmbedding(head // 2)
        self.deepstack = deepstack
        if deepstack:
            self.deepstack_merger_list = nn.ModuleList([nn.Identity() for _ in range(LEVELS - 1)])
        self.calls: list[torch.Tensor] = []

    def forward(self, hidden_states, cu_seqlens, rotary_pos_emb, pos_embeds):
        assert pos_embeds.shape[0] == hidden_states.shape[0]  # lmdeploy's, for the pixels given
        self.calls.append(hidden_states)
        outs = levels(hidden_states)
        return (outs[0], outs[1:]) if self.deepstack else outs[0]


class FakeGlmVisual(nn.Module):
    """Stands in for ``Glm4vVisionModel``: lmdeploy's own ``rot_pos_emb`` (which prepare calls),
    a fake forward."""

    rot_pos_emb = glm4_1v.Glm4vVisionModel.rot_pos_emb

    def __init__(self, config) -> None:
        super().__init__()
        vision = config.vision_config
        self.spatial_merge_size = vision.spatial_merge_size
        self.rotary_pos_emb = glm4_1v.Glm4vVisionRotaryEmbedding(vision.hidden_size // vision.num_heads // 2)
        self.calls: list[torch.Tensor] = []

    def forward(self, hidden_states, cu_seqlens, rotary_pos_emb, grid_thw, image_type_ids):
        assert rotary_pos_emb[0].shape[0] == hidden_states.shape[0]  # lmdeploy's, for the pixels given
        assert int(grid_thw.prod(-1).sum()) == hidden_states.shape[0]
        self.calls.append(hidden_states)
        return features(hidden_states)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return kwargs["inputs_embeds"]


class FakeQwen3VL:
    """Stands in for a ``Qwen3VLForConditionalGeneration`` in its own prepare and forward."""

    get_multimodal_mask = DeployModelMixinV1.get_multimodal_mask

    def __init__(self, config) -> None:
        self.config = config
        self.embed = nn.Embedding(config.text_config.vocab_size, HIDDEN)
        self.visual = FakeVisual(config, deepstack=True)
        self.language_model = Recorder()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def run(self, inputs: dict) -> dict:
        """lmdeploy's forward over what prepare made; what reached the language model."""
        qwen3_vl.Qwen3VLForConditionalGeneration.forward(self, **inputs)
        return self.language_model.calls[-1]


class FakeInternS1Pro(FakeQwen3VL):
    """Stands in for an ``InternS1ProForConditionalGeneration``: Qwen3-VL's tower (deepstack
    levels and all), a forward that drops the levels."""

    enable_return_routed_experts = False

    def run(self, inputs: dict) -> dict:
        interns1_pro.InternS1ProForConditionalGeneration.forward(self, **inputs)
        return self.language_model.calls[-1]


class FakeQwen3Omni(FakeQwen3VL):
    """Stands in for Qwen3-Omni's thinker: Qwen3-VL's tower, its own prepare and forward (an
    ``image_mask`` over the visual items, no audio here)."""

    def __init__(self, config) -> None:
        super().__init__(types.SimpleNamespace(text_config=config.thinker_config.text_config,
                                               vision_config=config.thinker_config.vision_config))
        self.config = config

    def run(self, inputs: dict) -> dict:
        OMNI_CLASS.forward(self, **inputs)
        return self.language_model.calls[-1]


class FakeQwen3VLMoe(FakeQwen3VL):
    """Stands in for a ``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL's prepare, its own forward."""

    enable_return_routed_experts = False

    def run(self, inputs: dict) -> dict:
        qwen3_vl_moe.Qwen3VLMoeForConditionalGeneration.forward(self, **inputs)
        return self.language_model.calls[-1]


class FakeQwen3_5:
    """Stands in for a ``Qwen3_5ForConditionalGeneration`` (its prepare) and its inner
    ``Qwen3_5Model`` (its forward), whose vision tower is ``model.visual``."""

    get_multimodal_mask = DeployModelMixinV1.get_multimodal_mask
    is_spec_decoding = False

    def __init__(self, config) -> None:
        self.config = config
        embed = nn.Embedding(config.text_config.vocab_size, HIDDEN)
        self.model = types.SimpleNamespace(visual=FakeVisual(config, deepstack=False),
                                           language_model=Recorder(),
                                           get_input_embeddings=lambda: embed)
        self.embed = embed

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def run(self, inputs: dict) -> dict:
        kwargs = {k: v for k, v in inputs.items() if k != "state_ids"}
        qwen3_5.Qwen3_5Model.forward(self.model, state_ids=None, **kwargs)
        return self.model.language_model.calls[-1]


GLM4V_CLASS = glm4_1v.Glm4vForConditionalGeneration.__wrapped__  # the class behind @vlm_model


class FakeGlm4v:
    """Stands in for a ``Glm4vForConditionalGeneration`` in its own prepare and forward."""

    def __init__(self, config) -> None:
        self.config = config
        self.embed = nn.Embedding(config.text_config.vocab_size, HIDDEN)
        self.visual = FakeGlmVisual(config)
        self.language_model = Recorder()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def run(self, inputs: dict) -> dict:
        GLM4V_CLASS.forward(self, **inputs)
        return self.language_model.calls[-1]


CLASSES = {tiny.QWEN3VL: qwen3_vl.Qwen3VLForConditionalGeneration,
           tiny.QWEN3_5: qwen3_5.Qwen3_5ForConditionalGeneration,
           tiny.GLM4V: GLM4V_CLASS, tiny.INTERNS1PRO: interns1_pro.InternS1ProForConditionalGeneration,
           tiny.QWEN3_OMNI: OMNI_CLASS, tiny.QWEN3VL_MOE: qwen3_vl_moe.Qwen3VLMoeForConditionalGeneration,
           tiny.QWEN3_5_MOE: qwen3_5_moe.Qwen3_5MoeForConditionalGeneration}
FAKES = {tiny.QWEN3VL: FakeQwen3VL, tiny.QWEN3_5: FakeQwen3_5, tiny.GLM4V: FakeGlm4v,
         tiny.INTERNS1PRO: FakeInternS1Pro, tiny.QWEN3_OMNI: FakeQwen3Omni, tiny.QWEN3VL_MOE: FakeQwen3VLMoe,
         tiny.QWEN3_5_MOE: FakeQwen3_5}


def vision_of(model):
    """The fake tower of a fake model (where its declaration says the tower is)."""
    return model.model.visual if isinstance(model, FakeQwen3_5) else model.visual


def step_context(input_ids: list[int], multimodals: list[dict] | None, config) -> types.SimpleNamespace:
    """The fields of lmdeploy's ``StepContext`` that the models' ``prepare`` reads."""
    text = getattr(config, "thinker_config", config).text_config  # (Qwen3-Omni: its thinker's)
    full = sum(1 for t in getattr(text, "layer_types", []) if t == "full_attention")
    linear = sum(1 for t in getattr(text, "layer_types", []) if t == "linear_attention")
    return types.SimpleNamespace(
        input_ids=torch.tensor([input_ids]), position_ids=None, attn_metadata=None,
        input_embeddings=None, input_embedding_indexing=None, input_multimodals=multimodals,
        mrope_position_ids=None, state_offsets=None, is_chunk_multimodal=False,
        state_caches=[torch.zeros(1, linear), torch.zeros(1, linear)], _full=full)


class Rig:
    def __init__(self, arch: str, path: str) -> None:
        self.arch = arch
        self.config = AutoConfig.from_pretrained(path)
        self.cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        self.plain = tiny.PromptPath(path)
        self.frontend = tiny.PromptPath(path)
        install_frontend(self.frontend.model, self.cache, f"test:{arch}")
        # featcache's own exact preprocessing of misses (the Qwen3 lineage's processor), else None
        self.fast = self.frontend.model.preprocess.frontend.maker is not None
        self.given: list[list[tuple[int, int]]] = []  # images the image processor was given
        ip = self.frontend.model.processor.image_processor
        given, call = self.given, type(ip).__call__

        def recorded(this, images, *args, **kwargs):
            given.append([im.size for im in images])
            return call(this, images, *args, **kwargs)

        ip.__class__ = type(f"Recorded{type(ip).__name__}", (type(ip),), {"__call__": recorded})
        inner = {tiny.GLM4V: lambda: glm4_1v.Glm4vInputProcessor(self.config),
                 tiny.INTERNS1PRO: lambda: interns1_pro.InternS1ProInputProcessor(self.config, torch.float16),
                 tiny.QWEN3_OMNI: lambda: qwen3_omni_moe_thinker.Qwen3OmniInputProcessor(self.config),
                 }.get(arch, lambda: qwen3_vl.Qwen3VLInputProcessor(self.config, torch.float16))()
        self.processor = KeyedInputProcessor(inner, families.SPECS[arch].items)

    def close(self) -> None:
        self.plain.close()
        self.frontend.close()
        gc.collect()
        self.cache.close()

    def path_of(self) -> tiny.PromptPath:
        return tiny.PromptPath(self.frontend.model.model_path)

    def prompt(self, *images, plain: bool = False, text: str = "describe", path=None, **kwargs) -> dict:
        path = path or (self.plain if plain else self.frontend)
        return path.prompt(tiny.messages(*(tiny.image_item(i) for i in images), text=text), **kwargs)

    def fake_model(self):
        return FAKES[self.arch](self.config)

    def stats(self) -> dict[str, int]:
        return self.cache.stats().get(SECTION, {})

    def step(self, model, prompt: dict) -> dict:
        """One prefill step of ``prompt`` through the input processor, prepare and forward;
        what reached the language model."""
        result = self.processor.preprocess_input(prompt["input_ids"], prompt["multimodal"])
        context = step_context(prompt["input_ids"], [result.input_multimodals], self.config)
        prepare = CLASSES[self.arch].prepare_inputs_for_generation
        inputs = prepare(model, [None] * context._full, None, context)
        return model.run(inputs)


@pytest.fixture(params=FAMILIES, ids=["qwen3vl", "qwen3_5", "glm4v", "interns1pro", "qwen3_omni",
                                      "qwen3vl_moe", "qwen3_5_moe"])
def rig(request, tmp_path_factory):
    r = Rig(request.param, tiny.checkpoint(request.param, tmp_path_factory))
    yield r
    r.close()


@pytest.fixture
def patched(rig, monkeypatch):
    cls = CLASSES[rig.arch]  # (an MoE variant's prepare is its base class's: patched there)
    assert tiny.featcache_prepare(monkeypatch, cls, families.SPECS[rig.arch]) in cls.__mro__
    return rig


A, B, C = (tiny.noise_image(100, 80, 0), tiny.noise_image(40, 300, 1), tiny.noise_image(500, 500, 2))


def assert_same(plain: dict, ours: dict, hits_have_pixels: bool = False) -> None:
    """featcache's output equals lmdeploy's: ids, offsets, every per-image field; a miss's
    pixels equal, a hit's a 0-row placeholder (``hits_have_pixels``: lmdeploy's own, equal)."""
    assert ours["input_ids"] == plain["input_ids"]
    assert len(ours["multimodal"]) == len(plain["multimodal"])
    for x, y in zip(plain["multimodal"], ours["multimodal"], strict=True):
        assert set(y) - {REF_KEY} == set(x)
        for name in x:
            if name == "pixel_values":
                continue
            if isinstance(x[name], torch.Tensor):
                assert torch.equal(x[name], y[name]) and x[name].dtype == y[name].dtype, name
            else:
                assert x[name] == y[name], name
        ref = y[REF_KEY]
        if ref.hit and not hits_have_pixels:
            assert y["pixel_values"].shape == (0, *x["pixel_values"].shape[1:])
            assert y["pixel_values"].dtype == x["pixel_values"].dtype
        else:
            assert torch.equal(y["pixel_values"], x["pixel_values"])
            assert y["pixel_values"].dtype == x["pixel_values"].dtype


def seed(rig: Rig, *images, **kwargs) -> dict[bytes, torch.Tensor]:
    """Store features for ``images`` as a previous step's model would have (every level)."""
    stored = {}
    width = HIDDEN * n_levels(rig.arch)
    for item in rig.prompt(*images, **kwargs)["multimodal"]:
        ref = item[REF_KEY]
        start, end = item["offset"]
        stored[ref.key] = torch.randn(end - start, width)
        rig.cache.put(ref.key, stored[ref.key], meta=ref.meta)
    return stored


# -- the frontend --------------------------------------------------------------------------------

def test_misses_are_lmdeploys_own_output(rig):
    gray, rgba = B.convert("L"), C.convert("RGBA")  # (not what featcache's fast path takes)
    for images in [(A,), (A, B), (C, A, B), (gray, A), (rgba,)]:
        assert_same(rig.prompt(*images, plain=True), rig.prompt(*images))
    assert rig.stats()["hits"] == 0


@pytest.mark.parametrize("images", [(A,), (B, A), (A, C, A), (C, B, A)],
                         ids=["hit", "miss-hit", "hit-miss-hit", "two-misses-hit"])
def test_hits_expand_from_their_metadata_equal_to_lmdeploy(rig, images):
    seed(rig, A)
    rig.given.clear()
    before = rig.stats().get("preprocess_fast", 0)
    text = "compare these two: one <then> the other"
    ours = rig.prompt(*images, text=text)
    assert_same(rig.prompt(*images, plain=True, text=text), ours)
    assert [r[REF_KEY].hit for r in ours["multimodal"]] == [im is A for im in images]
    misses = [im.size for im in images if im is not A]
    if rig.fast:  # featcache made the misses' pixels (equal to lmdeploy's, above)
        assert rig.given == [] and rig.stats().get("preprocess_fast", 0) - before == len(misses)
    else:
        assert rig.given == ([misses] if misses else [])  # the image processor never saw a hit


def test_a_size_override_is_in_the_key_and_equal_to_lmdeploy(rig):
    seed(rig, C)
    low, high = SMALL[rig.arch]
    small = {"image": {"min_pixels": low, "max_pixels": high}}
    ours = rig.prompt(C, mm_processor_kwargs=small)
    assert not ours["multimodal"][0][REF_KEY].hit  # another size: another entry
    assert_same(rig.prompt(C, plain=True, mm_processor_kwargs=small), ours)
    ref = ours["multimodal"][0][REF_KEY]
    start, end = ours["multimodal"][0]["offset"]
    rig.cache.put(ref.key, torch.randn(end - start, HIDDEN * n_levels(rig.arch)), meta=ref.meta)
    again = rig.prompt(A, C, mm_processor_kwargs=small)
    assert [r[REF_KEY].hit for r in again["multimodal"]] == [False, True]
    assert_same(rig.prompt(A, C, plain=True, mm_processor_kwargs=small), again)
    assert rig.prompt(C)["multimodal"][0][REF_KEY].hit  # the default size's entry is its own


@pytest.mark.parametrize("options", [{"image": {"max_pixels": "1e9"}}, {"image": {"min_pixels": -4}},
                                     {"image": {"max_pixels": True}}, {"image": [1]}, [1]])
def test_bad_size_options_are_refused_before_any_work(rig, options):
    with pytest.raises(MediaOptionError):
        rig.prompt(A, mm_processor_kwargs=options)
    assert rig.stats()["options_refused"] == 1
    assert rig.given == []


def test_a_failure_inside_featcache_falls_back_to_lmdeploy(rig, monkeypatch):
    from featcache.lmdeploy.request import processor as newapi

    seed(rig, A)

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(newapi, "get_mm_items_offset", broken, raising=False)
    monkeypatch.setattr(newapi.ProcessorLevel, "_expand", broken)
    plain = rig.prompt(A, B, plain=True)
    ours = rig.prompt(A, B)
    assert ours["input_ids"] == plain["input_ids"]
    assert all(torch.equal(x["pixel_values"], y["pixel_values"])
               for x, y in zip(plain["multimodal"], ours["multimodal"], strict=True))
    assert rig.stats()["frontend_errors"] == 1


# -- the engine: prepare and forward on lmdeploy's real code --------------------------------------

def expected(rig: Rig, prompt: dict, plain: dict, stored: dict[bytes, torch.Tensor]) -> list[torch.Tensor]:
    """Per level, the rows every image should contribute, in order: a hit's stored rows, a
    miss's fake-tower rows from lmdeploy's own pixels."""
    n = n_levels(rig.arch)
    rows: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for item, own in zip(prompt["multimodal"], plain["multimodal"], strict=True):
        ref = item[REF_KEY]
        if ref.hit:
            parts = stored[ref.key].chunk(n, dim=-1)
        else:
            parts = levels(own["pixel_values"])[:n]
        for k in range(n):
            rows[k].append(parts[k])
    return [torch.cat(r) for r in rows]


@pytest.mark.parametrize("images", [(A, B), (B, A, C), (A,)], ids=["hit-miss", "miss-hit-miss", "hit"])
def test_a_step_serves_hits_and_computes_misses_only(patched, images):
    rig = patched
    stored = seed(rig, A)
    model = rig.fake_model()
    visual = vision_of(model)
    prompt = rig.prompt(*images)
    plain = rig.prompt(*images, plain=True)
    got = rig.step(model, prompt)
    want = expected(rig, prompt, plain, stored)
    mask = torch.tensor(prompt["input_ids"]) == prompt["multimodal"][0]["image_token_id"]
    embeds = got["inputs_embeds"][0]
    assert torch.equal(embeds[mask].float(), want[0])
    assert torch.equal(embeds[~mask], model.embed(torch.tensor(prompt["input_ids"]))[~mask])
    if n_levels(rig.arch) > 1:
        deep = got["deepstack_visual_embeds"]
        assert len(deep) == LEVELS - 1
        for k, level in enumerate(deep):
            assert torch.equal(level.float(), want[k + 1])
        assert torch.equal(got["visual_pos_masks"][0, :, 0], mask)
    misses = [own["pixel_values"] for item, own in zip(prompt["multimodal"], plain["multimodal"], strict=True)
              if not item[REF_KEY].hit]
    if misses:
        assert len(visual.calls) == 1 and torch.equal(visual.calls[0], torch.cat(misses).to(visual.calls[0]))
    else:
        assert visual.calls == []  # every image hit: the tower never ran
    # each miss is now stored, every level of it, and the next request hits all of them
    for item, own in zip(prompt["multimodal"], plain["multimodal"], strict=True):
        if not item[REF_KEY].hit:
            lease = rig.cache.acquire(item[REF_KEY].key)
            assert lease is not None
            want_rows = torch.cat(levels(own["pixel_values"])[:n_levels(rig.arch)], -1)
            assert torch.equal(lease.tensor.float(), want_rows)
            lease.release()
    again = rig.prompt(*images)
    assert all(item[REF_KEY].hit for item in again["multimodal"])
    calls = len(visual.calls)
    got_again = rig.step(rig_model := model, again)
    assert len(visual.calls) == calls
    assert torch.equal(got_again["inputs_embeds"][0][mask], embeds[mask])
    del rig_model


def test_a_step_without_featcache_images_is_lmdeploys_own(patched):
    rig = patched
    model = rig.fake_model()
    plain = rig.prompt(A, B, plain=True)  # no FeatRef anywhere: lmdeploy's prepare untouched
    got = rig.step(model, plain)
    mask = torch.tensor(plain["input_ids"]) == plain["multimodal"][0]["image_token_id"]
    want = torch.cat([levels(m["pixel_values"])[0] for m in plain["multimodal"]])
    assert torch.equal(got["inputs_embeds"][0][mask].float(), want)


def test_a_declaration_that_drops_the_deepstack_levels_fails(tmp_path_factory, monkeypatch):
    """A planted bug in the Qwen3-VL declaration (its output declared a plain tensor) does not
    pass: the forward cannot take what the wrapper returns."""
    rig = Rig(tiny.QWEN3VL, tiny.checkpoint(tiny.QWEN3VL, tmp_path_factory))
    try:
        wrong = families.ArchSpec(**{**families.SPECS[tiny.QWEN3VL].__dict__, "output": families.TENSOR})
        tiny.featcache_prepare(monkeypatch, CLASSES[tiny.QWEN3VL], wrong)
        seed(rig, A)
        with pytest.raises((TypeError, AttributeError, RuntimeError)):
            rig.step(rig.fake_model(), rig.prompt(A, B))
    finally:
        rig.close()


def test_a_declaration_with_a_wrong_vision_path_fails(tmp_path_factory, monkeypatch):
    rig = Rig(tiny.QWEN3_5, tiny.checkpoint(tiny.QWEN3_5, tmp_path_factory))
    try:
        wrong = families.ArchSpec(**{**families.SPECS[tiny.QWEN3_5].__dict__, "vision": "visual"})
        tiny.featcache_prepare(monkeypatch, CLASSES[tiny.QWEN3_5], wrong)
        seed(rig, A)
        with pytest.raises(AttributeError):
            rig.step(rig.fake_model(), rig.prompt(A, B))
    finally:
        rig.close()


def test_a_processor_that_overrides_its_expansion_takes_lmdeploys_preprocessing(rig):
    """A checkpoint's remote-code processor (Intern-S2's, Intern-S1-Pro's) that overrides what
    featcache would reproduce is not reproduced: lmdeploy preprocesses the whole request, a hit
    is tagged (the vision model is still skipped for it) and counted as not skipping preprocessing."""

    processor = rig.frontend.model.processor
    base = type(processor)
    remote = type(f"Remote{base.__name__}", (base,), {
        "__module__": "transformers_modules.remote.processing",
        "replace_image_token": lambda self, *a, **k: base.replace_image_token(self, *a, **k)})
    processor.__class__ = remote
    ours = rig.frontend.model.preprocess.frontend
    ours.expands = families.reproduces_expansion(processor)
    assert not ours.expands
    seed(rig, A)
    rig.given.clear()
    plain, got = rig.prompt(A, B, plain=True), rig.prompt(A, B)
    assert got["input_ids"] == plain["input_ids"]
    for x, y in zip(plain["multimodal"], got["multimodal"], strict=True):
        assert torch.equal(x["pixel_values"], y["pixel_values"])
    assert [item[REF_KEY].hit for item in got["multimodal"]] == [True, False]
    assert rig.given == [[A.size, B.size]]  # both preprocessed, by lmdeploy
    assert rig.stats()["preprocess_not_skipped"] == 1
    processor.__class__ = base
    assert families.reproduces_expansion(processor)


def test_misses_take_featcaches_exact_preprocessing_where_it_reproduces_the_processor(rig):
    """The Qwen3 lineage's image processor (Qwen2-VL's at patch 16) and GLM-4.1V's (the same
    patchify after its own smart_resize) are reproduced by featcache's ``PatchMaker``: a request
    of new images never reaches the image processor, and its output is lmdeploy's
    (``test_misses_are_lmdeploys_own_output``); a processor it does not reproduce runs, counted
    as a fallback."""
    assert rig.fast
    rig.given.clear()
    assert_same(rig.prompt(C, B, plain=True), rig.prompt(C, B))
    stats = rig.stats()
    if rig.fast:
        assert rig.given == [] and stats["preprocess_fast"] == 2
    else:
        assert rig.given == [[C.size, B.size]] and stats["preprocess_fallback"] == 2


def test_a_processor_featcache_does_not_reproduce_makes_the_misses(rig, monkeypatch):
    from featcache.lmdeploy.request import processor as newapi

    frontend = rig.frontend.model.preprocess.frontend
    monkeypatch.setattr(frontend, "maker", None)
    rig.given.clear()
    seed(rig, A)
    assert_same(rig.prompt(A, C, plain=True), rig.prompt(A, C))
    assert rig.given == [[A.size], [C.size]] and rig.stats()["preprocess_fallback"] == 2
    assert newapi.processor_patch_maker(object())[0] is None


def test_qwen3_omni_audio_in_a_step_is_left_to_lmdeploy(tmp_path_factory, monkeypatch):
    """A Qwen3-Omni step with audio beside a hit and a miss: the vision call gets the miss only,
    the image rows land on the image tokens, and the audio item goes to lmdeploy's own prepare
    (its audio tower, its own mask over the audio tokens)."""
    from lmdeploy.pytorch.multimodal.data_type import Modality, MultiModalData

    rig = Rig(tiny.QWEN3_OMNI, tiny.checkpoint(tiny.QWEN3_OMNI, tmp_path_factory))
    try:
        tiny.featcache_prepare(monkeypatch, OMNI_CLASS, families.SPECS[tiny.QWEN3_OMNI])
        stored = seed(rig, A)
        prompt, plain = rig.prompt(A, B), rig.prompt(A, B, plain=True)
        audio_id = rig.config.thinker_config.audio_token_id
        ids = prompt["input_ids"] + [audio_id] * 3  # three audio tokens after the images
        result = rig.processor.preprocess_input(prompt["input_ids"], prompt["multimodal"])
        audio = MultiModalData(modality=Modality.AUDIO, data=torch.randn(1, 128, 6),
                               start=len(prompt["input_ids"]), end=len(ids),
                               meta=dict(audio_token_id=audio_id, audio_feature_lengths=torch.tensor([6])))
        mm = {"mm_data": [*result.input_multimodals["mm_data"], audio]}
        model = rig.fake_model()
        heard: list[torch.Tensor] = []

        def audio_tower(input_features, feature_lens):
            heard.append(input_features)
            return torch.full((3, HIDDEN), 7.0)

        model.audio_tower = audio_tower
        context = step_context(ids, [mm], rig.config)
        inputs = OMNI_CLASS.prepare_inputs_for_generation(model, [None] * context._full, None, context)
        got = model.run(inputs)
        embeds = got["inputs_embeds"][0]
        image = torch.tensor(ids) == prompt["multimodal"][0]["image_token_id"]
        want = torch.cat([stored[prompt["multimodal"][0][REF_KEY].key].chunk(LEVELS, -1)[0],
                          levels(plain["multimodal"][1]["pixel_values"])[0]])
        assert torch.equal(embeds[image].float(), want)
        assert len(model.visual.calls) == 1  # the miss (B) only
        missed = plain["multimodal"][1]["pixel_values"]
        assert torch.equal(model.visual.calls[0], missed.to(model.visual.calls[0]))
        assert len(heard) == 1 and torch.equal(embeds[-3:], torch.full((3, HIDDEN), 7.0))
    finally:
        rig.close()


def test_tag_mode_each_model_process_skips_the_tower_for_the_images_it_holds(patched, monkeypatch):
    """Several processes (lmdeploy's mp engine, tp > 1): the API process's frontend makes every
    request's output (lmdeploy's own) and tags every image; an image it sent before travels
    without pixels, its tag carrying what rebuilds them (here a pipeline's in-memory image: its
    pixel bytes). The model process (its own cache, ``ranks``) computes an image the first time
    and serves it after; one that lost it rebuilds its pixels (equal to lmdeploy's) and computes
    it again, through the same prepare and forward."""
    from featcache.lmdeploy.pytorch import ranks

    rig = patched
    with tag_mode(rig) as send:
        model = rig.fake_model()
        model.get_input_processor = lambda: rig.processor.inner  # (the real model's method)
        visual = vision_of(model)
        rows: list[torch.Tensor] = []
        b_key = None
        for turn, images in enumerate([(A, B), (B, C), (B,)]):
            if turn == 2:  # the model process lost B (evicted)
                ranks.local_cache().discard(b_key)
            sent = send(*images)
            b_key = sent["multimodal"][images.index(B)][REF_KEY].key
            plain = rig.prompt(*images, plain=True)
            for m, p in zip(sent["multimodal"], plain["multimodal"], strict=True):
                if m[REF_KEY].source is not None:  # sent before: no pixels, its source instead
                    assert m["pixel_values"].shape == (0, *p["pixel_values"].shape[1:])
                else:
                    assert torch.equal(m["pixel_values"], p["pixel_values"])
            assert [m[REF_KEY].source is not None for m in sent["multimodal"]] == [
                turn > 0 and im is B for im in images]
            got = rig.step(model, sent)
            mask = torch.tensor(sent["input_ids"]) == sent["multimodal"][0]["image_token_id"]
            rows.append(got["inputs_embeds"][0][mask].float())
            want = torch.cat([levels(p["pixel_values"])[0] for p in plain["multimodal"]])
            assert torch.equal(rows[-1], want)  # every image's rows, computed, served or rebuilt
        # the tower ran for A and B, then for C only (B served from the model process's cache),
        # then for B rebuilt from its source, with lmdeploy's own pixels
        assert len(visual.calls) == 3
        c_rows = rig.prompt(C, plain=True)["multimodal"][0]["pixel_values"].shape[0]
        assert visual.calls[1].shape[0] == c_rows
        b_pixels = rig.prompt(B, plain=True)["multimodal"][0]["pixel_values"]
        assert torch.equal(visual.calls[2], b_pixels.to(visual.calls[2]))
        assert model_cache_stats()["vision_skipped"] == 1
        assert model_cache_stats()["pixels_rebuilt"] == 1


def test_the_startup_probe_finds_featcaches_output_equal_to_lmdeploys_here(rig):
    """At install, ``ProcessorFrontend.probe`` compares featcache's output for a request of two
    images (missing, then held) with lmdeploy's own on this installation: equal for every family."""
    frontend = rig.frontend.model.preprocess.frontend
    assert frontend.expands and frontend.probe() is None
    assert rig.stats().get("expansion_probe_failed", 0) == 0
    assert rig.stats().get("preprocess_fast", 0) == 0  # the probe counts as no request


@pytest.mark.parametrize("plant", ["pixels", "expansion"])
def test_a_probe_that_finds_a_difference_leaves_every_request_to_lmdeploy(
        plant, tmp_path_factory, monkeypatch, caplog):
    """A planted difference (featcache's pixels one step off; an expansion one token short, as a
    transformers release might change it silently): the probe names it at install, the model's
    requests get lmdeploy's own preprocessing (equal to plain's, hits counted as not skipping
    it), and a hit still skips the vision model (its ref holds the lease)."""
    from featcache.lmdeploy.request import processor as newapi

    if plant == "pixels":
        real = newapi.processor_patches

        def off(maker, images, size):
            made = real(maker, images, size)
            return None if made is None else (made[0] + 1e-3, made[1])

        monkeypatch.setattr(newapi, "processor_patches", off)
    else:
        short = _short_by_one(newapi.ProcessorLevel._expand)
        monkeypatch.setattr(newapi.ProcessorLevel, "_expand", short)
    rig = Rig(tiny.QWEN3VL, tiny.checkpoint(tiny.QWEN3VL, tmp_path_factory))
    try:
        frontend = rig.frontend.model.preprocess.frontend
        assert not frontend.expands and frontend.maker is None
        assert rig.stats()["expansion_probe_failed"] == 1
        said = [r.getMessage() for r in caplog.records if "differed from lmdeploy's" in r.getMessage()]
        assert len(said) == 1 and ("pixel_values" if plant == "pixels" else "input ids") in said[0]
        seed(rig, A)
        rig.given.clear()
        ours = rig.prompt(A, B)
        assert_same(rig.prompt(A, B, plain=True), ours, hits_have_pixels=True)
        assert [item[REF_KEY].hit for item in ours["multimodal"]] == [True, False]
        assert rig.given == [[A.size, B.size]] and rig.stats()["preprocess_not_skipped"] == 1
    finally:
        rig.close()


def _short_by_one(expand):
    def short(self, *args, **kwargs):
        out = expand(self, *args, **kwargs)
        return {**out, "input_ids": out["input_ids"][:-1]}
    return short


def test_placeholder_runs_are_tokenized_once_and_give_the_tokenizers_own_ids(rig):
    """``processor.tokenized``: a prompt's runs of the image (and video) token, tokenized once each
    and repeated, give the ids the family's tokenizer gives the whole text: runs of every length,
    two kinds side by side, a run a client typed into its text, text around them; the tokenizer is
    never handed a run of two placeholders. A text argument that depends on the length
    (truncation) takes the whole text."""
    from featcache.lmdeploy.request.processor import tokenized

    model = rig.frontend.model.preprocess.frontend.model
    processor, tokens = model.processor, model.mm_tokens
    image = processor.image_token
    video = getattr(processor, "video_token", None) or image
    text = (f"say <{image}> then {image * 300}x{video * 7}{image}\n {image * 2} "
            f"and a typed {image}{image} end {video}")
    kwargs = {"padding": True, "return_tensors": "pt"}
    want = processor.tokenizer([text], **kwargs)["input_ids"].flatten()
    seen = []
    call = type(processor.tokenizer).__call__

    class Watched(type(processor.tokenizer)):
        def __call__(self, text, *args, **kw):
            seen.append(text)
            return call(self, text, *args, **kw)

    cls = type(processor.tokenizer)
    processor.tokenizer.__class__ = Watched
    try:
        got = tokenized(processor, tokens, [text], dict(kwargs))
        assert torch.equal(got, want)
        held = [image] + ([video] if getattr(tokens, "video_token_id", None) is not None else [])
        assert seen and all(t * 2 not in sent[0] for sent in seen for t in held)
        seen.clear()
        whole = tokenized(processor, tokens, [text], dict(kwargs, truncation=True, max_length=10 ** 6))
        assert torch.equal(whole, want) and seen == [[text]]
    finally:
        processor.tokenizer.__class__ = cls
