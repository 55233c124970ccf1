"""Hostile clients, second round (issue 39 items 1 and 2): what a request's decode options and a
data URL's text can still cost the server, or change in an answer.

- item 1: a request's image decode options (``media_io_kwargs.image``) are refused over
  ``MAX_IMAGE_OPTIONS_BYTES`` with a 400 naming the limit; under it they are encoded once per
  request, not once per image, and the memo of data URLs seen before holds digests only, within
  its byte budget, however large the options;
- item 2: a data URL is read as lmdeploy 0.18 reads it (``urllib.parse.urlparse``: its path ends
  at the first ``?`` or ``#``, a ``//host`` is no part of it, tabs and line breaks are dropped):
  the bytes, hence the key and the pixels, are lmdeploy's, or both refuse it.

Through `featcache serve` (lmdeploy's real CLI, api_server and FastAPI app, generation a stand-in:
``test_media_sources``) beside plain lmdeploy's own `serve api_server` handler on the same stand-in,
and through lmdeploy's real prompt path (``test_lmdeploy_hostile``'s rig), in both engine
processes (``in``; ``mp``: the frontend's tag mode).
"""

from __future__ import annotations

import base64
import gc
import importlib
import io
import json
import time
import tracemalloc

import _lmdeploy_stack
import pytest
import torch

_lmdeploy_stack.require("fastapi")  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402
from PIL import Image  # noqa: E402
from test_lmdeploy_hostile import Rig, url_item  # noqa: E402
from test_media_sources import StandInEngine  # noqa: E402
from test_media_sources import model as model  # noqa: E402,F401  (the servers fixture's)

from featcache.lmdeploy.request.media import LOCAL_FILES, MAX_IMAGE_OPTIONS_BYTES  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402
from featcache.lmdeploy.request.resolve import DataUrlKeys  # noqa: E402
from featcache.lmdeploy.request.sources import read_source  # noqa: E402


def png_of(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def solid_without_slash() -> bytes:
    """A small PNG whose base64 holds no ``/`` (so it can stand in a data URL's ``//host``) and
    no padding (so base64 read on past it decodes)."""
    for green in range(256):
        raw = png_of(Image.new("RGB", (32, 32), (0, green, 200)))
        if "/" not in b64(raw) and len(raw) % 3 == 0:
            return raw
    raise AssertionError("no such PNG")


def padded() -> bytes:
    """A PNG whose base64 ends in padding (its length is no multiple of 3)."""
    for seed in range(64):
        raw = png_of(tiny.noise_image(32, 24, seed=seed))
        if len(raw) % 3:
            return raw
    raise AssertionError("no such PNG")


A = png_of(tiny.noise_image(32, 24, seed=39))  # what plain lmdeploy reads in the URLs below
B = solid_without_slash()  # what featcache read instead, before this


def hostile_urls() -> dict[str, str]:
    """Data URLs whose text lmdeploy reads up to a ``?`` or ``#``, or past a ``//host``."""
    pad = padded()
    return {
        # lmdeploy: the image before the '#' (200); featcache read past it and found padding
        # inside the base64 (a 400)
        "padded, then a fragment": f"data:image/png;base64,{b64(pad)}#{b64(B)}",
        # lmdeploy: nothing after the comma, an invalid data URL (400); featcache read B (200)
        "a fragment before the data": f"data:image/png;base64,#{b64(B)}",
        "a query in the media type": f"data:image/png?x=1;base64,{b64(B)}",
        # both 200: lmdeploy reads A; featcache read its ';base64,' after the '//host', and B
        "a host holding another image": f"data://x;base64,{b64(B)}/image/png;base64,{b64(A)}",
        "a fragment after": f"data:image/png;base64,{b64(A)}#top",
        "a query after": f"data:image/png;base64,{b64(A)}?v=2",
        "line breaks in the data": f"data:image/png;base64,{b64(A)[:40]}\n{b64(A)[40:]}\r\n",
        "a tab in the media type": f"data:image/png;base\t64,{b64(A)}",
    }


def lmdeploy_reads(url: str) -> bytes | Exception:
    """The bytes lmdeploy 0.18's own reader (``load_from_url``) decodes for ``url``, or what it
    raises."""
    from lmdeploy.vl.media.connection import load_from_url
    from lmdeploy.vl.media.image import ImageMediaIO

    class Capture(ImageMediaIO):
        def load_bytes(self, data: bytes) -> bytes:  # type: ignore[override]
            return data

    try:
        return load_from_url(url, Capture())
    except Exception as e:  # noqa: BLE001  (what it raises is the answer)
        return e


# -- item 2: a data URL is read as lmdeploy reads it ---------------------------------------------
def corpus() -> list[str]:
    """Data URLs over the characters urlparse treats apart (``?``, ``#``, tab, CR, LF, space,
    ``//``), at the places that matter: the scheme, the media type, after the comma, inside the
    base64 (before and after its padding), at the end."""
    data = b64(padded())
    heads = ["data:", "DATA:", " data:", "\x01data:", "data://", "data://h/", "data://h,x/",
             "data:/", "data://[h/", "data://h]/"]
    urls = []
    for head in heads:
        for media in ["image/png;base64", "image/png;charset=x;base64", "image/png", ";base64",
                      "image/png;base64?q", "image/png#f;base64"]:
            urls.append(f"{head}{media},{data}")
    for c in ["?", "#", "\t", "\r", "\n", " ", "//", "?#", "#?"]:
        for at in [0, 1, 5, 12, len(data) - 3, len(data) - 1, len(data)]:
            urls.append(f"data:image/png;base64,{data[:at]}{c}{data[at:]}")
            urls.append(f"data:image/png;base{c}64,{data[:at]}{c}{data[at:]}")
        urls.append(f"data:image/png;base64,{c}")
    return urls


def test_data_urls_are_read_exactly_as_lmdeploy_reads_them():
    """Over the corpus: where lmdeploy decodes bytes, featcache reads the same bytes (so their
    key and pixels are lmdeploy's); where lmdeploy refuses the URL, featcache refuses it too with
    a ``ValueError`` (a 400 with its message)."""
    wrong = []
    for url in corpus():
        want = lmdeploy_reads(url)
        try:
            got: bytes | Exception = read_source(url, LOCAL_FILES)
        except ValueError as e:
            got = e
        if isinstance(want, bytes) != isinstance(got, bytes) or (isinstance(want, bytes)
                                                                 and want != got):
            wrong.append((url[:48], type(want).__name__, type(got).__name__))
    assert wrong == []


@pytest.fixture(params=[tiny.INTERNVL, tiny.QWEN2VL, tiny.QWEN3VL], ids=["internvl_hf", "qwen2vl", "qwen3vl"])
def path(request, tmp_path_factory):
    return tiny.checkpoint(request.param, tmp_path_factory)


def store(rig: Rig, out: dict) -> None:
    """What the model does with the features of the misses (in the multi-process mode the model
    processes store them: nothing here)."""
    if not rig.frontend.tags:
        rig.store(out)


@pytest.fixture(params=["in", "mp"])
def rig(request, path):
    r = Rig(path, tags=request.param == "mp")
    yield r
    r.close()


def test_a_data_url_with_a_query_fragment_or_host_gets_the_image_plain_lmdeploy_decodes(rig):
    """Through lmdeploy's real prompt path, sent twice (the second time: the memo of data URLs
    seen before, and in the multi-process mode an image sent without its pixels): the same
    pixels as plain lmdeploy's, keyed by the bytes lmdeploy decodes, or refused where plain
    lmdeploy refuses."""
    for name, url in hostile_urls().items():
        msgs = tiny.messages(url_item(url))
        try:
            plain = rig.plain.prompt(msgs)
        except ValueError:
            for _ in range(2):
                with pytest.raises(ValueError):
                    rig.cached.prompt(msgs)
            continue
        want = lmdeploy_reads(url)
        assert isinstance(want, bytes)
        for turn in range(2):
            try:
                out = rig.cached.prompt(msgs)
            except ValueError as e:
                raise AssertionError(f"{name}: refused, plain lmdeploy answers it: {e}") from None
            ref = out["multimodal"][0][REF_KEY]
            assert ref.key == rig.frontend._bytes_key(want, {}, {}), (name, turn)
            if getattr(ref, "source", None) is not None:  # sent without pixels (mp): the bytes
                assert ref.source.raw == want, (name, turn)  # the model process rebuilds from
            elif not getattr(ref, "hit", False):  # (a hit: the features of those same bytes)
                assert torch.equal(out["multimodal"][0]["pixel_values"],
                                   plain["multimodal"][0]["pixel_values"]), (name, turn)
            store(rig, out)
        # (mp: sent without pixels; the processor-level API sends every image with its pixels)
        assert turn == 1 and (ref.hit if not rig.frontend.tags else
                              ref.source is not None or rig.cached.encoder._uses_new_preprocess)


# -- `featcache serve` beside plain lmdeploy ----------------------------------------------------
@pytest.fixture
def servers(monkeypatch, model, tmp_path):
    """``servers(flags, drive, plain=False)``: `featcache serve MODEL ... flags` (or, with
    ``plain``, lmdeploy's own `serve api_server` handler) until uvicorn would listen, then
    ``drive(post)`` with ``post(url, options=None, images=1)`` posting a chat completion with
    ``images`` copies of that image and ``media_io_kwargs`` ``options``."""
    from fastapi.testclient import TestClient
    from lmdeploy.cli.serve import SubCliServe
    from lmdeploy.serve.openai import api_server

    import featcache.cli.serving as serving
    from featcache.cli import main as cli
    from featcache.server.serve import lmdeploy_parser

    core = importlib.import_module("lmdeploy.serve.core")
    StandInEngine.built.clear()
    monkeypatch.setattr(core, "VLAsyncEngine", StandInEngine)
    monkeypatch.setattr(serving, "cuda_problem", lambda: None)  # the engine is a stand-in

    def run(flags, drive, plain=False):
        def uvicorn_run(app, host, port, **kwargs):
            client = TestClient(app)

            def post(url, options=None, images=1):
                body = {"model": model, "max_completion_tokens": 4, "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "describe"},
                                                 *[url_item(url)] * images]}]}
                if options is not None:
                    body["media_io_kwargs"] = options
                return client.post("/v1/chat/completions", json=body)

            drive(post)

        monkeypatch.setattr(api_server.uvicorn, "run", uvicorn_run)
        if plain:
            SubCliServe.api_server(lmdeploy_parser().parse_args(
                [model, "--backend", "pytorch", "--max-batch-size", "4", "--server-port",
                 "23999", *flags]))
            return 0
        return cli(["serve", model, "--cache-dir", str(tmp_path / "store"), "--disk-bytes",
                    "64MiB", "--host-bytes", "32MiB", "--backend", "pytorch", "--max-batch-size",
                    "4", "--server-port", "23999", *flags])

    yield run
    StandInEngine.close_built()


@pytest.mark.parametrize("engine_process", ["in", "mp"])
def test_serve_answers_a_data_url_with_a_query_or_fragment_as_plain_lmdeploy_does(
        servers, engine_process):
    """Each URL twice: featcache answers what plain lmdeploy answers (200 or 400)."""
    urls = hostile_urls()

    def statuses(answers):
        def drive(post):
            for name, url in urls.items():
                answers[name] = [post(url).status_code for _ in range(2)]
        return drive

    plain: dict[str, list[int]] = {}
    servers([], statuses(plain), plain=True)
    assert plain["a fragment before the data"] == [400, 400]  # the premise
    assert plain["padded, then a fragment"] == [200, 200]
    featcache: dict[str, list[int]] = {}
    assert servers(["--engine-process", engine_process], statuses(featcache)) == 0
    assert featcache == plain


@pytest.mark.parametrize("engine_process", ["in", "mp"])
def test_serve_refuses_image_options_over_the_limit_with_a_400_naming_it(servers, engine_process):
    """Options over ``MAX_IMAGE_OPTIONS_BYTES`` (as JSON): a 400 naming the limit, at once, with
    20 images and 50,000 keys too; options under it are answered, and so is the next request.
    (Plain lmdeploy answers all of these; featcache took 24-36 s for 200 images and 50,000 keys.)"""
    url = f"data:image/png;base64,{b64(A)}"
    under = {"image": {"note": "x" * (MAX_IMAGE_OPTIONS_BYTES - 64)}}
    over = {"image": {"note": "x" * (MAX_IMAGE_OPTIONS_BYTES + 1)}}
    keys = {"image": {f"k{i}": i for i in range(50_000)}}
    answers = {}

    def drive(post):
        answers["under"] = post(url, under, images=4)
        answers["over"] = post(url, over)
        start = time.monotonic()
        answers["keys"] = post(url, keys, images=20)
        answers["keys took"] = time.monotonic() - start
        answers["next"] = post(url)

    assert servers(["--engine-process", engine_process], drive) == 0
    for name in ("under", "next"):
        assert answers[name].status_code == 200, (name, answers[name].text)
    for name in ("over", "keys"):
        assert answers[name].status_code == 400, (name, answers[name].text[:200])
        message = answers[name].json()["message"]
        assert "media_io_kwargs.image" in message and f"{MAX_IMAGE_OPTIONS_BYTES} bytes" in message
    assert answers["keys took"] < 5.0  # generous: one JSON encoding of the options, then refused


# -- item 1: option size, in memory and time -----------------------------------------------------
def big_options(size: int = MAX_IMAGE_OPTIONS_BYTES - 512) -> dict:
    """Unknown decode options (lmdeploy's ``ImageMediaIO`` keeps and ignores them) just under the
    limit, with a marker to find them by."""
    return {"image": {"featcache_test_marker": 1, "note": "x" * size}}


def test_the_data_url_memo_holds_no_option_text_and_keeps_to_its_byte_budget(rig):
    """120 data URLs each sent with ~15 KiB of options: the memo of data URLs seen before keeps
    to its byte budget, and what the frontend keeps after the requests is not their options
    (before: each entry held the options' JSON text, 240 MiB for 240 URLs with 1 MiB each)."""
    options = big_options()
    urls = [f"data:image/png;base64,{b64(png_of(tiny.noise_image(16, 12, seed=s)))}"
            for s in range(121)]
    rig.cached.prompt(tiny.messages(url_item(urls[0])), media_io_kwargs=options)  # warm
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for url in urls[1:]:
            rig.cached.prompt(tiny.messages(url_item(url)), media_io_kwargs=options)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    memo = rig.frontend.data_urls
    assert len(memo) == 121  # all remembered
    assert kept < 120 * MAX_IMAGE_OPTIONS_BYTES // 8, kept  # 1.8 MiB of options sent, not kept
    assert memo.bytes_used <= memo.capacity_bytes
    assert memo.bytes_used < 121 * 1024  # digests, not the options' text (15 KiB each)


def test_the_memo_is_bounded_by_bytes():
    urls = DataUrlKeys(capacity=10_000, capacity_bytes=64 << 10)
    from featcache.keys import image_key

    for i in range(2000):
        urls.put(urls.ident(f"data:image/png;base64,{i}", {}, {"note": "x" * 4096}),
                 image_key(bytes([i % 256]), namespace="t"))
    assert 0 < urls.bytes_used <= 64 << 10 and len(urls) < 2000
    assert len(urls.ident("data:x", {}, {"note": "x" * 15_000})) == 32  # a digest, whatever size
    with pytest.raises(ValueError):
        DataUrlKeys(capacity_bytes=0)


def test_a_key_prefix_gives_the_hashers_own_keys():
    """The invariant the once-per-request framing rests on: a ``KeyPrefix`` key equals the
    hasher's own for the same params, for every algorithm, keyed or not, content and id keys."""
    import os

    from featcache.keys import KeyHasher

    hashers = [KeyHasher(), KeyHasher("xxh3_128"), KeyHasher("blake2b"),
               KeyHasher(secret=os.urandom(32)), KeyHasher("blake2b", secret=os.urandom(32))]
    options = [{}, {"image_mode": "L"}, {"a": [1, 2.5, None, True, {"b": "c"}], "z": "é"}]
    items = [{}, {"max_dynamic_patch": 4}, {"detail": {"x": [1]}}]
    for hasher in hashers:
        for decode in options:
            prefix = hasher.prefix("ns", {"io": decode}, "item")
            for item in items:
                params = {"io": decode, "item": item}
                for image in (b"encoded bytes", tiny.noise_image(8, 6)):
                    assert prefix.image_key(image, item) == hasher.image_key(
                        image, namespace="ns", params=params)
                assert prefix.client_key("sku-1", item) == hasher.client_key(
                    "sku-1", namespace="ns", params=params)
    with pytest.raises(ValueError, match="sorting before"):
        KeyHasher().prefix("ns", {"zz": 1}, "item")


def test_a_requests_options_are_encoded_once_not_once_per_image(rig, monkeypatch):
    """A request of 24 images with large options, sent twice (the second time: every image
    remembered; in the multi-process mode sent without pixels): the options are encoded (JSON,
    key framing) a bounded number of times per request, not once or more per image (before:
    200 images with a 50,000-key object took 24-36 s against plain lmdeploy's 1 s)."""
    from featcache import keys

    encoded = []

    def marked(obj, depth=0):
        if isinstance(obj, dict):
            return "featcache_test_marker" in obj or (depth < 3 and any(
                marked(v, depth + 1) for v in obj.values()))
        return isinstance(obj, (list, tuple)) and depth < 3 and any(
            marked(v, depth + 1) for v in obj)

    real_dumps, real_mapping = json.dumps, keys._Framer.mapping

    def dumps(obj, *args, **kwargs):
        if marked(obj):
            encoded.append("json")
        return real_dumps(obj, *args, **kwargs)

    def mapping(self, m):
        if marked(m):
            encoded.append("key")
        return real_mapping(self, m)

    monkeypatch.setattr(json, "dumps", dumps)
    monkeypatch.setattr(keys._Framer, "mapping", mapping)
    urls = [f"data:image/png;base64,{b64(png_of(tiny.noise_image(16, 12, seed=s)))}"
            for s in range(24)]
    msgs = tiny.messages(*[url_item(u) for u in urls])
    options = big_options(4096)
    per_request = []
    for _ in range(2):
        encoded.clear()
        out = rig.cached.prompt(msgs, media_io_kwargs=options)
        store(rig, out)
        per_request.append(len(encoded))
    assert max(per_request) <= 4, per_request


def test_refused_options_are_counted_and_the_next_request_is_served(rig):
    """Decode options refused with a 400 (over the limit, not JSON, no image mode) are counted,
    one each (``options_refused``; not ``media_refused``: no source was refused), before any
    image of the request is read; the same image with no options is then served."""
    url = f"data:image/png;base64,{b64(A)}"
    msgs = tiny.messages(url_item(url))
    bad = [{"image": {"note": "x" * (MAX_IMAGE_OPTIONS_BYTES + 1)}},
           {"image": {"x": float("nan")}}, {"image": {"image_mode": "NOPE"}}, {"image": ["RGB"]}]
    for options in bad:
        with pytest.raises(ValueError, match="media_io_kwargs"):
            rig.cached.prompt(msgs, media_io_kwargs=options)
    stats = rig.cache.stats()["lmdeploy"]
    assert stats["options_refused"] == len(bad)
    assert stats.get("media_refused", 0) == 0 and stats.get("bad_images", 0) == 0
    out = rig.cached.prompt(msgs)
    assert out["multimodal"][0]["pixel_values"].numel() > 0 or REF_KEY in out["multimodal"][0]
    assert rig.cache.stats()["lmdeploy"]["options_refused"] == len(bad)


def test_the_same_options_in_another_order_are_one_key_and_one_memo_entry(rig):
    """Decode options are canonical JSON wherever they are read: a client writing the same options
    in another order gets the same key (a hit) and the data URL memo's entry, not a second one
    (which a client could otherwise grow with every permutation). (Planted: the request's option
    text without sorted keys; every test sent options of one key.)"""
    url = f"data:image/png;base64,{b64(png_of(tiny.noise_image(24, 16, seed=44)))}"
    msgs = tiny.messages(url_item(url))
    first = rig.cached.prompt(msgs, media_io_kwargs={"image": {"image_mode": "L", "zz_unused": 1}})
    store(rig, first)
    again = rig.cached.prompt(msgs, media_io_kwargs={"image": {"zz_unused": 1, "image_mode": "L"}})
    ref, ref2 = first["multimodal"][0][REF_KEY], again["multimodal"][0][REF_KEY]
    assert ref2.key == ref.key
    assert ref2.hit if not rig.frontend.tags else (  # (mp: sent without pixels, but by the new API)
        ref2.source is not None or rig.cached.encoder._uses_new_preprocess)
    assert len(rig.frontend.data_urls) == 1
