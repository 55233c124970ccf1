"""featcache's prefix-cache hook (``featcache.lmdeploy.pytorch.prefix``) on lmdeploy's real CPU code.

Requests go through lmdeploy's real prompt path with featcache's frontend and the model's real
input processor inside ``KeyedInputProcessor`` (the rigs of ``test_lmdeploy_engine``: tiny
InternVL-HF and Qwen2-VL checkpoints), then into lmdeploy's real ``Scheduler`` (its
``BlockTrie``, prefill scheduler and ``SchedulerSequenceDefault``: pure Python) with prefix
caching on and small blocks, so that the tiny images span several blocks. The forward of a
scheduled sequence gets what lmdeploy's input maker would give it (``seq.token_ids``,
``seq.get_input_multimodals()``, ``seq.mrope_pos_ids``) through the patched real
``prepare_inputs_for_generation`` and real ``forward`` of the model class (fake towers, as there).

lmdeploy's ``strategies.ar.sequence`` imports the engine's guided decoding, which imports
``xgrammar`` (a CUDA-only dependency, not installed here): a stub stands in for it when missing.
"""

from __future__ import annotations

import hashlib
import importlib
import types

import _lmdeploy_stack
import numpy as np
import pytest
import torch

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead


from _ranks import stub_xgrammar  # noqa: E402

stub_xgrammar()

import lmdeploy_tiny as tiny  # noqa: E402
import test_lmdeploy_engine  # noqa: E402
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig  # noqa: E402
from lmdeploy.pytorch.messages import SchedulerSequence, SequenceMeta, UpdateTokenMode  # noqa: E402
from lmdeploy.pytorch.multimodal.data_type import ensure_multimodal_content_hashes  # noqa: E402
from lmdeploy.pytorch.paging.scheduler import Scheduler  # noqa: E402
from lmdeploy.pytorch.strategies.ar.sequence import ARSequenceStrategy  # noqa: E402

from featcache.lmdeploy.pytorch import prefix  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY, FeatRef  # noqa: E402
from featcache.lmdeploy.request.tags import FeatTag  # noqa: E402

MROPE = (tiny.QWEN2VL, "Qwen2_5_VLForConditionalGeneration", tiny.QWEN3VL)  # the architectures with M-RoPE
TAIL = [11, 12]  # text after the prompt's template (stands in for the next turn's first words)


def block_for(rig, image, tail: list[int] = TAIL, before_end: int = 1) -> int:
    """A block size whose last whole block ``before_end`` tokens or more before the prompt's end
    ends inside the image, as 64 does for a 13-tile InternVL image followed by a short question
    (the tiny prompts have a dozen or two tokens after the image); of those, the one leaving
    most of the image uncached. ``before_end``: 1 for a match of the same prompt (a block must
    end before the last token), 0 for the blocks a prompt leaves in the trie."""
    ids, mm = _prompt(rig, image, tail=tail)
    (data,) = rig.processor.preprocess_input(ids, mm).input_multimodals["image"]
    fits = {block: ((len(ids) - before_end) // block) * block for block in range(2, len(ids))}
    fits = {block: h for block, h in fits.items() if data.start < h < data.end}
    assert fits, f"no block size fits an image at {data.start}..{data.end} of {len(ids)}"
    return min(fits, key=lambda block: (fits[block], block))


# the engine tests' rig (tiny InternVL-HF and Qwen2-VL) and their patched model class
rig = test_lmdeploy_engine.rig
patched = test_lmdeploy_engine.patched


@pytest.fixture(autouse=True)
def lmdeploy_alone(monkeypatch):
    """lmdeploy's own ``SchedulerSequence`` and no hook installed, whatever an earlier test left
    (``featcache serve``'s engine has no ``close``: its hook stays for the process)."""
    for name, method in (prefix._installed[0] if prefix._installed else {}).items():
        monkeypatch.setattr(SchedulerSequence, name, method)
    monkeypatch.setattr(prefix, "_installed", [])
    monkeypatch.setattr(prefix, "_users", 0)


@pytest.fixture
def hooked():
    remove = prefix.install_prefix_hook()
    yield
    remove()


class Engine:
    """lmdeploy's real scheduler and block trie, driven as the engine loop drives them."""

    def __init__(self, rig, block: int) -> None:
        self.rig = rig
        self.block = block
        use_mrope = rig.arch in MROPE
        meta = SequenceMeta(block, strategy=ARSequenceStrategy(), use_mrope=use_mrope)
        self.scheduler = Scheduler(
            SchedulerConfig(max_batches=8, max_session_len=8192),
            CacheConfig(max_batches=8, block_size=block, num_cpu_blocks=0, num_gpu_blocks=4096,
                        enable_prefix_caching=True),
            seq_meta=meta)
        self.sessions = 0

    def request(self, input_ids: list[int], multimodal: list[dict]) -> SchedulerSequence:
        """Add a request (as ``Engine._on_add_message`` does) and schedule its prefill."""
        res = self.rig.processor.preprocess_input(input_ids, multimodal)
        mms = ensure_multimodal_content_hashes(res.input_multimodals)
        self.sessions += 1
        self.scheduler.add_session(self.sessions)
        seq = self.scheduler.sessions[self.sessions].add_sequence(np.array(res.input_ids),
                                                                  multimodals=mms)
        running = self.scheduler.schedule(is_prefill=True).running
        assert running == [seq]
        self.scheduler.activate_seqs(running)  # dispatched to the forward
        return seq

    def finish(self, seq: SchedulerSequence, generated: list[int]) -> None:
        """The forwards of ``seq``: its prefill's token, then decode steps; then end it."""
        seq.update_token_ids(np.array(generated[:1]), mode=UpdateTokenMode.PREFILL)
        for token in generated[1:]:
            assert self.scheduler.schedule_running([seq]) == [True]
            seq.update_token_ids(np.array([token]), mode=UpdateTokenMode.DECODE)
        self.scheduler.end_session(seq.session_id)


def _prompt(rig, *imgs, tail: list[int] = ()) -> tuple[list[int], list[dict]]:
    out = rig.prompt(*imgs)
    return out["input_ids"] + list(tail), out["multimodal"]


def _span(seq: SchedulerSequence) -> tuple[int, int]:
    (data,) = seq.history_multimodals.multimodals["image"]
    return data.start, data.end


def _forward(rig, patched, seq: SchedulerSequence, model=None):
    """One prefill forward of ``seq`` as the engine builds it: (token embeddings, input ids,
    model)."""
    ids = seq.token_ids.tolist()
    mms = seq.get_input_multimodals()
    ctx = types.SimpleNamespace(
        input_ids=torch.tensor([ids]), position_ids=None, attn_metadata=None,
        input_embeddings=None, input_embedding_indexing=None,
        input_multimodals=[mms] if mms else None, mrope_position_ids=None, model_metas=None,
        is_decoding=False)
    model = model or rig.fake_model()
    inputs = patched.prepare_inputs_for_generation(model, None, context=ctx)
    return patched.forward(model, **inputs)[0], ctx.input_ids[0], model


def _turn_one(rig, engine: Engine, image, tail: list[int]) -> tuple[list[int], list[dict]]:
    """Turn 1 (the image a miss): prefilled whole, its blocks in the trie; then the model's put
    (``rig.seed``) makes the image a featcache hit."""
    ids, mm = _prompt(rig, image, tail=tail)
    assert not mm[0][REF_KEY].hit
    seq = engine.request(ids, mm)
    assert seq.num_history_ids == 0
    engine.finish(seq, [7])
    return ids, mm


IMAGE = dict(width=100, height=80, seed=5)


def test_match_inside_a_held_image_keeps_its_block_and_serves_the_tail_rows(rig, patched, hooked):
    check_tail_rows(rig, patched)


def check_tail_rows(rig, patched, vision_inputs=lambda model: model.vision_inputs) -> None:
    """A repeat whose match ends inside a held image: kept at its block, the forward given the
    image's tail rows bit for bit, no vision call (``vision_inputs(model)``: what the fake tower
    was given), and what the uncached forward gives there (also run on legacy InternVL and
    Qwen2.5-VL: test_lmdeploy_models_more.py)."""
    a = tiny.noise_image(**IMAGE)
    engine = Engine(rig, block_for(rig, a))
    ids, _ = _turn_one(rig, engine, a, TAIL)
    (stored,) = rig.seed(a).values()

    again, mm = _prompt(rig, a, tail=TAIL)  # the same prompt again: the image a hit
    assert again == ids and mm[0][REF_KEY].hit
    seq = engine.request(again, mm)

    start, end = _span(seq)
    h = seq.num_history_ids
    # kept at the deepest block the trie holds (whole blocks before the prompt's end), which ends
    # inside the image
    assert h == ((len(ids) - 1) // engine.block) * engine.block
    assert start < h < end
    assert seq.cached_tokens == h

    embeds, step_ids, model = _forward(rig, patched, seq)

    mask = step_ids == rig.token_id
    assert int(mask.sum()) == end - h
    # exactly the tail rows of the cached features, bit for bit, and no vision call
    assert torch.equal(embeds[mask], stored[h - start:])
    assert vision_inputs(model) == []
    assert rig.stats()["partial_images"] == 1
    # and what the uncached forward gives those positions
    seq.set_step(0)
    assert seq.get_input_multimodals()["image"][0].start == start  # whole again: no partial
    full, _, _ = _forward(rig, patched, seq, model)
    assert torch.equal(embeds, full[h:])


def test_a_miss_keeps_lmdeploys_clamp(rig, hooked):
    a = tiny.noise_image(**IMAGE)
    engine = Engine(rig, block_for(rig, a))
    _turn_one(rig, engine, a, TAIL)  # the image's features are never stored

    again, mm = _prompt(rig, a, tail=TAIL)
    assert not mm[0][REF_KEY].hit
    seq = engine.request(again, mm)

    start, _ = _span(seq)
    assert seq.num_history_ids == (start // engine.block) * engine.block  # rewound before the image
    assert prefix.partial_image(seq) is None
    assert seq.get_input_multimodals()["image"][0].start == start  # the whole image, as lmdeploy


class OthersHashes:
    """The rig's input processor with each image's ``content_hash`` not ``featcache:<its key>``
    but another hash (as if another user of the engine had hashed the image), the same on every
    turn: the trie matches blocks inside the image, blocks never keyed by featcache's features."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def preprocess_input(self, *args, **kwargs):
        result = self.inner.preprocess_input(*args, **kwargs)
        for data in result.input_multimodals.get("image", ()):
            data.content_hash = "other:" + hashlib.sha256(data.meta[REF_KEY].key).hexdigest()
        return result

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_hit_whose_content_hash_is_not_its_key_is_not_held_and_is_rewound(rig, hooked):
    """A hit ``FeatRef`` on an image whose ``content_hash`` is not ``featcache:<its key>``: the
    blocks the match reached inside it hold KV of whatever that hash keyed, not of featcache's
    features, so the image is not held (``prefix.is_held``) and the match rewinds before it, as
    lmdeploy's own clamp does."""
    rig.processor = OthersHashes(rig.processor)
    a = tiny.noise_image(**IMAGE)
    engine = Engine(rig, block_for(rig, a))
    _turn_one(rig, engine, a, TAIL)
    rig.seed(a)
    again, mm = _prompt(rig, a, tail=TAIL)
    assert mm[0][REF_KEY].hit
    asked = []  # the matches the trie asks the clamp about

    def clamp(seq, step):
        asked.append(step)
        return prefix.clamp_prefix_cache_match_step(seq, step)

    hook = SchedulerSequence.clamp_prefix_cache_match_step
    SchedulerSequence.clamp_prefix_cache_match_step = clamp  # until the hook's remover runs: not
    try:  # monkeypatch, whose undo would come after it and put the hook back for later tests
        seq = engine.request(again, mm)
    finally:
        SchedulerSequence.clamp_prefix_cache_match_step = hook

    start, _ = _span(seq)
    assert seq.num_history_ids == (start // engine.block) * engine.block  # rewound before the image
    assert prefix.partial_image(seq) is None
    (data,) = seq.history_multimodals.multimodals["image"]
    assert data.meta[REF_KEY].hit and data.content_hash.startswith("other:")
    assert not prefix.is_held(data)
    data.content_hash = "featcache:" + data.meta[REF_KEY].key.hex()
    assert prefix.is_held(data)  # the hash alone makes the difference
    assert max(asked) > start  # and the trie did match blocks inside it: the clamp undid that


def test_is_held_wants_the_content_hash_of_its_own_key():
    key, other = b"k" * 16, b"o" * 16
    lease = types.SimpleNamespace(release=lambda: None)
    ref = FeatRef(None, key, b"", lease)
    tag = FeatTag(key, b"")
    pixels = torch.zeros(4, 3)
    for meta in ({REF_KEY: ref}, {REF_KEY: tag}):
        for content_hash, held in (("featcache:" + key.hex(), True), ("featcache:" + other.hex(), False),
                                   (key.hex(), False), (None, False), ("0" * 64, False)):
            data = types.SimpleNamespace(meta=meta, data=pixels, content_hash=content_hash)
            assert prefix.is_held(data) is held, (meta, content_hash)
    miss = FeatRef(None, key, b"", None)
    assert not prefix.is_held(types.SimpleNamespace(meta={REF_KEY: miss}, data=pixels,
                                                    content_hash="featcache:" + key.hex()))


def test_without_the_hook_a_held_image_is_rewound_too(rig):
    """lmdeploy alone: the behaviour the hook changes (and why turn 2 of a chat misses)."""
    a = tiny.noise_image(**IMAGE)
    engine = Engine(rig, block_for(rig, a))
    _turn_one(rig, engine, a, TAIL)
    rig.seed(a)
    seq = engine.request(*_prompt(rig, a, tail=TAIL))
    start, _ = _span(seq)
    assert seq.num_history_ids == (start // engine.block) * engine.block
    assert seq.cached_tokens == seq.num_history_ids


def test_two_different_images_after_the_same_text_share_no_block(rig, hooked):
    a, b = tiny.noise_image(**IMAGE), tiny.noise_image(**{**IMAGE, "seed": 6})  # same size
    engine = Engine(rig, 4)  # small blocks: the text before the images fills some
    rig.seed(a, b)
    first = engine.request(*_prompt(rig, a, tail=TAIL))
    ids_a = first.history_cache[:first.num_all_ids].tolist()
    blocks_a = first.logical_blocks.get_real_blocks().tolist()  # first stays alive: no block
    # id it holds can be recycled for the second
    ids_b, mm = _prompt(rig, b, tail=TAIL)
    assert ids_b == ids_a  # the same token ids: only the images' content tells them apart
    second = engine.request(ids_b, mm)

    start, _ = _span(second)
    first_image_block = start // engine.block
    assert first_image_block > 0
    assert second.num_history_ids == first_image_block * engine.block  # the text blocks only
    blocks_b = second.logical_blocks.get_real_blocks().tolist()
    assert blocks_b[:first_image_block] == blocks_a[:first_image_block]
    assert not set(blocks_b[first_image_block:]) & set(blocks_a[first_image_block:])


def test_chat_turns_reuse_earlier_turns_whatever_the_answers_length(rig, hooked):
    """A 3-turn chat resending its image, 6-token answers whose sampled ids differ from the ids
    the next turn's prompt re-tokenises them to (blocks holding sampled ids never match): turn 2
    reuses turn 1's prompt blocks, the last ending inside the image; turn 3 turn 2's."""
    a = tiny.noise_image(**IMAGE)
    engine = Engine(rig, block_for(rig, a, before_end=0))
    block = engine.block
    user = [TAIL, [21, 22, 23], [24, 25, 26, 27]]  # each turn's new user text
    answers = [[31, 32, 33, 34, 35, 36], [41, 42, 43, 44, 45, 46]]  # as the next turn tokenises
    sampled = [90, 91, 92, 93, 94, 95]  # what the engine generated
    history: list[int] = []
    lengths, cached = [], []
    for turn in range(3):
        history = history + user[turn]
        ids, mm = _prompt(rig, a, tail=history)
        seq = engine.request(ids, mm)
        lengths.append(len(ids))
        cached.append(seq.cached_tokens)
        if turn < 2:
            engine.finish(seq, sampled)
            history = history + answers[turn]
        if turn == 0:
            rig.seed(a)  # the model's put of turn 1's features
    start, end = _span(seq)
    assert cached[0] == 0
    assert cached[1] == (lengths[0] // block) * block and start < cached[1] < end
    assert cached[2] == (lengths[1] // block) * block > end


def test_mrope_positions_of_a_partly_cached_image_are_the_uncached_ones(rig, hooked):
    if rig.arch != tiny.QWEN2VL:
        pytest.skip("M-RoPE: Qwen2-VL")
    a = tiny.noise_image(100, 130, seed=5)  # a grid that is not square: rows and columns differ
    block = block_for(rig, a)
    engine = Engine(rig, block)
    _turn_one(rig, engine, a, TAIL)
    rig.seed(a)
    seq = engine.request(*_prompt(rig, a, tail=TAIL))
    start, end = _span(seq)
    h = seq.num_history_ids
    assert start < h < end

    got = seq.mrope_pos_ids.copy()  # what the input maker hands the forward

    plain = Engine(rig, block)  # the same prompt, nothing cached
    full = plain.request(*_prompt(rig, a, tail=TAIL))
    assert full.num_history_ids == 0
    assert np.array_equal(got, full.mrope_pos_ids[h:])
    # the image's own grid positions (lmdeploy's processor) from its start, then text after it
    (data,) = full.history_multimodals.multimodals["image"]
    assert np.array_equal(got[:end - h], data.mrope_pos_ids[h - start:] + start)
    assert len(set(got[:end - h, 1].tolist())) > 1 and len(set(got[:end - h, 2].tolist())) > 1


def test_install_is_counted_and_remove_restores_lmdeploy():
    original = (SchedulerSequence.clamp_prefix_cache_match_step,
                SchedulerSequence.get_input_multimodals)
    first, second = prefix.install_prefix_hook(), prefix.install_prefix_hook()
    assert SchedulerSequence.clamp_prefix_cache_match_step is prefix.clamp_prefix_cache_match_step
    first()
    first()  # idempotent
    assert SchedulerSequence.clamp_prefix_cache_match_step is prefix.clamp_prefix_cache_match_step
    second()
    assert (SchedulerSequence.clamp_prefix_cache_match_step,
            SchedulerSequence.get_input_multimodals) == original


@pytest.mark.parametrize("arch, prefix_caching", [(tiny.QWEN2VL, True), (tiny.QWEN2VL, False),
                                                  (tiny.QWEN3_5, True)])
def test_wrap_installs_the_hook_with_prefix_caching_and_close_removes_it(
        tmp_path_factory, monkeypatch, arch, prefix_caching):
    """With prefix caching on, ``wrap`` installs the hook, except for the Qwen3.5 family (its
    matches are lmdeploy's: ``families.PARTIAL_IMAGES``); closing the pipeline removes it."""
    from lmdeploy import PytorchEngineConfig

    from featcache import FeatureCache
    from featcache.lmdeploy import families, wrap

    spec = families.SPECS[arch]
    cls = getattr(importlib.import_module(f"lmdeploy.pytorch.models.{spec.module}"), spec.cls)
    monkeypatch.setattr(cls, "prepare_inputs_for_generation", cls.prepare_inputs_for_generation)
    path = tiny.PromptPath(tiny.checkpoint(arch, tmp_path_factory))
    original = SchedulerSequence.clamp_prefix_cache_match_step
    engine = types.SimpleNamespace(
        vl_encoder=path.encoder, prompt_processor=path.processor,
        backend_config=PytorchEngineConfig(enable_prefix_caching=prefix_caching),
        engine=types.SimpleNamespace(input_processor=object()))
    closed = []
    pipe = types.SimpleNamespace(async_engine=engine, close=lambda: closed.append(True))
    cache = FeatureCache(device="cpu", device_bytes="1MiB", host_bytes=0)
    try:
        assert wrap(pipe, cache) is pipe
        hooked = SchedulerSequence.clamp_prefix_cache_match_step is prefix.clamp_prefix_cache_match_step
        assert hooked == (prefix_caching and arch in families.PARTIAL_IMAGES)
        pipe.close()
        assert closed == [True]
        assert SchedulerSequence.clamp_prefix_cache_match_step is original
    finally:
        path.close()
        cache.close()
