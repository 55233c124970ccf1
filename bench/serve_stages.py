"""Per-stage times of every chat request, measured inside a server's own process.

    python bench/serve_stages.py [--stages-out FILE] [--allow-loopback-media] -- \\
        featcache serve MODEL [featcache and lmdeploy options]
    python bench/serve_stages.py [--stages-out FILE] [--allow-loopback-media] -- \\
        lmdeploy serve api_server MODEL [lmdeploy options]

Installs timers on lmdeploy's and featcache's functions in this process (each wrapper calls the
function it replaces with the same arguments and returns what it returns), then runs the command
line's own ``main``. Each ``POST /v1/chat/completions`` appends one JSON line to FILE (default
``$FEATCACHE_STAGES_OUT``): marks (ms since the request reached the app: body read, endpoint
entered, prepared, first engine output, first byte sent) and spans (name path -> [ms, calls]:
JSON parsing, image parsing, base64 and image decoding, featcache's keying and lookups, lmdeploy's
preprocessing, chat template, tokenization, ...). bench/lib/stages.py reads them (``summarize``
turns a line into stages, each owned by featcache or lmdeploy). The timers add microseconds per
call; nothing else changes, except:

- the event loop's default executor and the vision encoder's one-worker executor are replaced by
  executors of the same sizes whose threads run in the submitting request's context (as
  ``asyncio.to_thread`` does), so that work done on them is charged to its request;
- ``--allow-loopback-media``: lmdeploy refuses image URLs whose host is not globally routable
  (``_is_safe_url``); this lets 127.0.0.1/localhost through, for a bench that serves its images on
  a local port. Never for a real server.

Engine side: with the PyTorch engine in this process (``featcache serve``), the engine's
``_on_add_message`` (featcache's input processor, content hashes) and the model agent's steps
(``_async_step``: prefill or decode, host wall time) are recorded too and matched to the request
by session id and time window. Plain ``lmdeploy serve api_server`` runs the engine in a second
process (``enable_mp_engine``): for it, the API-process stages and "prepared -> first engine
output" (queueing + prefill + first token + the hops between the processes) are what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import contextvars
import functools
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.lib

from bench.lib.patching import Patches  # noqa: E402
from bench.lib.timing import timed_call  # noqa: E402

ENV = "FEATCACHE_STAGES_OUT"
CHAT_PATH = "/v1/chat/completions"


class Record:
    """One request's marks (ms since t0, first time each) and spans (path -> [ms, calls])."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.unix = time.time()
        self.marks: dict[str, float] = {}
        self.spans: dict[str, list[float]] = {}
        self.body_bytes = 0
        self.session_id: int | None = None
        self.lock = threading.Lock()

    def mark(self, name: str, at: float | None = None) -> None:
        self.marks.setdefault(name, round(((at or time.perf_counter()) - self.t0) * 1e3, 3))

    def add(self, path: str, ms: float) -> None:
        with self.lock:
            total = self.spans.setdefault(path, [0.0, 0])
            total[0] += ms
            total[1] += 1

    def as_json(self, engine: dict[str, Any] | None) -> dict[str, Any]:
        spans = {k: [round(v[0], 3), int(v[1])] for k, v in self.spans.items()}
        return {"unix": round(self.unix, 3), "body_bytes": self.body_bytes, "marks_ms": self.marks,
                "spans_ms": spans, "session_id": self.session_id, "engine": engine}


REC: contextvars.ContextVar[Record | None] = contextvars.ContextVar("stages_rec", default=None)
PATH: contextvars.ContextVar[str] = contextvars.ContextVar("stages_path", default="")


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """Time the block into the current request's record under its nesting path (no-op outside a
    request)."""
    rec = REC.get()
    if rec is None:
        yield
        return
    path = f"{PATH.get()}>{name}" if PATH.get() else name
    token = PATH.set(path)
    t = time.perf_counter()
    try:
        yield
    finally:
        rec.add(path, (time.perf_counter() - t) * 1e3)
        PATH.reset(token)


def timed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` (sync or coroutine function) timed as span ``name``; same signature for inspect."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def async_wrapper(*a: Any, **k: Any) -> Any:
            with span(name):
                return await fn(*a, **k)
        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        with span(name):
            return fn(*a, **k)
    return wrapper


class ContextExecutor(ThreadPoolExecutor):
    """A thread pool whose tasks run in the submitter's context (``asyncio.to_thread``'s rule)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)


# -- engine side (in-process engine only) -------------------------------------------------------------
class EngineLog:
    """What the engine did, outside any request's context: add-message batches by session id and
    the model agent's steps (bounded)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.adds: dict[int, dict[str, float]] = {}
        self.steps: collections.deque[tuple[float, float, bool, int]] = collections.deque(maxlen=4096)

    def add(self, sessions: list[int], start: float, end: float, spans: dict[str, float]) -> None:
        with self.lock:
            for s in sessions:
                self.adds[s] = {"start": start, "end": end, **spans}

    def step(self, start: float, end: float, decoding: bool, batch: int) -> None:
        with self.lock:
            self.steps.append((start, end, decoding, batch))

    def for_request(self, rec: Record) -> dict[str, Any] | None:
        """The engine's share of ``rec`` (ms, relative to its t0), or None if not in process."""
        with self.lock:
            add = self.adds.pop(rec.session_id, None) if rec.session_id is not None else None
            steps = list(self.steps)
        if add is None:
            return None
        first = rec.t0 + rec.marks.get("first_output", 1e12) / 1e3
        rel = lambda t: round((t - rec.t0) * 1e3, 3)  # noqa: E731
        window = [s for s in steps if s[1] > add["start"] and s[0] < first]
        return {"add_at_ms": rel(add["start"]), "add_ms": round((add["end"] - add["start"]) * 1e3, 3),
                "add_spans_ms": {k: round(v, 3) for k, v in add.items() if k not in ("start", "end")},
                "steps": [[rel(a), round((b - a) * 1e3, 3), d, n] for a, b, d, n in window]}


ENGINE = EngineLog()
ENGINE_SPANS: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "stages_engine_spans", default=None)


def engine_timed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` timed into the engine's add-message spans (``ENGINE_SPANS``) under ``name``."""
    def add(ms: float) -> None:
        spans = ENGINE_SPANS.get()
        if spans is not None:
            spans[name] = spans.get(name, 0.0) + ms
    return timed_call(fn, add)


# -- the request: ASGI middleware and the generator -----------------------------------------------------
class Sink:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def write(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, separators=(",", ":")) + "\n"
        with self.lock, open(self.path, "a") as f:
            f.write(line)


class StageMiddleware:
    """Opens a record per chat request, marks the body's last byte and the first byte sent."""

    def __init__(self, app: Any, sink: Sink) -> None:
        self.app = app
        self.sink = sink
        self.executor_set = False

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") != "http" or scope.get("path") != CHAT_PATH:
            await self.app(scope, receive, send)
            return
        if not self.executor_set:  # the loop's default executor, made context-carrying
            asyncio.get_running_loop().set_default_executor(
                ContextExecutor(max_workers=min(32, (os.cpu_count() or 1) + 4)))
            self.executor_set = True
        rec = Record()
        token = REC.set(rec)

        async def receive_timed() -> dict:
            message = await receive()
            if message.get("type") == "http.request":
                rec.body_bytes += len(message.get("body", b""))
                if not message.get("more_body", False):
                    rec.mark("body_read")
            return message

        async def send_timed(message: dict) -> None:
            if message.get("type") == "http.response.body" and message.get("body"):
                rec.mark("first_byte")
            await send(message)

        try:
            await self.app(scope, receive_timed, send_timed)
        finally:
            rec.mark("end")
            REC.reset(token)
            self.sink.write(rec.as_json(ENGINE.for_request(rec)))


def timed_generate(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``AsyncEngine.generate`` (an async generator): marks its start and first output."""
    @functools.wraps(fn)
    async def generate(self: Any, request: Any, *a: Any, **k: Any) -> Any:
        rec = REC.get()
        if rec is not None:
            rec.mark("generate_start")
            session = getattr(request, "session", None)
            rec.session_id = getattr(session, "session_id", None)
        inner = fn(self, request, *a, **k)
        try:
            async for out in inner:
                if rec is not None and getattr(out, "token_ids", None):
                    rec.mark("first_output")
                yield out
        finally:  # closed when the caller closes this one (lmdeploy's cleanup), not at GC
            await inner.aclose()
    return generate


# -- installing ---------------------------------------------------------------------------------------
PATCHES = Patches()


def _patch(owner: Any, name: str, make: Callable[[Any], Any], installed: list[str],
           label: str, kind: str = "function") -> None:
    if PATCHES.patch(owner, name, make, kind):
        installed.append(label)


def install(sink: Sink, allow_loopback_media: bool = False) -> list[str]:
    """Install every timer that the installed packages allow; the list of what was installed."""
    done: list[str] = []
    import uvicorn

    def with_stages(run: Callable[..., Any]) -> Callable[..., Any]:
        def run_with_stages(app: Any, *a: Any, **k: Any) -> Any:
            return run(StageMiddleware(app, sink), *a, **k)
        return run_with_stages
    _patch(uvicorn, "run", with_stages, done, "uvicorn.run (middleware)")

    from starlette.requests import Request
    _patch(Request, "json", lambda f: timed(f, "json_parse"), done, "starlette Request.json")

    from lmdeploy.serve.core.async_engine import AsyncEngine
    from lmdeploy.serve.core.chat_runner import ChatRunner

    def marked_prepare(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def prepare(cls: Any, *a: Any, **k: Any) -> Any:
            rec = REC.get()
            if rec is not None:
                rec.mark("endpoint")
            with span("prepare"):
                out = await fn(cls, *a, **k)
            if rec is not None:
                rec.mark("prepared")
            return out
        return prepare
    _patch(ChatRunner, "prepare", marked_prepare, done, "ChatRunner.prepare", kind="class")
    _patch(AsyncEngine, "preprocess", lambda f: timed(f, "engine_preprocess"), done,
           "AsyncEngine.preprocess")
    _patch(AsyncEngine, "generate", timed_generate, done, "AsyncEngine.generate")

    from lmdeploy.serve.processors import multimodal
    from lmdeploy.serve.processors.multimodal import MultimodalProcessor
    _patch(MultimodalProcessor, "async_parse_multimodal_item",
           lambda f: timed(f, "parse_items"), done, "MultimodalProcessor.async_parse_multimodal_item",
           kind="static")
    _patch(MultimodalProcessor, "_get_text_prompt_input", lambda f: timed(f, "text_prompt"), done,
           "MultimodalProcessor._get_text_prompt_input")
    _patch(multimodal, "load_from_url", lambda f: timed(f, "load_from_url"), done, "load_from_url")

    from lmdeploy.vl.media import connection
    from lmdeploy.vl.media.image import ImageMediaIO
    _patch(connection, "_load_http_url", lambda f: timed(f, "http_fetch"), done, "_load_http_url")
    _patch(ImageMediaIO, "load_bytes", lambda f: timed(f, "image_decode"), done, "ImageMediaIO.load_bytes")
    _patch(ImageMediaIO, "load_base64", lambda f: timed(f, "load_base64"), done, "ImageMediaIO.load_base64")
    _patch(ImageMediaIO, "load_file", lambda f: timed(f, "load_file"), done, "ImageMediaIO.load_file")
    if allow_loopback_media:
        def loopback(is_safe: Callable[[str], tuple[bool, str]]) -> Callable[[str], tuple[bool, str]]:
            def loopback_ok(url: str) -> tuple[bool, str]:
                from urllib3.util import parse_url

                if parse_url(url).hostname in ("127.0.0.1", "localhost"):
                    return True, "loopback allowed (bench/serve_stages.py --allow-loopback-media)"
                return is_safe(url)
            return loopback_ok
        _patch(connection, "_is_safe_url", loopback, done, "_is_safe_url (loopback allowed)")

    from lmdeploy.vl.engine import ImageEncoder

    def context_executor(init: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(init)
        def encoder_init(self: Any, *a: Any, **k: Any) -> None:
            init(self, *a, **k)
            self.executor.shutdown(wait=False)
            self.executor = ContextExecutor(max_workers=1)  # (lmdeploy's: ThreadPoolExecutor(1))
        return encoder_init
    _patch(ImageEncoder, "__init__", context_executor, done, "ImageEncoder.__init__ (executor)")
    _patch(ImageEncoder, "preprocess", lambda f: timed(f, "vl_preprocess"), done, "ImageEncoder.preprocess")
    for name in ("wrap_for_pytorch", "wrap_for_turbomind"):
        _patch(ImageEncoder, name, lambda f: timed(f, "template"), done, f"ImageEncoder.{name}")
    from lmdeploy.vl.model.base import VISION_MODELS
    for cls in {c for c in VISION_MODELS.module_dict.values() if "preprocess" in vars(c)}:
        _patch(cls, "preprocess", lambda f: timed(f, "model_preprocess"), done, f"{cls.__name__}.preprocess")
    from lmdeploy.tokenizer import Tokenizer
    _patch(Tokenizer, "encode", lambda f: timed(f, "tokenize"), done, "Tokenizer.encode")

    try:  # the in-process PyTorch engine
        from lmdeploy.pytorch.engine import engine as pt_engine
        from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent
    except ImportError as e:
        print(f"[stages] no engine-side timers ({e})", flush=True)
    else:
        def add_message(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def _on_add_message(self: Any, reqs: list[Any], **k: Any) -> Any:
                spans: dict[str, float] = {}
                token = ENGINE_SPANS.set(spans)
                t = time.perf_counter()
                try:
                    return fn(self, reqs, **k)
                finally:
                    ENGINE_SPANS.reset(token)
                    sessions = [r.data.get("session_id") for r in reqs if isinstance(r.data, dict)]
                    ENGINE.add([s for s in sessions if s is not None], t, time.perf_counter(), spans)
            return _on_add_message
        _patch(pt_engine.Engine, "_on_add_message", add_message, done, "Engine._on_add_message")
        _patch(pt_engine, "ensure_multimodal_content_hashes",
               lambda f: engine_timed(f, "content_hashes"), done, "ensure_multimodal_content_hashes")

        def async_step(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            async def _async_step(self: Any, inputs: Any = None, *a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await fn(self, inputs, *a, **k)
                finally:
                    decoding = bool(getattr(inputs, "is_decoding", False))
                    seqs = getattr(inputs, "seq_length", None)
                    ENGINE.step(t, time.perf_counter(), decoding, int(len(seqs)) if seqs is not None else 0)
            return _async_step
        _patch(BaseModelAgent, "_async_step", async_step, done, "BaseModelAgent._async_step")

    try:  # featcache's hooks (absent from a plain lmdeploy server's code path, harmless there)
        from featcache.core.cache import FeatureCache
        from featcache.lmdeploy import fastprep
        from featcache.lmdeploy.pytorch import engine as fc_engine
        from featcache.lmdeploy.request import frontend, resolve
    except ImportError:
        return done
    # featcache's own preprocessing of a miss (lmdeploy's model preprocess runs inside it, timed
    # as model_preprocess, only where it falls back)
    _patch(fastprep.FastPreprocess, "__call__", lambda f: timed(f, "fc_preprocess"), done,
           "featcache FastPreprocess.__call__")
    _patch(frontend.Frontend, "resolve_sources", lambda f: timed(f, "fc_resolve"), done,
           "featcache Frontend.resolve_sources")
    _patch(frontend.Frontend, "__call__", lambda f: timed(f, "fc_frontend"), done,
           "featcache Frontend.__call__")
    _patch(resolve, "encoded_bytes", lambda f: timed(f, "fc_source_bytes"), done,
           "featcache encoded_bytes")
    _patch(resolve, "fetched_bytes", lambda f: timed(f, "fc_source_bytes"), done,
           "featcache fetched_bytes (lmdeploy's fetcher inside)")
    _patch(frontend.Frontend, "_bytes_key", lambda f: timed(f, "fc_key"), done,
           "featcache Frontend._bytes_key (an encoded image's key)")
    _patch(resolve.DataUrlKeys, "ident", lambda f: timed(f, "fc_key"), done,
           "featcache DataUrlKeys.ident (a data URL seen before: keyed by its text)")
    _patch(frontend.Frontend, "_id_key", lambda f: timed(f, "fc_key"), done,
           "featcache Frontend._id_key (a client id's key)")
    _patch(FeatureCache, "acquire", lambda f: timed(f, "fc_acquire"), done, "FeatureCache.acquire")
    _patch(fc_engine.KeyedInputProcessor, "preprocess_input",
           lambda f: engine_timed(f, "fc_input_processor"), done, "featcache KeyedInputProcessor")
    return done


def uninstall() -> None:
    """Put back everything ``install`` replaced (for tests)."""
    PATCHES.undo()


# -- main -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print(__doc__)
        return 0 if argv in (["-h"], ["--help"]) else 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="serve_stages.py")
    p.add_argument("--stages-out", default=os.environ.get(ENV))
    p.add_argument("--allow-loopback-media", action="store_true")
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not args.stages_out or not command or command[0] not in ("featcache", "lmdeploy"):
        p.error(f"give --stages-out (or ${ENV}) and, after --, a featcache or lmdeploy command line")
    done = install(Sink(os.path.abspath(args.stages_out)), args.allow_loopback_media)
    print(f"[stages] {len(done)} timers installed; records to {args.stages_out}", flush=True)
    if command[0] == "featcache":
        from featcache.cli import main as featcache_main

        return featcache_main(command[1:])
    from lmdeploy.cli.entrypoint import run

    sys.argv = command
    run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
