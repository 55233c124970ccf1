"""Stand-ins for lmdeploy's pipelines on the CPU, what the benchmarks' dry runs share: a pipeline
whose engine runs on an event loop of its own (``Pipe``, called as lmdeploy's), the vision model's
image preprocessing (``Vision``), the messages' ``image_data`` items as the images it reads
(``image_items``), and lmdeploy's TurboMind Python over the recording stand-in for its compiled
module (``turbomind_binding``). Each benchmark's own engine (what its dry run checks) stays with it:
bench/e2e/standin.py (PyTorch), bench/turbomind/standin.py (TurboMind).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import threading
import time
import types
from typing import Any

from bench.lib.images import user_message

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


class Vision:
    """lmdeploy's vision-model ``preprocess`` in small: every image of the messages resized to
    28 x 28 px, repeated as ``tiles`` tiles of ``per_tile`` image tokens, its pixels divided by
    ``scale`` and held in ``dtype``; ``delay_s`` of sleep per image (the preprocessing's time). The
    items go in a last message of role ``preprocess``, as lmdeploy's do."""

    def __init__(self, tiles: int, per_tile: int, token_id: int, dtype: Any = None,
                 scale: float = 1.0, delay_s: float = 0.0) -> None:
        self.tiles, self.per_tile, self.token_id = tiles, per_tile, token_id
        self.dtype, self.scale, self.delay_s = dtype, scale, delay_s

    def preprocess(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        import numpy as np
        import torch

        out = []
        for m in messages:
            for x in m["content"] if isinstance(m.get("content"), list) else []:
                if isinstance(x, dict) and x.get("type") == "image":
                    a = np.asarray(x["data"].convert("RGB").resize((28, 28)), dtype=np.float32)
                    px = torch.from_numpy(a).permute(2, 0, 1)[None].repeat(self.tiles, 1, 1, 1) / self.scale
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    out.append(dict(pixel_values=px if self.dtype is None else px.to(self.dtype),
                                    image_tokens=self.tiles * self.per_tile, image_token_id=self.token_id))
        messages.append(dict(role="preprocess", content=out))
        return messages


def encoder(vision: Any) -> Any:
    """An engine's ``vl_encoder`` holding ``vision`` as its model (where featcache's hooks go)."""
    return types.SimpleNamespace(model=vision)


def image_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each ``image_data`` item as the ``image`` item lmdeploy's vision model
    reads (its PIL image under ``data``); other items and text-only messages as they are."""
    return [dict(m, content=[dict(type="image", data=x["image_data"]["data"])
                             if isinstance(x, dict) and x.get("type") == "image_data" else x
                             for x in m["content"]]) if isinstance(m.get("content"), list) else m
            for m in messages]


class Pipe:
    """A pipeline over a stand-in ``engine`` (``preprocess`` and ``generate`` coroutines, as
    lmdeploy's AsyncEngine), on an event loop in a thread of its own: called with a (text, image)
    tuple, one response; with a list of tuples or message lists, one response each. ``_run``
    schedules a coroutine on its loop (as lmdeploy's pipeline does); ``close`` stops the loop."""

    def __init__(self, engine: Any) -> None:
        self.async_engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ids = itertools.count(1)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def __call__(self, prompts: Any, gen_config: Any) -> Any:
        async def one(p: Any) -> Any:
            if isinstance(p, tuple):
                p = [user_message(*p)]
            req = await self.async_engine.preprocess(p, next(self.ids), gen_config)
            async for out in self.async_engine.generate(req):
                return out
        if isinstance(prompts, tuple):
            return self._run(one(prompts)).result()
        return [self._run(one(p)).result() for p in prompts]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def turbomind_binding() -> Any:
    """A context in which lmdeploy's real TurboMind Python imports over tests/turbomind_binding.py's
    recording stand-in for the compiled module (``lmdeploy.turbomind._turbomind``); sys.modules is
    restored after."""
    tests = os.path.join(ROOT, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import turbomind_binding

    return turbomind_binding.installed()
