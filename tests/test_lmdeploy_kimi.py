"""featcache on Kimi-K2.5 / K2.6 (``KimiK25ForConditionalGeneration``), on lmdeploy 0.18's real
CPU code: its processor-level frontend (``KimiK25VisionModel.preprocess``, over a stand-in of the
checkpoint's remote processor, ``kimi_processor_standin``), its input processor inside
``KeyedInputProcessor``, and its real ``prepare_inputs_for_generation`` and ``forward`` patched by
featcache, on a stand-in model whose vision call (``get_image_features``, one tensor per image) is
a fake computing each image's features from its own pixels and grid.

Kimi's prepare refuses a step whose image tokens do not add up to the grids of the images it was
handed, so featcache keeps every image in the step's list (a hit's pixels 0-row for the prepare)
and cuts ``grid_thws`` to the computed images after it (``ArchSpec.keep_items``). Its preprocessing
is the checkpoint's remote processor, which featcache does not reproduce: lmdeploy preprocesses
every image and featcache tags them (``preprocess_not_skipped``); a hit skips the vision tower.
"""

from __future__ import annotations

import _family_rig
import _lmdeploy_stack
import pytest
import torch
from torch import nn

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402
from _family_rig import FamilyRig, Recorder, assert_prompt_is_lmdeploys, model_cache_stats, tag_mode  # noqa: E402
from lmdeploy.pytorch.models import kimi_k25  # noqa: E402

from featcache.lmdeploy import families  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402

HIDDEN = 256
DTYPE = torch.float16
CLASS = kimi_k25.KimiK25ForConditionalGeneration
SPEC = families.SPECS[tiny.KIMI]


def features(pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> list[torch.Tensor]:
    """One [h * w / 4, HIDDEN] tensor per image: each 2x2 group of its patches' pixels, cut."""
    out, start = [], 0
    for t, h, w in grid_thws.tolist():
        patches = pixel_values[start:start + t * h * w].float().reshape(-1, 4 * 3 * 14 * 14)
        out.append(patches[:, :HIDDEN].to(pixel_values.dtype))
        start += t * h * w
    return out


class FakeKimi:
    """Stands in for a ``KimiK25ForConditionalGeneration``: its own prepare and forward (and their
    checks); a fake vision call; a recorder for the language model."""

    _UNSUPPORTED_MULTIMODAL_FORWARD_KEYS = CLASS._UNSUPPORTED_MULTIMODAL_FORWARD_KEYS
    _raise_for_unsupported_multimodal_kwargs = CLASS._raise_for_unsupported_multimodal_kwargs
    language_model_only = False

    def __init__(self, config) -> None:
        self.language_model = Recorder(config.text_config.vocab_size, HIDDEN, DTYPE)
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def get_image_features(self, pixel_values, grid_thws):
        self.calls.append((pixel_values, grid_thws))
        return features(pixel_values, grid_thws)

    def run(self, inputs: dict) -> dict:
        CLASS.forward(self, **inputs)
        return self.language_model.calls[-1]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny.checkpoint(tiny.KIMI, tmp_path_factory)


@pytest.fixture
def rig(path, monkeypatch):
    assert tiny.featcache_prepare(monkeypatch, CLASS, SPEC) is CLASS
    r = FamilyRig(tiny.KIMI, path, CLASS, lambda config: kimi_k25.KimiK25InputProcessor(config, DTYPE))
    yield r
    r.close()


A, B, C = (tiny.noise_image(100, 80, 0), tiny.noise_image(40, 300, 1), tiny.noise_image(500, 500, 2))


def seed(rig: FamilyRig, *images) -> dict[bytes, torch.Tensor]:
    return _family_rig.seed(rig, *images, hidden=HIDDEN, dtype=DTYPE)


@pytest.mark.parametrize("images", [(A,), (B, A), (A, C, A), (C, B)],
                         ids=["hit", "miss-hit", "hit-miss-hit", "misses"])
def test_the_prompt_is_lmdeploys_and_its_images_are_keyed(rig, images):
    """The remote processor is lmdeploy's to run (``reproduces_expansion``: Kimi's vision model
    has a preprocess of its own): the request's output is lmdeploy's, each image tagged with its
    ref, a hit's holding its lease; the hits are counted as not skipping preprocessing."""
    seed(rig, A)
    assert not rig.frontend.model.preprocess.frontend.expands
    before = rig.cache.stats()[SECTION].get("preprocess_not_skipped", 0)
    ours = rig.prompt(*images)
    assert_prompt_is_lmdeploys(rig.prompt(*images, plain=True), ours, hits_have_pixels=True)
    assert [item[REF_KEY].hit for item in ours["multimodal"]] == [im is A for im in images]
    after = rig.cache.stats()[SECTION].get("preprocess_not_skipped", 0)
    assert after - before == sum(im is A for im in images)


@pytest.mark.parametrize("images", [(A, B), (B, A, C), (A,), (A, A), (C, C)],
                         ids=["hit-miss", "miss-hit-miss", "hit", "hit-twice", "miss-twice"])
def test_a_step_keeps_every_image_and_the_tower_sees_the_misses_only(rig, images):
    """A step's image rows: a hit's stored rows, a miss's the rows plain lmdeploy's own step makes
    of it; the tower is handed the computed images' pixels and grids only (a repeated miss once);
    Kimi's own checks (image tokens against the grids, rows against the image mask) pass."""
    stored = seed(rig, A)
    prompt = rig.prompt(*images)
    model = FakeKimi(rig.config)
    got = rig.step(model, prompt)
    theirs = rig.plain_step(FakeKimi(rig.config), rig.prompt(*images, plain=True))
    ids = torch.tensor(prompt["input_ids"])
    mask = ids == prompt["multimodal"][0]["image_token_id"]
    items = prompt["multimodal"]
    computed = theirs["inputs_embeds"][0][mask].split([tiny.tokens(x) for x in items])
    want = torch.cat([stored[item[REF_KEY].key] if item[REF_KEY].hit else rows
                      for item, rows in zip(items, computed, strict=True)])
    embeds = got["inputs_embeds"][0]
    assert torch.equal(embeds[mask], want)
    assert torch.equal(embeds[~mask], model.get_input_embeddings()(ids)[~mask])
    firsts = {}
    for i, item in enumerate(items):
        if not item[REF_KEY].hit:
            firsts.setdefault(item[REF_KEY].key, i)
    if firsts:
        (pixels, grids), = model.calls
        assert torch.equal(grids, torch.cat([items[i]["grid_thws"] for i in firsts.values()]))
        assert torch.equal(pixels, torch.cat([items[i]["pixel_values"] for i in firsts.values()]).to(DTYPE))
    else:
        assert model.calls == []  # every image hit: the tower never ran
    # each miss is now stored: the same request again never runs the tower
    again = rig.prompt(*images)
    assert all(item[REF_KEY].hit for item in again["multimodal"])
    model_again = FakeKimi(rig.config)
    model_again.language_model.embed = model.language_model.embed
    got_again = rig.step(model_again, again)
    assert model_again.calls == []
    assert torch.equal(got_again["inputs_embeds"][0], embeds)


def test_a_declaration_that_takes_hits_out_fails_kimis_own_check(rig, monkeypatch):
    """A planted bug: without ``keep_items`` the hits leave the step's list, and Kimi's prepare
    refuses the step (its image tokens no longer add up to the grids it was handed)."""
    wrong = families.ArchSpec(**{**SPEC.__dict__, "keep_items": ()})
    monkeypatch.setattr(CLASS, "prepare_inputs_for_generation",
                        CLASS.prepare_inputs_for_generation.__wrapped__)
    tiny.featcache_prepare(monkeypatch, CLASS, wrong)
    seed(rig, A)
    with pytest.raises(ValueError, match="media-pad positions"):
        rig.step(FakeKimi(rig.config), rig.prompt(A, B))


def test_a_declaration_naming_an_input_the_prepare_does_not_make_fails(rig, monkeypatch):
    """A planted bug: ``keep_items`` naming an input Kimi's prepare does not make. The step fails,
    naming it, rather than hand the tower the grids of images whose pixels it was not given."""
    wrong = families.ArchSpec(**{**SPEC.__dict__, "keep_items": ("not_an_input",)})
    monkeypatch.setattr(CLASS, "prepare_inputs_for_generation",
                        CLASS.prepare_inputs_for_generation.__wrapped__)
    tiny.featcache_prepare(monkeypatch, CLASS, wrong)
    seed(rig, A)
    with pytest.raises(RuntimeError, match="not_an_input"):
        rig.step(FakeKimi(rig.config), rig.prompt(A, B))


def test_tag_mode_each_model_process_skips_the_tower_for_the_images_it_holds(rig):
    """Several processes (lmdeploy's mp engine, tp > 1): the API process's frontend tags every
    image, sent with its pixels; the model process (its own cache, ``ranks``) computes an image
    the first time and serves it after, through Kimi's prepare and forward; the rows are those
    plain lmdeploy's own step makes."""
    with tag_mode(rig) as send:
        model = FakeKimi(rig.config)
        for images in [(A, B), (B, C)]:
            sent = send(*images)
            got = rig.step(model, sent)
            theirs = rig.plain_step(FakeKimi(rig.config), rig.prompt(*images, plain=True))
            mask = torch.tensor(sent["input_ids"]) == sent["multimodal"][0]["image_token_id"]
            assert torch.equal(got["inputs_embeds"][0][mask], theirs["inputs_embeds"][0][mask])
        # the tower ran for A and B, then for C only (B served from the model process's cache)
        assert len(model.calls) == 2
        assert model.calls[1][1].tolist() == sent["multimodal"][1]["grid_thws"].tolist()
        assert model_cache_stats()["vision_skipped"] == 1
