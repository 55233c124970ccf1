"""Hostile clients, second round (issue 39 items 3, 7, 8): what one request can still cost the
server or another client.

- item 3: bytes PIL fails to read with an exception other than ``OSError`` (a PNG chunk type that
  is not ASCII: ``UnicodeDecodeError``; and the others PIL raises on damaged files) are a bad
  image like any other: a 400 with the reason, counted ``bad_images``, one WARNING line, no
  traceback; in both engine processes, through `featcache serve` (lmdeploy's real CLI, api_server
  and FastAPI app; generation a stand-in: ``test_media_sources``);
- item 7: ``--trust-client-image-ids verify``: an id is bound to an image only by a request that
  was accepted (lmdeploy's real prompt path: ``test_lmdeploy_hostile``'s rig);
- item 8: a tag whose metadata the model process cannot store fails its own request before it
  is scheduled; the request beside it is scheduled and its step completes (lmdeploy's own
  ``Engine._on_add_message`` as featcache wraps it, then lmdeploy's real ``prepare`` and
  ``forward`` with a fake vision tower: ``tests/_ranks.py``).
"""

from __future__ import annotations

import io
import logging
import pickle
import types

import _lmdeploy_stack
import pytest
import torch

_lmdeploy_stack.require("fastapi")  # a skip naming the missing module; CI fails instead

import _ranks  # noqa: E402
import lmdeploy_tiny as tiny  # noqa: E402
import test_lmdeploy_engine as eng  # noqa: E402
from PIL import Image  # noqa: E402
from test_lmdeploy_hostile import Rig, data_url, png, url_item  # noqa: E402
from test_media_sources import StandInEngine  # noqa: E402
from test_media_sources import model as model  # noqa: E402,F401  (the serve fixture's)
from test_media_sources import serve as serve  # noqa: E402,F401

from featcache.lmdeploy import counters_cache  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION, install_frontend  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402
from featcache.lmdeploy.request.sources import BadImageError, ImageIdError, trust_image_ids  # noqa: E402
from featcache.lmdeploy.request.tags import FeatTag  # noqa: E402

_ranks.stub_xgrammar()  # (lmdeploy's engine modules import it)


# -- item 3: every failure to decode a client's bytes is a bad image ------------------------------
def mutated(fmt: str, at: int, value: int, mode: str = "RGB") -> bytes:
    """A small image saved as ``fmt`` with one byte changed (found by mutating such files)."""
    buf = io.BytesIO()
    Image.new(mode, (8, 6), (10,) * len(mode)).save(buf, format=fmt)
    raw = bytearray(buf.getvalue())
    raw[at] = value
    return bytes(raw)


# the bytes, and what PIL 13 raises reading them as lmdeploy does (``ImageMediaIO.load_bytes``)
HOSTILE = {
    "png chunk type not ASCII": (lambda: mutated("PNG", 12, 0x80), UnicodeDecodeError),
    "gif tile outside the image": (lambda: mutated("GIF", 30, 0), ValueError),
    "tiff rational as an integer": (lambda: mutated("TIFF", 72, 5), TypeError),
    "dds unknown pixel format": (lambda: mutated("DDS", 80, 0), NotImplementedError),
    "spider stack offset": (lambda: mutated("SPIDER", 107, 127, "L"), AttributeError),
}


def test_the_hostile_bytes_raise_what_pil_raises():
    """The premise of the tests below: each of these is an exception PIL raises on damaged bytes
    that is not the ``OSError`` it raises for most (plain lmdeploy answers those with a 500)."""
    from lmdeploy.vl.media.image import ImageMediaIO

    for name, (make, kind) in HOSTILE.items():
        with pytest.raises(Exception) as e:
            ImageMediaIO().load_bytes(make())
        assert type(e.value) is kind and not isinstance(e.value, OSError), name


@pytest.fixture(params=[tiny.INTERNVL, tiny.QWEN2VL, tiny.QWEN3VL], ids=["internvl_hf", "qwen2vl", "qwen3vl"])
def path(request, tmp_path_factory):
    return tiny.checkpoint(request.param, tmp_path_factory)


@pytest.fixture(params=["in", "mp"])
def rig(request, path):
    r = Rig(path, tags=request.param == "mp")
    yield r
    r.close()


def featcache_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "featcache"]


@pytest.mark.parametrize("case", list(HOSTILE))
def test_any_image_pil_cannot_read_is_a_bad_image_one_warning_counted(rig, caplog, case):
    """Issue 39 item 3 (was: a 400 with PIL's message, counted ``frontend_errors``, an ERROR
    with a traceback, for the one-process frontend and the tag mode of several)."""
    caplog.set_level(logging.WARNING, logger="featcache")
    make, kind = HOSTILE[case]
    for _ in range(3):
        with pytest.raises(BadImageError, match=f"cannot be decoded \\({kind.__name__}: "):
            rig.cached.prompt(tiny.messages(url_item(data_url(make()))))
    counts = rig.counters()
    assert counts.get("bad_images") == 3 and "frontend_errors" not in counts, counts
    assert [r.levelname for r in featcache_records(caplog)] == ["WARNING"]
    assert "Traceback" not in caplog.text
    good = rig.cached.prompt(tiny.messages(url_item(data_url(png(tiny.noise_image(32, 24))))))
    assert good["multimodal"]  # and the next request is answered


def test_a_failure_before_the_bytes_are_read_is_not_the_clients(rig, monkeypatch, caplog):
    """The catch covers PIL reading the client's bytes, nothing of featcache's: a failure of
    featcache's own (here building lmdeploy's reader with the options featcache checked) stays
    featcache's error, logged as one, never relabelled as the client's bad image."""
    from lmdeploy.vl.media import image

    def broken(self, *args, **kwargs):
        raise RuntimeError("a bug of the server's")

    monkeypatch.setattr(image.ImageMediaIO, "__init__", broken)
    caplog.set_level(logging.WARNING, logger="featcache")
    with pytest.raises(RuntimeError, match="a bug of the server's"):
        rig.cached.prompt(tiny.messages(url_item(data_url(png(tiny.noise_image(32, 24))))))
    counts = rig.counters()
    assert "bad_images" not in counts and counts.get("frontend_errors") == 1, counts
    assert [r.levelname for r in featcache_records(caplog)] == ["ERROR"]


@pytest.mark.parametrize("engine_process", ["in", "mp"])
def test_serve_answers_an_image_pil_cannot_read_with_a_400_and_counts_it(serve, caplog,
                                                                         engine_process):
    """Through `featcache serve`: the non-ASCII PNG chunk is a 400 naming the image as
    undecodable, counted ``bad_images`` (not ``frontend_errors``), one WARNING and no traceback;
    the next request is answered."""
    caplog.set_level(logging.WARNING, logger="featcache")
    answers = {}

    def drive(post):
        for name, (make, _) in HOSTILE.items():
            answers[name] = post(data_url(make()))
        answers["next"] = post(data_url(png(tiny.noise_image(64, 48, seed=3))))
        [engine] = StandInEngine.built
        frontend = engine.prompt_processor.async_parse_multimodal_item.frontend
        answers["counts"] = dict(frontend.cache.stats().get(SECTION, {}))

    assert serve(["--engine-process", engine_process], drive) == 0
    for name, (_, kind) in HOSTILE.items():
        response = answers[name]
        assert response.status_code == 400, (name, response.text)
        message = response.json()["message"]
        assert f"the image cannot be decoded ({kind.__name__}: " in message, (name, message)
    assert answers["next"].status_code == 200, answers["next"].text
    counts = answers["counts"]
    assert counts.get("bad_images") == len(HOSTILE) and not counts.get("frontend_errors"), counts
    records = featcache_records(caplog)  # (besides the server's own start-up warnings)
    assert not [r for r in records if r.levelno >= logging.ERROR]
    assert [r.levelname for r in records if "client sent an image" in r.getMessage()] == ["WARNING"]
    assert "Traceback" not in caplog.text


# -- item 7: an id is bound only by a request that was accepted -----------------------------------
NOT_AN_IMAGE = data_url(b"hello, not an image")
REFUSED = {  # a request naming id "p" that is refused, and why
    "its bytes are no image": lambda a: [url_item(NOT_AN_IMAGE, uuid="p")],
    "another item is no image": lambda a: [url_item(data_url(a), uuid="p"),
                                           url_item(NOT_AN_IMAGE)],
    "another item is refused by the media policy": lambda a: [url_item(data_url(a), uuid="p"),
                                                              url_item("/dev/zero")],
}


@pytest.fixture(params=[tiny.INTERNVL, tiny.QWEN2VL, tiny.QWEN3VL], ids=["internvl_hf", "qwen2vl", "qwen3vl"])
def verifying(request, tmp_path_factory):
    """``--trust-client-image-ids verify``, one process (ids alone are answered)."""
    r = Rig(tiny.checkpoint(request.param, tmp_path_factory))
    trust_image_ids(r.cached.processor, "verify")
    yield r
    r.close()


def images(*seeds: int) -> list[bytes]:
    return [png(tiny.noise_image(100, 80, seed=s)) for s in seeds]


def answered_from(rig, image_id: str, raw: bytes, stored: dict) -> None:
    """``image_id`` alone is answered with ``raw``'s features (``stored``: its request's output)."""
    alone = rig.cached.prompt(tiny.messages({"type": "image_url", "uuid": image_id}))
    ref = alone["multimodal"][0][REF_KEY]
    assert ref.hit and ref.key == stored["multimodal"][0][REF_KEY].key
    plain = rig.plain.prompt(tiny.messages(url_item(data_url(raw))))
    assert alone["input_ids"] == plain["input_ids"]


@pytest.mark.parametrize("refusal", list(REFUSED))
def test_verify_an_id_first_sent_in_a_refused_request_names_the_first_accepted_image(
        verifying, refusal):
    """Issue 39 item 7 (was: answered from B, then ``p`` alone a 400 "not in the cache")."""
    rig = verifying
    a, b = images(40, 41)
    with pytest.raises(ValueError):  # (each refusal its own 400)
        rig.cached.prompt(tiny.messages(*REFUSED[refusal](a)))
    sent = rig.cached.prompt(tiny.messages(url_item(data_url(b), uuid="p")))
    rig.store(sent)
    answered_from(rig, "p", b, sent)
    assert "image_id_mismatch" not in rig.counters()


def test_verify_an_id_sent_with_an_image_the_model_refuses_is_not_bound(tmp_path_factory):
    """Refused after its bytes decoded: Qwen2-VL's preprocessing refuses an image whose aspect
    ratio is over 200; the id is bound by the next request, whose image is accepted."""
    rig = Rig(tiny.checkpoint(tiny.QWEN2VL, tmp_path_factory))
    trust_image_ids(rig.cached.processor, "verify")
    try:
        thin = png(tiny.noise_image(2000, 2, seed=42))
        with pytest.raises(ValueError, match="aspect ratio"):
            rig.cached.prompt(tiny.messages(url_item(data_url(thin), uuid="p")))
        # the model's refusal, as plain lmdeploy's: counted as such, not as featcache's failure
        counts = rig.counters()
        assert counts["preprocess_refused"] == 1 and "frontend_errors" not in counts, counts
        (b,) = images(43)
        sent = rig.cached.prompt(tiny.messages(url_item(data_url(b), uuid="p")))
        rig.store(sent)
        answered_from(rig, "p", b, sent)
    finally:
        rig.close()


@pytest.mark.parametrize("refusal", list(REFUSED))
def test_verify_in_the_tag_mode_binds_only_accepted_images_too(path, refusal):
    """Several processes (ids alone are refused there: the model processes need the bytes): the
    id is bound to B, the first accepted image, so B is no mismatch and C is one."""
    rig = Rig(path, tags=True)
    trust_image_ids(rig.cached.processor, "verify")
    try:
        a, b, c = images(44, 45, 46)
        with pytest.raises(ValueError):
            rig.cached.prompt(tiny.messages(*REFUSED[refusal](a)))
        for raw in (b, b):
            rig.cached.prompt(tiny.messages(url_item(data_url(raw), uuid="p")))
        assert "image_id_mismatch" not in rig.counters()
        rig.cached.prompt(tiny.messages(url_item(data_url(c), uuid="p")))
        assert rig.counters()["image_id_mismatch"] == 1
        with pytest.raises(ImageIdError, match="came without its image"):
            rig.cached.prompt(tiny.messages({"type": "image_url", "uuid": "p"}))
    finally:
        rig.close()


# -- item 8: a damaged tag fails its own request, never the one beside it ------------------------
@pytest.fixture
def side(tmp_path_factory):
    s = _ranks.Side(tiny.checkpoint(tiny.INTERNVL, tmp_path_factory))
    yield s
    s.close()


@pytest.fixture
def tag_frontend(tmp_path_factory):
    """The tag-mode frontend (the API process of several), data URLs keyed by their bytes."""
    cache = counters_cache()
    prompts = tiny.PromptPath(tiny.checkpoint(tiny.INTERNVL, tmp_path_factory))
    install_frontend(prompts.model, cache, "test:hostile2", prompts.processor, tags=True)
    yield prompts
    prompts.close()
    cache.close()


def stand_in_engine(scheduled: list, responses: list):
    """What lmdeploy's ``Engine._on_add_message`` reads of its engine, featcache's input
    processor (lmdeploy's own, wrapped) in place: the scheduled requests and the error
    responses are recorded."""
    from featcache.lmdeploy.pytorch.engine import KeyedInputProcessor

    class Inner:
        def preprocess_input(self, input_ids, input_multimodals, **kwargs):
            return types.SimpleNamespace(input_ids=input_ids, input_multimodals={"image": []})

    return types.SimpleNamespace(
        scheduler=None, input_processor=KeyedInputProcessor(Inner()),
        engine_config=types.SimpleNamespace(language_model_only=False),
        cache_config=types.SimpleNamespace(enable_prefix_caching=False),
        _response=lambda resp, kind, data=None, err_msg="": responses.append((resp, kind, err_msg)),
        _add_message=lambda reqs: scheduled.extend(r.resp for r in reqs))


DAMAGED = {
    "not JSON": b"not json {",
    "not UTF-8": b"\xff\xfe{}",
    "JSON, not an object": b"[1, 2]",
    "nested past the parser's depth": b"[" * 50_000,
    "an object over the metadata cap": b'{"x": "' + b"y" * (64 << 10) + b'"}',
}


@pytest.mark.parametrize("pixels", ["with pixels", "without pixels"])
@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_tag_with_damaged_metadata_fails_its_own_request_the_one_beside_it_completes(
        tag_frontend, side, damage, pixels):
    """Issue 39 item 8 (was: scheduled; storing its features with their cost raised a
    ``ValueError`` in the model step, which failed the request beside it too). The damaged
    image is the second of its request: every image is checked."""
    from lmdeploy.messages import ResponseType
    from lmdeploy.pytorch.engine.engine import Engine

    import featcache.lmdeploy.pytorch.processes  # noqa: F401  (what installs the engine hooks)

    first, second, beside = images(50, 51, 52)
    if pixels == "without pixels":  # sent before: it travels as its bytes (a model process
        tag_frontend.prompt(tiny.messages(url_item(data_url(second))))  # that lacks it rebuilds)
    bad = tag_frontend.prompt(tiny.messages(url_item(data_url(first)), url_item(data_url(second))))
    tag = bad["multimodal"][1][REF_KEY]
    assert (tag.source is None) == (pixels == "with pixels")
    bad["multimodal"][1][REF_KEY] = FeatTag(tag.key, DAMAGED[damage], tag.source)
    good = tag_frontend.prompt(tiny.messages(url_item(data_url(beside))))
    blobs = {name: pickle.dumps((out["input_ids"], out["multimodal"]))
             for name, out in (("damaged", bad), ("good", good))}

    def request(name):  # as lmdeploy's RPC hands a request to the engine process: unpickled
        input_ids, multimodal = pickle.loads(blobs[name])
        return types.SimpleNamespace(resp=name, data={
            "session_id": 1, "token_ids": input_ids, "input_multimodals": multimodal})

    scheduled, responses = [], []
    Engine._on_add_message(stand_in_engine(scheduled, responses),
                           [request("damaged"), request("good")])
    # the step of what was scheduled completes, with the good request's features
    rows, calls = side.step([blobs[name] for name in scheduled])
    pixels_good = good["multimodal"][0]["pixel_values"]
    assert torch.equal(rows, eng.per_image(tiny.INTERNVL, pixels_good))
    assert scheduled == ["good"] and len(calls) == 1
    [(resp, kind, message)] = responses
    assert resp == "damaged" and kind == ResponseType.INTERNAL_ENGINE_ERROR
    assert "metadata" in message, message


def test_tags_the_frontend_sends_pass_the_check(tag_frontend):
    """The check refuses only what the model could not store: every tag the frontend makes, with
    or without pixels, of every image of a request, passes it."""
    from featcache.lmdeploy.pytorch.engine import unservable

    a, b = images(53, 54)
    first = tag_frontend.prompt(tiny.messages(url_item(data_url(a)), url_item(data_url(b))))
    again = tag_frontend.prompt(tiny.messages(url_item(data_url(a)), url_item(data_url(b))))
    assert all(m[REF_KEY].source is not None for m in again["multimodal"])
    for out in (first, again):
        assert unservable(pickle.loads(pickle.dumps(out["multimodal"]))) is None
