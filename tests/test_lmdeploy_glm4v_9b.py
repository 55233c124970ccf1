"""featcache on GLM-4V-9B (``ChatGLMModel`` / ``ChatGLMForConditionalGeneration`` with a
``vision_config``), on lmdeploy 0.18's real CPU code: its legacy frontend (``GLM4VisionModel``:
torchvision's transforms, unpacked aside by the test command) over a tiny checkpoint whose remote
config is a stand-in (``bench.device.seed_remote_code``), its input processor inside
``KeyedInputProcessor``, and its real top-level ``prepare_inputs_for_generation`` and ``forward``
and its transformer's ``forward`` (the vision call, ``transformer.vision``, and the scatter),
patched by featcache, over a fake EVA2CLIP and a recording encoder.
"""

from __future__ import annotations

import _family_rig
import _lmdeploy_stack
import pytest
import torch
from torch import nn

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402
from _family_rig import FakeEVA2CLIP, FamilyRig, model_cache_stats, tag_mode  # noqa: E402
from lmdeploy.pytorch.models import chatglm2  # noqa: E402

from featcache.lmdeploy import PREFIX_CACHED, families  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402

HIDDEN = 256
DTYPE = torch.float16
CLASS = chatglm2.ChatGLMForConditionalGeneration
SPEC = families.SPECS[tiny.GLM4V_9B]


class FakeTransformer:
    """``ChatGLMModel``'s own forward over a fake vision model, a token embedding, a rotary stand-in
    and a recording encoder."""

    forward = chatglm2.ChatGLMModel.forward

    def __init__(self, vocab: int) -> None:
        self.vision = FakeEVA2CLIP(tiny.GLM4V_9B_TOKENS, HIDDEN, DTYPE)
        self.embedding = nn.Embedding(vocab, HIDDEN).to(DTYPE)  # the same in every instance:
        nn.init.normal_(self.embedding.weight, generator=torch.Generator().manual_seed(0))
        self.calls: list[torch.Tensor] = []

    def __call__(self, **kwargs):
        return self.forward(**kwargs)

    def rotary_pos_emb(self, hidden_states, position_ids):
        return torch.zeros(1, 1), torch.zeros(1, 1)

    def encoder(self, hidden_states, **kwargs):
        self.calls.append(hidden_states)
        return hidden_states

    def get_input_embeddings(self) -> nn.Module:
        return self.embedding


class FakeGLM4V:
    def __init__(self, config) -> None:
        self.config = config
        self.transformer = FakeTransformer(config.padded_vocab_size)

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.embedding

    def run(self, inputs: dict) -> torch.Tensor:
        with torch.no_grad():
            return CLASS.forward(self, **inputs)[0]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    _lmdeploy_stack.need_transforms()
    return tiny.checkpoint(tiny.GLM4V_9B, tmp_path_factory)


@pytest.fixture
def rig(path, monkeypatch):
    assert tiny.featcache_prepare(monkeypatch, CLASS, SPEC) is CLASS
    r = FamilyRig(tiny.GLM4V_9B, path, CLASS, lambda config: chatglm2.ChatGLMInputProcessor(config, DTYPE),
                  transforms=True)
    yield r
    r.close()


A, B, C = (tiny.noise_image(100, 80, 0), tiny.noise_image(40, 30, 1), tiny.noise_image(50, 120, 2))


def seed(rig: FamilyRig, *images) -> dict[bytes, torch.Tensor]:
    return _family_rig.seed(rig, *images, hidden=HIDDEN, dtype=DTYPE)


@pytest.mark.parametrize("images", [(A,), (B, A), (A, C, A)], ids=["hit", "miss-hit", "hit-miss-hit"])
def test_hits_skip_preprocessing_and_the_prompt_is_lmdeploys(rig, images):
    seed(rig, A)
    _family_rig.assert_hits_skip_preprocessing(rig, images, A, per_image=False)


@pytest.mark.parametrize("images", [(A, B), (B, A, C), (A,), (C, C)],
                         ids=["hit-miss", "miss-hit-miss", "hit", "miss-twice"])
def test_a_step_serves_hits_computes_misses_and_keeps_lmdeploys_inputs(rig, images):
    """The embeddings reaching the encoder: a hit's stored rows, a miss's the rows plain
    lmdeploy's own step makes of it, text rows plain lmdeploy's; the vision model is handed the
    misses' pixels only (a repeated miss once), and never when every image hit."""
    stored = seed(rig, A)
    prompt = rig.prompt(*images)
    model = FakeGLM4V(rig.config)
    got = rig.step(model, prompt)
    theirs = rig.plain_step(FakeGLM4V(rig.config), rig.prompt(*images, plain=True))
    ids = torch.tensor(prompt["input_ids"])
    mask = ids == prompt["multimodal"][0]["image_token_id"]
    items = prompt["multimodal"]
    computed = theirs[mask].split([tiny.tokens(x) for x in items])
    want = torch.cat([stored[item[REF_KEY].key] if item[REF_KEY].hit else part
                      for item, part in zip(items, computed, strict=True)])
    assert torch.equal(got[mask], want)
    assert torch.equal(got[~mask], theirs[~mask])
    firsts = {}
    for i, item in enumerate(items):
        if not item[REF_KEY].hit:
            firsts.setdefault(item[REF_KEY].key, i)
    calls = model.transformer.vision.calls
    if firsts:
        (pixels,) = calls
        misses = [items[i]["pixel_values"] for i in firsts.values()]
        assert torch.equal(pixels, torch.stack(misses).to(DTYPE))
    else:
        assert calls == []
    again = rig.prompt(*images)
    assert all(item[REF_KEY].hit for item in again["multimodal"])
    calls.clear()
    assert torch.equal(rig.step(model, again), got)
    assert calls == []
    assert rig.cache.stats()[SECTION]["vision_skipped"] >= len(images)


def test_a_declaration_with_a_wrong_vision_path_fails(rig, monkeypatch):
    """A planted bug: the vision call declared where GLM-4V has none (``vision``, not
    ``transformer.vision``) fails the step instead of serving anything."""
    wrong = families.ArchSpec(**{**SPEC.__dict__, "vision": "vision"})
    monkeypatch.setattr(CLASS, "prepare_inputs_for_generation",
                        CLASS.prepare_inputs_for_generation.__wrapped__)
    tiny.featcache_prepare(monkeypatch, CLASS, wrong)
    seed(rig, A)
    with pytest.raises(AttributeError, match="vision"):
        rig.step(FakeGLM4V(rig.config), rig.prompt(A, B))


def test_prefix_caching_stays_off_for_glm4v_9b():
    assert not {"ChatGLMModel", "ChatGLMForConditionalGeneration"} & PREFIX_CACHED


def test_tag_mode_each_model_process_skips_the_tower_for_the_images_it_holds(rig):
    """Several processes: the API process tags every image; the model process (its own cache,
    ``ranks``) computes an image the first time and serves it after; the rows are plain's."""
    with tag_mode(rig) as send:
        model = FakeGLM4V(rig.config)
        for images in [(A, B), (B, C)]:
            got = rig.step(model, send(*images))
            assert torch.equal(got, rig.plain_step(FakeGLM4V(rig.config), rig.prompt(*images, plain=True)))
        # the tower ran for A and B, then for C only (B served from the model process's cache)
        calls = model.transformer.vision.calls
        assert len(calls) == 2 and calls[1].shape[0] == 1
        assert model_cache_stats()["vision_skipped"] == 1
