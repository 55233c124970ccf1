"""Hostile clients, second round (issue 39 items 5 and 6): what an http(s) image URL can cost.

- item 5: one deadline (``LMDEPLOY_IMAGE_FETCH_TIMEOUT``) for the whole fetch: a server that
  drips its response headers, or the file name of a gzip body's header, a byte every 0.3 s is
  answered when the timeout has passed (lmdeploy's timeout holds for each socket read alone:
  plain lmdeploy waits for as long as it drips); gzip and deflate bodies are decoded under the
  byte cap, compressed and decompressed;
- item 6: a failing URL (a 404, a short body, no answer, a redirect to a blocked address, a
  redirect loop) is fetched once per request, and answered 400 with the reason, in both engine
  processes, through `featcache serve` (lmdeploy's real CLI, api_server and FastAPI app;
  generation a stand-in: ``test_media_sources``).

The servers are real, on 127.0.0.1 (which lmdeploy's address check, and so featcache's, may
reach in these tests only; ``localhost`` stays refused), and count the requests they receive.
"""

from __future__ import annotations

import gzip
import http.server
import io
import select
import socket
import ssl
import struct
import threading
import time
import tracemalloc
import types
import zlib
from collections import Counter
from urllib.parse import urlsplit

import _lmdeploy_stack
import pytest

_lmdeploy_stack.require("fastapi")  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402
from test_media_sources import loopback_server, url_item  # noqa: E402
from test_media_sources import model as model  # noqa: E402,F401  (the serve fixture's)
from test_media_sources import prompt_path as prompt_path  # noqa: E402,F401  (rig's)
from test_media_sources import rig as rig  # noqa: E402,F401
from test_media_sources import serve as serve  # noqa: E402,F401

from featcache.lmdeploy.request.frontend import Frontend  # noqa: E402
from featcache.lmdeploy.request.media import MediaError, MediaPolicy  # noqa: E402
from featcache.lmdeploy.request.sources import fetched_bytes  # noqa: E402

DRIP_S = 0.3  # a byte every DRIP_S seconds
DRIP_FOR_S = 6.0  # how long a drip lasts at most (then the server hangs up)
CAP = 1 << 20


def png(seed: int = 0) -> bytes:
    buf = io.BytesIO()
    tiny.noise_image(64, 48, seed=seed).save(buf, format="PNG")
    return buf.getvalue()


IMAGE = png(39)
# a gzip member's header with the FNAME flag: the file name (NUL-terminated) follows it
GZIP_NAMED = b"\x1f\x8b\x08\x08" + struct.pack("<I", 0) + b"\x00\xff"


@pytest.fixture
def web(monkeypatch):
    """The hostile server: its requests counted by path (``hits``), an absolute-form request
    (as a proxy is sent one) served by its path and counted in ``proxied``."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    hits: Counter[str] = Counter()
    proxied: list[str] = []
    lock = threading.Lock()
    closing = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_GET(self):
            path = self.path
            if path.startswith("http://"):
                with lock:
                    proxied.append(path)
                path = urlsplit(path).path
            with lock:
                hits[path] += 1
            port = self.server.server_address[1]
            if path == "/a.png":
                self._send(200, IMAGE)
            elif path == "/a.png.gz":
                self._send(200, gzip.compress(IMAGE), [("Content-Encoding", "gzip")])
            elif path == "/a.png.zlib":
                self._send(200, zlib.compress(IMAGE), [("Content-Encoding", "deflate")])
            elif path == "/a.png.deflate":  # raw deflate, as some servers send "deflate"
                raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
                self._send(200, raw.compress(IMAGE) + raw.flush(), [("Content-Encoding", "deflate")])
            elif path == "/bomb":  # 64 MiB of zeros in 64 KiB of gzip
                self._send(200, BOMB, [("Content-Encoding", "gzip")])
            elif path == "/drip-headers":
                self._drip(b"HTTP/1.0 200 OK\r\nContent-Type: image/png\r\nX-Slow: " + b"x" * 100)
            elif path == "/drip-gzip":
                self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Encoding: gzip\r\n\r\n" + GZIP_NAMED)
                self._drip(b"a" * 100)
            elif path == "/silent":  # the request read, never an answer
                closing.wait(DRIP_FOR_S)
            elif path == "/short":
                self.send_response(200)
                self.send_header("Content-Length", str(len(IMAGE)))
                self.end_headers()
                self.wfile.write(IMAGE[:100])
            elif path == "/to-blocked":
                self._redirect(f"http://localhost:{port}/a.png")
            elif path == "/loop":
                self._redirect("/loop")
            elif path == "/slow-loop":  # each hop answered after 0.7 s
                time.sleep(0.7)
                self._redirect("/slow-loop")
            else:
                self._send(404, b"not here")

        def _send(self, code, body, headers=()):
            self.send_response(code)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _redirect(self, location):
            self.send_response(302)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _drip(self, data):
            end = time.monotonic() + DRIP_FOR_S
            try:
                for byte in data:
                    if closing.is_set() or time.monotonic() > end:
                        return  # (hangs up)
                    self.wfile.write(bytes([byte]))
                    time.sleep(DRIP_S)
            except OSError:
                pass  # the client hung up

        def log_message(self, *args):
            pass

    server = loopback_server(Handler, monkeypatch)
    monkeypatch.setenv("LMDEPLOY_IMAGE_FETCH_TIMEOUT", "1")
    port = server.server_address[1]
    yield types.SimpleNamespace(base=f"http://127.0.0.1:{port}", port=port, hits=hits,
                                proxied=proxied)
    closing.set()
    server.shutdown()
    server.server_close()


BOMB = gzip.compress(b"\0" * (64 << 20), compresslevel=9)
POLICY = MediaPolicy(None, max_image_bytes=CAP)


def timed_refusal(url: str, error: type[Exception], words: str) -> float:
    start = time.monotonic()
    with pytest.raises(error, match=words):
        fetched_bytes(url, None, POLICY)
    return time.monotonic() - start


# -- item 5: one deadline for the whole response ---------------------------------------------------
@pytest.mark.parametrize("path", ["/drip-headers", "/drip-gzip", "/silent"])
def test_a_response_dripped_or_never_sent_is_answered_at_the_fetch_timeout(web, path):
    """Headers dripped a byte every 0.3 s, a gzip header whose file name is dripped, a server
    that never answers: each refused once the 1 s timeout has passed for the whole response, one
    request to the server (lmdeploy's timeout holds for each socket read: plain waits for as long
    as the server drips)."""
    took = timed_refusal(web.base + path, MediaError,
                         r"was not received within 1 s \(LMDEPLOY_IMAGE_FETCH_TIMEOUT\)")
    assert took < 3.0, took
    assert web.hits[path] == 1


def test_one_deadline_covers_every_redirect_too(web, monkeypatch):
    """The timeout is for the whole fetch: a redirect does not start it again (4 hops answered
    after 0.7 s each would take 2.8 s; the timeout is 2 s)."""
    monkeypatch.setenv("LMDEPLOY_IMAGE_FETCH_TIMEOUT", "2")
    took = timed_refusal(web.base + "/slow-loop", MediaError, "not received within 2 s")
    assert took < 2.6, took
    assert web.hits["/slow-loop"] == 3


def test_compressed_bodies_are_decoded_within_the_cap(web):
    """gzip and deflate (zlib or raw) bodies give the image; a gzip body that decompresses past
    the cap (64 MiB of zeros in 64 KiB) is refused as soon as it passes it, never held whole."""
    for path in ("/a.png.gz", "/a.png.zlib", "/a.png.deflate"):
        assert fetched_bytes(web.base + path, None, POLICY) == IMAGE, path
    tracemalloc.start()
    try:
        took = timed_refusal(web.base + "/bomb", MediaError, r"--max-image-bytes \(1048576 bytes")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert took < 1.0
    assert peak < 8 * CAP, peak  # at most the cap and one read past it, not 64 MiB


# -- https and proxies, as lmdeploy's fetcher (requests) reaches them --------------------------------
# a self-signed certificate for 127.0.0.1 (EC P-256, valid 2020-2120) and its key: test-only
CERT = """-----BEGIN CERTIFICATE-----
MIIBbzCCARSgAwIBAgIUP3UyZZ31ahaQiV3VLoWaHhRow/8wCgYIKoZIzj0EAwIw
IzEhMB8GA1UEAwwYZmVhdGNhY2hlIHRlc3QgMTI3LjAuMC4xMCAXDTIwMDEwMTAw
MDAwMFoYDzIxMjAwMTAxMDAwMDAwWjAjMSEwHwYDVQQDDBhmZWF0Y2FjaGUgdGVz
dCAxMjcuMC4wLjEwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAAQDBNJmo36PQu4I
vBwfXJHolyclaC/V8VUiZ1GBRnQV+CPHWAgKg+uphKJ/OZ3Vi7fgQkIBRmUnqiad
ipc3QJHAoyQwIjAPBgNVHREECDAGhwR/AAABMA8GA1UdEwEB/wQFMAMBAf8wCgYI
KoZIzj0EAwIDSQAwRgIhAJZeSaqsemmk8gtiLENrd4MG+ltGO0kVYgsGO1lUUQPt
AiEAy37mGW3PW2exiQzdoQiTpdXyZiCmRS/Ju/vh393o3ZE=
-----END CERTIFICATE-----
"""
KEY = """-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg25aO5ETAU8gOdJ1L
hkDNyWrRkoAJrWxizWdZaJCTCeehRANCAAQDBNJmo36PQu4IvBwfXJHolyclaC/V
8VUiZ1GBRnQV+CPHWAgKg+uphKJ/OZ3Vi7fgQkIBRmUnqiadipc3QJHA
-----END PRIVATE KEY-----
"""


@pytest.fixture
def tls(tmp_path, web):
    """An https server on 127.0.0.1 with a self-signed certificate (``cert``: its file), and an
    http proxy that tunnels (CONNECT; ``tunnels``: the targets it was asked for)."""
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_text(CERT)
    key_file.write_text(KEY)

    class Image(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(IMAGE)))
            self.end_headers()
            self.wfile.write(IMAGE)

        def log_message(self, *args):
            pass

    secure = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Image)
    secure.daemon_threads = True
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    secure.socket = context.wrap_socket(secure.socket, server_side=True)
    tunnels: list[str] = []

    class Tunnel(http.server.BaseHTTPRequestHandler):
        def do_CONNECT(self):
            tunnels.append(self.path)
            host, _, port = self.path.rpartition(":")
            upstream = socket.create_connection((host, int(port)), timeout=5)
            self.send_response(200, "Connection established")
            self.end_headers()
            ends = [self.connection, upstream]
            try:
                while True:
                    ready, _, _ = select.select(ends, [], [], 5)
                    if not ready:
                        return
                    for end in ready:
                        data = end.recv(65536)
                        if not data:
                            return
                        (upstream if end is self.connection else self.connection).sendall(data)
            finally:
                upstream.close()

        def log_message(self, *args):
            pass

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Tunnel)
    proxy.daemon_threads = True
    for server in (secure, proxy):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield types.SimpleNamespace(url=f"https://127.0.0.1:{secure.server_address[1]}/a.png",
                                cert=str(cert_file), tunnels=tunnels,
                                proxy=f"http://127.0.0.1:{proxy.server_address[1]}")
    for server in (secure, proxy):
        server.shutdown()
        server.server_close()


def test_https_certificates_are_checked_as_lmdeploys_fetcher_checks_them(tls, monkeypatch):
    """A certificate no authority of requests' bundle signed is refused; trusted through
    ``REQUESTS_CA_BUNDLE`` (as requests trusts it), the image is fetched."""
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="certificate verify failed"):
        fetched_bytes(tls.url, None, POLICY)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", tls.cert)
    assert fetched_bytes(tls.url, None, POLICY) == IMAGE


def test_proxies_from_the_environment_are_used_as_lmdeploys_fetcher_uses_them(web, tls,
                                                                               monkeypatch):
    """``http_proxy``: an http URL is asked of the proxy (absolute form); ``https_proxy``: an
    https URL is tunnelled through it (CONNECT); ``no_proxy`` bypasses it."""
    monkeypatch.setenv("http_proxy", web.base)
    unreachable = "http://127.0.0.1:9/a.png"  # (nothing listens there: only the proxy answers)
    assert fetched_bytes(unreachable, None, POLICY) == IMAGE
    assert web.proxied == [unreachable]
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", tls.cert)
    monkeypatch.setenv("https_proxy", tls.proxy)
    assert fetched_bytes(tls.url, None, POLICY) == IMAGE
    assert tls.tunnels == [urlsplit(tls.url).netloc]
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    assert fetched_bytes(tls.url, None, POLICY) == IMAGE
    assert len(tls.tunnels) == 1 and len(web.proxied) == 1


# -- item 6: a failing URL is fetched once, answered 400 -------------------------------------------
FAILING = {  # path: (words of the answer, requests the server should receive)
    "/missing": ("404 Not Found", 1),
    "/short": ("ended after 100 of", 1),
    "/silent": ("not received within 1 s", 1),
    "/to-blocked": ("URL is blocked for security reasons", 1),
    "/loop": ("Exceeded maximum media URL redirects", 4),  # plain lmdeploy's 4 requests
    "/drip-headers": ("not received within 1 s", 1),
    "/drip-gzip": ("not received within 1 s", 1),
}


@pytest.mark.parametrize("engine_process", ["in", "mp"])
def test_serve_fetches_a_failing_url_once_and_answers_400_with_the_reason(serve, web,
                                                                          engine_process):
    """Each failing URL costs one fetch (a redirect loop as many requests as plain lmdeploy's,
    4), within the 1 s timeout for the whole response (no answer: 1 s, not 2), and is answered
    400 naming what went wrong; the server then answers an image it can fetch (fetched once)."""
    answers = {}

    def drive(post):
        for path in FAILING:
            start = time.monotonic()
            answers[path] = (post(web.base + path), time.monotonic() - start)
        answers["/a.png"] = (post(web.base + "/a.png"), 0.0)

    assert serve(["--engine-process", engine_process], drive) == 0
    wrong = []
    for path, (words, fetches) in FAILING.items():
        response, took = answers[path]
        message = response.json().get("message", "")
        # one fetch timeout of 1 s, not two
        if response.status_code != 400 or words not in message or web.hits[path] != fetches or took > 1.8:
            wrong.append((path, response.status_code, message[:120], web.hits[path], round(took, 2)))
    assert not wrong  # (path, status, message, requests received, seconds)
    assert answers["/a.png"][0].status_code == 200, answers["/a.png"][0].text
    assert web.hits["/a.png"] == 1


def test_an_image_featcache_cannot_key_is_still_fetched_once(rig, web, monkeypatch):
    """An image whose key cannot be made (its parameters) is decoded, uncached, from the bytes
    fetched for it, not fetched again to be read uncached (lmdeploy's prompt path: its own
    reader fails the test if it is asked for the image)."""
    def unkeyable(self, raw, params, io):
        raise TypeError("a parameter that cannot be keyed")

    monkeypatch.setattr(Frontend, "_bytes_key", unkeyable)
    out = rig.prompt(url_item(web.base + "/a.png"))
    assert len(out["multimodal"]) == 1
    assert web.hits["/a.png"] == 1


def test_a_video_url_has_the_video_deadline_and_the_video_cap(web, monkeypatch):
    """An http(s) video (issue 52) is fetched as an image is, within lmdeploy's video fetch
    timeout (``LMDEPLOY_VIDEO_FETCH_TIMEOUT``) for the whole fetch and at most
    ``--max-video-bytes`` of it: a dripped response and an oversized body are refused, each
    naming what refused it."""
    from featcache.lmdeploy.request.media import VideoLimits
    from featcache.lmdeploy.request.video.read import read_video

    monkeypatch.setenv("LMDEPLOY_VIDEO_FETCH_TIMEOUT", "1")
    start = time.monotonic()
    deadline = r"the video at .* not received within 1 s \(LMDEPLOY_VIDEO_FETCH_TIMEOUT\)"
    with pytest.raises(MediaError, match=deadline):
        read_video(web.base + "/drip-headers", POLICY, VideoLimits())
    assert time.monotonic() - start < 3.0
    with pytest.raises(MediaError, match="--max-video-bytes"):
        read_video(web.base + "/a.png.gz", POLICY, VideoLimits(max_video_bytes=len(IMAGE) - 1))
    assert read_video(web.base + "/a.png.gz", POLICY, VideoLimits()) == IMAGE
