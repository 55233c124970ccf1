"""Compute image features offline into the disk tier, so a server starts hot (``featcache warm``).

For a PyTorch-engine server (the default), each image goes through a featcache pipeline of the
model (lmdeploy's PyTorch engine, one GPU), as a one-token request whose image is a local file:
the key is the one a server computes for the same file sent as a file path or a base64 data URL
(keys of encoded images are digests of their bytes, the model's namespace and the per-image
parameters), so ``featcache serve`` over the same cache directory with the same ``--dtype`` and
parameters serves them from disk. Images already cached are not computed again. No write is
dropped: the puts (made by featcache's model hook in lmdeploy's engine) run inside
``cache.blocking_puts()``, so when the disk falls behind they wait for room in the write-through
queues instead of dropping the entry, as a server's puts do. The store is flushed to disk before
``warm_images`` returns. The command line is ``featcache.cli.serving``'s.

For a TurboMind server (``backend="turbomind"``), what its path serves is filled without building
TurboMind's engine (``featcache.lmdeploy.tm_warm``): the native path's engine-ready pixels
(lmdeploy's preprocessing: no GPU needed), the features path's features (the vision tower: on the
GPU, else slowly on the CPU), or both for the combined configuration; keyed as a TurboMind
``featcache.lmdeploy.pipeline(..., turbomind=PATH)`` keys them (``featcache serve --backend
turbomind`` serves the native path).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache import FeatureCache

BACKENDS = ("pytorch", "turbomind")
TURBOMIND_PATHS = ("native", "features", "combined")  # featcache.lmdeploy.turbomind.PATHS' names
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def collect(images: Iterable[str], from_dir: str | None) -> list[str]:
    """The image files to warm, in order, each once; raises ``ValueError`` for missing ones."""
    paths = [os.path.abspath(p) for p in images]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"no such file: {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                          if len(missing) > 1 else ""))
    if from_dir is not None:
        if not os.path.isdir(from_dir):
            raise ValueError(f"no such directory: {from_dir}")
        for root, dirs, files in os.walk(from_dir):
            dirs.sort()
            paths += [os.path.abspath(os.path.join(root, f)) for f in sorted(files)
                      if f.lower().endswith(IMAGE_SUFFIXES)]
    seen: set[str] = set()
    return [p for p in paths if not (p in seen or seen.add(p))]  # type: ignore[func-returns-value]


def parse_params(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values that read as int, float or bool become one."""
    params: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {item!r}: use KEY=VALUE")
        value: Any = text
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                continue
        if text in ("true", "false"):
            value = text == "true"
        params[key] = value
    return params


def request(path: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The one-token request that computes ``path``'s features, as a client would send it."""
    return [{"role": "user", "content": [
        {"type": "text", "text": "."},
        {"type": "image_url", "image_url": {"url": path, **params}}]}]


@dataclass
class WarmReport:
    images: int  # images asked for
    image_bytes: int  # bytes of their files
    computed: int  # images whose features (TurboMind native, combined: pixels) were computed (misses)
    cached: int  # images already cached (hits)
    entries: int  # entries of the store afterwards
    bytes: int  # bytes of the store afterwards
    seconds: float  # from the first batch to the flushed store
    failed: list[str] = field(default_factory=list)  # "PATH: ERROR" of each image that failed
    vision_images: int = 0  # TurboMind features, combined: images the vision tower ran on


def warm_images(model: str, cache: FeatureCache, paths: list[str], *, params: dict[str, Any],
                dtype: str = "auto", batch: int = 8,
                progress: Callable[[int, int], None] | None = None, backend: str = "pytorch",
                turbomind: str = "native") -> WarmReport:
    """Run ``model``'s vision model over ``paths`` in batches of ``batch``, storing features in
    ``cache`` (the caller's: it stays open, flushed). Its puts block for queue room meanwhile
    (``blocking_puts``): every computed feature reaches the disk. An image that fails is
    reported, not raised; ``progress(done, bytes)`` is called after each batch.
    ``backend="turbomind"``: fill what ``turbomind`` ("native", "features" or "combined") serves
    instead (a host cache: ``FeatureCache(device="cpu", ...)``); no engine is built."""
    from .lmdeploy import SECTION  # (here: collect and parse_params need no torch)

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    send, close = (_turbomind(model, cache, turbomind, dtype, batch) if backend == "turbomind"
                   else _pytorch(model, cache, dtype))
    failed: list[str] = []
    start = time.perf_counter()
    done = nbytes = 0
    try:
        with cache.blocking_puts():  # no write dropped: wait for the disk instead
            for i in range(0, len(paths), batch):
                chunk = paths[i:i + batch]
                try:
                    send([request(p, params) for p in chunk])
                except Exception:  # one bad file fails its batch: find it, keep the others
                    for p in chunk:
                        try:
                            send([request(p, params)])
                        except Exception as e:
                            failed.append(f"{p}: {type(e).__name__}: {e}")
                done += len(chunk)
                nbytes += sum(os.path.getsize(p) for p in chunk)
                if progress is not None:
                    progress(done, nbytes)
        cache.flush()
        stats = cache.stats()
    finally:
        close()
    counts, disk = stats.get(SECTION, {}), stats.get("disk", {})
    return WarmReport(images=len(paths), image_bytes=nbytes, computed=counts.get("misses", 0),
                      cached=counts.get("hits", 0), entries=disk.get("entries", 0),
                      bytes=disk.get("bytes", 0), seconds=time.perf_counter() - start,
                      failed=failed, vision_images=counts.get("vision_images", 0))


Send = Callable[[list[list[dict[str, Any]]]], None]


def _pytorch(model: str, cache: FeatureCache, dtype: str) -> tuple[Send, Callable[[], None]]:
    """Requests through a featcache pipeline on lmdeploy's PyTorch engine (one token each)."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig

    from .lmdeploy import pipeline

    pipe = pipeline(model, cache=cache, log_level="ERROR",
                    backend_config=PytorchEngineConfig(dtype=dtype, session_len=16384))
    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    return (lambda requests: pipe(requests, gen_config=gen)), pipe.close


def _turbomind(model: str, cache: FeatureCache, path: str, dtype: str,
               batch: int) -> tuple[Send, Callable[[], None]]:
    """Requests through lmdeploy's TurboMind prompt path with featcache's ``path`` (no engine):
    all the images of a batch in one request, so the features tower runs over them at once."""
    from .lmdeploy.tm_warm import PromptPath

    prompt = PromptPath(model, cache, path, dtype, batch)

    def send(requests: list[list[dict[str, Any]]]) -> None:
        prompt.send([[{"role": "user", "content": [
            part for messages in requests for part in messages[0]["content"]]}]])

    return send, prompt.close
