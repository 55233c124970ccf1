"""Images sent as data URLs or files: keyed by their encoded bytes, hits never decoded.

Runs lmdeploy's real prompt path (MultimodalProcessor + ImageEncoder) on the tiny checkpoints, with
featcache's frontend installed together with its source resolver, as ``featcache.lmdeploy.wrap``
installs them. Needs lmdeploy 0.18 (requirements/lmdeploy-cpu.txt); skipped without.
"""

from __future__ import annotations

import base64
import copy
import gc
import io

import _lmdeploy_stack
import pytest
import torch

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402
from lmdeploy.vl.media.image import ImageMediaIO  # noqa: E402

from featcache import FeatureCache, image_key  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION, install_frontend  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402
from featcache.lmdeploy.request.sources import encoded_bytes, source_of  # noqa: E402

HIDDEN = 256


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def url_item(url: str, **params) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **params}}


class Rig:
    def __init__(self, arch: str, path: str) -> None:
        self.cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        self.namespace = f"test:{arch}"
        self.plain = tiny.PromptPath(path)
        self.cached = tiny.PromptPath(path)
        install_frontend(self.cached.model, self.cache, self.namespace, self.cached.processor)
        self.cached.record_featcache()  # calls: featcache's preprocessing too (Qwen2-VL's)
        self.frontend = self.cached.model.preprocess.frontend

    def bytes_key(self, raw: bytes, params: dict | None = None, io: dict | None = None) -> bytes:
        """The key the frontend gives an encoded image (its cache's secret, params, options)."""
        return self.frontend._bytes_key(raw, params or {}, io or {})

    def id_key(self, image_id: str) -> bytes:
        return self.frontend._id_key(image_id, {}, {})

    def close(self) -> None:
        self.plain.close()
        self.cached.close()
        gc.collect()
        self.cache.close()

    def store(self, out: dict) -> None:
        """What the model does with the features of the misses."""
        for item in out["multimodal"]:
            ref = item[REF_KEY]
            if not ref.hit:
                self.cache.put(ref.key, torch.randn(tiny.tokens(item), HIDDEN), meta=ref.meta)

    def counters(self) -> dict[str, int]:
        stats = self.cache.stats().get(SECTION, {})
        return {k: v for k, v in stats.items() if v}


@pytest.fixture(params=[tiny.INTERNVL, tiny.QWEN2VL, tiny.QWEN3VL], ids=["internvl_hf", "qwen2vl", "qwen3vl"])
def rig(request, tmp_path_factory):
    r = Rig(request.param, tiny.checkpoint(request.param, tmp_path_factory))
    yield r
    r.close()


@pytest.fixture
def decodes(monkeypatch):
    """Counts image decodes (lmdeploy's and featcache's both go through ImageMediaIO.load_bytes
    or load_file)."""
    calls = []
    load_bytes, load_file = ImageMediaIO.load_bytes, ImageMediaIO.load_file
    monkeypatch.setattr(ImageMediaIO, "load_bytes",
                        lambda self, data: calls.append("bytes") or load_bytes(self, data))
    monkeypatch.setattr(ImageMediaIO, "load_file",
                        lambda self, path: calls.append("file") or load_file(self, path))
    return calls


def assert_same_prompt(got: dict, want: dict) -> None:
    assert got.get("prompt") == want.get("prompt") and got["input_ids"] == want["input_ids"]
    assert [m["offset"] for m in got["multimodal"]] == [m["offset"] for m in want["multimodal"]]
    for g, w in zip(got["multimodal"], want["multimodal"], strict=True):
        assert tiny.tokens(g) == tiny.tokens(w)


@pytest.mark.parametrize("sent_as", ["data_url", "file"])
def test_a_repeated_encoded_image_is_neither_decoded_nor_preprocessed(rig, decodes, tmp_path,
                                                                        sent_as):
    raw = png(tiny.noise_image(100, 80, seed=3))
    if sent_as == "file":
        (tmp_path / "img.png").write_bytes(raw)
        source = str(tmp_path / "img.png")
    else:
        source = data_url(raw)
    msgs = tiny.messages(url_item(source))
    untouched = copy.deepcopy(msgs)

    first = rig.cached.prompt(msgs)
    assert decodes == ["bytes"] and len(rig.cached.calls) == 1  # decoded once (by featcache)
    assert rig.cache.stats()["cache"]["misses"] == 1  # looked up once, by its bytes' key
    ref = first["multimodal"][0][REF_KEY]
    assert ref.key == rig.bytes_key(raw)  # keyed by its bytes
    assert_same_prompt(first, rig.plain.prompt(msgs))
    rig.store(first)
    decodes.clear()

    second = rig.cached.prompt(msgs)
    assert decodes == []  # no decode, no pixel hashing
    assert len(rig.cached.calls) == 1  # no preprocessing
    hit = second["multimodal"][0]
    assert hit[REF_KEY].hit and hit[REF_KEY].key == ref.key and hit["pixel_values"].shape[0] == 0
    assert_same_prompt(second, rig.plain.prompt(msgs))
    assert msgs == untouched  # the caller's messages are left as they were
    counters = rig.counters()
    assert counters["source_keyed"] == 2 and counters["decode_skipped"] == 1
    assert counters["hits"] == 1 and counters["misses"] == 1


def test_per_image_params_are_part_of_the_bytes_key(rig):
    raw = png(tiny.noise_image(64, 64, seed=4))
    first = rig.cached.prompt(tiny.messages(url_item(data_url(raw))))
    rig.store(first)
    other = rig.cached.prompt(tiny.messages(url_item(data_url(raw), max_pixels=28 * 28 * 32)))
    assert not other["multimodal"][0][REF_KEY].hit


def test_a_failure_after_resolving_still_serves_the_request(rig, monkeypatch):
    raw = png(tiny.noise_image(90, 70, seed=5))
    msgs = tiny.messages(url_item(data_url(raw)))
    rig.store(rig.cached.prompt(msgs))

    def broken(self, messages, *args):
        raise RuntimeError("frontend on fire")

    monkeypatch.setattr(type(rig.cached.model.preprocess.frontend), "_preprocess", broken)
    out = rig.cached.prompt(msgs)  # the hit was resolved from its bytes; the fallback decodes it
    assert_same_prompt(out, rig.plain.prompt(msgs))
    assert rig.counters()["frontend_errors"] == 1
    del out
    gc.collect()
    assert not rig.cache._chain.top._books.pinned(rig.bytes_key(raw))


@pytest.fixture
def http_images(tmp_path, monkeypatch):
    """A directory served over http on 127.0.0.1 (its GETs counted), which lmdeploy's fetcher may
    reach in this test (it refuses loopback addresses otherwise; localhost stays refused)."""
    import functools
    import http.server
    import threading

    from lmdeploy.vl.media import connection

    gets: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            gets.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Handler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    safe = connection._is_safe_url
    monkeypatch.setattr(connection, "_is_safe_url",
                        lambda url: (True, "test") if "//127.0.0.1:" in url else safe(url))
    yield server.server_address[1], tmp_path, gets
    server.shutdown()
    server.server_close()


def test_an_http_image_is_fetched_once_keyed_by_its_bytes_and_a_hit_never_decoded(rig, decodes,
                                                                                   http_images):
    port, root, gets = http_images
    raw = png(tiny.noise_image(96, 72, seed=21))
    (root / "a.png").write_bytes(raw)
    msgs = tiny.messages(url_item(f"http://127.0.0.1:{port}/a.png"))

    first = rig.cached.prompt(msgs)
    assert gets == ["/a.png"] and decodes == ["bytes"]  # fetched once, decoded once (by featcache)
    ref = first["multimodal"][0][REF_KEY]
    assert ref.key == rig.bytes_key(raw)
    rig.store(first)
    decodes.clear()

    second = rig.cached.prompt(msgs)
    assert gets == ["/a.png"] * 2 and decodes == []  # the bytes keyed again; no decode
    assert second["multimodal"][0][REF_KEY].hit and len(rig.cached.calls) == 1
    assert_same_prompt(second, rig.plain.prompt(msgs))
    assert rig.counters()["decode_skipped"] == 1


def test_an_http_url_featcache_may_not_fetch_is_left_to_lmdeploy(rig, http_images):
    port, root, gets = http_images
    (root / "b.png").write_bytes(png(tiny.noise_image(64, 64, seed=22)))
    with pytest.raises(ValueError, match="blocked"):  # lmdeploy's own refusal reaches the client
        rig.cached.prompt(tiny.messages(url_item(f"http://localhost:{port}/b.png")))
    assert gets == [] and rig.counters()["fetch_failed"] == 1


def test_sources_featcache_leaves_to_lmdeploy():
    assert encoded_bytes("http://example.com/a.png") is None
    assert encoded_bytes("https://example.com/a.png") is None
    assert encoded_bytes("data:image/png;charset=utf-8,abc") is None  # not base64: lmdeploy's call
    assert encoded_bytes("data:image/png;base64,") is None
    assert encoded_bytes("/no/such/file.png") is None
    assert encoded_bytes("data:image/png;base64," + base64.b64encode(b"xyz").decode()) == b"xyz"
    assert source_of({"type": "image_url", "image_url": {"url": "u", "detail": "low"}}) == (
        "u", {"detail": "low"})
    assert source_of({"type": "image", "image": "u", "max_dynamic_patch": 2}) == (
        "u", {"max_dynamic_patch": 2})
    assert source_of({"type": "image_data", "image_data": {"data": "x"}}) is None
    assert source_of({"type": "text", "text": "hi"}) is None


def test_a_data_url_is_read_in_one_strict_pass(monkeypatch):
    """Issue 16: on a ~5 MB data URL, urlparse (~2 ms) and pybase64's lenient decoder (~2.7 ms
    against ~0.5 ms strict) were most of featcache's share of a hit; neither runs now for a
    well-formed data URL, and what a lenient client sends still gives lmdeploy's bytes."""
    import pybase64

    from featcache.lmdeploy.request import sources

    calls: list[str] = []
    parse, decode = sources.urlparse, pybase64.b64decode
    monkeypatch.setattr(sources, "urlparse", lambda u: calls.append("urlparse") or parse(u))
    monkeypatch.setattr(pybase64, "b64decode", lambda d, validate=False: calls.append(
        "strict" if validate else "lenient") or decode(d, validate=validate))
    raw = bytes(range(256)) * 64
    text = base64.b64encode(raw).decode()
    assert encoded_bytes("data:image/png;base64," + text) == raw
    assert calls == ["strict"]
    calls.clear()
    wrapped = "\n".join(text[i:i + 76] for i in range(0, len(text), 76))  # MIME line breaks
    assert decode(wrapped) == raw  # lmdeploy's decoding (ImageMediaIO.load_base64)
    assert encoded_bytes("DATA:image/png;base64," + wrapped) == raw
    # (line breaks: split as lmdeploy splits it, urlsplit dropping them; then strict again)
    assert calls == ["strict", "strict"]
    assert encoded_bytes(" data:image/png;base64," + text) == raw  # urlparse's stripping kept


def test_a_data_url_sent_again_is_not_decoded_again(rig, monkeypatch):
    """Issue 16: a chat client resends the same data URL every turn; the second time it is keyed
    by its text (DataUrlKeys), not base64-decoded again, and served as the same hit."""
    import pybase64

    raw = png(tiny.noise_image(80, 60, seed=23))
    first = rig.cached.prompt(tiny.messages(url_item(data_url(raw))))
    rig.store(first)
    key = first["multimodal"][0][REF_KEY].key
    decoded: list[int] = []
    decode = pybase64.b64decode
    monkeypatch.setattr(pybase64, "b64decode", lambda d, validate=False: decoded.append(1)
                        or decode(d, validate=validate))
    again = rig.cached.prompt(tiny.messages(url_item(data_url(raw))))  # an equal, new string
    assert decoded == [] and again["multimodal"][0][REF_KEY].hit
    assert again["multimodal"][0][REF_KEY].key == key
    assert rig.counters()["data_url_remembered"] == 1
    other = rig.cached.prompt(tiny.messages(url_item(data_url(raw), max_pixels=28 * 28 * 32)))
    assert decoded == [1] and not other["multimodal"][0][REF_KEY].hit  # other params: keyed anew


def test_a_remembered_data_url_whose_features_are_gone_costs_what_any_miss_costs(
        rig, decodes, monkeypatch):
    raw = png(tiny.noise_image(72, 56, seed=24))
    first = rig.cached.prompt(tiny.messages(url_item(data_url(raw))))
    rig.store(first)
    key = first["multimodal"][0][REF_KEY].key
    rig.cache.discard(key)  # evicted since: the URL is still remembered
    decodes.clear()
    lookups: list[bytes] = []
    acquire = rig.cache.acquire
    monkeypatch.setattr(rig.cache, "acquire", lambda k: lookups.append(k) or acquire(k))
    fresh = png(tiny.noise_image(72, 56, seed=25))
    rig.cached.prompt(tiny.messages(url_item(data_url(fresh))))  # a miss never seen: the baseline
    baseline, decodes[:], lookups[:] = len(lookups), [], []
    again = rig.cached.prompt(tiny.messages(url_item(data_url(raw))))
    ref = again["multimodal"][0][REF_KEY]
    assert not ref.hit and ref.key == key  # a miss under the same key: its features stored again
    # looked up and decoded as often as any other miss: remembering the URL adds no lookup
    assert lookups == [key] * baseline and decodes == ["bytes"]
    assert rig.counters()["data_url_remembered"] == 1


def test_remembered_data_urls_are_bounded():
    from featcache.keys import image_key as key_of
    from featcache.lmdeploy.request.resolve import DataUrlKeys

    urls = DataUrlKeys(capacity=2)
    idents = [urls.ident(f"data:image/png;base64,{i}", {}, {}) for i in range(3)]
    for i, ident in enumerate(idents):
        urls.put(ident, key_of(bytes([i]), namespace="t"))
    assert len(urls) == 2 and urls.get(idents[0]) is None
    assert urls.get(idents[2]) == key_of(bytes([2]), namespace="t")
    assert urls.ident("data:x", {"a": 1}, {}) != urls.ident("data:x", {}, {})
    assert urls.ident("data:x", {}, {"image_mode": "L"}) != urls.ident("data:x", {}, {})
    assert urls.ident("data:x", {}, {}) != DataUrlKeys().ident("data:x", {}, {})  # keyed per map
    assert urls.ident("data:x", {"f": object()}, {}) is None  # not JSON: not remembered
    with pytest.raises(ValueError):
        DataUrlKeys(capacity=0)


# -- client image ids (featcache serve --trust-client-image-ids) -------------------------------------
def id_item(image_id: str, url: str | None = None, **params) -> dict:
    item: dict = {"type": "image_url", "uuid": image_id}
    if url is not None or params:
        item["image_url"] = {**({"url": url} if url is not None else {}), **params}
    return item


@pytest.fixture
def trusted(rig):
    from featcache.lmdeploy.request.sources import trust_image_ids

    trust_image_ids(rig.cached.processor, True)
    return rig


def test_a_trusted_id_is_sent_once_with_its_image_then_alone(trusted, decodes):

    rig = trusted
    raw = png(tiny.noise_image(100, 80, seed=11))
    with_image = tiny.messages(id_item("sku-1234", data_url(raw)))
    first = rig.cached.prompt(with_image)
    ref = first["multimodal"][0][REF_KEY]
    assert not ref.hit and ref.key == rig.id_key("sku-1234")
    assert ref.key != rig.bytes_key(raw)  # keyed by the id
    plain = rig.plain.prompt(tiny.messages(url_item(data_url(raw))))
    assert_same_prompt(first, plain)
    rig.store(first)
    decodes.clear()

    alone = rig.cached.prompt(tiny.messages(id_item("sku-1234")))  # no image bytes at all
    hit = alone["multimodal"][0]
    assert hit[REF_KEY].hit and hit[REF_KEY].key == ref.key
    assert decodes == [] and len(rig.cached.calls) == 1  # neither decoded nor preprocessed
    assert_same_prompt(alone, plain)
    assert rig.counters()["image_id_keyed"] == 2


def test_an_id_the_cache_does_not_hold_asks_for_the_image_again(trusted):
    from featcache.lmdeploy.request.sources import ImageIdError

    with pytest.raises(ImageIdError, match="not in the cache .* send the image again with this uuid"):
        trusted.cached.prompt(tiny.messages(id_item("never-sent")))
    assert trusted.counters()["image_id_refused"] == 1


def test_ids_are_refused_where_they_cannot_be_honoured(trusted):
    from featcache.lmdeploy.request.sources import ImageIdError

    rig = trusted
    with pytest.raises(ImageIdError, match="could not be read"):  # lmdeploy's fetcher refuses it
        rig.cached.prompt(tiny.messages(id_item("x", "http://example.invalid/a.png")))
    with pytest.raises(ImageIdError, match="bad image uuid"):
        rig.cached.prompt(tiny.messages(id_item("y" * 300)))
    with pytest.raises(ImageIdError, match="bad image uuid"):
        rig.cached.prompt(tiny.messages({"type": "image_url", "uuid": 7}))


def test_without_trust_an_id_alone_is_refused_and_an_id_beside_the_image_is_ignored(rig):
    from featcache.lmdeploy.request.sources import ImageIdError

    raw = png(tiny.noise_image(64, 48, seed=12))
    out = rig.cached.prompt(tiny.messages(id_item("sku-1", data_url(raw))))
    assert out["multimodal"][0][REF_KEY].key == rig.bytes_key(raw)
    rig.store(out)
    with pytest.raises(ImageIdError, match="does not take image ids .*--trust-client-image-ids"):
        rig.cached.prompt(tiny.messages(id_item("sku-1")))


def test_ids_of_different_models_and_contents_never_meet():
    from featcache.keys import client_image_key

    a = client_image_key("sku-1", namespace="model-A")
    assert a != client_image_key("sku-1", namespace="model-B")
    assert a != client_image_key("sku-1", namespace="model-A", params={"max_dynamic_patch": 6})
    assert a != image_key(b"sku-1", namespace="model-A")  # an id is never an image's bytes
    assert a.namespace == "model-A"


def test_an_id_only_hit_that_cannot_be_served_fails_with_a_message_not_a_crash(trusted, monkeypatch):
    """The frontend failing after an id-only hit cannot fall back to decoding (no bytes were
    sent): the request gets the message, and the entry is unpinned at once."""
    from featcache.lmdeploy.request.sources import ImageIdError

    rig = trusted
    raw = png(tiny.noise_image(90, 70, seed=13))
    rig.store(rig.cached.prompt(tiny.messages(id_item("sku-9", data_url(raw)))))

    def broken(self, messages, *args):
        raise RuntimeError("frontend on fire")

    monkeypatch.setattr(type(rig.cached.model.preprocess.frontend), "_preprocess", broken)
    with pytest.raises(ImageIdError, match="could not be served and the image was not sent"):
        rig.cached.prompt(tiny.messages(id_item("sku-9")))
    assert not rig.cache._chain.top._books.pinned(rig.id_key("sku-9"))
