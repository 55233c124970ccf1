"""``featcache serve``'s per-request report on the wire: the ``X-Featcache`` response header, and
with ``--featcache-report usage`` the ``featcache`` member of a chat completion's ``usage`` object.

``ReportMiddleware`` is an ASGI middleware around lmdeploy's whole app (``reporting_app`` hands
uvicorn the wrapped app). For each HTTP request it sets a new ``ReportSlot`` in the context
variable ``featcache.lmdeploy.request.report.REQUEST``; the engine's ``preprocess`` (run in the request's
own task, before lmdeploy answers) puts the request's ``RequestReport`` in it. Then:

- the response's start (status and headers) gets ``X-Featcache: <report>`` whenever the request
  was prepared by a featcache engine (any status; none for a request refused before, such as a
  400 for a bad image, nor for routes that prepare nothing). A streamed response starts after
  ``preprocess`` returned too, so its header holds the same: every lookup is made by then. The
  value is built from counts and featcache's own words only (``RequestReport.header``), and
  checked against ``SAFE`` before it is sent: no byte of a request reaches it;
- with ``usage``, the JSON body of a chat completion gets ``usage.featcache``
  (``RequestReport.usage``: also the vision time of the request's misses, known once the model
  ran them), its ``content-length`` updated; a streamed one gets it in its final usage chunk
  (the one lmdeploy sends when the client asked ``stream_options.include_usage``), read after the
  last token. Without ``usage`` (the default) bodies are passed on byte for byte.

Invariant: a response the middleware cannot read or rewrite (not JSON, no usage object, a body it
cannot parse) is passed on unchanged; nothing here fails a request.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

from ..config import REPORTS
from ..lmdeploy.request.report import HEADER, REQUEST, ReportSlot, RequestReport

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

USAGE_PATHS = ("/v1/chat/completions",)  # responses whose usage object gets the report
SAFE = re.compile(r"[a-z0-9_=;:,. -]*")  # every character a header value may hold
_USAGE_CHUNK = re.compile(rb'"usage":\s*\{')  # (a client's text is escaped: \"usage\" never matches)


class ReportMiddleware:
    """Each request's ``RequestReport`` on its response: the header always, the usage object's
    ``featcache`` member with ``usage``."""

    def __init__(self, app: App, usage: bool = False) -> None:
        self.app = app
        self.usage = usage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        slot = ReportSlot()
        token = REQUEST.set(slot)
        try:
            rewrite = self.usage and scope.get("path") in USAGE_PATHS
            await self.app(scope, receive, _Reporting(slot, send, rewrite).send)
        finally:
            REQUEST.reset(token)


class _Reporting:
    """One response's ``send``, with the report added."""

    def __init__(self, slot: ReportSlot, send: Send, rewrite: bool) -> None:
        self.slot = slot
        self.inner = send
        self.rewrite = rewrite
        self.report: RequestReport | None = None
        self.kind = ""  # "json" (held until whole), "stream", or "" (passed on)
        self.start: Message | None = None
        self.body: list[bytes] = []

    async def send(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            self.report = self.slot.report
            message = self._with_header(message)
            self.kind = _body_kind(message) if self.rewrite and self.report is not None else ""
            if self.kind == "json":
                self.start = message  # sent with the rewritten body's length
                return
        elif kind == "http.response.body" and self.kind == "json":
            self.body.append(bytes(message.get("body", b"")))
            if message.get("more_body", False):
                return
            await self._send_json()
            return
        elif kind == "http.response.body" and self.kind == "stream":
            message = self._with_usage_chunk(message)
        await self.inner(message)

    def _with_header(self, message: Message) -> Message:
        if self.report is None:
            return message
        value = self.report.header()
        if not SAFE.fullmatch(value):  # never: the value is featcache's own words and numbers
            return message
        headers = [*message.get("headers", ()), (HEADER.lower().encode(), value.encode("ascii"))]
        return {**message, "headers": headers}

    async def _send_json(self) -> None:
        assert self.start is not None and self.report is not None
        body = b"".join(self.body)
        try:
            doc = json.loads(body)
            if not isinstance(doc, dict) or not isinstance(doc.get("usage"), dict):
                raise ValueError("no usage object")
            doc["usage"]["featcache"] = self.report.usage()
            body = json.dumps(doc, ensure_ascii=False, allow_nan=False,
                              separators=(",", ":")).encode()
        except ValueError:  # not what a chat completion answers: passed on as it came
            pass
        headers = [(k, v) for k, v in self.start.get("headers", ()) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.inner({**self.start, "headers": headers})
        await self.inner({"type": "http.response.body", "body": body, "more_body": False})

    def _with_usage_chunk(self, message: Message) -> Message:
        """The server-sent event carrying the final usage object gets the report in it."""
        body = bytes(message.get("body", b""))
        if not _USAGE_CHUNK.search(body):
            return message
        events = body.split(b"\n\n")
        for i, event in enumerate(events):
            if event.startswith(b"data: {") and _USAGE_CHUNK.search(event):
                events[i] = self._with_usage(event)
        return {**message, "body": b"\n\n".join(events)}

    def _with_usage(self, event: bytes) -> bytes:
        assert self.report is not None
        try:
            doc = json.loads(event[len(b"data: "):])
        except ValueError:
            return event
        if not isinstance(doc, dict) or not isinstance(doc.get("usage"), dict):
            return event
        doc["usage"]["featcache"] = self.report.usage()
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode()


def _body_kind(start: Message) -> str:
    """How a response's body is read for its usage object: by its content type."""
    types = [v for k, v in start.get("headers", ()) if k.lower() == b"content-type"]
    content_type = types[0].split(b";")[0].strip().lower() if types else b""
    if start.get("status") == 200 and content_type == b"application/json":
        return "json"
    if content_type == b"text/event-stream":
        return "stream"
    return ""


@contextlib.contextmanager
def reporting_app(report: str = REPORTS[0]) -> Iterator[None]:
    """While active, the app lmdeploy's api_server hands uvicorn is wrapped in a
    ``ReportMiddleware`` (``report``: one of ``REPORTS``; "off": left as it is)."""
    if report not in REPORTS:
        raise ValueError(f"report is one of {', '.join(REPORTS)}, not {report!r}")
    if report == "off":
        yield
        return
    from lmdeploy.serve.openai import api_server

    original = api_server.uvicorn
    api_server.uvicorn = _Uvicorn(original, usage=report == "usage")  # type: ignore[assignment]
    try:
        yield
    finally:
        api_server.uvicorn = original


class _Uvicorn:
    """The ``uvicorn`` module as api_server sees it: ``run`` takes the app wrapped."""

    def __init__(self, module: Any, usage: bool) -> None:
        self._module = module
        self._usage = usage

    def run(self, app: Any, *args: Any, **kwargs: Any) -> Any:
        return self._module.run(ReportMiddleware(app, self._usage), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)
