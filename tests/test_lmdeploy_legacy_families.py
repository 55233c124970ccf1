"""featcache on the legacy-API families declared after InternVL and Qwen2-VL, on lmdeploy 0.18's
real CPU code: Gemma 3 (``Gemma3ForConditionalGeneration``) and LLaVA (``LlavaForConditionalGeneration``).

Both take lmdeploy's legacy preprocessing (``preprocess(messages)``: per request for Gemma 3, per
image for LLaVA), run by featcache on the misses only, and a method as their vision call
(``get_image_features``). Gemma 3's preprocessing is a fixed bilinear resize, and its forward
does two things with the pixels it is handed: the vision call
(``get_image_features`` -> [images, tokens, hidden]) and, whenever pixels are given, bidirectional
attention masks among the image tokens built in the pixels' dtype. So a step whose images all hit
must still hand the forward pixels of the model's dtype (the hits' own 0-row pixels), and engine
prefix caching stays off (the masks assume every image's whole span is in the step).

Each family's tiny checkpoint (``lmdeploy_tiny``) goes through lmdeploy's real prompt path, plain
and with featcache's frontend; then lmdeploy's real input processor inside
``KeyedInputProcessor``, the patched real ``prepare_inputs_for_generation`` and the real
``forward`` (Gemma 3's real mask builder), on a stand-in model whose vision call is a fake that
computes each image's features from its own pixels and whose language model is a recorder.
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
from _family_rig import Recorder, model_cache_stats, tag_mode  # noqa: E402
from lmdeploy.pytorch.models import gemma3_vl, llava  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy import PREFIX_CACHED, families  # noqa: E402
from featcache.lmdeploy.pytorch.engine import KeyedInputProcessor  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION, install_frontend  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402

HIDDEN = 256  # the tiny LLM's hidden size
DTYPE = torch.float16  # the model dtype the engine casts pixels to
CLASS = gemma3_vl.Gemma3ForConditionalGeneration
SPEC = families.SPECS[tiny.GEMMA3]
FAMILIES = [tiny.GEMMA3, tiny.LLAVA]
CLASSES = {tiny.GEMMA3: CLASS, tiny.LLAVA: llava.LlavaForConditionalGeneration}


def features(pixel_values: torch.Tensor, tokens: int = tiny.GEMMA3_TOKENS) -> torch.Tensor:
    """[images, tokens, HIDDEN]: each image's tokens from its own pixels (float32)."""
    flat = pixel_values.float().reshape(pixel_values.shape[0], -1)
    return flat[:, :tokens * HIDDEN].reshape(-1, tokens, HIDDEN)


class FakeGemma3:
    """Stands in for a ``Gemma3ForConditionalGeneration``: its own prepare, forward and mask
    builder; a fake vision call; a recorder for the language model."""

    prepare_attn_masks = CLASS.prepare_attn_masks

    def __init__(self, config) -> None:
        self.config = config
        self.sliding_window = config.text_config.sliding_window
        self.language_model = Recorder(config.text_config.vocab_size, HIDDEN, DTYPE)
        self.calls: list[torch.Tensor] = []

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        self.calls.append(pixel_values)
        return features(pixel_values).to(pixel_values.dtype)

    def run(self, inputs: dict) -> dict:
        CLASS.forward(self, **inputs)
        return self.language_model.calls[-1]


class FakeLlava:
    """Stands in for a ``LlavaForConditionalGeneration``: its own prepare and forward; a fake
    vision call returning, as lmdeploy's, [1, images * tokens, hidden]."""

    def __init__(self, config) -> None:
        self.config = config
        self.language_model = Recorder(config.text_config.vocab_size, HIDDEN, DTYPE)
        self.calls: list[torch.Tensor] = []

    def get_image_features(self, pixel_values, vision_feature_layer=-1,
                           vision_feature_select_strategy="default"):
        assert (vision_feature_layer, vision_feature_select_strategy) == (-2, "default")  # the config's
        self.calls.append(pixel_values)
        return features(pixel_values, tiny.LLAVA_TOKENS).to(pixel_values.dtype).flatten(0, 1)[None]

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def run(self, inputs: dict) -> dict:
        llava.LlavaForConditionalGeneration.forward(self, **inputs)
        return self.language_model.calls[-1]


FAKES = {tiny.GEMMA3: FakeGemma3, tiny.LLAVA: FakeLlava}


class Rig:
    def __init__(self, arch: str, path: str) -> None:
        self.arch = arch
        self.config = AutoConfig.from_pretrained(path)
        self.cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        self.plain = tiny.PromptPath(path)
        self.frontend = tiny.PromptPath(path)
        install_frontend(self.frontend.model, self.cache, f"test:{arch}")
        self.frontend.record_featcache()
        inner = {tiny.GEMMA3: gemma3_vl.Gemma3VLInputProcessor,
                 tiny.LLAVA: llava.LLavaInputProcessor}[arch](self.config, DTYPE)
        self.processor = KeyedInputProcessor(inner)
        self.cls = CLASSES[arch]

    def fake_model(self):
        return FAKES[self.arch](self.config)

    def plain_step(self, prompt: dict) -> tuple[object, dict]:
        """The same step without featcache: lmdeploy's own prepare (and input processor)."""
        model = self.fake_model()
        result = self.processor.inner.preprocess_input(prompt["input_ids"], prompt["multimodal"])
        n = len(prompt["input_ids"])
        context = types.SimpleNamespace(
            input_ids=torch.tensor([prompt["input_ids"]]), position_ids=torch.arange(n)[None],
            attn_metadata=None, input_embeddings=None, input_embedding_indexing=None,
            input_multimodals=[result.input_multimodals])
        prepare = getattr(self.cls.prepare_inputs_for_generation, "__wrapped__",
                          self.cls.prepare_inputs_for_generation)
        return model, model.run(prepare(model, None, None, context))

    def close(self) -> None:
        self.plain.close()
        self.frontend.close()
        gc.collect()
        self.cache.close()

    def path_of(self) -> tiny.PromptPath:
        return tiny.PromptPath(self.frontend.model.model_path)

    def prompt(self, *images, plain: bool = False, text: str = "describe", path=None) -> dict:
        path = path or (self.plain if plain else self.frontend)
        return path.prompt(tiny.messages(*(tiny.image_item(i) for i in images), text=text))

    def step(self, model, prompt: dict) -> dict:
        """One prefill step of ``prompt``: input processor, prepare, forward; what reached the
        language model."""
        result = self.processor.preprocess_input(prompt["input_ids"], prompt["multimodal"])
        n = len(prompt["input_ids"])
        context = types.SimpleNamespace(
            input_ids=torch.tensor([prompt["input_ids"]]), position_ids=torch.arange(n)[None],
            attn_metadata=None, input_embeddings=None, input_embedding_indexing=None,
            input_multimodals=[result.input_multimodals])
        inputs = self.cls.prepare_inputs_for_generation(model, None, None, context)
        return model.run(inputs)


@pytest.fixture(params=FAMILIES, ids=["gemma3", "llava"])
def rig(request, tmp_path_factory):
    r = Rig(request.param, tiny.checkpoint(request.param, tmp_path_factory))
    yield r
    r.close()


@pytest.fixture
def patched(rig, monkeypatch):
    assert tiny.featcache_prepare(monkeypatch, rig.cls, families.SPECS[rig.arch]) is rig.cls
    return rig


@pytest.fixture
def gemma(tmp_path_factory):
    r = Rig(tiny.GEMMA3, tiny.checkpoint(tiny.GEMMA3, tmp_path_factory))
    yield r
    r.close()


A, B, C = (tiny.noise_image(100, 80, 0), tiny.noise_image(40, 300, 1), tiny.noise_image(500, 500, 2))


def seed(rig: Rig, *images) -> dict[bytes, torch.Tensor]:
    """Store features for ``images`` as a previous step's model would have."""
    stored = {}
    for item in rig.prompt(*images)["multimodal"]:
        ref = item[REF_KEY]
        stored[ref.key] = torch.randn(tiny.tokens(item), HIDDEN).to(DTYPE)
        rig.cache.put(ref.key, stored[ref.key], meta=ref.meta)
    return stored


def assert_same(plain: dict, ours: dict) -> None:
    """featcache's prompt equals lmdeploy's: ids, and every per-image field the engine reads (the
    pixels of a miss; a hit's are a 0-row placeholder of their dtype). Gemma 3's ``num_crops`` is
    left out: lmdeploy 0.18 slices it by the image's index in the request (``[:idx:idx + 1]``:
    empty for the first image, one zero after), and no engine code reads it."""
    assert ours["input_ids"] == plain["input_ids"]
    assert len(ours["multimodal"]) == len(plain["multimodal"])
    for x, y in zip(plain["multimodal"], ours["multimodal"], strict=True):
        assert set(y) - {REF_KEY} == set(x)
        for name in set(x) - {"num_crops", "pixel_values"}:
            assert x[name] == y[name] or list(x[name]) == list(y[name]), name
        if y[REF_KEY].hit:
            assert y["pixel_values"].shape == (0, *x["pixel_values"].shape[1:])
        else:
            assert torch.equal(y["pixel_values"], x["pixel_values"])
        assert y["pixel_values"].dtype == x["pixel_values"].dtype


@pytest.mark.parametrize("images", [(A,), (B, A), (A, C, A), (C, B, A)],
                         ids=["hit", "miss-hit", "hit-miss-hit", "two-misses-hit"])
def test_hits_skip_preprocessing_and_the_prompt_is_lmdeploys(rig, images):
    seed(rig, A)
    rig.frontend.calls.clear()
    ours = rig.prompt(*images, text="compare: one <then> the other")
    assert_same(rig.prompt(*images, plain=True, text="compare: one <then> the other"), ours)
    assert [item[REF_KEY].hit for item in ours["multimodal"]] == [im is A for im in images]
    misses = [im.size for im in images if im is not A]
    assert rig.frontend.calls == ([misses] if misses else [])  # a hit is never preprocessed


@pytest.mark.parametrize("images", [(A, B), (B, A, C), (A,), (A, A)],
                         ids=["hit-miss", "miss-hit-miss", "hit", "hit-twice"])
def test_a_step_serves_hits_computes_misses_and_keeps_lmdeploys_inputs(patched, images):
    """A step's image rows: a hit's stored rows, a miss's the rows plain lmdeploy's own step
    makes of it (the same fake tower, lmdeploy's prepare and forward); every other input of
    the language model plain lmdeploy's (Gemma 3's masks)."""
    rig = patched
    stored = seed(rig, A)
    prompt = rig.prompt(*images)
    plain = rig.prompt(*images, plain=True)
    model = rig.fake_model()
    got = rig.step(model, prompt)
    _, theirs = rig.plain_step(plain)  # plain lmdeploy computes every image, hits too
    ids = torch.tensor(prompt["input_ids"])
    mask = ids == prompt["multimodal"][0]["image_token_id"]
    embeds = got["inputs_embeds"][0]
    computed = theirs["inputs_embeds"][0][mask].split([tiny.tokens(x) for x in plain["multimodal"]])
    want = torch.cat([stored[item[REF_KEY].key].to(embeds.dtype) if item[REF_KEY].hit else rows
                      for item, rows in zip(prompt["multimodal"], computed, strict=True)])
    assert torch.equal(embeds[mask], want)
    assert torch.equal(embeds[~mask], model.get_input_embeddings()(ids)[~mask])
    misses = [own["pixel_values"] for item, own in zip(prompt["multimodal"], plain["multimodal"], strict=True)
              if not item[REF_KEY].hit]
    if misses:
        assert len(model.calls) == 1 and torch.equal(model.calls[0], torch.cat(misses).to(DTYPE))
    else:
        assert model.calls == []  # every image hit: the tower never ran
    assert set(got) == set(theirs)
    for name in set(got) - {"inputs_embeds"}:
        if isinstance(got[name], list) and got[name] and isinstance(got[name][0], torch.Tensor):
            for x, y in zip(got[name], theirs[name], strict=True):
                assert x.dtype == y.dtype and torch.equal(x, y), name
        else:
            assert got[name] == theirs[name], name
    if rig.arch == tiny.GEMMA3:
        assert got["has_images"] and all(m.dtype == DTYPE for m in got["global_attn_masks"])
    # each miss is now stored, and the next request hits all of its images
    again = rig.prompt(*images)
    assert all(item[REF_KEY].hit for item in again["multimodal"])
    calls = len(model.calls)
    got_again = rig.step(model, again)
    assert len(model.calls) == calls
    assert torch.equal(got_again["inputs_embeds"][0][mask], embeds[mask])
    assert rig.cache.stats()[SECTION]["vision_skipped"] >= len(images)


def test_gemma3_all_hit_step_hands_the_forward_pixels_of_the_model_dtype(gemma, monkeypatch):
    tiny.featcache_prepare(monkeypatch, CLASS, SPEC)
    seed(gemma, A)
    prompt = gemma.prompt(A)
    result = gemma.processor.preprocess_input(prompt["input_ids"], prompt["multimodal"])
    context = types.SimpleNamespace(input_ids=torch.tensor([prompt["input_ids"]]),
                                    position_ids=torch.arange(len(prompt["input_ids"]))[None],
                                    input_multimodals=[result.input_multimodals])
    inputs = CLASS.prepare_inputs_for_generation(FakeGemma3(gemma.config), None, None, context)
    assert inputs["pixel_values"].dtype == DTYPE and inputs["pixel_values"].shape[0] == 0


def test_gemma3_declaration_with_a_float32_placeholder_fails(gemma, monkeypatch):
    """A planted bug: an all-hit placeholder of another dtype (``_empty``'s float32) changes the
    masks' dtype from what plain lmdeploy's forward builds, which the step test catches."""
    wrong = families.ArchSpec(**{**SPEC.__dict__, "placeholders": {
        "pixel_values": lambda device, images: torch.empty(0, device=device)}})
    tiny.featcache_prepare(monkeypatch, CLASS, wrong)
    seed(gemma, A)
    got = gemma.step(FakeGemma3(gemma.config), gemma.prompt(A))
    _, theirs = gemma.plain_step(gemma.prompt(A, plain=True))
    assert got["global_attn_masks"][0].dtype != theirs["global_attn_masks"][0].dtype


def test_prefix_caching_is_never_turned_on_for_gemma3():
    assert tiny.GEMMA3 in families.SPECS and tiny.GEMMA3 not in PREFIX_CACHED
    assert {"Qwen3VLForConditionalGeneration", "InternVLForConditionalGeneration"} <= PREFIX_CACHED


def test_tag_mode_each_model_process_skips_the_tower_for_the_images_it_holds(patched):
    """Several processes (lmdeploy's mp engine, tp > 1): the API process's frontend tags every
    image (lmdeploy's preprocessing the first time an image is seen); the model process (its own
    cache, ``ranks``) computes an image the first time and serves it after, through the same
    prepare and forward; the rows are those plain lmdeploy's own step makes."""
    rig = patched
    with tag_mode(rig) as send:
        model = rig.fake_model()
        for images in [(A, B), (B, C)]:
            sent = send(*images)
            got = rig.step(model, sent)
            _, theirs = rig.plain_step(rig.prompt(*images, plain=True))
            mask = torch.tensor(sent["input_ids"]) == sent["multimodal"][0]["image_token_id"]
            assert torch.equal(got["inputs_embeds"][0][mask], theirs["inputs_embeds"][0][mask])
        # the tower ran for A and B, then for C only (B served from the model process's cache)
        assert len(model.calls) == 2 and model.calls[1].shape[0] == 1
        assert model_cache_stats()["vision_skipped"] == 1
