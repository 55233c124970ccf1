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
TurboMind's engine (``featcache.lmdeploy.turbomind.warm``): the native path's engine-ready pixels
(lmdeploy's preprocessing: no GPU needed), the features path's features (the vision tower: on the
GPU, else slowly on the CPU), or both for the combined configuration; keyed as a TurboMind
``featcache.lmdeploy.pipeline(..., turbomind=PATH)`` keys them (``featcache serve --backend
turbomind`` serves the native path).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import FeatCacheError

if TYPE_CHECKING:
    from .core.cache import FeatureCache

BACKENDS = ("pytorch", "turbomind")
TURBOMIND_PATHS = ("native", "features", "combined")  # featcache.lmdeploy.turbomind.PATHS' names
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class ModelLoadError(FeatCacheError):
    """A model that ``warm`` or ``serve`` cannot load: one line naming its path and what is wrong
    (``model_error``)."""


def config_problem(model: str) -> str | None:
    """What is wrong with the model directory ``model``'s ``config.json`` that no loader gets
    past (none there, not JSON, not an object), or None. Reads the file only (no lmdeploy)."""
    config = os.path.join(model, "config.json")
    try:
        with open(config, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return f"{model!r} is not a model directory: it has no config.json"
    except OSError as e:
        return f"cannot read {config!r}: {e.strerror or e}"
    try:
        doc = json.loads(raw)
    except UnicodeDecodeError:
        return f"{config!r} is not a model config: it is not UTF-8 text"
    except ValueError as e:
        where = f": {e.msg} at line {e.lineno} column {e.colno}" if isinstance(
            e, json.JSONDecodeError) else ""
        return f"{config!r} is not valid JSON{where}"
    if not isinstance(doc, dict):
        return f"{config!r} is not a model config (a JSON object)"
    return None


def _architectures(model: str) -> str:
    """The architectures ``model``'s config.json names, for a message (empty if it names none)."""
    try:
        with open(os.path.join(model, "config.json"), "rb") as f:
            names = json.loads(f.read()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return ""
    return ", ".join(str(n) for n in names) if isinstance(names, list) else ""


def model_error(model: str, error: BaseException) -> str:
    """What went wrong loading ``model``, in one line that names it: lmdeploy's and transformers'
    errors as a user can act on them, else the error's type and first line."""
    text = str(error).strip()
    archs = _architectures(model)
    if "featcache does not cache" in text:  # featcache's own refusal (turbomind.warm): already says it
        return f"{model!r}: {' '.join(text.split())}"
    if "Could not find model architecture" in text:
        what = "its config.json names no model architecture (no \"architectures\")"
    elif "Unrecognized model in" in text:
        what = "its config.json names no \"model_type\" transformers knows"
    elif "unsupported vl model" in text:
        what = ("it is not a vision-language model lmdeploy 0.18 runs"
                + (f" (config.json: architectures {archs})" if archs else ""))
    elif "is not a valid JSON file" in text:
        what = "its config.json is not valid JSON"
    else:
        said = " ".join(text.split()).rstrip(":{ ")  # every line of it, on one
        if len(said) > 400:
            said = said[:400] + " ..."
        what = f"{type(error).__name__}" + (f": {said}" if said else "")
    return f"cannot load the model {model!r}: {what}"


@contextlib.contextmanager
def loading(model: str) -> Iterator[None]:
    """Building ``model``'s pipeline or prompt path: any failure becomes a ``ModelLoadError``
    naming it (``model_error``), and transformers' note that torchvision is missing (it falls back
    to the PIL image processors lmdeploy's InternVL module imports, whatever the model) is not
    shown: a server over the same environment preprocesses as this does."""
    quiet = _NoTorchvisionNote()
    logger = logging.getLogger("transformers.utils.import_utils")
    logger.addFilter(quiet)
    try:
        yield
    except FeatCacheError:
        raise
    except Exception as e:
        raise ModelLoadError(model_error(model, e)) from e
    finally:
        logger.removeFilter(quiet)


class _NoTorchvisionNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back" not in record.getMessage()


def collect(images: Iterable[str], from_dir: str | None) -> list[str]:
    """The image files to warm, in order, each once; raises ``ValueError`` for missing ones."""
    paths = [os.path.abspath(p) for p in images]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"no such file: {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                          if len(missing) > 1 else ""))
    if from_dir is not None:
        if os.path.exists(from_dir) and not os.path.isdir(from_dir):
            raise ValueError(f"--from-dir {from_dir} is a file, not a directory (give image files "
                             "as IMAGE arguments)")
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
    with loading(model):  # one line naming the model if it cannot be loaded
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
    from lmdeploy.utils import get_logger

    from .lmdeploy.turbomind.warm import PromptPath

    # lmdeploy logs INFO lines on stdout ("matching vision model: ..."), which carries warm's
    # report (--json: one object): errors only, as the PyTorch path's pipeline(log_level="ERROR")
    logger = get_logger("lmdeploy")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        prompt = PromptPath(model, cache, path, dtype, batch)
    except BaseException:
        logger.setLevel(level)
        raise

    def send(requests: list[list[dict[str, Any]]]) -> None:
        prompt.send([[{"role": "user", "content": [
            part for messages in requests for part in messages[0]["content"]]}]])

    def close() -> None:
        try:
            prompt.close()
        finally:
            logger.setLevel(level)

    return send, close
