"""The primitives a miss costs on either side, each timed alone on one image (``micro``)."""

from __future__ import annotations

import gc
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

from bench.lib.engines import host_cache
from bench.lib.images import image
from bench.lib.timing import timed_call
from bench.turbomind.probes import unprobed


def micro(pipe: Any, size: tuple[int, int], k: int = 5) -> dict[str, Any]:
    """One ``size`` image through lmdeploy's own image preprocessing (unwrapped), then each step a
    miss costs on either side, alone: lmdeploy's sha256 fingerprint, featcache's key, blake2b
    fingerprint and meta, pageable and pinned copies (fresh allocations kept alive as the cache keeps
    them, then re-used from torch's caching host allocator), the put (no disk tier / with one)."""
    import torch

    from featcache.keys import image_key
    from featcache.lmdeploy.request.entry_meta import encode_item

    resolve, fingerprint = unprobed()
    hook = pipe.async_engine.vl_encoder.model.preprocess  # lmdeploy's own, under any featcache hook
    prep = hook.frontend.original if hasattr(hook, "frontend") else hook
    im = image(7, size)

    out: dict[str, Any] = {}

    def series(name: str, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(0)`` .. ``fn(k - 1)``, each timed; their results."""
        times: list[float] = []
        results = [timed_call(fn, times.append)(i) for i in range(k)]
        out[name] = dict(median_ms=round(statistics.median(times), 3), all_ms=[round(x, 3) for x in times])
        return results

    items = series("lmdeploy_image_preprocess", lambda i: prep(
        [dict(role="user", content=[dict(type="image", data=im)])])[-1]["content"][0])
    item = items[0]
    px = item["pixel_values"]
    out["pixels"] = dict(shape=list(px.shape), dtype=str(px.dtype), mbytes=round(px.nbytes / 2**20, 2),
                         image_tokens=int(item["image_tokens"]))
    series("lmdeploy_sha256_fingerprint", lambda i: resolve(dict(pixel_values=px)))
    keys = series("featcache_image_key", lambda i: image_key(im, namespace=f"micro-{i}", params={}))
    series("featcache_blake2b_fingerprint", lambda i: fingerprint(keys[i]))
    series("featcache_encode_meta", lambda i: encode_item(item, "micro"))
    series("pageable_clone", lambda i: px.clone())
    pinned: list[Any] = []
    if torch.cuda.is_available():
        pinned = series("pinned_alloc_copy_fresh", lambda i: torch.empty_like(
            px, memory_format=torch.contiguous_format, pin_memory=True).copy_(px))
        del pinned[:]
        gc.collect()
        series("pinned_alloc_copy_reused", lambda i: torch.empty_like(
            px, memory_format=torch.contiguous_format, pin_memory=True).copy_(px))
    with tempfile.TemporaryDirectory() as d:
        for name, disk in (("put_no_disk", None), ("put_with_disk", d)):
            cache = host_cache(1 << 30, disk, 1 << 30)
            tensors = [px.clone() for _ in range(k)]

            def put(i: int, c: Any = cache, ts: list[Any] = tensors) -> Any:
                return c.put(keys[i], ts[i], meta=b"m")
            series(name, put)
            cache.close()
    return out
