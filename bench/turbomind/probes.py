"""The per-step timers: milliseconds and calls per named step of a request (``PROBE``), wrappers
on the live pipeline's objects (``instrument``) and, once per import of lmdeploy's TurboMind, on
its module-level steps (``install_global_probes``); ``derive`` makes one request's figures."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from bench.lib.patching import Patches
from bench.lib.timing import timed_call


class Probe:
    """Milliseconds and calls per named step, summed over threads; snapshots give per-request
    deltas (sequential series) or per-series totals (concurrent)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, name: str, ms: float, calls: int = 1) -> None:
        with self.lock:
            self.ms[name] += ms
            self.calls[name] += calls

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a function or coroutine function), each call's time added under ``name``."""
        return timed_call(fn, lambda ms: self.add(name, ms))

    def snap(self) -> tuple[dict[str, float], dict[str, int]]:
        with self.lock:
            return dict(self.ms), dict(self.calls)

    def since(self, snap: tuple[dict[str, float], dict[str, int]]) -> dict[str, Any]:
        ms, calls = self.snap()
        out: dict[str, Any] = {k: round(v - snap[0].get(k, 0.0), 3) for k, v in ms.items()
                               if calls[k] != snap[1].get(k, 0)}
        n = {k: v - snap[1].get(k, 0) for k, v in calls.items() if v != snap[1].get(k, 0)}
        if n:
            out["calls"] = n
        return out


PROBE = Probe()
PATCHES = Patches()  # the module-level steps, wrapped once per module object (a fresh import anew)


def install_global_probes() -> None:
    """Module-level steps: TurboMind's converter (InternVL items), lmdeploy's per-image fingerprint
    (``sha256_computed`` counts those without a featcache fingerprint), featcache's fingerprint."""
    import lmdeploy.turbomind.models.internvl as ivl
    import lmdeploy.turbomind.turbomind as tmt

    import featcache.lmdeploy.turbomind.native as fct

    def resolve(original: Callable[..., bytes]) -> Callable[..., bytes]:
        def counted(input_mm: dict[str, Any], *a: Any) -> bytes:
            if input_mm.get("fingerprint") is None:
                PROBE.add("sha256_computed", 0.0)
            return original(input_mm, *a)
        return PROBE.timed("tm_fingerprint", counted)

    PATCHES.patch(tmt.TurboMind, "mm_input_converter", lambda f: PROBE.timed("tm_convert", f))
    PATCHES.patch(ivl, "_resolve_fingerprint", resolve)
    PATCHES.patch(fct, "fingerprint", lambda f: PROBE.timed("fc_fingerprint", f))


def unprobed() -> tuple[Callable[..., bytes], Callable[..., bytes]]:
    """(lmdeploy's InternVL ``_resolve_fingerprint``, featcache's ``fingerprint``) as they were
    before ``install_global_probes`` (for timing them alone)."""
    import lmdeploy.turbomind.models.internvl as ivl

    import featcache.lmdeploy.turbomind.native as fct

    return PATCHES.original(ivl, "_resolve_fingerprint"), PATCHES.original(fct, "fingerprint")


def instrument(pipe: Any, path: str) -> dict[str, Any]:
    """Wrap the live pipeline's steps (instance attributes); returns what was found."""
    from featcache.lmdeploy.turbomind.native import NativePixels

    engine = pipe.async_engine
    engine.preprocess = PROBE.timed("request_preprocess", engine.preprocess)
    vm = engine.vl_encoder.model
    hook = vm.preprocess
    found: dict[str, Any] = dict(hook=type(hook).__name__)
    if path == "plain":
        vm.preprocess = PROBE.timed("image_preprocess", hook)
        return found
    frontend = hook.frontend
    cache = frontend.cache
    vm.preprocess = PROBE.timed("hook", hook)
    frontend.original = PROBE.timed("image_preprocess", frontend.original)
    frontend._key = PROBE.timed("fc_key", frontend._key)
    frontend._tag_misses = PROBE.timed("fc_tag", frontend._tag_misses)
    cache.acquire = PROBE.timed("fc_acquire", cache.acquire)  # type: ignore[method-assign]
    cache.put = PROBE.timed("fc_put", cache.put)  # type: ignore[method-assign]
    if isinstance(hook, NativePixels):
        hook._serve = PROBE.timed("fc_serve", hook._serve)  # type: ignore[method-assign]
        found["pin"] = getattr(hook, "pin", False)
        found["vision_dtype"] = str(hook.vision_dtype)
    if path in ("features", "combined"):
        server = vm.forward.__self__
        server = getattr(server, "features", server)  # combined: its FeatureServer
        vm.forward = PROBE.timed("fc_forward", vm.forward)
        server.run = PROBE.timed("fc_vision", server.run)
    return found


def derive(parts: dict[str, Any], wall: float) -> dict[str, float]:
    """Per-request figures from one request's probe delta (ms)."""
    d = {k: float(v) for k, v in parts.items() if k != "calls"}
    d.pop("sha256_computed", None)
    if "hook" in d:
        d["featcache_own"] = d["hook"] - d.get("image_preprocess", 0.0)
    if "fc_serve" in d:
        d["serve_copy"] = d["fc_serve"] - d.get("fc_put", 0.0) - d.get("fc_fingerprint", 0.0)
    d["python_total"] = d.get("request_preprocess", 0.0) + d.get("tm_convert", 0.0)
    d["engine_rest"] = wall - d["python_total"]
    d["wall"] = wall
    return d
