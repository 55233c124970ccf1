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

import _family_rig
import _lmdeploy_stack
import pytest
import torch
from torch import nn

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402
from _family_rig import FamilyRig, model_cache_stats, tag_mode  # noqa: E402
from lmdeploy.pytorch.models import llama4  # noqa: E402

from featcache.lmdeploy import PREFIX_CACHED, families  # noqa: E402
from featcache.lmdeploy.pytorch.engine import ROWS_KEY, KeyedInputProcessor  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION  # noqa: E402
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


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny.checkpoint(tiny.LLAMA4, tmp_path_factory)


@pytest.fixture
def rig(path, monkeypatch):
    assert tiny.featcache_prepare(monkeypatch, CLASS, SPEC) is CLASS
    r = FamilyRig(tiny.LLAMA4, path, CLASS, lambda config: llama4.Llama4InputProcessor(config, DTYPE))
    yield r
    r.close()


A, B, C = (tiny.noise_image(100, 80, 0), tiny.noise_image(40, 30, 1), tiny.noise_image(50, 120, 2))


def seed(rig: FamilyRig, *images) -> dict[bytes, torch.Tensor]:
    """Store features for ``images`` as a previous step's model would have (before the projector)."""
    return _family_rig.seed(rig, *images, hidden=HIDDEN, dtype=DTYPE, rows=rows)


def test_a_span_holds_more_tokens_than_rows_and_the_input_processor_counts_them(rig):
    prompt = rig.prompt(A, B)
    result = rig.processor.preprocess_input(prompt["input_ids"], prompt["multimodal"])
    data = result.input_multimodals["image"]
    assert [d.meta[ROWS_KEY] for d in data] == [20, 4]  # A: 2x2 tiles and a global one; B: one tile
    assert [d.end - d.start for d in data] == [25, 5]  # + separators and the <|image|> marker


@pytest.mark.parametrize("images", [(A,), (B, A), (A, C, A)], ids=["hit", "miss-hit", "hit-miss-hit"])
def test_hits_skip_preprocessing_and_the_prompt_is_lmdeploys(rig, images):
    seed(rig, A)
    _family_rig.assert_hits_skip_preprocessing(rig, images, A, per_image=True)


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
    theirs = rig.plain_step(FakeLlama4(rig.config), rig.prompt(*images, plain=True))
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
    with tag_mode(rig) as send:
        model = FakeLlama4(rig.config)
        for images in [(A, B), (B, C)]:
            sent = send(*images)
            got = rig.step(model, sent)
            theirs = rig.plain_step(FakeLlama4(rig.config), rig.prompt(*images, plain=True))
            mask = torch.tensor(sent["input_ids"]) == sent["multimodal"][0]["image_token_id"]
            assert torch.equal(got["inputs_embeds"][0][mask], theirs["inputs_embeds"][0][mask])
        # the tower ran for A and B, then for C only (B served from the model process's cache)
        assert len(model.calls) == 2
        assert model.calls[1].shape[0] == sent["multimodal"][1]["pixel_values"].shape[0]
        assert model_cache_stats()["vision_skipped"] == 1
