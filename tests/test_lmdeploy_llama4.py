"""featcache on Llama 4 (``Llama4ForConditionalGeneration``), on lmdeploy 0.18's real CPU code:
its legacy frontend (``LLama4VisionModel.preprocess``, transformers' ``Llama4Processor`` over a
stand-in image processor, ``llama4_image_standin``), its input processor inside
``KeyedInputProcessor``, and its real ``prepare_inputs_for_generation`` and ``forward`` patched by
featcache, on a stand-in model whose vision call (``get_image_features`` -> [tiles, patches,
hidden], before the projector) is a fake computing each tile's rows from its own pixels.

An image's span holds more than its feature rows: its tiles' ``<|patch|>`` tokens, the separators
between tiles and an ``<|image|>`` marker. Its rows are the ``<|patch|>`` tokens in its span
(``ArchSpec.token_rows``), counted by the input processor; a planted declaration without it fails.
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
from lmdeploy.pytorch.models import llama4  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy import PREFIX_CACHED, families  # noqa: E402
from featcache.lmdeploy.pytorch.engine import ROWS_KEY, KeyedInputProcessor  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION, install_frontend  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402

HIDDEN = 256
DTYPE = torch.float16
CLASS = llama4.Llama4ForConditionalGeneration
SPEC = families.SPECS[tiny.LLAMA4]


class Recorder:
    """Llama 4's language model, called as ``language_model(inputs_embeds, position_ids=, ...)``."""

    def __init__(self, vocab: int) -> None:
        self.calls: list[dict] = []
        self.embed = nn.Embedding(vocab, HIDDEN).to(DTYPE)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def __call__(self, inputs_embeds, **kwargs):
        self.calls.append(dict(inputs_embeds=inputs_embeds, **kwargs))
        return inputs_embeds


class FakeLlama4:
    """Stands in for a ``Llama4ForConditionalGeneration``: its own prepare and forward; a fake
    vision call returning, as lmdeploy's, [tiles, patches, hidden]; a fixed projector."""

    def __init__(self, config) -> None:
        self.language_model = Recorder(config.text_config.vocab_size)
        self.multi_modal_projector = nn.Linear(HIDDEN, HIDDEN, bias=False).to(DTYPE)
        nn.init.normal_(self.multi_modal_projector.weight, generator=torch.Generator().manual_seed(0))
        self.calls: list[torch.Tensor] = []

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        self.calls.append(pixel_values)
        flat = pixel_values.float().reshape(pixel_values.shape[0], -1)
        n = tiny.LLAMA4_TILE_TOKENS
        return flat[:, :n * HIDDEN].reshape(-1, n, HIDDEN).to(DTYPE)

    def run(self, inputs: dict) -> dict:
        with torch.no_grad():
            CLASS.forward(self, **inputs)
        return self.language_model.calls[-1]


def rows(item: dict, input_ids: list[int]) -> int:
    """An image's feature rows: the ``<|patch|>`` tokens in its span."""
    start = item["offset"]
    return input_ids[start:start + item["image_tokens"]].count(item["image_token_id"])


class Rig:
    def __init__(self, path: str) -> None:
        self.config = AutoConfig.from_pretrained(path)
        self.cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        self.plain = tiny.PromptPath(path, trust_remote_code=True)
        self.frontend = tiny.PromptPath(path, trust_remote_code=True)
        install_frontend(self.frontend.model, self.cache, "test:llama4")
        self.frontend.record_featcache()
        self.inner = llama4.Llama4InputProcessor(self.config, DTYPE)
        self.processor = KeyedInputProcessor(self.inner, SPEC.items, SPEC.token_rows)

    def close(self) -> None:
        self.plain.close()
        self.frontend.close()
        gc.collect()
        self.cache.close()

    def prompt(self, *images, plain: bool = False) -> dict:
        path = self.plain if plain else self.frontend
        return path.prompt(tiny.messages(*(tiny.image_item(i) for i in images), text="compare"))

    def step(self, model: FakeLlama4, prompt: dict, processor=None, prepare=None) -> dict:
        result = (processor or self.processor).preprocess_input(prompt["input_ids"], prompt["multimodal"])
        n = len(prompt["input_ids"])
        context = types.SimpleNamespace(
            input_ids=torch.tensor([prompt["input_ids"]]), position_ids=torch.arange(n)[None],
            attn_metadata=None, input_multimodals=[result.input_multimodals])
        return model.run((prepare or CLASS.prepare_inputs_for_generation)(model, None, None, context))

    def plain_step(self, prompt: dict) -> dict:
        own = getattr(CLASS.prepare_inputs_for_generation, "__wrapped__", CLASS.prepare_inputs_for_generation)
        return self.step(FakeLlama4(self.config), prompt, self.inner, own)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny.checkpoint(tiny.LLAMA4, tmp_path_factory)


@pytest.fixture
def rig(path, monkeypatch):
    assert tiny.featcache_prepare(monkeypatch, CLASS, SPEC) is CLASS
    r = Rig(path)
    yield r
    r.close()


A, B, C = (tiny.noise_image(100, 80, 0), tiny.noise_image(40, 30, 1), tiny.noise_image(50, 120, 2))


def seed(rig: Rig, *images) -> dict[bytes, torch.Tensor]:
    """Store features for ``images`` as a previous step's model would have (before the projector)."""
    stored = {}
    prompt = rig.prompt(*images)
    for item in prompt["multimodal"]:
        ref = item[REF_KEY]
        stored[ref.key] = torch.randn(rows(item, prompt["input_ids"]), HIDDEN).to(DTYPE)
        rig.cache.put(ref.key, stored[ref.key], meta=ref.meta)
    return stored


def test_a_span_holds_more_tokens_than_rows_and_the_input_processor_counts_them(rig):
    prompt = rig.prompt(A, B)
    result = rig.processor.preprocess_input(prompt["input_ids"], prompt["multimodal"])
    data = result.input_multimodals["image"]
    assert [d.meta[ROWS_KEY] for d in data] == [20, 4]  # A: 2x2 tiles and a global one; B: one tile
    assert [d.end - d.start for d in data] == [25, 5]  # + separators and the <|image|> marker


@pytest.mark.parametrize("images", [(A,), (B, A), (A, C, A)], ids=["hit", "miss-hit", "hit-miss-hit"])
def test_hits_skip_preprocessing_and_the_prompt_is_lmdeploys(rig, images):
    seed(rig, A)
    rig.frontend.calls.clear()
    ours, plain = rig.prompt(*images), rig.prompt(*images, plain=True)
    assert ours["input_ids"] == plain["input_ids"]
    for x, y in zip(plain["multimodal"], ours["multimodal"], strict=True):
        assert set(y) - {REF_KEY} == set(x)
        for name in set(x) - {"pixel_values"}:
            assert x[name] == y[name], name
        if y[REF_KEY].hit:
            assert y["pixel_values"].shape == (0, *x["pixel_values"].shape[1:])
        else:
            assert torch.equal(y["pixel_values"], x["pixel_values"])
    assert [item[REF_KEY].hit for item in ours["multimodal"]] == [im is A for im in images]
    misses = [im.size for im in images if im is not A]
    assert rig.frontend.calls == [[m] for m in misses]  # per image, the misses only


@pytest.mark.parametrize("images", [(A, B), (B, A, C), (A,), (C, C)],
                         ids=["hit-miss", "miss-hit-miss", "hit", "miss-twice"])
def test_a_step_serves_hits_computes_misses_and_keeps_lmdeploys_inputs(rig, images):
    """A step's image rows (after the projector, which runs on hits too): a hit's stored rows
    projected, a miss's the rows plain lmdeploy's own step makes of it; text rows and the image
    mask plain lmdeploy's; the tower is handed the misses' tiles only."""
    stored = seed(rig, A)
    prompt = rig.prompt(*images)
    model = FakeLlama4(rig.config)
    got = rig.step(model, prompt)
    theirs = rig.plain_step(rig.prompt(*images, plain=True))
    ids = torch.tensor(prompt["input_ids"])
    mask = ids == prompt["multimodal"][0]["image_token_id"]
    items = prompt["multimodal"]
    computed = theirs["inputs_embeds"][0][mask].split([rows(x, prompt["input_ids"]) for x in items])
    with torch.no_grad():
        want = torch.cat([model.multi_modal_projector(stored[item[REF_KEY].key]) if item[REF_KEY].hit
                          else part for item, part in zip(items, computed, strict=True)])
    embeds = got["inputs_embeds"][0]
    assert torch.equal(embeds[mask], want)
    assert torch.equal(embeds[~mask], model.get_input_embeddings()(ids)[~mask].detach())
    firsts = {}
    for i, item in enumerate(items):
        if not item[REF_KEY].hit:
            firsts.setdefault(item[REF_KEY].key, i)
    if firsts:
        (pixels,) = model.calls
        assert torch.equal(pixels, torch.cat([items[i]["pixel_values"] for i in firsts.values()]).to(DTYPE))
    else:
        assert model.calls == []
    again = rig.prompt(*images)
    assert all(item[REF_KEY].hit for item in again["multimodal"])
    model.calls.clear()
    assert torch.equal(rig.step(model, again)["inputs_embeds"][0], embeds)
    assert model.calls == []
    assert rig.cache.stats()[SECTION]["vision_skipped"] >= len(images)


def test_a_declaration_that_counts_span_tokens_as_rows_fails(rig, monkeypatch):
    """A planted bug: without ``token_rows`` an image's rows are taken as its span's length,
    more than the tower returns for it; the step refuses rather than scatter wrong rows."""
    wrong = families.ArchSpec(**{**SPEC.__dict__, "token_rows": False})
    monkeypatch.setattr(CLASS, "prepare_inputs_for_generation",
                        CLASS.prepare_inputs_for_generation.__wrapped__)
    tiny.featcache_prepare(monkeypatch, CLASS, wrong)
    rig.processor = KeyedInputProcessor(rig.inner, wrong.items, wrong.token_rows)
    with pytest.raises(RuntimeError, match="feature rows"):
        rig.step(FakeLlama4(rig.config), rig.prompt(A, B))


def test_prefix_caching_stays_off_for_llama4():
    assert tiny.LLAMA4 not in PREFIX_CACHED and tiny.LLAMA4 in families.TOKEN_ROWS


def test_tag_mode_each_model_process_skips_the_tower_for_the_images_it_holds(rig):
    """Several processes: the API process tags every image; the model process (its own cache,
    ``ranks``) computes an image the first time and serves it after; the rows are those plain
    lmdeploy's own step makes, the rows counted in the engine process's input processor."""
    import json
    import pickle

    from featcache.lmdeploy import counters_cache
    from featcache.lmdeploy.pytorch import ranks
    from featcache.lmdeploy.request.tags import FeatTag

    api_cache = counters_cache()
    api = tiny.PromptPath(rig.frontend.model.model_path, trust_remote_code=True)
    install_frontend(api.model, api_cache, "test:llama4", tags=True)
    ranks.configure(json.dumps({"feature_cache": {"device": "cpu", "device_bytes": 64 << 20,
                                                   "host_bytes": 0}}))
    try:
        model = FakeLlama4(rig.config)
        for images in [(A, B), (B, C)]:
            sent = api.prompt(tiny.messages(*(tiny.image_item(i) for i in images), text="compare"))
            plain = rig.prompt(*images, plain=True)
            assert sent["input_ids"] == plain["input_ids"]
            assert all(isinstance(m[REF_KEY], FeatTag) for m in sent["multimodal"])
            got = rig.step(model, pickle.loads(pickle.dumps(sent)))  # as lmdeploy's RPC hands it over
            theirs = rig.plain_step(plain)
            mask = torch.tensor(sent["input_ids"]) == sent["multimodal"][0]["image_token_id"]
            assert torch.equal(got["inputs_embeds"][0][mask], theirs["inputs_embeds"][0][mask])
        # the tower ran for A and B, then for C only (B served from the model process's cache)
        assert len(model.calls) == 2
        assert model.calls[1].shape[0] == sent["multimodal"][1]["pixel_values"].shape[0]
        assert ranks.local_cache().stats()[SECTION]["vision_skipped"] == 1
    finally:
        ranks.reset_for_tests()
        api.close()
        api_cache.close()
