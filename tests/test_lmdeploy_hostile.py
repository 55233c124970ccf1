"""Many clients, one cache: nothing one client sends changes what another is answered (issue 26).

Runs lmdeploy's real prompt path (MultimodalProcessor + ImageEncoder) on the tiny checkpoints, with
featcache's frontend as ``featcache.lmdeploy.wrap`` installs it (one process, and the tag mode of
several processes), against plain lmdeploy's answer for the same request.
"""

from __future__ import annotations

import base64
import gc
import io

import _lmdeploy_stack
import _redis
import pytest
import torch

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402
from test_lmdeploy_sources import Rig as SourcesRig  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy import counters_cache  # noqa: E402
from featcache.lmdeploy.request.frontend import MediaOptionError, install_frontend  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402
from featcache.lmdeploy.request.sources import ImageIdError, trust_image_ids  # noqa: E402

GREY = {"image": {"image_mode": "L"}}


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()


def url_item(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


class Rig(SourcesRig):
    """test_lmdeploy_sources' rig (plain and featcache prompt paths, ``store``, ``counters``),
    with the tag mode of several processes as an option."""

    def __init__(self, path: str, tags: bool = False) -> None:
        self.cache = counters_cache() if tags else FeatureCache(device="cpu", device_bytes="64MiB",
                                                                host_bytes=0)
        self.namespace = "test:hostile"
        self.plain = tiny.PromptPath(path)
        self.cached = tiny.PromptPath(path)
        install_frontend(self.cached.model, self.cache, self.namespace, self.cached.processor,
                         tags=tags)
        self.cached.record_featcache()
        self.frontend = self.cached.model.preprocess.frontend


@pytest.fixture(params=[tiny.INTERNVL, tiny.QWEN2VL, tiny.QWEN3VL], ids=["internvl_hf", "qwen2vl", "qwen3vl"])
def path(request, tmp_path_factory):
    return tiny.checkpoint(request.param, tmp_path_factory)


@pytest.fixture
def rig(path):
    r = Rig(path)
    yield r
    r.close()


def sources(raw: bytes, tmp_path) -> dict[str, str]:
    (tmp_path / "img.png").write_bytes(raw)
    return {"data_url": data_url(raw), "file": str(tmp_path / "img.png")}


# -- 1. decode options are part of the key -----------------------------------------------------------
@pytest.mark.parametrize("sent_as", ["data_url", "file"])
def test_the_same_bytes_with_other_decode_options_get_their_own_features(rig, tmp_path, sent_as):
    raw = png(tiny.noise_image(100, 80, seed=21))
    source = sources(raw, tmp_path)[sent_as]
    msgs = tiny.messages(url_item(source))
    first = rig.cached.prompt(msgs)  # RGB, the default: stored
    rig.store(first)
    again = rig.cached.prompt(msgs)
    assert again["multimodal"][0][REF_KEY].hit  # the same request: a hit (data URL remembered)

    grey = rig.cached.prompt(msgs, media_io_kwargs=GREY)  # another client's options
    plain = rig.plain.prompt(msgs, media_io_kwargs=GREY)
    ref = grey["multimodal"][0][REF_KEY]
    assert not ref.hit and ref.key != first["multimodal"][0][REF_KEY].key
    assert torch.equal(grey["multimodal"][0]["pixel_values"], plain["multimodal"][0]["pixel_values"])
    rgb = rig.plain.prompt(msgs)["multimodal"][0]["pixel_values"]
    assert not torch.equal(plain["multimodal"][0]["pixel_values"], rgb)  # the option matters
    rig.store(grey)
    # and the first client keeps getting its own
    assert rig.cached.prompt(msgs)["multimodal"][0][REF_KEY].key == first["multimodal"][0][REF_KEY].key
    assert rig.cached.prompt(msgs, media_io_kwargs=GREY)["multimodal"][0][REF_KEY].key == ref.key


def test_an_option_that_changes_nothing_still_gets_its_own_key(rig):
    """Options lmdeploy's reader keeps but does not use are keyed too: never a shared entry
    between requests whose decoding could differ."""
    raw = png(tiny.noise_image(64, 48, seed=22))
    msgs = tiny.messages(url_item(data_url(raw)))
    a = rig.cached.prompt(msgs)["multimodal"][0][REF_KEY].key
    b = rig.cached.prompt(msgs, media_io_kwargs={"image": {"fmt": "x"}})["multimodal"][0][REF_KEY].key
    assert a != b


@pytest.mark.parametrize("options, why", [
    ({"image": {"image_mode": "NOPE"}}, "image_mode"),
    ({"image": {"image_mode": ["RGB"]}}, "image_mode"),
    ({"image": "RGB"}, "object of named options"),
    ("RGB", "must be an object"),
])
def test_bad_decode_options_are_the_clients_error_with_a_reason(rig, options, why):
    msgs = tiny.messages(url_item(data_url(png(tiny.noise_image(32, 32, seed=23)))))
    with pytest.raises(MediaOptionError, match=why):
        rig.cached.prompt(msgs, media_io_kwargs=options)
    assert issubclass(MediaOptionError, ValueError)  # lmdeploy answers a ValueError with a 400
    assert rig.cached.prompt(msgs)["multimodal"]  # and the next request is answered


def test_options_do_not_matter_to_a_text_only_request(rig):
    out = rig.cached.prompt([{"role": "user", "content": "hi"}], media_io_kwargs={"image": "junk"})
    assert out["input_ids"]


def test_several_processes_key_decode_options_too(path):
    """The tag mode: an image sent before with other options is preprocessed, not sent without
    pixels under the first options' key (a model process that lost it would rebuild it wrongly)."""
    rig = Rig(path, tags=True)
    try:
        raw = png(tiny.noise_image(100, 80, seed=24))
        msgs = tiny.messages(url_item(data_url(raw)))
        first = rig.cached.prompt(msgs)
        again = rig.cached.prompt(msgs)
        # (both APIs: the processor-level one too, since its frontend sends what it sent before
        # without pixels)
        assert again["multimodal"][0][REF_KEY].key == first["multimodal"][0][REF_KEY].key
        assert again["multimodal"][0][REF_KEY].source is not None  # sent without pixels
        assert again["multimodal"][0]["pixel_values"].numel() == 0
        assert len(rig.cached.calls) == 1
        grey = rig.cached.prompt(msgs, media_io_kwargs=GREY)
        tag = grey["multimodal"][0][REF_KEY]
        assert tag.source is None  # preprocessed, with pixels (equal to lmdeploy's: below)
        if not rig.cached.encoder._uses_new_preprocess:  # (the processor-level frontend gives a
            assert len(rig.cached.calls) == 2  # grey image to the image processor, unrecorded)
        assert tag.key != first["multimodal"][0][REF_KEY].key
        plain = rig.plain.prompt(msgs, media_io_kwargs=GREY)
        assert torch.equal(grey["multimodal"][0]["pixel_values"],
                           plain["multimodal"][0]["pixel_values"])
        resent = rig.cached.prompt(msgs, media_io_kwargs=GREY)  # and resent: its own options
        assert resent["multimodal"][0][REF_KEY].key == tag.key
        source = resent["multimodal"][0][REF_KEY].source
        assert source is not None and '"image_mode": "L"' in source.decode
    finally:
        rig.close()


# -- 2. keys under the cache's secret ---------------------------------------------------------------
def test_the_frontend_keys_with_its_caches_secret(path, tmp_path):
    raw = png(tiny.noise_image(64, 48, seed=25))
    keys = []
    for store in ("a", "b"):
        cache = FeatureCache(device="cpu", device_bytes="16MiB", host_bytes=0,
                             disk_path=tmp_path / store, disk_bytes="16MiB")
        prompts = tiny.PromptPath(path)
        install_frontend(prompts.model, cache, "test:hostile", prompts.processor)
        try:
            out = prompts.prompt(tiny.messages(url_item(data_url(raw))))
            keys.append(out["multimodal"][0][REF_KEY].key)
            assert keys[-1] == cache.image_key(raw, namespace="test:hostile",
                                               params={"item": {}, "io": {}})
        finally:
            prompts.close()
            gc.collect()
            cache.close()
    assert keys[0] != keys[1]  # unpredictable: each store has its own secret


def test_the_tag_mode_keys_with_the_model_processes_store_secret(tmp_path):
    from featcache.lmdeploy.pytorch.processes import settings_hasher

    with FeatureCache(device="cpu", host_bytes=0, disk_path=tmp_path / "s", disk_bytes="16MiB") as c:
        want = c.image_key(b"image bytes")
        settings = {"feature_cache": {k: v for k, v in vars(c.config).items() if k != "device"}}
    assert settings_hasher(settings).image_key(b"image bytes") == want
    assert settings_hasher({"default_cache": {"path": str(tmp_path / "s")}}).image_key(
        b"image bytes") == want
    assert settings_hasher({"default_cache": {"path": str(tmp_path / "t")}}).image_key(
        b"image bytes") != want


def test_the_tag_mode_keys_with_the_fleets_secret_when_serve_names_a_remote(path, tmp_path):
    """What `featcache serve --remote-url` hands the engine (``{"default_cache": ...}`` with a
    store path and a ``remote_url``, serving.py's ``sizes``), on a replica whose store made a
    secret of its own before it joined the fleet: the frontend, keying at start before any model
    process opened the store, keys as the model processes' caches do, with the fleet's secret."""
    from featcache.lmdeploy.pytorch import ranks
    from featcache.lmdeploy.pytorch.processes import settings_hasher

    server = _redis.RedisServer(_redis.redis_binary(), tmp_path)
    raw = png(tiny.noise_image(64, 48, seed=31))
    params = {"item": {}, "io": {}}
    try:
        with FeatureCache(device="cpu", host_bytes=0, disk_path=tmp_path / "fleet",
                          disk_bytes="16MiB", remote_url=server.url) as other:  # another replica
            fleet = other.image_key(raw, namespace="test:hostile", params=params)
        with FeatureCache(device="cpu", host_bytes=0, disk_path=tmp_path / "s",
                          disk_bytes="16MiB") as alone:  # this replica, before it joined
            assert alone.image_key(raw, namespace="test:hostile", params=params) != fleet
        settings = {"default_cache": dict(
            path=str(tmp_path / "s"), device_bytes=1 << 20, host_bytes=0, disk_bytes=16 << 20,
            remote_url=server.url, key_algorithm=None, key_secret_file=None)}
        prompts = tiny.PromptPath(path)
        frontend_cache = counters_cache()
        install_frontend(prompts.model, frontend_cache, "test:hostile", prompts.processor,
                         tags=True, hasher=settings_hasher(settings))
        try:
            tag = prompts.prompt(tiny.messages(url_item(data_url(raw))))["multimodal"][0][REF_KEY]
        finally:
            prompts.close()
            gc.collect()
            frontend_cache.close()
        model_cache = ranks._build(settings)  # a model process's cache, built at its first image
        try:
            assert tag.key == model_cache.image_key(raw, namespace="test:hostile", params=params)
            assert tag.key == fleet
        finally:
            model_cache.close()
    finally:
        server.kill()


# -- 5. client ids, verified -------------------------------------------------------------------------
@pytest.fixture
def verifying(rig):
    trust_image_ids(rig.cached.processor, "verify")
    return rig


def test_verify_an_id_resent_with_other_bytes_is_answered_from_those_bytes(verifying):
    rig = verifying
    a = png(tiny.noise_image(100, 80, seed=26))
    b = png(tiny.noise_image(100, 80, seed=27))
    first = rig.cached.prompt(tiny.messages(url_item(data_url(a), uuid="sku-1")))
    rig.store(first)
    other = rig.cached.prompt(tiny.messages(url_item(data_url(b), uuid="sku-1")))
    plain = rig.plain.prompt(tiny.messages(url_item(data_url(b))))
    ref = other["multimodal"][0][REF_KEY]
    assert not ref.hit and ref.key != first["multimodal"][0][REF_KEY].key
    assert torch.equal(other["multimodal"][0]["pixel_values"], plain["multimodal"][0]["pixel_values"])
    assert rig.counters()["image_id_mismatch"] == 1
    rig.store(other)
    alone = rig.cached.prompt(tiny.messages({"type": "image_url", "uuid": "sku-1"}))
    hit = alone["multimodal"][0][REF_KEY]
    assert hit.hit and hit.key == first["multimodal"][0][REF_KEY].key  # the id names its first image


def test_verify_an_id_never_sent_with_its_image_is_refused(verifying):
    with pytest.raises(ImageIdError, match="not known to this server"):
        verifying.cached.prompt(tiny.messages({"type": "image_url", "uuid": "never"}))


def test_trusted_ids_keep_vllms_semantics_the_first_image_wins(rig):
    trust_image_ids(rig.cached.processor, True)
    a = png(tiny.noise_image(100, 80, seed=28))
    b = png(tiny.noise_image(100, 80, seed=29))
    first = rig.cached.prompt(tiny.messages(url_item(data_url(a), uuid="sku-2")))
    rig.store(first)
    other = rig.cached.prompt(tiny.messages(url_item(data_url(b), uuid="sku-2")))
    assert other["multimodal"][0][REF_KEY].hit  # documented: an id names one image, as in vLLM


@pytest.mark.parametrize("algorithm", ["blake3", "xxh3_128"])
def test_a_crafted_collision_changes_no_answer_by_default(path, algorithm):
    """Two BMPs built to share an xxh3 key under the server's namespace and parameters: with the
    default keys the second gets its own features; with the xxh3 opt-in it gets the first's
    (why xxh3 is for a single trusted tenant only)."""
    from _collide import xxh3_twins

    rig = Rig(path)
    rig.cache.close()
    rig.cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0, key_algorithm=algorithm)
    rig.frontend.cache, rig.frontend.hasher = rig.cache, rig.cache.hasher
    try:
        a, b = xxh3_twins("test:hostile", {"item": {}, "io": {}})
        first = rig.cached.prompt(tiny.messages(url_item(data_url(a, "bmp"))))
        rig.store(first)
        second = rig.cached.prompt(tiny.messages(url_item(data_url(b, "bmp"))))
        ref = second["multimodal"][0][REF_KEY]
        if algorithm == "xxh3_128":
            assert ref.hit and ref.key == first["multimodal"][0][REF_KEY].key  # poisoned
        else:
            plain = rig.plain.prompt(tiny.messages(url_item(data_url(b, "bmp"))))
            assert not ref.hit
            assert torch.equal(second["multimodal"][0]["pixel_values"],
                               plain["multimodal"][0]["pixel_values"])
    finally:
        rig.close()


def test_request_processor_options_cannot_change_a_cached_answer(rig):
    """``mm_processor_kwargs`` (a request field) reaches only new-API preprocessors in lmdeploy
    0.18; the models featcache serves have the legacy one, which never sees it. A hit for a
    request carrying it must equal plain lmdeploy's answer to that request (if lmdeploy ever
    honoured it for these models, the token counts here would differ)."""
    raw = png(tiny.noise_image(160, 120, seed=30))
    msgs = tiny.messages(url_item(data_url(raw)))
    rig.store(rig.cached.prompt(msgs))
    options = {"max_dynamic_patch": 1, "min_pixels": 28 * 28, "max_pixels": 56 * 56}
    hit = rig.cached.prompt(msgs, mm_processor_kwargs=options)
    plain = rig.plain.prompt(msgs, mm_processor_kwargs=options)
    assert hit["multimodal"][0][REF_KEY].hit
    assert hit["input_ids"] == plain["input_ids"]
    assert tiny.tokens(hit["multimodal"][0]) == tiny.tokens(plain["multimodal"][0])
    # the premise: a legacy preprocessor, or the new API's, whose processor reads only the
    # "image" object's pixel bounds (keyed: tests/test_lmdeploy_newapi.py)
    assert not rig.cached.encoder._uses_new_preprocess or "image" not in options


def test_a_processor_level_preprocessor_gets_the_processor_frontend():
    """lmdeploy's new API (``preprocess(messages, input_prompt, mm_processor_kwargs)``) is served
    by ``newapi.ProcessorFrontend``; lmdeploy still reads the hooked method as the new API (it
    decides by the signature), and request options reach the frontend."""
    from lmdeploy.vl.engine import ImageEncoder

    from featcache.lmdeploy.request.frontend import ProcessorFrontend

    seen = []

    class NewApi:
        def preprocess(self, messages, input_prompt=None, mm_processor_kwargs=None):
            seen.append((input_prompt, mm_processor_kwargs))
            return dict(input_ids=[1], multimodal=[])

    model = NewApi()
    with counters_cache() as cache:
        install_frontend(model, cache, "test:hostile")
        assert isinstance(model.preprocess.frontend, ProcessorFrontend)
        assert ImageEncoder._is_new_preprocess_api(model)
        assert model.preprocess([{"role": "user", "content": "hi"}], "prompt", {"video": {}}) == \
            dict(input_ids=[1], multimodal=[])
    assert seen == [("prompt", {"video": {}})]


@pytest.mark.parametrize("url, why", [
    ("data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(), "cannot be decoded"),
    ("data:image/png;base64,abcde", "not valid base64"),
])
def test_an_image_that_is_none_is_the_clients_error_one_warning_counted(rig, caplog, url, why):
    """Issue 29 item 8: a malformed image is the client's mistake: a ValueError (lmdeploy answers
    400; plain lmdeploy's PIL error is an OSError, a 500), counted, one warning line a minute and
    no traceback, not featcache's ERROR."""
    import logging

    from featcache.lmdeploy.request.sources import BadImageError

    caplog.set_level(logging.WARNING, logger="featcache")
    for _ in range(3):
        with pytest.raises(BadImageError, match=why):
            rig.cached.prompt(tiny.messages(url_item(url)))
    assert issubclass(BadImageError, ValueError)
    counts = rig.counters()
    assert counts["bad_images"] == 3 and "frontend_errors" not in counts
    records = [r for r in caplog.records if r.name == "featcache"]
    assert [r.levelname for r in records] == ["WARNING"] and "Traceback" not in caplog.text
    assert rig.cached.prompt(tiny.messages(url_item(data_url(png(tiny.noise_image(32, 24)))))) \
        ["multimodal"]  # and the next request is answered


def test_trust_modes_are_checked(rig):
    with pytest.raises(ValueError, match="False, True or 'verify'"):
        trust_image_ids(rig.cached.processor, "yes")


@pytest.mark.parametrize("options, why", [
    ({"image": {"image_mode": "NOPE"}}, "image_mode"),
    ({"image": "RGB"}, "object of named options"),
    ("RGB", "must be an object"),
])
def test_the_guard_of_a_model_featcache_does_not_cache_checks_options_too(options, why):
    """Where featcache does not cache the model it still reads the sources (``SourceGuard``), so
    a client's malformed decode options are its 400 there too, not an error inside decoding."""
    from featcache.lmdeploy.request.sources import SourceGuard

    guard = SourceGuard()
    msgs = tiny.messages(url_item(data_url(png(tiny.noise_image(32, 32, seed=24)))))
    with pytest.raises(MediaOptionError, match=why):
        guard.resolve_sources(msgs, options)
    assert guard.resolve_sources([{"role": "user", "content": "hi"}], {"image": "junk"})
    out = guard.resolve_sources(msgs, {"image": {"image_mode": "L"}})
    image = next(x for x in out[0]["content"] if x.get("type") != "text")["image_data"]["data"]
    assert image.mode == "L"  # read here, with the request's options
