"""Image sources a hostile client names (issue 26, item 3): files outside the allowed directory,
FIFOs, devices, huge files, data URLs and http bodies; none reaches the answer, blocks the server or
takes its memory, and lmdeploy never reads a source itself.

Three levels: ``featcache.lmdeploy.request.media`` alone (the policy and its readers); lmdeploy's real
prompt path (``MultimodalProcessor`` + ``ImageEncoder`` on a tiny checkpoint) with featcache's
frontend, lmdeploy's own reader replaced by one that fails the test if it is ever asked for an
image; and `featcache serve` end to end: lmdeploy's real CLI, api_server, FastAPI app, chat
completion handler and ``AsyncEngine.preprocess``, over an engine whose generation (which needs
CUDA) is a stand-in answering "ok".
"""

from __future__ import annotations

import base64
import gc
import http.server
import importlib
import io
import os
import threading
import time
import types

import _lmdeploy_stack
import pytest

_lmdeploy_stack.require("fastapi")  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402
from lmdeploy.serve.core.async_engine import AsyncEngine, GenOut  # noqa: E402
from lmdeploy.vl.media import connection  # noqa: E402
from lmdeploy.vl.media.image import ImageMediaIO  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy.request import media  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION, Frontend, install_frontend  # noqa: E402
from featcache.lmdeploy.request.media import LOCAL_FILES, MediaError, MediaPolicy, read_local  # noqa: E402
from featcache.lmdeploy.request.sources import encoded_bytes, fetched_bytes, set_media_policy  # noqa: E402

GiB = 1 << 30


def png(seed: int = 0, size: tuple[int, int] = (64, 48)) -> bytes:
    buf = io.BytesIO()
    tiny.noise_image(*size, seed=seed).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def url_item(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture
def disk(tmp_path):
    """An allowed directory holding an image, a FIFO, a sparse 1 GiB file and links (to a file
    outside, to /dev/zero, to a directory outside, to the image); and a secret image outside."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "good.png").write_bytes(png(1))
    (outside / "secret.png").write_bytes(png(2))
    os.mkfifo(allowed / "fifo")
    with open(allowed / "huge.png", "wb") as f:
        f.truncate(GiB)  # sparse: 1 GiB stated, nothing on the disk
    (allowed / "to_secret.png").symlink_to(outside / "secret.png")
    (allowed / "to_zero.png").symlink_to("/dev/zero")
    (allowed / "to_outside").symlink_to(outside)
    (allowed / "to_good.png").symlink_to("good.png")
    return types.SimpleNamespace(allowed=allowed, outside=outside, policy=MediaPolicy(str(allowed)))


def refused(source: str, policy: MediaPolicy, match: str) -> float:
    """Seconds ``encoded_bytes`` took to refuse ``source`` with a ``MediaError`` matching."""
    start = time.monotonic()
    with pytest.raises(MediaError, match=match):
        encoded_bytes(source, policy)
    return time.monotonic() - start


# -- the policy and its readers ----------------------------------------------------------------
def test_no_local_file_is_read_without_an_allowed_directory(disk):
    good = str(disk.allowed / "good.png")
    for source in (good, "file://" + good, "/dev/zero", "relative.png"):
        refused(source, MediaPolicy(), "reads no local files.*--allowed-local-media-path DIR")
    assert encoded_bytes(good, disk.policy) == png(1)
    assert encoded_bytes("file://" + good, disk.policy) == png(1)


def test_only_files_under_the_allowed_directory_are_read_links_included(disk, monkeypatch):
    monkeypatch.chdir(disk.allowed)
    assert encoded_bytes("good.png", disk.policy) == png(1)  # relative, as lmdeploy reads it
    assert encoded_bytes("to_good.png", disk.policy) == png(1)  # a link that stays inside
    secret = disk.outside / "secret.png"
    for source in (str(secret), "file://" + str(secret), "../outside/secret.png",
                   str(disk.allowed / ".." / "outside" / "secret.png"),
                   "file://" + str(disk.outside).replace("outside", "%6Futside") + "/secret.png",
                   "to_secret.png", "to_outside/secret.png", "to_zero.png", "/etc/hostname"):
        took = refused(source, disk.policy, "not under the directory .*--allowed-local-media-path")
        assert took < 1.0
    with pytest.raises(MediaError, match="not under the directory") as e:
        encoded_bytes("to_secret.png", disk.policy)
    assert str(disk.outside) not in str(e.value)  # where the link leads is not said


def test_fifos_devices_and_directories_are_refused_at_once(disk):
    for policy in (disk.policy, LOCAL_FILES):
        took = refused(str(disk.allowed / "fifo"), policy, r"not a regular file \(a FIFO\)")
        assert took < 1.0  # opened without blocking: no writer needed
        refused(str(disk.allowed), policy, r"not a regular file \(a directory\)")
    took = refused("/dev/zero", LOCAL_FILES, r"not a regular file \(a device\)")
    assert took < 1.0
    refused(str(disk.allowed / "to_zero.png"), LOCAL_FILES, r"a device")


def test_files_over_the_cap_are_refused_never_read_past_it(disk):
    took = refused(str(disk.allowed / "huge.png"), disk.policy,
                   r"larger than this server's --max-image-bytes \(67108864 bytes")
    assert took < 1.0  # its stated size: nothing read
    # a file whose stated size is 0 but that holds more (procfs): read up to the cap and one byte
    small = MediaPolicy(os.sep, max_image_bytes=16)
    start = time.monotonic()
    with pytest.raises(MediaError, match="--max-image-bytes"):
        read_local("/proc/self/maps", small)
    assert time.monotonic() - start < 1.0
    assert read_local(str(disk.allowed / "good.png"), MediaPolicy(str(disk.allowed), len(png(1)))
                      ) == png(1)  # exactly the cap
    refused(str(disk.allowed / "good.png"), MediaPolicy(str(disk.allowed), len(png(1)) - 1),
            "--max-image-bytes")


def test_a_file_stated_over_the_cap_is_refused_with_nothing_of_it_read(disk, monkeypatch):
    """Refused on its stated size: not one byte of it read (a check only a little too loose
    reads the file up to the cap, and then refuses it with the same message)."""
    (disk.allowed / "one_over.png").write_bytes(png(1) + b"\0")
    cap = len(png(1))
    watched = {(st.st_dev, st.st_ino) for st in (os.stat(disk.allowed / name)
                                                 for name in ("huge.png", "one_over.png"))}
    reads: list[int] = []
    real_read = os.read

    def spy(fd: int, n: int) -> bytes:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in watched:
            reads.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", spy)
    for name, policy in (("huge.png", disk.policy), ("huge.png", MediaPolicy(str(disk.allowed), cap)),
                         ("one_over.png", MediaPolicy(str(disk.allowed), cap))):
        refused(str(disk.allowed / name), policy, "larger than this server's --max-image-bytes")
        with pytest.raises(MediaError, match="--max-image-bytes"):
            read_local(str(disk.allowed / name), policy)
    assert reads == []
    assert encoded_bytes(str(disk.allowed / "one_over.png"), MediaPolicy(str(disk.allowed), cap + 1)
                         ) == png(1) + b"\0"
    assert reads  # the spy sees the reads of a watched file once it is under the cap


def test_a_link_swapped_in_after_the_check_is_not_followed(disk, monkeypatch):
    """The check resolves the path; the file is then reached from the allowed directory without
    following links: a component that became a link in between does not open (here the check
    is fooled into seeing the link's own path, as if it had been a directory when checked)."""
    path = str(disk.allowed / "to_outside" / "secret.png")
    with monkeypatch.context() as m:
        m.setattr(media.os.path, "realpath", os.path.abspath)
        with pytest.raises(OSError):
            read_local(path, disk.policy)
        assert encoded_bytes(path, disk.policy) is None  # (then reported as unreadable)
        with pytest.raises(MediaError, match=r"a link"):
            read_local(str(disk.allowed / "to_secret.png"), disk.policy)


def test_data_urls_over_the_cap_are_refused_before_decoding(monkeypatch):
    import pybase64

    decoded = []
    real = pybase64.b64decode
    monkeypatch.setattr(pybase64, "b64decode", lambda data, **k: decoded.append(len(data))
                        or real(data, **k))
    policy = MediaPolicy(None, max_image_bytes=1000)
    assert encoded_bytes(data_url(b"x" * 1000), policy) == b"x" * 1000
    assert decoded == [1336]
    decoded.clear()
    with pytest.raises(MediaError, match=r"data URL .*--max-image-bytes \(1000 bytes"):
        encoded_bytes(data_url(b"x" * 1003), policy)
    assert decoded == []  # refused by its length alone
    with pytest.raises(MediaError, match="--max-image-bytes"):  # within the text's slack
        encoded_bytes(data_url(b"x" * 1001), policy)
    decoded.clear()
    big = "data:image/png;base64," + "A" * (96 << 20)  # 72 MiB once decoded
    start = time.monotonic()
    with pytest.raises(MediaError, match=r"67108864 bytes"):
        encoded_bytes(big, MediaPolicy())
    assert time.monotonic() - start < 1.0 and decoded == []


def test_policy_values_are_checked():
    with pytest.raises(ValueError, match="is not a directory"):
        MediaPolicy("/no/such/dir")
    with pytest.raises(ValueError, match="at least 1 byte"):
        MediaPolicy(None, 0)
    with pytest.raises(TypeError, match="max_image_bytes"):
        MediaPolicy(None, 1.5)  # type: ignore[arg-type]
    assert MediaPolicy.create(None, "2MiB").max_image_bytes == 2 << 20
    assert MediaPolicy().max_image_bytes == 64 << 20 and MediaPolicy().allowed_local_media_path is None
    assert LOCAL_FILES.allowed_local_media_path == os.sep


# -- http(s) -----------------------------------------------------------------------------------

def loopback_server(handler: type, monkeypatch) -> http.server.ThreadingHTTPServer:
    """``handler`` served on 127.0.0.1 from a daemon thread, and lmdeploy's address check told to
    let fetches of it through (it refuses loopback addresses): the server, for the caller to shut."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    safe = connection._is_safe_url
    monkeypatch.setattr(connection, "_is_safe_url",
                        lambda url: (True, "test") if "//127.0.0.1:" in url else safe(url))
    return server

@pytest.fixture
def web(monkeypatch):
    """An http server on 127.0.0.1 (which lmdeploy's address check, and so featcache's, may
    reach in these tests only; localhost stays refused): an image, a body stated too long, an
    endless body, a body dripped slowly, redirect chains."""
    image = png(3)
    sent = {"endless": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_GET(self):
            path = self.path
            if path == "/a.png":
                self._send(200, image)
            elif path == "/stated":
                self.send_response(200)
                self.send_header("Content-Length", str(GiB))
                self.end_headers()
                self.wfile.write(b"\0" * 4096)
            elif path == "/endless":  # no length: until the client hangs up
                self.send_response(200)
                self.end_headers()
                try:
                    while True:
                        self.wfile.write(b"\0" * 65536)
                        sent["endless"] += 65536
                except OSError:
                    pass
            elif path == "/drip":
                self.send_response(200)
                self.end_headers()
                try:
                    for _ in range(100):
                        self.wfile.write(b"\0")
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:
                    pass
            elif path.startswith("/hop/"):
                left = int(path.rsplit("/", 1)[1])
                self.send_response(302)
                self.send_header("Location", f"/hop/{left - 1}" if left > 0 else "/a.png")
                self.end_headers()
            elif path == "/ftp":
                self.send_response(302)
                self.send_header("Location", "ftp://127.0.0.1/a.png")
                self.end_headers()
            else:
                self._send(404, b"")

        def _send(self, code, body):
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = loopback_server(Handler, monkeypatch)
    yield types.SimpleNamespace(base=f"http://127.0.0.1:{server.server_address[1]}",
                                port=server.server_address[1], image=image, sent=sent)
    server.shutdown()
    server.server_close()


def test_http_bodies_are_read_up_to_the_cap_and_within_the_timeout(web, monkeypatch):
    policy = MediaPolicy(None, max_image_bytes=1 << 20)
    assert fetched_bytes(web.base + "/a.png", None, policy) == web.image
    assert fetched_bytes(web.base + "/hop/2", None, policy) == web.image  # redirects followed
    for path in ("/stated", "/endless"):
        start = time.monotonic()
        with pytest.raises(MediaError, match=r"--max-image-bytes \(1048576 bytes"):
            fetched_bytes(web.base + path, None, policy)
        assert time.monotonic() - start < 1.0
    monkeypatch.setenv("LMDEPLOY_IMAGE_FETCH_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.raises(MediaError, match=r"not received within 1 s \(LMDEPLOY_IMAGE_FETCH_TIMEOUT"):
        fetched_bytes(web.base + "/drip", None, policy)
    assert time.monotonic() - start < 2.5  # the whole body within the timeout, not each read


def test_http_fetches_keep_lmdeploys_checks_and_messages(web):
    """The same refusals, in the same words, as lmdeploy's own ``load_from_url``."""
    cases = [(web.base + "/hop/5", None, "Exceeded maximum media URL redirects"),
             (web.base + "/ftp", None, "Unsupported scheme: ftp"),
             (web.base + "/a.png", ["example.com"], "must be from one of the allowed domains"),
             (f"http://localhost:{web.port}/a.png", None, "blocked for security reasons")]
    for url, domains, words in cases:
        with pytest.raises(ValueError, match=words) as ours:
            fetched_bytes(url, domains, MediaPolicy())
        with pytest.raises(ValueError) as theirs:
            connection.load_from_url(url, ImageMediaIO(), domains)
        assert str(ours.value) == str(theirs.value)


# -- lmdeploy's prompt path --------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)


@pytest.fixture(scope="module")
def prompt_path(model):
    path = tiny.PromptPath(model)
    cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
    install_frontend(path.model, cache, "test:media", path.processor)
    yield types.SimpleNamespace(path=path, cache=cache,
                                frontend=path.processor.async_parse_multimodal_item.frontend)
    path.close()
    gc.collect()
    cache.close()


@pytest.fixture
def rig(prompt_path, monkeypatch):
    """The prompt path, lmdeploy's reader replaced by one that fails on any image source, the
    policy restored after the test."""
    from lmdeploy.serve.processors import multimodal

    asked = []
    real = multimodal.load_from_url

    def load_from_url(url, media_io, allowed_media_domains=None):
        if isinstance(media_io, ImageMediaIO):
            asked.append(url)
            raise AssertionError(f"lmdeploy was left to read {url[:80]!r}")
        return real(url, media_io, allowed_media_domains)

    monkeypatch.setattr(multimodal, "load_from_url", load_from_url)
    before = prompt_path.frontend.media
    rig = types.SimpleNamespace(asked=asked, **vars(prompt_path))
    rig.prompt = lambda *items: prompt_path.path.prompt(tiny.messages(*items))
    rig.refused = lambda: prompt_path.cache.stats()[SECTION].get("media_refused", 0)
    yield rig
    set_media_policy(prompt_path.path.processor, before)
    assert asked == []


def test_the_python_api_reads_any_regular_file_but_no_fifo_device_or_huge_file(rig, disk):
    assert rig.frontend.media is LOCAL_FILES  # what install_frontend / wrap() / pipeline() use
    out = rig.prompt(url_item(str(disk.outside / "secret.png")))  # the caller's own files
    assert len(out["multimodal"]) == 1
    for source, words in [(str(disk.allowed / "fifo"), "FIFO"), ("/dev/zero", "device"),
                          (str(disk.allowed / "huge.png"), "--max-image-bytes")]:
        start = time.monotonic()
        with pytest.raises(MediaError, match=words):
            rig.prompt(url_item(source))
        assert time.monotonic() - start < 1.0


def test_the_policy_holds_on_every_path_lmdeploy_is_never_left_a_source(rig, disk, monkeypatch):
    set_media_policy(rig.path.processor, disk.policy)
    good, secret = str(disk.allowed / "good.png"), str(disk.outside / "secret.png")
    assert len(rig.prompt(url_item(good))["multimodal"]) == 1
    refusals = rig.refused()
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        rig.prompt(url_item(secret))
    assert rig.refused() == refusals + 1
    with pytest.raises(ValueError, match="cannot read image file"):  # reported by featcache
        rig.prompt(url_item(str(disk.allowed / "missing.png")))

    # featcache fails while resolving: the sources are still read by it, under the policy
    def broken(self, *args):
        raise RuntimeError("resolver on fire")

    monkeypatch.setattr(Frontend, "_resolve_message", broken)
    assert len(rig.prompt(url_item(good))["multimodal"]) == 1  # read and decoded, uncached
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        rig.prompt(url_item(secret))
    with pytest.raises(MediaError, match="FIFO"):
        rig.prompt(url_item(str(disk.allowed / "fifo")))


def test_an_image_the_resolver_leaves_is_still_read_by_featcache(rig, disk, monkeypatch):
    """A source the resolver could not read or key stays a source; featcache reads it (under the
    policy) and decodes it, lmdeploy does not."""
    set_media_policy(rig.path.processor, disk.policy)
    monkeypatch.setattr(Frontend, "_source_bytes", lambda self, source, domains: None)
    assert len(rig.prompt(url_item(str(disk.allowed / "good.png")))["multimodal"]) == 1
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        rig.prompt(url_item(str(disk.outside / "secret.png")))


def test_an_http_url_featcache_may_not_fetch_is_refused_by_it(rig, web):
    with pytest.raises(ValueError, match="blocked"):
        rig.prompt(url_item(f"http://localhost:{web.port}/a.png"))
    set_media_policy(rig.path.processor, MediaPolicy(None, max_image_bytes=1 << 20))
    start = time.monotonic()
    with pytest.raises(MediaError, match="--max-image-bytes"):
        rig.prompt(url_item(web.base + "/endless"))
    assert time.monotonic() - start < 1.0


def test_other_media_files_are_checked_before_lmdeploy_reads_them(rig, disk):
    set_media_policy(rig.path.processor, disk.policy)
    for source, words in [(str(disk.outside / "clip.mp4"), "--allowed-local-media-path"),
                          (str(disk.allowed / "fifo"), "FIFO"), ("/dev/zero", "not under")]:
        item = {"type": "video_url", "video_url": {"url": source}}
        with pytest.raises(MediaError, match=words):
            rig.path.prompt([{"role": "user", "content": [{"type": "text", "text": "x"}, item]}])


def test_wrap_reads_sources_under_its_policy_for_an_architecture_it_does_not_cache_too(
        model, disk, monkeypatch):
    """``wrap(pipe, cache, media_policy=...)``: the frontend of a cached model reads under it;
    a model featcache does not cache still has its image sources read by featcache under it."""
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.processors import multimodal

    import featcache.lmdeploy as fl

    real = multimodal.load_from_url
    monkeypatch.setattr(multimodal, "load_from_url", lambda url, io, domains=None: (
        pytest.fail(f"lmdeploy read {url!r}") if isinstance(io, ImageMediaIO) else real(url, io, domains)))
    monkeypatch.delitem(fl.SPECS, tiny.INTERNVL)  # an architecture featcache does not cache
    path = tiny.PromptPath(model)
    cache = FeatureCache(device="cpu", device_bytes="1MiB", host_bytes=0)
    try:
        engine = types.SimpleNamespace(vl_encoder=path.encoder, prompt_processor=path.processor,
                                       backend_config=PytorchEngineConfig(),
                                       engine=types.SimpleNamespace(input_processor=object()))
        fl.wrap(types.SimpleNamespace(async_engine=engine), cache, media_policy=disk.policy)
        assert not getattr(path.model.preprocess, "_featcache", False)  # not cached
        out = path.prompt(tiny.messages(url_item(str(disk.allowed / "good.png"))))
        assert len(out["multimodal"]) == 1
        with pytest.raises(MediaError, match="--allowed-local-media-path"):
            path.prompt(tiny.messages(url_item(str(disk.outside / "secret.png"))))
        with pytest.raises(MediaError, match="FIFO"):
            path.prompt(tiny.messages(url_item(str(disk.allowed / "fifo"))))
    finally:
        path.close()
        cache.close()


# -- featcache serve, end to end ---------------------------------------------------------------
class StandInEngine:
    """What the server instantiates in place of ``VLAsyncEngine``: lmdeploy's real prompt path for
    the checkpoint and lmdeploy's own ``AsyncEngine.preprocess`` (where a request's failure
    becomes its HTTP status); only generation (CUDA) is a stand-in, answering "ok"."""

    built: list[StandInEngine] = []

    @classmethod
    def close_built(cls) -> None:
        """A serve fixture's teardown: every engine it built closed (those a test left open)."""
        for engine in cls.built:
            if not engine.closed:
                engine.close()
        gc.collect()

    def __init__(self, model_path, backend_config, **kwargs):
        from lmdeploy.logger import RequestLogger
        from lmdeploy.serve.managers import SessionManager
        from lmdeploy.utils import get_hf_gen_cfg

        self.path = tiny.PromptPath(model_path)
        self.vl_encoder = self.path.encoder
        self.prompt_processor = self.path.processor
        self.prompt_processor.allowed_media_domains = kwargs.get("allowed_media_domains")
        self.tokenizer = self.prompt_processor.tokenizer
        self.chat_template = self.prompt_processor.chat_template
        self.model_name = kwargs.get("model_name") or model_path
        self.hf_gen_cfg = get_hf_gen_cfg(model_path)
        self.backend_config = backend_config
        self.session_len = backend_config.session_len = 4096
        self.stop_words, self.backend, self.epoch = None, "pytorch", 0
        self.request_logger = RequestLogger(None)
        self.session_mgr = SessionManager()
        self.arch, self.is_sleeping, self.closed = tiny.INTERNVL, False, False
        mp = bool(getattr(backend_config, "enable_mp_engine", False))
        self.engine = (types.SimpleNamespace(_collective_rpc=lambda method: []) if mp
                       else types.SimpleNamespace(input_processor=object()))
        StandInEngine.built.append(self)

    preprocess = AsyncEngine.preprocess  # lmdeploy's: a ValueError becomes a 400 with its message
    _determine_gen_config = AsyncEngine._determine_gen_config

    async def generate(self, request, stream_response=True):
        self.session_mgr.remove(request.session)
        yield GenOut(response="ok", input_token_len=request.input_token_len, generate_token_len=1,
                     finish_reason="stop", token_ids=[1])

    def close(self):
        self.path.close()
        self.closed = True


@pytest.fixture
def serve(monkeypatch, model, tmp_path):
    """``serve(flags, drive)``: run `featcache serve MODEL ... flags` until uvicorn would listen,
    then ``drive(post)`` with ``post(url)`` posting a chat completion with that image (the app
    driven in process); returns the exit code."""
    from fastapi.testclient import TestClient
    from lmdeploy.serve.openai import api_server

    import featcache.cli.serving as serving
    from featcache.cli import main as cli

    core = importlib.import_module("lmdeploy.serve.core")  # `lmdeploy.serve` is also a function
    StandInEngine.built.clear()
    monkeypatch.setattr(core, "VLAsyncEngine", StandInEngine)
    monkeypatch.setattr(serving, "cuda_problem", lambda: None)  # the engine is a stand-in

    def run(flags, drive):
        def uvicorn_run(app, host, port, **kwargs):
            client = TestClient(app)

            def post(url):
                return client.post("/v1/chat/completions", json={
                    "model": model, "max_completion_tokens": 4, "messages": [{"role": "user", "content": [
                        {"type": "text", "text": "describe"}, url_item(url)]}]})

            drive(post)

        monkeypatch.setattr(api_server.uvicorn, "run", uvicorn_run)
        return cli(["serve", model, "--cache-dir", str(tmp_path / "store"), "--disk-bytes", "64MiB",
                    "--host-bytes", "32MiB", "--backend", "pytorch", "--max-batch-size", "4",
                    "--server-port", "23999", *flags])

    yield run
    StandInEngine.close_built()


@pytest.mark.parametrize("engine_process", ["in", "mp"])
def test_serve_answers_hostile_sources_with_400_at_once_and_keeps_answering(serve, disk,
                                                                            engine_process):
    """The issue's cases against `featcache serve --allowed-local-media-path DIR`: /dev/zero, a
    FIFO, a 1 GiB file, files outside DIR (a path, file://, a link in DIR), a data URL over
    --max-image-bytes; each a 400 within 1 s naming the option, and the server answers the next
    request. (Plain lmdeploy: /dev/zero exhausts its memory, the FIFO blocks forever, the files
    outside are read into the answer: docs/reliability.md, "Hostile clients".)"""
    answers = {}
    hostile = {
        "/dev/zero": "/dev/zero",
        "fifo": str(disk.allowed / "fifo"),
        "1 GiB file": str(disk.allowed / "huge.png"),
        "outside": str(disk.outside / "secret.png"),
        "outside, file://": "file://" + str(disk.outside / "secret.png"),
        "link out": str(disk.allowed / "to_secret.png"),
        "data URL over the cap": data_url(b"\0" * (2 << 20)),
        "not an image": data_url(b"hello, not an image"),  # plain lmdeploy: a 500 (an OSError)
        "not base64": "data:image/png;base64,abcde",
    }

    def drive(post):
        answers["first"] = post(data_url(png(4)))
        for name, url in hostile.items():
            start = time.monotonic()
            answers[name] = (post(url), time.monotonic() - start)
        answers["file in DIR"] = post(str(disk.allowed / "good.png"))
        answers["last"] = post(data_url(png(5)))

    assert serve(["--engine-process", engine_process, "--allowed-local-media-path",
                  str(disk.allowed), "--max-image-bytes", "1MiB"], drive) == 0
    for name in ("first", "file in DIR", "last"):
        assert answers[name].status_code == 200, (name, answers[name].text)
        assert answers[name].json()["choices"][0]["message"]["content"] == "ok"
    words = {"/dev/zero": "--allowed-local-media-path", "fifo": "not a regular file",
             "1 GiB file": "--max-image-bytes", "data URL over the cap": "--max-image-bytes",
             "not an image": "cannot be decoded", "not base64": "not valid base64"}
    for name in hostile:
        response, took = answers[name]
        assert response.status_code == 400, (name, response.text)
        assert words.get(name, "--allowed-local-media-path") in response.json()["message"], name
        assert took < 1.0, (name, took)
    [engine] = StandInEngine.built
    frontend = engine.prompt_processor.async_parse_multimodal_item.frontend
    assert frontend.media == MediaPolicy(str(disk.allowed), 1 << 20)


def test_serve_reads_no_local_file_unless_told(serve, disk):
    answers = []
    assert serve(["--engine-process", "in"],
                 lambda post: answers.append(post(str(disk.allowed / "good.png")))) == 0
    assert answers[0].status_code == 400
    message = answers[0].json()["message"]
    assert "reads no local files" in message and "--allowed-local-media-path DIR" in message


def test_serve_refuses_bad_media_options(serve, capsys):
    assert serve(["--allowed-local-media-path", "/no/such/dir"], lambda post: None) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert serve(["--max-image-bytes", "0"], lambda post: None) == 2
    assert "at least 1 byte" in capsys.readouterr().err
    assert StandInEngine.built == []


def test_a_long_data_url_is_told_frames_or_container_by_its_head_as_by_the_whole():
    """``read.is_frames`` parses a long data URL's first ``HEAD_CHARS`` where they decide it: its
    verdict equals the whole URL's parse (lmdeploy's) for URLs crafted around the head's end,
    with tabs and newlines (which the parse drops), ``#`` and ``?`` (which end the path), ``//``
    (a network location) and the media type in any case."""
    import random

    from featcache.lmdeploy.request.video.read import HEAD_CHARS, _frames_parts, is_frames

    def whole(url: str) -> bool:
        return url[:5].lower() == "data:" and _frames_parts(url)[0].lower() == "video/jpeg"

    rng = random.Random(0)
    pieces = ["a", "/", ",", ";", "#", "?", "\t", "\n", "\r", " ", "video/jpeg", "VIDEO/JPEG", "base64",
              "//", ":", "x" * 50]
    frames = 0
    for _ in range(5000):
        prefix = rng.choice(["data:", "DATA:", "data://", "data:video/jpeg;base64,",
                             "data:Video/Jpeg;base64,", "data:video/mp4;base64,", " data:"])
        filler = "A" * rng.choice([0, HEAD_CHARS - 20, HEAD_CHARS, HEAD_CHARS + 10, 3 * HEAD_CHARS])
        rest = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))), filler,
                "".join(rng.choice(pieces) for _ in range(5))]
        rng.shuffle(rest)
        url = prefix + "".join(rest)
        assert is_frames(url) == whole(url), repr(url[:80])
        frames += whole(url)
    assert 200 < frames < 4800  # both verdicts were reached
