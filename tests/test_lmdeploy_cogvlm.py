"""featcache on CogVLM / CogVLM2 (``CogVLMForCausalLM``), on lmdeploy 0.18's real CPU code: its legacy
frontend (``CogVLMVisionModel``: torchvision's transforms, unpacked aside by the test command; its
own chat template) over a tiny checkpoint whose remote config is a stand-in
(``bench.device.seed_remote_code``), its input processor inside ``KeyedInputProcessor``, and its real
``prepare_inputs_for_generation``, ``forward`` and model forward (the vision call,
``model.vision``, written at ``vision_ids``), patched by featcache, over a fake EVA2CLIP and
recording decoder layers.

CogVLM routes every decoder layer's vision and language experts by ``vision_ids`` and
``lang_ids``, which its prepare builds only when it is handed images: a step whose images all hit
gets them rebuilt (``families.cogvlm_step_inputs``), and the vision rows go back as [images,
tokens, hidden], which its forward flattens before an index assignment (``PER_IMAGE``).
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
from lmdeploy.pytorch.models import cogvlm  # noqa: E402

from featcache.lmdeploy import PREFIX_CACHED, families  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402

HIDDEN = 256
DTYPE = torch.float16
CLASS = cogvlm.CogVLMForCausalLM
SPEC = families.SPECS[tiny.COGVLM]


class Layer:
    """A decoder layer that records the expert routing it is handed."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, hidden_states, **kwargs):
        self.calls.append(dict(lang_ids=kwargs["lang_ids"], vision_ids=kwargs["vision_ids"]))
        return hidden_states, None


class FakeModel:
    """``CogVLMModel``'s own forward over a fake vision model, recording layers."""

    forward = cogvlm.CogVLMModel.forward

    def __init__(self, vocab: int) -> None:
        self.vision = FakeEVA2CLIP(tiny.GLM4V_9B_TOKENS, HIDDEN, DTYPE)
        self.embed_tokens = nn.Embedding(vocab, HIDDEN).to(DTYPE)  # the same in every instance:
        nn.init.normal_(self.embed_tokens.weight, generator=torch.Generator().manual_seed(0))
        self.layers = [Layer()]

    def __call__(self, **kwargs):
        return self.forward(**kwargs)

    def rotary_emb(self, hidden_states, position_ids):
        return torch.zeros(1, 1), torch.zeros(1, 1)

    def norm(self, hidden_states, residual):
        return hidden_states, None

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens


class FakeCogVLM:
    def __init__(self, config) -> None:
        self.config = config
        self.model = FakeModel(config.vocab_size)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def run(self, inputs: dict) -> tuple[torch.Tensor, dict]:
        with torch.no_grad():
            out = CLASS.forward(self, **{**inputs, "past_key_values": [None]})[0]
        return out, self.model.layers[0].calls[-1]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    _lmdeploy_stack.need_transforms()
    return tiny.checkpoint(tiny.COGVLM, tmp_path_factory)


@pytest.fixture
def rig(path, monkeypatch):
    assert tiny.featcache_prepare(monkeypatch, CLASS, SPEC) is CLASS
    r = FamilyRig(tiny.COGVLM, path, CLASS, lambda config: cogvlm.CogVLMInputProcessor(config, DTYPE),
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


@pytest.mark.parametrize("images", [(A, B), (B, A, C), (A,), (A, A), (C, C)],
                         ids=["hit-miss", "miss-hit-miss", "hit", "hit-twice", "miss-twice"])
def test_a_step_serves_hits_computes_misses_and_keeps_the_expert_routing(rig, images):
    """The embeddings reaching the decoder: a hit's stored rows, a miss's the rows plain
    lmdeploy's own step makes of it, text rows plain lmdeploy's; every layer's expert routing
    (``vision_ids``, ``lang_ids``) plain lmdeploy's, an all-hit step's too; the vision model is
    handed the misses' pixels only (a repeated miss once), and never when every image hit."""
    stored = seed(rig, A)
    prompt = rig.prompt(*images)
    model = FakeCogVLM(rig.config)
    got, routing = rig.step(model, prompt)
    theirs, their_routing = rig.plain_step(FakeCogVLM(rig.config), rig.prompt(*images, plain=True))
    ids = torch.tensor(prompt["input_ids"])
    mask = ids == prompt["multimodal"][0]["image_token_id"]
    items = prompt["multimodal"]
    computed = theirs[mask].split([tiny.tokens(x) for x in items])
    want = torch.cat([stored[item[REF_KEY].key] if item[REF_KEY].hit else part
                      for item, part in zip(items, computed, strict=True)])
    assert torch.equal(got[mask], want)
    assert torch.equal(got[~mask], theirs[~mask])
    for name in ("vision_ids", "lang_ids"):
        assert torch.equal(routing[name], their_routing[name]), name
    firsts = {}
    for i, item in enumerate(items):
        if not item[REF_KEY].hit:
            firsts.setdefault(item[REF_KEY].key, i)
    calls = model.model.vision.calls
    if firsts:
        (pixels,) = calls
        misses = [items[i]["pixel_values"] for i in firsts.values()]
        assert torch.equal(pixels, torch.stack(misses).to(DTYPE))
    else:
        assert calls == []
    again = rig.prompt(*images)
    assert all(item[REF_KEY].hit for item in again["multimodal"])
    calls.clear()
    assert torch.equal(rig.step(model, again)[0], got)
    assert calls == []


def test_a_declaration_without_the_routing_fails(rig, monkeypatch):
    """A planted bug: without ``cogvlm_step_inputs`` a step whose images all hit reaches the
    forward with no ``vision_ids``, and its image rows are never written (text embeddings stay
    where the image's rows go)."""
    wrong = families.ArchSpec(**{**SPEC.__dict__, "step_inputs": None})
    monkeypatch.setattr(CLASS, "prepare_inputs_for_generation",
                        CLASS.prepare_inputs_for_generation.__wrapped__)
    tiny.featcache_prepare(monkeypatch, CLASS, wrong)
    stored = seed(rig, A)
    prompt = rig.prompt(A)
    got, routing = rig.step(FakeCogVLM(rig.config), prompt)
    mask = torch.tensor(prompt["input_ids"]) == prompt["multimodal"][0]["image_token_id"]
    assert routing["vision_ids"] is None
    assert not torch.equal(got[mask], stored[prompt["multimodal"][0][REF_KEY].key])


def test_prefix_caching_stays_off_for_cogvlm():
    assert tiny.COGVLM not in PREFIX_CACHED


def test_tag_mode_each_model_process_skips_the_tower_for_the_images_it_holds(rig):
    with tag_mode(rig) as send:
        model = FakeCogVLM(rig.config)
        for images in [(A, B), (B, C)]:
            got, _ = rig.step(model, send(*images))
            theirs, _ = rig.plain_step(FakeCogVLM(rig.config), rig.prompt(*images, plain=True))
            assert torch.equal(got, theirs)
        calls = model.model.vision.calls
        assert len(calls) == 2 and calls[1].shape[0] == 1
        assert model_cache_stats()["vision_skipped"] == 1


def test_a_declaration_with_flat_rows_fails(rig, monkeypatch):
    """A planted bug: the vision rows served flat ([rows, hidden], ``TENSOR``), which CogVLM's
    forward flattens once more before its index assignment: the step fails, never a wrong row."""
    wrong = families.ArchSpec(**{**SPEC.__dict__, "output": families.TENSOR})
    monkeypatch.setattr(CLASS, "prepare_inputs_for_generation",
                        CLASS.prepare_inputs_for_generation.__wrapped__)
    tiny.featcache_prepare(monkeypatch, CLASS, wrong)
    seed(rig, A)
    with pytest.raises(RuntimeError):
        rig.step(FakeCogVLM(rig.config), rig.prompt(A, B))
