"""featcache's prefix-cache hook on the processor-level families, on lmdeploy's real CPU code.

The Qwen3 lineage keeps its images in the step's ``mm_data`` list. Requests go through lmdeploy's
real prompt path with featcache's frontend (``ProcessorFrontend``) and the model's real input
processor inside ``KeyedInputProcessor`` (the rigs of ``test_lmdeploy_newapi``), then into
lmdeploy's real ``Scheduler`` with prefix caching on and small blocks; a scheduled sequence's
forward gets what lmdeploy's input maker gives it through the patched real ``prepare`` and real
``forward`` of Qwen3-VL (its deepstack levels included) over the fake tower.

- Qwen3-VL: a repeat whose match ends inside a held image keeps its block, and the forward gets
  the image's remaining rows of every level from the cache, bit for bit what the uncached forward
  gives those positions, with no vision call; its M-RoPE positions are the uncached ones.
- Qwen3.5: its hybrid state is restored only at lmdeploy's state checkpoints, outside images, so
  featcache leaves its matches to lmdeploy (``families.PARTIAL_IMAGES``).
"""

from __future__ import annotations

import _lmdeploy_stack
import numpy as np
import pytest
import torch

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

from _ranks import stub_xgrammar  # noqa: E402

stub_xgrammar()

import lmdeploy_tiny as tiny  # noqa: E402
import test_lmdeploy_newapi as newapi  # noqa: E402
import test_lmdeploy_prefix as prefix_tests  # noqa: E402
from lmdeploy.pytorch.messages import SchedulerSequence  # noqa: E402

from featcache.lmdeploy import PARTIAL_IMAGES, families  # noqa: E402
from featcache.lmdeploy.pytorch import prefix  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402

TAIL = [11, 12]  # text after the prompt's template (the next turn's first words)
IMAGE = dict(width=100, height=130, seed=5)  # a grid that is not square: rows and columns differ


# the prefix tests' engine (lmdeploy's real scheduler and block trie) and their fixtures
Engine = prefix_tests.Engine
hooked = prefix_tests.hooked
lmdeploy_alone = prefix_tests.lmdeploy_alone  # (autouse)


@pytest.fixture
def rig(tmp_path_factory, monkeypatch):
    r = newapi.Rig(tiny.QWEN3VL, tiny.checkpoint(tiny.QWEN3VL, tmp_path_factory))
    tiny.featcache_prepare(monkeypatch, newapi.CLASSES[tiny.QWEN3VL], families.SPECS[tiny.QWEN3VL])
    yield r
    r.close()


def prompt(rig, image) -> tuple[list[int], list[dict]]:
    out = rig.prompt(image)
    return out["input_ids"] + TAIL, out["multimodal"]


def span(seq: SchedulerSequence) -> tuple[int, int]:
    (data,) = seq.history_multimodals.multimodals["mm_data"]
    return data.start, data.end


def block_for(rig, image) -> int:
    """A block size whose last whole block before the prompt's end ends inside the image."""
    ids, mm = prompt(rig, image)
    (data,) = rig.processor.preprocess_input(ids, mm).input_multimodals["mm_data"]
    fits = {block: ((len(ids) - 1) // block) * block for block in range(2, len(ids))}
    fits = {block: h for block, h in fits.items() if data.start < h < data.end}
    assert fits
    return min(fits, key=lambda block: (fits[block], block))


def forward(rig, seq: SchedulerSequence, model=None) -> tuple[dict, torch.Tensor, object]:
    """One prefill forward of ``seq`` as the engine builds it: what reached the language model,
    the step's ids, the model."""
    ids = seq.token_ids.tolist()
    mms = seq.get_input_multimodals()
    ctx = newapi.step_context(ids, [mms] if mms else None, rig.config)
    model = model or rig.fake_model()
    inputs = newapi.CLASSES[rig.arch].prepare_inputs_for_generation(model, [None] * ctx._full, None, ctx)
    return model.run(inputs), ctx.input_ids[0], model


def test_a_match_inside_a_held_image_serves_its_remaining_rows_of_every_level(rig, hooked):
    a = tiny.noise_image(**IMAGE)
    engine = Engine(rig, block_for(rig, a))
    ids, mm = prompt(rig, a)
    assert not mm[0][REF_KEY].hit
    engine.finish(engine.request(ids, mm), [7])  # turn 1: the image computed whole
    (stored,) = newapi.seed(rig, a).values()  # the model's put of its features, every level

    again, mm = prompt(rig, a)
    assert again == ids and mm[0][REF_KEY].hit
    seq = engine.request(again, mm)
    start, end = span(seq)
    h = seq.num_history_ids
    assert h == ((len(ids) - 1) // engine.block) * engine.block and start < h < end

    got, step_ids, model = forward(rig, seq)
    mask = step_ids == mm[0]["image_token_id"]
    assert int(mask.sum()) == end - h
    levels = stored.chunk(newapi.LEVELS, dim=-1)
    assert torch.equal(got["inputs_embeds"][0][mask].float(), levels[0][h - start:])
    for k, deep in enumerate(got["deepstack_visual_embeds"]):
        assert torch.equal(deep.float(), levels[k + 1][h - start:])
    assert newapi.vision_of(model).calls == []
    assert rig.stats()["partial_images"] == 1
    # what the uncached forward gives those positions
    seq.set_step(0)
    assert seq.get_input_multimodals()["mm_data"][0].start == start
    full, _, _ = forward(rig, seq, model)
    assert torch.equal(got["inputs_embeds"][0], full["inputs_embeds"][0][h:])


def test_the_mrope_positions_of_a_partly_cached_image_are_the_uncached_ones(rig, hooked):
    a = tiny.noise_image(**IMAGE)
    block = block_for(rig, a)
    engine = Engine(rig, block)
    ids, mm = prompt(rig, a)
    engine.finish(engine.request(ids, mm), [7])
    newapi.seed(rig, a)
    seq = engine.request(*prompt(rig, a))
    start, end = span(seq)
    h = seq.num_history_ids
    assert start < h < end
    full = Engine(rig, block).request(*prompt(rig, a))
    assert full.num_history_ids == 0
    assert np.array_equal(seq.mrope_pos_ids, full.mrope_pos_ids[h:])


def test_without_a_hit_lmdeploys_clamp_rewinds_before_the_image(rig, hooked):
    a = tiny.noise_image(**IMAGE)
    engine = Engine(rig, block_for(rig, a))
    engine.finish(engine.request(*prompt(rig, a)), [7])  # its features never stored
    again, mm = prompt(rig, a)
    assert not mm[0][REF_KEY].hit
    seq = engine.request(again, mm)
    start, _ = span(seq)
    assert seq.num_history_ids == (start // engine.block) * engine.block
    assert prefix.partial_image(seq) is None


def test_the_qwen3_5_family_leaves_its_matches_to_lmdeploy():
    qwen3_5 = {arch for arch, spec in families.SPECS.items() if spec.module in ("qwen3_5", "qwen3_5_moe",
                                                                                "interns2_mobius")}
    assert qwen3_5 and not qwen3_5 & PARTIAL_IMAGES
    assert {tiny.QWEN3VL, tiny.GLM4V, tiny.INTERNVL, tiny.QWEN2VL} <= PARTIAL_IMAGES
    assert tiny.GEMMA3 not in PARTIAL_IMAGES  # (its prefix caching stays off)
