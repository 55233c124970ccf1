"""``featcache.server.report``'s middleware over a toy ASGI app: the ``X-Featcache`` header on each
response of a prepared request, ``usage.featcache`` in a chat completion's JSON body or a stream's
final usage chunk (``--featcache-report usage``), bodies untouched otherwise, and each of several
concurrent requests with its own report. `featcache serve` end to end: tests/test_request_report.py.
"""

from __future__ import annotations

import asyncio
import json

import _lmdeploy_stack

_lmdeploy_stack.require()  # featcache.lmdeploy's report; CI fails instead of skipping

from featcache.lmdeploy.request.report import REQUEST, RequestReport  # noqa: E402
from featcache.server.report import ReportMiddleware  # noqa: E402


# -- the middleware ----------------------------------------------------------------------------------
def toy_app(reports: dict[str, RequestReport], stream: bool = False):
    """An ASGI app that 'prepares' a request (the report its path names, put in the request's
    slot as the engine's preprocess does), yields to other requests, then answers."""

    async def app(scope, receive, send):
        slot = REQUEST.get()
        report = reports.get(scope["path"])
        if report is not None:
            slot.reports.append(report)
        await asyncio.sleep(0)  # the other request runs meanwhile
        if stream:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for event in [b'data: {"choices":[{"delta":{"content":"\\"usage\\":{"}}],"usage":null}',
                          b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3}}',
                          b"data: [DONE]"]:
                await send({"type": "http.response.body", "body": event + b"\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        body = json.dumps({"choices": [], "usage": {"prompt_tokens": 3}}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body[:5], "more_body": True})
        await send({"type": "http.response.body", "body": body[5:], "more_body": False})

    return app


def call(app, path: str) -> tuple[dict, bytes]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    async def go():
        await app({"type": "http", "path": path, "method": "POST"}, receive, send)

    return go, sent


def answered(sent: list) -> tuple[dict[bytes, bytes], bytes]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    return dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def test_concurrent_requests_each_get_their_own_report_header_and_usage():
    reports = {"/v1/chat/completions": RequestReport("in", 1, 1, {"device": 1}, 0.2),
               "/other": RequestReport("in", 2, 0, {}, 0.0)}
    app = ReportMiddleware(toy_app(reports), usage=True)
    (a, sent_a), (b, sent_b), (c, sent_c) = (call(app, p) for p in (*reports, "/nothing"))

    async def both():
        await asyncio.gather(a(), b(), c())

    asyncio.run(both())
    headers, body = answered(sent_a)
    assert headers[b"x-featcache"] == b"mode=in; images=1; hits=1; tiers=device:1; vision_saved_ms=200"
    doc = json.loads(body)
    assert doc["usage"]["featcache"]["hits"] == 1 and doc["usage"]["prompt_tokens"] == 3
    assert headers[b"content-length"] == str(len(body)).encode()
    headers, body = answered(sent_b)  # not a chat completion: the header only, the body as it was
    assert headers[b"x-featcache"].startswith(b"mode=in; images=2; hits=0")
    assert "featcache" not in json.loads(body)["usage"]
    headers, _ = answered(sent_c)  # prepared by no featcache engine: no header
    assert b"x-featcache" not in headers


def test_a_streamed_response_gets_the_report_in_its_final_usage_chunk_only():
    report = RequestReport("mp", 2, 1)
    app = ReportMiddleware(toy_app({"/v1/chat/completions": report}, stream=True), usage=True)
    go, sent = call(app, "/v1/chat/completions")
    asyncio.run(go())
    headers, body = answered(sent)
    assert headers[b"x-featcache"] == report.header().encode()
    events = [e for e in body.split(b"\n\n") if e]
    assert b'"usage":null' in events[0] and b"featcache" not in events[0]  # a client's text untouched
    assert json.loads(events[1][6:])["usage"]["featcache"] == report.usage()
    assert events[2] == b"data: [DONE]"
    plain = ReportMiddleware(toy_app({"/v1/chat/completions": report}, stream=True))
    go, sent_plain = call(plain, "/v1/chat/completions")
    asyncio.run(go())
    assert answered(sent_plain)[1].count(b"featcache") == 0  # usage off: bodies byte for byte
