"""What a hit saves: the vision model's time on the misses of a step, per image, for
``FeatureCache.put(..., cost_s=...)`` (value eviction weighs it: ``featcache.eviction.value``).

One ``VisionClock`` per model instance (the model hook's vision wrapper holds it), so each model's
rate is its own. A vision call runs over every miss of a step at once; each image's share is its
token count's (InternVL's tiles, Qwen2-VL's patches: the vision work is per token).

- On the CPU the call is timed directly (it is synchronous): each image's cost is its share of
  this very call, and the rate (seconds per image token) follows it.
- On CUDA the call only queues kernels: the clock records a pair of timing events around it on
  the current stream and reads them later, once the GPU has passed them (``Event.query``, never
  a wait: no synchronisation on the request path). Each image's cost is then its token count
  times the rate measured so far (an exponential mean of the finished calls); before any call
  has finished the cost is unknown (None), which the books count as the mean of known costs.
  No events are recorded while the stream is being captured into a CUDA graph.

Invariant: nothing here waits for the GPU or raises out of a timing failure (a cost is then
unknown); at most ``MAX_PENDING`` event pairs are held.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

MAX_PENDING = 16  # timed calls not yet finished on the GPU; older ones are forgotten
SMOOTHING = 0.25  # weight of the newest call in the rate


class VisionClock:
    """The vision model's seconds per image token, from its calls; thread-compatible (one
    engine loop calls a model's vision)."""

    def __init__(self) -> None:
        self.per_token_s: float | None = None
        self._pending: deque[tuple[Any, Any, int]] = deque(maxlen=MAX_PENDING)

    def run(self, vision: Callable[[], torch.Tensor],
            tokens: list[int]) -> tuple[torch.Tensor, list[float | None]]:
        """``vision()``'s output, and each image's cost in seconds (``tokens``: the image
        tokens of each image the call computes, in order; None: not known yet)."""
        self._harvest()
        events = self._start()
        began = time.perf_counter()
        out = vision()
        took = time.perf_counter() - began
        total = sum(tokens)
        if events is not None and out.is_cuda:
            try:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((events, end, total))
            except RuntimeError:
                pass
        elif total > 0:  # the call ran to completion here: its own time is its cost
            self._learn(took / total)
            return out, [took * n / total for n in tokens]
        rate = self.per_token_s
        return out, [None if rate is None else rate * n for n in tokens]

    def _start(self) -> Any:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        try:
            if torch.cuda.is_current_stream_capturing():
                return None
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        except RuntimeError:
            return None

    def _harvest(self) -> None:
        """Learn from the timed calls the GPU has finished (oldest first; never waits)."""
        while self._pending:
            start, end, total = self._pending[0]
            try:
                if not end.query():
                    return
                seconds = start.elapsed_time(end) / 1e3
            except RuntimeError:
                seconds = None
            self._pending.popleft()
            if seconds is not None and total > 0:
                self._learn(seconds / total)

    def _learn(self, per_token_s: float) -> None:
        rate = self.per_token_s
        self.per_token_s = per_token_s if rate is None else rate + SMOOTHING * (per_token_s - rate)
