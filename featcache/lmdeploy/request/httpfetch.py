"""What featcache reads of an http(s) image: lmdeploy's checks, one deadline for all of it, a cap.

lmdeploy 0.18 fetches an image URL with ``requests`` (``vl/media/connection.py::_load_http_url``),
whose timeout holds for each socket read alone: a server that drips its response headers, or the
file name in a gzip body's header, a byte every 0.3 s holds the request for as long as it drips
(issue 39 item 5). ``fetch_http`` keeps lmdeploy's checks and messages (``_is_safe_url`` on every
hop, ``allowed_media_domains``, at most 3 redirects, its request headers) and what requests
reaches (proxies from the environment and ``no_proxy``, read by requests' own functions; its CA
bundle, or ``REQUESTS_CA_BUNDLE``), over the standard library's ``http.client``, and holds:

- one deadline, ``LMDEPLOY_IMAGE_FETCH_TIMEOUT`` seconds (lmdeploy's, 10 by default) after the
  fetch began, for all of it: every redirect, connecting, a proxy's tunnel, the TLS handshake,
  the request, the status line and headers, the body and its decoding. No socket operation waits
  past it: each read and write is given what is left as its timeout (``_DeadlineSocket``;
  CPython's TLS handshake and ``sendall`` take a timeout as their total), and what is left is
  checked after each read and each step of decoding. (Resolving a host name is not bounded by
  it: lmdeploy's address check resolves it first, with no timeout, as plain lmdeploy does.)
- at most ``max_image_bytes`` of the body as sent and of it decoded: a stated length over the cap
  is refused before the body is read, reads are at most 1 MiB, and gzip or deflate is decoded by
  ``_Decoder``, which never makes more than what is left under the cap (a body that would
  decompress to 64 MiB is refused after the cap and one byte, never held whole);
- one request per hop and nothing retried: a failure raises. ``FetchError`` (a ``ValueError``:
  lmdeploy answers it with 400 and the message) for a URL that cannot be fetched: refused by
  lmdeploy's checks (their messages), an error status, a body cut short or damaged, a connection
  that failed; ``MediaError`` for the deadline and the cap (the server's limits, named).
"""

from __future__ import annotations

import base64
import functools
import http.client
import io
import os
import socket
import ssl
import time
import zlib
from typing import Any
from urllib.parse import unquote, urljoin

from .media import MediaError, MediaPolicy, _too_large, shown

# 2026-12 (issue 39): requests was kept at first. Its timeouts hold per socket read, and a deadline
# needs the socket before the headers are read: reachable only inside urllib3's pools (a connection
# class per pool), and a watchdog that shuts sockets at the deadline needs that same socket.
# http.client over a socket that gives every operation what is left does it with public interfaces.
MAX_REDIRECTS = 3  # lmdeploy 0.18's (vl/media/connection.py)
_REDIRECTS = (301, 302, 303, 307, 308)  # what requests' ``Response.is_redirect`` follows
_READ = 1 << 20  # the most bytes of a body read at a time
_MAX_CONNECT_REPLY = 64 << 10  # the most a proxy's answer to CONNECT may hold
# the request headers: lmdeploy's (its User-Agent) over those requests adds; one request a connection
_HEADERS = {"Accept-Encoding": "gzip, deflate", "Accept": "*/*", "Connection": "close"}
_GZIP, _DEFLATE = ("gzip", "x-gzip"), "deflate"
# per medium: the environment variable lmdeploy reads its fetch timeout from, and its default
_TIMEOUTS = {"image": ("LMDEPLOY_IMAGE_FETCH_TIMEOUT", 10), "video": ("LMDEPLOY_VIDEO_FETCH_TIMEOUT", 30)}


class FetchError(ValueError):
    """An http(s) image URL that cannot be fetched: refused by lmdeploy's checks (with its
    message), or its server's answer is no image body (an error status, a body cut short or
    damaged, a connection that failed). lmdeploy answers a ``ValueError`` with HTTP 400 and the
    message."""


def fetch_http(url: str, allowed_media_domains: list[str] | None, policy: MediaPolicy,
               medium: str = "image", cap: int | None = None) -> bytes:
    """The body behind the http(s) image URL ``url``, fetched with lmdeploy 0.18's checks and
    headers (module docstring), within one deadline for all of it and at most
    ``policy.max_image_bytes`` of it, as sent and decoded. Raises ``FetchError`` for a URL that
    cannot be fetched, ``MediaError`` once the deadline has passed or the body passes the cap.
    ``medium="video"``: lmdeploy's video deadline (``LMDEPLOY_VIDEO_FETCH_TIMEOUT``, 30 s) and
    ``cap`` bytes at most (the video limits' own)."""
    from lmdeploy.vl.media import connection  # lmdeploy's request headers

    domains = {d.lower() for d in allowed_media_domains} if allowed_media_domains else None
    env, default = _TIMEOUTS[medium]
    deadline = _Deadline(int(os.environ.get(env, default)), f"the {medium} at {shown(url)!r}", env)
    cap = policy.max_image_bytes if cap is None else cap
    headers = {**_HEADERS, **connection.headers}
    for _ in range(MAX_REDIRECTS + 1):
        parsed = _checked(url, domains)
        deadline.left()  # (the check resolves the host: it may have taken the time)
        try:
            conn, response = _get(parsed, headers, deadline)
            try:
                if response.status in _REDIRECTS and response.getheader("Location") is not None:
                    location = response.getheader("Location")
                    if not location:
                        raise FetchError("Redirect response missing Location header")
                    url = urljoin(parsed.url, location)
                    continue
                if not 200 <= response.status < 300:
                    raise _failed(deadline, f"its server answered {response.status} "
                                  f"{response.reason[:80]}")
                return _body(response, cap, deadline)
            finally:
                response.close()  # (its socket too: the connection passed it on)
                conn.close()
        except TimeoutError:  # every wait is given what is left: the deadline has passed
            raise deadline.passed() from None
        except http.client.IncompleteRead as e:
            raise _failed(deadline, f"its body ended after {len(e.partial)} bytes of a chunk") from None
        except (OSError, http.client.HTTPException) as e:  # refused, reset, TLS, a bad answer
            raise _failed(deadline, f"{type(e).__name__}: {str(e)[:200]}") from None
    raise FetchError("Exceeded maximum media URL redirects")


def _checked(url: str, domains: set[str] | None) -> Any:
    """``url`` parsed (a urllib3 ``Url``) if lmdeploy's checks let it be fetched, with its
    messages: an http(s) URL with a host name, of ``domains`` if given, whose addresses are all
    public (``_is_safe_url``, which resolves it)."""
    from lmdeploy.vl.media import connection
    from urllib3.util import parse_url

    try:
        parsed = parse_url(url)
    except ValueError as e:  # (urllib3's LocationParseError: lmdeploy's parse raises it too)
        raise FetchError(f"invalid image URL {shown(url)!r}: {e}") from None
    if parsed.scheme not in ("http", "https"):
        raise FetchError(f"URL is blocked for security reasons: Unsupported scheme: {parsed.scheme}")
    if not parsed.hostname:
        raise FetchError("URL is blocked for security reasons: Could not parse hostname from URL")
    if domains and parsed.hostname not in domains:
        raise FetchError(f"The URL must be from one of the allowed domains: {domains}. "
                         f"Input URL domain: {parsed.hostname}")
    safe, reason = connection._is_safe_url(parsed.url)
    if not safe:
        raise FetchError(f"URL is blocked for security reasons: {reason}")
    return parsed


def _failed(deadline: _Deadline, why: str) -> FetchError:
    return FetchError(f"{deadline.what} could not be fetched: {why}; send the image as a data URL, "
                      "or from a server that answers with it")


class _Deadline:
    """When a fetch must be done: ``timeout_s`` after it was made."""

    def __init__(self, timeout_s: int, what: str, env: str = "LMDEPLOY_IMAGE_FETCH_TIMEOUT") -> None:
        self.timeout_s = timeout_s
        self.what = what
        self.env = env
        self._at = time.monotonic() + timeout_s

    def left(self) -> float:
        """The seconds left, more than 0; raises ``passed()`` when none are."""
        left = self._at - time.monotonic()
        if left <= 0:
            raise self.passed()
        return left

    def passed(self) -> MediaError:
        return MediaError(f"{self.what} was not received within {self.timeout_s} s "
                          f"({self.env}): send it as a data URL, or from a faster server")


# -- one request -------------------------------------------------------------------------------
def _get(parsed: Any, headers: dict[str, str], deadline: _Deadline
         ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """(connection, response) of a GET of ``parsed`` (a urllib3 ``Url``), through the proxy the
    environment names for it (an http URL asked of the proxy in absolute form, an https one
    tunnelled through it), its status line and headers read."""
    from requests.utils import get_environ_proxies, select_proxy

    secure = parsed.scheme == "https"
    port = parsed.port or (443 if secure else 80)
    hostname = parsed.hostname.strip("[]")  # (an IPv6 address without its brackets)
    head = {**headers, "Host": parsed.netloc}
    if parsed.auth:
        head["Authorization"] = _basic(*parsed.auth.partition(":")[::2])
    target = parsed.request_uri
    proxy = select_proxy(parsed.url, get_environ_proxies(parsed.url))
    tls = _tls_context(_ca_bundle()) if secure else None
    if proxy is None:
        conn = _Connection(hostname, port, deadline, tls)
    else:
        via, auth = _proxy(proxy, parsed.url)
        tunnel = f"{parsed.host}:{port}" if secure else None
        conn = _Connection(via.hostname.strip("[]"), via.port or 80, deadline, tls, hostname, tunnel,
                           auth)
        if not secure:  # asked of the proxy: the URL in absolute form (without its userinfo)
            target = f"http://{parsed.netloc}{parsed.request_uri}"
            head.update(auth)
    try:
        conn.request("GET", target, headers=head)  # (Host and Accept-Encoding given: none added)
        return conn, conn.getresponse()
    except BaseException:
        conn.close()
        raise


def _proxy(proxy: str, url: str) -> tuple[Any, dict[str, str]]:
    """(proxy ``Url``, its ``Proxy-Authorization`` header if it has credentials) for ``url``."""
    from requests.utils import get_auth_from_url, prepend_scheme_if_needed
    from urllib3.util import parse_url

    via = parse_url(prepend_scheme_if_needed(proxy, "http"))
    if via.scheme != "http" or not via.hostname:
        raise FetchError(f"the proxy {shown(proxy)!r} the server's environment names for "
                         f"{shown(url)!r} is not an http:// proxy, the only kind featcache "
                         "fetches images through (its operator may change http_proxy, "
                         "https_proxy, all_proxy or no_proxy)")
    user, password = get_auth_from_url(proxy)
    return via, ({"Proxy-Authorization": _basic(user, password)} if user or password else {})


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()


def _ca_bundle() -> str:
    """The CA bundle requests verifies with: ``REQUESTS_CA_BUNDLE`` or ``CURL_CA_BUNDLE`` (a
    file or a directory), else its own (certifi's)."""
    from requests.utils import DEFAULT_CA_BUNDLE_PATH

    return (os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
            or DEFAULT_CA_BUNDLE_PATH)


@functools.lru_cache(maxsize=8)
def _tls_context(bundle: str) -> ssl.SSLContext:
    if os.path.isdir(bundle):
        return ssl.create_default_context(capath=bundle)
    return ssl.create_default_context(cafile=bundle)


class _Connection(http.client.HTTPConnection):
    """One request to ``host`` (the server, or a proxy), over a socket every operation of which
    ends by ``deadline``: connected (each address tried with what is left), tunnelled (CONNECT
    ``tunnel``, with the proxy's ``tunnel_headers``) and wrapped in TLS (``tls``, the certificate
    checked for ``server_hostname``, by default ``host``) here, then read and written through a
    ``_DeadlineSocket``."""

    def __init__(self, host: str, port: int, deadline: _Deadline, tls: ssl.SSLContext | None,
                 server_hostname: str | None = None, tunnel: str | None = None,
                 tunnel_headers: dict[str, str] | None = None) -> None:
        super().__init__(host, port)
        self._deadline = deadline
        self._tls = tls
        self._server_hostname = server_hostname or host
        self._through = tunnel
        self._through_headers = tunnel_headers or {}

    def connect(self) -> None:
        sock = _open(self.host, self.port, self._deadline)
        try:
            if self._through is not None:
                _tunnel(sock, self._through, self._through_headers, self._deadline)
            if self._tls is not None:
                sock.settimeout(self._deadline.left())  # (the handshake's total)
                sock = self._tls.wrap_socket(sock, server_hostname=self._server_hostname)
        except BaseException:
            sock.close()
            raise
        self.sock = _DeadlineSocket(sock, self._deadline)


def _open(host: str, port: int, deadline: _Deadline) -> socket.socket:
    """A TCP connection to ``host``: its addresses tried in turn, each with what is left."""
    error: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(deadline.left())
            sock.connect(address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            sock.close()
            if isinstance(e, TimeoutError):
                raise
            error = e
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise error if error is not None else OSError(f"no address to connect to for {host}")


def _tunnel(sock: socket.socket, target: str, headers: dict[str, str], deadline: _Deadline) -> None:
    """Ask the proxy on ``sock`` for a tunnel to ``target`` (``host:port``) and read its answer
    (to its blank line: nothing follows it until the client speaks)."""
    lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}",
             *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    sock.settimeout(deadline.left())
    sock.sendall("\r\n".join(lines).encode("latin-1"))
    reply = b""
    while b"\r\n\r\n" not in reply:
        if len(reply) > _MAX_CONNECT_REPLY:
            raise http.client.HTTPException("the proxy's answer to CONNECT is too long")
        sock.settimeout(deadline.left())
        chunk = sock.recv(4096)
        if not chunk:
            raise http.client.RemoteDisconnected("the proxy closed the connection on CONNECT")
        reply += chunk
    status = reply.split(b"\r\n", 1)[0].decode("latin-1")
    if status.split(" ", 2)[1:2] != ["200"]:
        raise OSError(f"the proxy refused a tunnel to {target}: {status}")


class _DeadlineSocket:
    """A connected socket as ``http.client`` uses it (``sendall``, ``makefile``, ``close``),
    every read and write given what is left of the deadline as its timeout."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._sock = sock
        self._deadline = deadline

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(self._deadline.left())
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        if mode != "rb":
            raise ValueError(f"a deadline socket is read as 'rb' only, not {mode!r}")
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def close(self) -> None:
        self._sock.close()


class _DeadlineReader(io.RawIOBase):
    """The socket's bytes (its own unbuffered ``makefile``, which keeps the socket open until
    this is closed too, as ``http.client`` expects), each read waiting at most what is left of
    the deadline."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        super().__init__()
        self._sock = sock
        self._raw = sock.makefile("rb", buffering=0)
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        self._sock.settimeout(self._deadline.left())
        return self._raw.readinto(buffer)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


# -- the body ----------------------------------------------------------------------------------
def _body(response: http.client.HTTPResponse, cap: int, deadline: _Deadline) -> bytes:
    """The body of ``response``, decoded, at most ``cap`` bytes as sent and as decoded (``MediaError``
    past either), read by the deadline; ``FetchError`` for a body shorter than stated, damaged,
    or sent in an encoding featcache does not decode."""
    what = deadline.what
    stated = response.getheader("Content-Length", "")
    if stated.isdigit() and int(stated) > cap:
        raise _too_large(what, cap)
    decoder = _decoder(response.getheader("Content-Encoding", ""), cap, deadline)
    kept: list[bytes] = []
    received = 0
    while chunk := response.read1(_READ):  # (one socket read at most)
        received += len(chunk)
        if received > cap:
            raise _too_large(what, cap)
        kept.extend(decoder.feed(chunk) if decoder is not None else (chunk,))
        deadline.left()
    if response.length:  # (what is still due of a stated length: the server hung up early)
        raise _failed(deadline, f"its body ended after {received} of {received + response.length} bytes")
    if decoder is not None:
        decoder.finish()
    return b"".join(kept)


def _decoder(encoding: str, cap: int, deadline: _Deadline) -> _Decoder | None:
    codings = [c.strip() for c in encoding.lower().split(",") if c.strip() not in ("", "identity")]
    if not codings:
        return None
    if len(codings) == 1 and (codings[0] in _GZIP or codings[0] == _DEFLATE):
        return _Decoder(codings[0], cap, deadline)
    raise _failed(deadline, f"its body is sent with Content-Encoding {encoding[:80]!r}, which "
                  "featcache does not decode (it asks for gzip or deflate)")


class _Decoder:
    """A gzip (all of its members) or deflate (zlib, or raw as some servers send it, as urllib3
    reads both) body, decoded as its bytes arrive: never more than what is left under ``cap``
    at a time (``MediaError`` past it), the deadline checked after each step."""

    def __init__(self, coding: str, cap: int, deadline: _Deadline) -> None:
        self._coding = coding
        self._cap = cap
        self._deadline = deadline
        self._made = 0
        self._z: Any = zlib.decompressobj(16 + zlib.MAX_WBITS) if coding in _GZIP else None
        self._head = b""  # deflate: its first bytes, until they tell zlib's header from raw
        self._members = 0  # gzip members decoded whole
        self._ignoring = False

    def feed(self, data: bytes) -> list[bytes]:
        if self._z is None:  # deflate: zlib's two-byte header, or raw deflate
            data = self._head + data
            if len(data) < 2:
                self._head = data
                return []
            zlib_header = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            self._z = zlib.decompressobj(zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS)
        out: list[bytes] = []
        while data and not self._ignoring:
            try:
                piece = self._z.decompress(data, self._cap + 1 - self._made)  # (at least 1)
            except zlib.error as e:
                if self._members:  # after a whole member: trailing bytes, ignored (as urllib3)
                    self._ignoring = True
                    break
                raise _failed(self._deadline, f"its {self._coding} body is damaged ({e})") from None
            self._made += len(piece)
            if self._made > self._cap:
                raise _too_large(self._deadline.what, self._cap)
            out.append(piece)
            data = self._z.unconsumed_tail
            if self._z.eof:  # a stream ended: gzip may send another member, deflate nothing
                data, self._members = self._z.unused_data, self._members + 1
                if self._coding in _GZIP:
                    self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
                else:
                    self._ignoring = True
            self._deadline.left()
        return out

    def finish(self) -> None:
        """Raise if the body ended before its first compressed stream did."""
        if not self._members:
            raise _failed(self._deadline, f"its {self._coding} body ends early")
