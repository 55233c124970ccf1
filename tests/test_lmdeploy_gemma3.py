"""featcache on Gemma 3 (``Gemma3ForConditionalGeneration``), on lmdeploy 0.18's real CPU code.

Gemma 3 takes lmdeploy's legacy preprocessing (one image-processor call per request: a fixed
bilinear resize) and its forward does two things with the pixels it is handed: the vision call
(``get_image_features`` -> [images, tokens, hidden]) and, whenever pixels are given, bidirectional
attention masks among the image tokens built in the pixels' dtype. So a step whose images all hit
must still hand the forward pixels of the model's dtype (the hits' own 0-row pixels), and engine
prefix caching stays off (the masks assume every image's whole span is in the step).

A tiny checkpoint (``lmdeploy_tiny``) goes through lmdeploy's real prompt path, plain and with
featcache's frontend; then lmdeploy's real input processor inside ``KeyedInputProcessor``, the
patched real ``prepare_inputs_for_generation`` and the real ``forward`` (its real mask builder)
of ``Gemma3ForConditionalGeneration``, on a stand-in model whose vision tower is a fake that
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
from lmdeploy.pytorch.models import gemma3_vl  # noqa: E402
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


def features(pixel_values: torch.Tensor) -> torch.Tensor:
    """[images, tokens, HIDDEN]: each image's tokens from its own pixels (float32)."""
    flat = pixel_values.float().reshape(pixel_values.shape[0], -1)
    return flat[:, :tiny.GEMMA3_TOKENS * HIDDEN].reshape(-1, tiny.GEMMA3_TOKENS, HIDDEN)


class Recorder:
    def __init__(self, vocab: int) -> None:
        self.calls: list[dict] = []
        self.embed = nn.Embedding(vocab, HIDDEN).to(DTYPE)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def prepare_inputs_for_generation(self, past_key_values=None, inputs_embeds=None, context=None):
        return dict(input_ids=context.input_ids, position_ids=context.position_ids,
                    past_key_values=past_key_values, attn_metadata=None, inputs_embeds=inputs_embeds)

    def __call__(self, input_ids, position_ids, inputs_embeds=None, **kwargs):
        self.calls.append(dict(inputs_embeds=inputs_embeds, **kwargs))
        return inputs_embeds


class FakeGemma3:
    """Stands in for a ``Gemma3ForConditionalGeneration``: its own prepare, forward and mask
    builder; a fake vision call; a recorder for the language model."""

    prepare_attn_masks = CLASS.prepare_attn_masks

    def __init__(self, config) -> None:
        self.config = config
        self.sliding_window = config.text_config.sliding_window
        self.language_model = Recorder(config.text_config.vocab_size)
        self.calls: list[torch.Tensor] = []

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        self.calls.append(pixel_values)
        return features(pixel_values).to(pixel_values.dtype)

    def run(self, inputs: dict) -> dict:
        CLASS.forward(self, **inputs)
        return self.language_model.calls[-1]


class Rig:
    def __init__(self, path: str) -> None:
        self.config = AutoConfig.from_pretrained(path)
        self.cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        self.plain = tiny.PromptPath(path)
        self.frontend = tiny.PromptPath(path)
        install_frontend(self.frontend.model, self.cache, "test:gemma3")
        self.frontend.record_featcache()
        self.processor = KeyedInputProcessor(gemma3_vl.Gemma3VLInputProcessor(self.config, DTYPE))

    def close(self) -> None:
        self.plain.close()
        self.frontend.close()
        gc.collect()
        self.cache.close()

    def prompt(self, *images, plain: bool = False, text: str = "describe") -> dict:
        path = self.plain if plain else self.frontend
        return path.prompt(tiny.messages(*(tiny.image_item(i) for i in images), text=text))

    def step(self, model: FakeGemma3, prompt: dict) -> dict:
        """One prefill step of ``prompt``: input processor, prepare, forward; what reached the
        language model."""
        result = self.processor.preprocess_input(prompt["input_ids"], prompt["multimodal"])
        n = len(prompt["input_ids"])
        context = types.SimpleNamespace(
            input_ids=torch.tensor([prompt["input_ids"]]), position_ids=torch.arange(n)[None],
            input_multimodals=[result.input_multimodals])
        inputs = CLASS.prepare_inputs_for_generation(model, None, None, context)
        return model.run(inputs)


@pytest.fixture
def rig(tmp_path_factory):
    r = Rig(tiny.checkpoint(tiny.GEMMA3, tmp_path_factory))
    yield r
    r.close()


@pytest.fixture
def patched(rig, monkeypatch):
    assert tiny.featcache_prepare(monkeypatch, CLASS, SPEC) is CLASS
    return rig


A, B, C = (tiny.noise_image(100, 80, 0), tiny.noise_image(40, 300, 1), tiny.noise_image(500, 500, 2))


def seed(rig: Rig, *images) -> dict[bytes, torch.Tensor]:
    """Store features for ``images`` as a previous step's model would have."""
    stored = {}
    for item in rig.prompt(*images)["multimodal"]:
        ref = item[REF_KEY]
        stored[ref.key] = torch.randn(tiny.GEMMA3_TOKENS, HIDDEN).to(DTYPE)
        rig.cache.put(ref.key, stored[ref.key], meta=ref.meta)
    return stored


def assert_same(plain: dict, ours: dict) -> None:
    """featcache's prompt equals lmdeploy's: ids, and every per-image field the engine reads (the
    pixels of a miss; a hit's are a 0-row placeholder of their dtype). ``num_crops`` is left out:
    lmdeploy 0.18 slices it by the image's index in the request (``[:idx:idx + 1]``: empty for the
    first image, one zero after), and no engine code reads it."""
    assert ours["input_ids"] == plain["input_ids"]
    assert len(ours["multimodal"]) == len(plain["multimodal"])
    for x, y in zip(plain["multimodal"], ours["multimodal"], strict=True):
        for name in ("offset", "image_tokens", "image_token_id"):
            assert x[name] == y[name], name
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
def test_a_step_serves_hits_computes_misses_and_keeps_lmdeploys_masks(patched, images):
    rig = patched
    stored = seed(rig, A)
    prompt = rig.prompt(*images)
    plain = rig.prompt(*images, plain=True)
    model = FakeGemma3(rig.config)
    got = rig.step(model, prompt)
    ids = torch.tensor(prompt["input_ids"])
    mask = ids == rig.config.image_token_index
    want = torch.cat([stored[item[REF_KEY].key] if item[REF_KEY].hit
                      else features(own["pixel_values"].to(DTYPE))[0].to(DTYPE)
                      for item, own in zip(prompt["multimodal"], plain["multimodal"], strict=True)])
    embeds = got["inputs_embeds"][0]
    assert torch.equal(embeds[mask], want.to(embeds.dtype))
    assert torch.equal(embeds[~mask], model.get_input_embeddings()(ids)[~mask])
    misses = [own["pixel_values"] for item, own in zip(prompt["multimodal"], plain["multimodal"], strict=True)
              if not item[REF_KEY].hit]
    if misses:
        assert len(model.calls) == 1 and torch.equal(model.calls[0], torch.cat(misses).to(DTYPE))
    else:
        assert model.calls == []  # every image hit: the tower never ran
    # the masks plain lmdeploy's forward builds for this prompt: the same values, the same dtype
    plain_model = FakeGemma3(rig.config)
    plain_inputs = CLASS.prepare_inputs_for_generation.__wrapped__(
        plain_model, None, None, types.SimpleNamespace(
            input_ids=ids[None], position_ids=torch.arange(len(ids))[None],
            input_multimodals=[gemma3_vl.Gemma3VLInputProcessor(rig.config, DTYPE).preprocess_input(
                plain["input_ids"], plain["multimodal"]).input_multimodals]))
    want_masks = plain_model.run(plain_inputs)
    assert got["has_images"] and want_masks["has_images"]
    for name in ("global_attn_masks", "local_attn_masks"):
        for ours, theirs in zip(got[name], want_masks[name], strict=True):
            assert ours.dtype == theirs.dtype == DTYPE
            assert torch.equal(ours, theirs)
    # each miss is now stored, and the next request hits all of its images
    again = rig.prompt(*images)
    assert all(item[REF_KEY].hit for item in again["multimodal"])
    calls = len(model.calls)
    got_again = rig.step(model, again)
    assert len(model.calls) == calls
    assert torch.equal(got_again["inputs_embeds"][0][mask], embeds[mask])
    assert rig.cache.stats()[SECTION]["vision_skipped"] >= len(images)


def test_an_all_hit_step_hands_the_forward_pixels_of_the_model_dtype(patched):
    """The planted bug this guards: an all-hit placeholder of another dtype (``_empty``'s float32)
    changes the masks' dtype from what plain lmdeploy's forward builds."""
    rig = patched
    seed(rig, A)
    result = rig.processor.preprocess_input(rig.prompt(A)["input_ids"], rig.prompt(A)["multimodal"])
    context = types.SimpleNamespace(input_ids=torch.tensor([rig.prompt(A)["input_ids"]]),
                                    position_ids=torch.arange(len(rig.prompt(A)["input_ids"]))[None],
                                    input_multimodals=[result.input_multimodals])
    inputs = CLASS.prepare_inputs_for_generation(FakeGemma3(rig.config), None, None, context)
    assert inputs["pixel_values"].dtype == DTYPE and inputs["pixel_values"].shape[0] == 0


def test_a_float32_placeholder_would_change_the_masks(tmp_path_factory, monkeypatch):
    rig = Rig(tiny.checkpoint(tiny.GEMMA3, tmp_path_factory))
    try:
        wrong = families.ArchSpec(**{**SPEC.__dict__, "placeholders": {
            "pixel_values": lambda device, images: torch.empty(0, device=device)}})
        tiny.featcache_prepare(monkeypatch, CLASS, wrong)
        seed(rig, A)
        got = rig.step(FakeGemma3(rig.config), rig.prompt(A))
        assert got["global_attn_masks"][0].dtype != DTYPE  # what the test above rules out
    finally:
        rig.close()


def test_prefix_caching_is_never_turned_on_for_gemma3():
    assert tiny.GEMMA3 in families.SPECS and tiny.GEMMA3 not in PREFIX_CACHED
    assert {"Qwen3VLForConditionalGeneration", "InternVLForConditionalGeneration"} <= PREFIX_CACHED
