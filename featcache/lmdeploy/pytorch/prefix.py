"""The prefix-cache hook: a PyTorch-engine prefix match may end inside an image featcache holds.

lmdeploy 0.18 keeps whole 64-token blocks in its block trie and rewinds any match that would end
inside an image span to the block at or before the image's start
(``SchedulerSequence.clamp_prefix_cache_match_step``, called by ``BlockTrie._match_block_prefix``),
because its forward can only produce an image's features whole. A prompt whose image ends a few
tokens before a block boundary (a chat turn repeating the previous turn's image) so loses every
block. When featcache holds the image, the forward can be handed just the rows it needs. Two
class-level hooks on ``lmdeploy.pytorch.messages.SchedulerSequence``, installed with a pipeline
that has prefix caching on and removed when the last such pipeline closes:

- ``clamp_prefix_cache_match_step``: lmdeploy's rewind, over every span except those of *held*
  images (below). A match ending inside a held image stays at its block boundary; any other span
  (a miss, an image another engine user hashed, an embedding range) rewinds exactly as before.
- ``get_input_multimodals``: when the sequence's first uncached position ``h`` lies inside a held
  image (``start < h < end``), the image is put first in the step's multimodal inputs as a copy
  with ``start = h`` and ``meta[SKIP_KEY] = h - start`` (lmdeploy's own list leaves it out: it only
  returns images wholly inside the uncached range). The model hook (``models``) then serves rows
  ``[SKIP:]`` of the image's cached features, a view of the leased tensor: no copy, no vision call.

An image is *held* when its ``MultiModalData.meta`` carries a hit ``FeatRef`` (its lease pins the
features for the life of the sequence, ``refs``) or a valid ``FeatTag`` beside its pixels (several
processes: the model process serves the rows from its cache or recomputes the image from the
pixels and slices it, ``models._serve``), and its ``content_hash`` is that ref's
``featcache:<key hex>`` (so the trie blocks it matched were keyed by the same features).

Invariants:
- a match ends inside an image only if that image is held; the trie's block identity (token ids
  plus every overlapping span's content hash) is unchanged, so two different images never share
  a block;
- the rows a partly cached image contributes to a forward are exactly rows ``[h - start, end -
  start)`` of its features, in token order before every other image of the step;
- positions are untouched: lmdeploy's M-RoPE positions (``history_mrope_pos_ids``) are computed
  for the whole prompt when it arrives and sliced from ``h``, as for any cached prefix.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..request.refs import REF_KEY, FeatRef
from ..request.tags import FeatTag

SKIP_KEY = "featcache_skip"  # MultiModalData.meta: rows of the image already in the KV cache

_lock = threading.Lock()
_installed: list[dict[str, Any]] = []  # the originals, while any pipeline holds the hook
_users = 0


def is_held(data: Any) -> bool:
    """Whether featcache can give the forward any rows of this ``MultiModalData``'s features for
    the life of its sequence: its features are leased (a hit ``FeatRef``, one process), or it is
    tagged and carries its pixels or the bytes to rebuild them (a ``FeatTag``, several processes:
    the model process serves the rows from its cache, or recomputes the whole image and slices
    it)."""
    ref = (getattr(data, "meta", None) or {}).get(REF_KEY)
    if isinstance(ref, FeatRef):
        held = ref.hit
    elif isinstance(ref, FeatTag):
        pixels = getattr(data, "data", None)
        held = ref.valid and (ref.source is not None
                              or isinstance(pixels, torch.Tensor) and pixels.numel() > 0)
    else:
        return False
    return held and getattr(data, "content_hash", None) == "featcache:" + ref.key.hex()


LISTS = ("image", "mm_data")  # the step's MultiModalData lists an image may be in (``families``)


def _held_spans(seq: Any) -> set[tuple[int, int]]:
    multimodals = seq.history_multimodals.multimodals
    return {(d.start, d.end) for key in LISTS for d in multimodals.get(key, ()) if is_held(d)}


def clamp_prefix_cache_match_step(seq: Any, step: int) -> int:
    """lmdeploy 0.18's ``SchedulerSequence.clamp_prefix_cache_match_step`` (messages.py), with
    the spans of held images left out: rewind a match out of every other span, to a block
    boundary, until the boundary is outside all of them."""
    if step <= 0:
        return step
    block_size = seq.block_size
    held = _held_spans(seq)
    spans = [(s.start, s.end) for s in seq.prefix_cache.multimodal_spans
             if (s.start, s.end) not in held]
    spans.extend((e.start, e.end) for e in seq.history_embeddings.embeddings)
    clamped = step
    while clamped > 0:
        next_step = clamped
        for start, end in spans:
            if start < next_step < end:
                next_step = min(next_step, start)
        next_step = (next_step // block_size) * block_size
        if next_step == clamped:
            break
        clamped = next_step
    return clamped


def partial_image(seq: Any) -> tuple[str, Any] | None:
    """The held image the sequence's first uncached position falls inside, as the step's copy
    (``start`` at that position, ``meta[SKIP_KEY]`` the rows before it) with the key of its list
    ("image", or the Qwen3 lineage's "mm_data"), or None."""
    h = seq.num_history_ids
    multimodals = seq.history_multimodals.multimodals
    for key in LISTS:
        for data in multimodals.get(key, ()):
            if data.start < h < data.end and is_held(data):
                return key, dataclasses.replace(data, start=h, meta={**data.meta, SKIP_KEY: h - data.start})
    return None


def install_prefix_hook() -> Callable[[], None]:
    """Install the two hooks (shared by every pipeline; counted); returns the remover."""
    global _users
    from lmdeploy.pytorch.messages import SchedulerSequence

    with _lock:
        if _users == 0:
            original = SchedulerSequence.get_input_multimodals

            def get_input_multimodals(self: Any) -> Any:
                out = original(self)
                found = partial_image(self)
                if found is None:
                    return out
                key, part = found
                return {**out, key: [part, *out.get(key, [])]}

            _installed.append(dict(
                clamp_prefix_cache_match_step=SchedulerSequence.clamp_prefix_cache_match_step,
                get_input_multimodals=original))
            SchedulerSequence.clamp_prefix_cache_match_step = (  # type: ignore[method-assign]
                clamp_prefix_cache_match_step)
            SchedulerSequence.get_input_multimodals = (  # type: ignore[method-assign]
                get_input_multimodals)
        _users += 1

    done = False

    def remove() -> None:
        global _users
        nonlocal done
        with _lock:
            if done:
                return
            done = True
            _users -= 1
            if _users == 0:
                for name, method in _installed.pop().items():
                    setattr(SchedulerSequence, name, method)

    return remove
