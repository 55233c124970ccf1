"""featcache's multi-process mode (lmdeploy's mp engine, tp > 1) on lmdeploy's real CPU code.

- the tag (``FeatTag``): pickles; a corrupt one unpickles as an invalid tag, never an exception;
- the frontend in tag mode: every image preprocessed by lmdeploy, tagged, and the request pickles
  (what lmdeploy's ZMQ RPC does with it);
- the model side (``tests/_ranks.py``: lmdeploy's input processor, ``prepare`` and ``forward``;
  fake vision tower): requests arrive pickled; the vision tower runs once per distinct image,
  later requests are served from the process's own cache with identical features;
- an encoded image sent again: neither decoded nor preprocessed, it travels as its bytes; served
  by the model process, or (evicted on purpose) its pixels rebuilt exactly;
- two ranks (two processes, a gloo group): one rank evicts an entry on purpose; both then make
  the same vision call and produce identical features, and nothing hangs; the same with an image
  sent without pixels (both ranks rebuild them);
- the ranks' counters read on their own sockets, never through lmdeploy's executor;
- the channels into lmdeploy's processes: the engine config unpickled in a fresh interpreter
  installs featcache's engine hooks; the module-map file, run by lmdeploy's own
  ``update_custom_module_map``, installs the model hooks.
"""

from __future__ import annotations

import base64
import io
import json
import multiprocessing
import os
import pickle
import subprocess
import sys

import _lmdeploy_stack
import pytest
import torch

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import _ranks  # noqa: E402
import lmdeploy_tiny as tiny  # noqa: E402
import test_lmdeploy_engine as eng  # noqa: E402

from featcache.lmdeploy import counters_cache  # noqa: E402
from featcache.lmdeploy.pytorch import models, prefix, ranks  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION, install_frontend  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY, FeatRef  # noqa: E402
from featcache.lmdeploy.request.tags import FeatTag, Pixels, Source, _restore, restore_pixels  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)


@pytest.fixture
def frontend(path):
    """lmdeploy's prompt path with featcache's frontend in tag mode (the API process)."""
    cache = counters_cache()
    prompts = tiny.PromptPath(path)
    install_frontend(prompts.model, cache, "test:processes", tags=True, pack=True)
    prompts.record_featcache()  # calls: featcache's preprocessing too (InternVL-HF's)
    yield prompts, cache
    prompts.close()
    cache.close()


@pytest.fixture
def side(path):
    s = _ranks.Side(path)
    yield s
    s.close()


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def request(prompts, *images) -> bytes:
    """A request as lmdeploy's RPC sends it to the engine process: pickled."""
    out = prompts.prompt(tiny.messages(*(tiny.image_item(i) for i in images)))
    return pickle.dumps((out["input_ids"], out["multimodal"]))


# -- the tag -------------------------------------------------------------------------------------

class _Forged:
    """Pickles as a tag with the given fields (a sender of another version, or corruption)."""

    def __init__(self, *fields):
        self.fields = fields

    def __reduce__(self):
        return (_restore, self.fields)


def test_tag_pickles_and_a_corrupt_tag_unpickles_as_invalid():
    tag = FeatTag(b"k" * 32, b'{"fields":{}}')
    again = pickle.loads(pickle.dumps(tag))
    assert again == tag and again.valid and again.key == tag.key and again.meta == tag.meta

    for fields in [(None, b""), (b"", b""), (b"k", "not bytes"), (b"k" * 600, b""), (),
                   (b"k", b"m", "not a source"), (b"k", b"m", ("raw", "{}", "{}"))]:
        bad = pickle.loads(pickle.dumps(_Forged(*fields)))
        assert isinstance(bad, FeatTag) and not bad.valid, fields
    # fields a later version may add are ignored
    assert pickle.loads(pickle.dumps(_Forged(b"k", b"m", None, "extra"))) == FeatTag(b"k", b"m")
    sourced = FeatTag(b"k", b"m", Source(b"png", '{"io": {"image_mode": "RGB"}}', "{}"))
    again = pickle.loads(pickle.dumps(sourced))
    assert again == sourced and again.source.raw == b"png" and again != FeatTag(b"k", b"m")
    with pytest.raises(TypeError):
        FeatTag("str key", b"")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_pixels_travel_as_their_bytes_and_arrive_as_the_same_tensor(dtype):
    pixels = torch.randn(3, 3, 8, 8).to(dtype)[:, :, 1:7]  # (not contiguous: sent as if it were)
    blob = pickle.dumps(Pixels(pixels))
    assert len(blob) < pixels.numel() * pixels.element_size() + 200  # the bytes, once
    back = pickle.loads(blob)
    assert isinstance(back, torch.Tensor) and back.dtype == dtype and torch.equal(back, pixels)


@pytest.mark.parametrize("fields", [(), (b"xx", "float16", (3,)), (b"xx", "load", (1,)),
                                    ("xx", "float16", (1,)), (b"xx", "float16", [1]),
                                    (b"xx", "float16", (-1,)), (b"", "float16", (0,)), (b"xx", None, (1,))])
def test_pixel_fields_that_make_no_tensor_arrive_empty_never_raising(fields):
    """(the engine then refuses the request, ``unservable``; an exception while unpickling would
    stop lmdeploy's RPC server)."""
    back = pickle.loads(pickle.dumps(_ForgedPixels(*fields)))
    assert isinstance(back, torch.Tensor) and back.numel() == 0


class _ForgedPixels:
    def __init__(self, *fields):
        self.fields = fields

    def __reduce__(self):
        return (restore_pixels, self.fields)


def test_a_one_process_ref_refuses_to_cross_a_process_boundary():
    """A FeatRef holds this process's lease and tensors: pickled (a process boundary the mode
    choice missed), it fails with featcache's own message, not lmdeploy's "cannot pickle
    'Stream' object"; copies within the process share its one lease."""
    import copy

    from featcache import FeatureCache
    from featcache.lmdeploy.request.refs import FeatRef

    with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes=0) as cache:
        ref = FeatRef(cache, b"k" * 16, b"{}", None)
        with pytest.raises(TypeError, match="cross a process boundary"):
            pickle.dumps({"meta": {"featcache": ref}})
        assert copy.deepcopy({"r": ref})["r"] is ref and copy.copy(ref) is ref


# -- the frontend in tag mode --------------------------------------------------------------------

def test_tag_mode_frontend_sends_pixels_once_then_the_images_bytes(frontend, path):
    prompts, cache = frontend
    plain = tiny.PromptPath(path)
    a, b = eng.images(1, 2)
    try:
        want = plain.prompt(tiny.messages(tiny.image_item(a), tiny.image_item(b)))
        first = prompts.prompt(tiny.messages(tiny.image_item(a), tiny.image_item(b)))
        assert first["input_ids"] == want["input_ids"]
        # the pixels travel as their bytes (``Pixels``), and reach the engine as lmdeploy's tensors
        assert all(isinstance(m["pixel_values"], Pixels) for m in first["multimodal"])
        arrived = pickle.loads(pickle.dumps(first["multimodal"]))
        for got, ref in zip(arrived, want["multimodal"], strict=True):
            assert isinstance(got[REF_KEY], FeatTag) and got[REF_KEY].source is None
            assert got["pixel_values"].dtype == ref["pixel_values"].dtype
            assert torch.equal(got["pixel_values"], ref["pixel_values"])
        # sent before: not preprocessed again; the tags carry the images' pixel bytes instead
        again = prompts.prompt(tiny.messages(tiny.image_item(a), tiny.image_item(b)))
        assert again["input_ids"] == want["input_ids"]
        assert [len(c) for c in prompts.calls] == [2]
        for got, ref, im in zip(again["multimodal"], first["multimodal"], (a, b), strict=True):
            tag = got[REF_KEY]
            assert tag.key == ref[REF_KEY].key and tag.source.raw == im.tobytes()
            assert got["pixel_values"].shape[0] == 0
        back = pickle.loads(pickle.dumps(again["multimodal"]))
        assert [m[REF_KEY] for m in back] == [m[REF_KEY] for m in again["multimodal"]]
        stats = cache.stats()[SECTION]
        assert (stats["tagged"], stats["hits"], stats["misses"]) == (4, 2, 2)
    finally:
        plain.close()


def test_an_in_memory_image_is_rebuilt_from_its_pixel_bytes(frontend, side):
    prompts, _ = frontend
    (a,) = eng.images(4)
    first = request(prompts, a)
    again = request(prompts, a)  # sent before: its pixel bytes travel, not its pixels
    rows1, calls1 = side.step([first])
    ranks.local_cache().discard(pickle.loads(first)[1][0][REF_KEY].key)
    rows2, calls2 = side.step([again])
    assert len(calls2) == 1 and torch.equal(calls2[0], calls1[0])  # the same vision input
    assert torch.equal(rows2, rows1)
    palette = a.convert("P")  # its bytes do not say all of it: preprocessed, sent with pixels
    request(prompts, palette)
    _, mm = pickle.loads(request(prompts, palette))
    assert mm[0][REF_KEY].source is None and mm[0]["pixel_values"].shape[0] > 0


# -- the model side, one process -----------------------------------------------------------------

def test_model_process_runs_vision_once_per_distinct_image(frontend, side):
    prompts, _ = frontend
    a, b, c = eng.images(1, 2, 3)

    def pixels(blob):
        return [m["pixel_values"] for m in pickle.loads(blob)[1]]

    first = request(prompts, a, b)
    second = [request(prompts, c, a), request(prompts, b)]  # a and b: sent before, no pixels
    pa, pb = pixels(first)
    pc, none = pixels(second[0])
    assert none.shape[0] == 0
    rows1, calls1 = side.step([first])
    rows2, calls2 = side.step(second)
    # step 1: a and b computed; step 2: only c (a and b served from the process's cache)
    assert [x.shape[0] for x in calls1] == [pa.shape[0] + pb.shape[0]]
    assert len(calls2) == 1 and torch.equal(calls2[0], pc)
    fa, fb, fc = (eng.per_image(tiny.INTERNVL, p) for p in (pa, pb, pc))
    assert torch.equal(rows1, torch.cat([fa, fb]))
    assert torch.equal(rows2, torch.cat([fc, fa, fb]))
    stats = ranks.local_cache().stats()[SECTION]
    assert (stats["vision_calls"], stats["vision_images"], stats["vision_skipped"]) == (2, 3, 2)


def test_invalid_tag_is_computed_and_not_stored(frontend, side):
    prompts, _ = frontend
    (a,) = eng.images(1)
    ids, mm = pickle.loads(request(prompts, a))
    mm[0][REF_KEY] = _restore("corrupt", None)
    blob = pickle.dumps((ids, mm))
    for _ in range(2):
        rows, calls = side.step([blob])
        assert len(calls) == 1  # computed every time
        assert torch.equal(rows, eng.per_image(tiny.INTERNVL, mm[0]["pixel_values"]))
    assert len(ranks.local_cache()) == 0


def test_model_process_without_a_cache_computes_every_image(frontend, side, monkeypatch):
    prompts, _ = frontend
    (a,) = eng.images(1)
    monkeypatch.setattr(ranks, "_build", lambda settings: 1 / 0)  # the cache cannot be built
    for _ in range(2):
        rows, calls = side.step([request(prompts, a)])
        assert len(calls) == 1
    assert ranks.local_cache() is None


def test_partly_cached_tagged_image_is_recomputed_whole_and_sliced(frontend, side):
    """A prefix match ending inside a tagged image (``prefix.is_held``) that the model process
    does not hold: the whole image is recomputed from its pixels, stored whole, sliced."""
    prompts, _ = frontend
    (a,) = eng.images(1)
    ids, mm = pickle.loads(request(prompts, a))
    data = side.processor.preprocess_input(ids, mm).input_multimodals["image"][0]
    data.content_hash = "featcache:" + mm[0][REF_KEY].key.hex()
    assert prefix.is_held(data)
    bare = type(data)(**{**data.__dict__, "data": data.data[:0]})
    assert not prefix.is_held(bare)
    tag = mm[0][REF_KEY]  # sent without pixels, with the bytes to rebuild them: held
    bare.meta = {**bare.meta, REF_KEY: FeatTag(tag.key, tag.meta, Source(b"png", '{"io": {}}', "{}"))}
    assert prefix.is_held(bare)
    cache = ranks.local_cache()
    tokens = data.end - data.start
    skip = 3
    ref = FeatRef(cache, mm[0][REF_KEY].key, mm[0][REF_KEY].meta, None)
    whole = torch.arange(tokens * 8, dtype=torch.float32).reshape(tokens, 8)
    got = models._serve(models._Plan([ref], [tokens - skip], [skip]), lambda: whole)
    assert torch.equal(got, whole[skip:])
    with cache.lease(ref.key) as stored:
        assert torch.equal(stored, whole)


# -- images sent again without pixels ------------------------------------------------------------

@pytest.fixture
def sourced(path):
    """The tag-mode frontend with lmdeploy's source parsing hooked (data URLs keyed by bytes)."""
    cache = counters_cache()
    prompts = tiny.PromptPath(path)
    install_frontend(prompts.model, cache, "test:processes", prompts.processor, tags=True,
                     pack=True)
    prompts.record_featcache()  # calls: featcache's preprocessing too (InternVL-HF's)
    yield prompts, cache
    prompts.close()
    cache.close()


def sent_pixels(item: dict) -> torch.Tensor:
    """An image's pixels as the engine process gets them (sent as ``Pixels``: its bytes)."""
    return pickle.loads(pickle.dumps(item["pixel_values"]))


def data_url_request(prompts, raw: bytes, **kwargs) -> tuple[dict, bytes]:
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    out = prompts.prompt(tiny.messages({"type": "image_url", "image_url": {"url": url}}), **kwargs)
    return out, pickle.dumps((out["input_ids"], out["multimodal"]))


def test_an_encoded_image_sent_again_travels_without_pixels_and_is_served(sourced, side, path):
    prompts, cache = sourced
    raw = png(tiny.noise_image(120, 90, seed=4))
    first, blob1 = data_url_request(prompts, raw)
    assert len(prompts.calls) == 1 and first["multimodal"][0][REF_KEY].source is None
    pixels = sent_pixels(first["multimodal"][0])
    second, blob2 = data_url_request(prompts, raw)
    assert len(prompts.calls) == 1  # not decoded, not preprocessed: sent before
    tag = second["multimodal"][0][REF_KEY]
    assert tag.key == first["multimodal"][0][REF_KEY].key and tag.source.raw == raw
    assert second["multimodal"][0]["pixel_values"].shape[0] == 0
    assert second["input_ids"] == first["input_ids"]  # the same prompt, from the metadata
    assert len(blob2) < len(blob1)  # what lmdeploy's RPC carries: the PNG, not the pixels
    stats = cache.stats()[SECTION]
    assert (stats["hits"], stats["misses"], stats["tagged"]) == (1, 1, 2)

    rows1, calls1 = side.step([blob1])  # computed from the pixels sent
    rows2, calls2 = side.step([blob2])  # served: no pixels needed
    assert [c.shape[0] for c in calls1] == [pixels.shape[0]] and calls2 == []
    assert torch.equal(rows2, rows1)
    assert torch.equal(rows1, eng.per_image(tiny.INTERNVL, pixels))


def test_a_model_process_that_lost_the_features_rebuilds_the_pixels(sourced, side):
    prompts, _ = sourced
    raw = png(tiny.noise_image(120, 90, seed=5))
    first, blob1 = data_url_request(prompts, raw)
    _, blob2 = data_url_request(prompts, raw)
    rows1, _ = side.step([blob1])
    cache = ranks.local_cache()
    cache.discard(first["multimodal"][0][REF_KEY].key)  # evicted on purpose
    before = {k: cache.stats()[SECTION].get(k, 0) for k in ("preprocess_fast", "preprocess_fallback")}

    rows2, calls2 = side.step([blob2])
    # rebuilt from the PNG exactly as the frontend's process made them: same vision input, same
    # features; stored again, so the next time is served
    assert len(calls2) == 1
    assert torch.equal(calls2[0], sent_pixels(first["multimodal"][0]).to(calls2[0].dtype))
    assert torch.equal(rows2, rows1)
    stats = cache.stats()[SECTION]
    assert stats["pixels_rebuilt"] == 1
    # through featcache's preprocessing, counted on the process's cache (this InternVL-HF model's
    # fast path: tests/test_preprocess_exact_internvl_hf.py; lmdeploy's code not run)
    assert stats["preprocess_fast"] == before["preprocess_fast"] + 1
    assert stats.get("preprocess_fallback", 0) == before["preprocess_fallback"]
    rows3, calls3 = side.step([blob2])
    assert calls3 == [] and torch.equal(rows3, rows1)


def test_a_rebuild_decodes_with_the_requests_options(sourced, side, path):
    """A grey request (``media_io_kwargs`` image_mode "L") sent again without pixels, its features
    lost: the pixels rebuilt are lmdeploy's preprocessing of the grey-converted image (what the
    frontend made), not of the image decoded as RGB."""
    from PIL import Image

    prompts, _ = sourced
    grey = {"image": {"image_mode": "L"}}
    raw = png(tiny.noise_image(120, 90, seed=8))
    first, blob1 = data_url_request(prompts, raw, media_io_kwargs=grey)
    _, blob2 = data_url_request(prompts, raw, media_io_kwargs=grey)
    assert len(prompts.calls) == 1  # sent again without pixels
    plain = tiny.PromptPath(path)  # lmdeploy alone, given the grey-converted image
    try:
        want = plain.prompt(tiny.messages(tiny.image_item(Image.open(io.BytesIO(raw)).convert("L"))
                                          ))["multimodal"][0]["pixel_values"]
        as_rgb = plain.prompt(tiny.messages(tiny.image_item(Image.open(io.BytesIO(raw)).convert("RGB"))
                                            ))["multimodal"][0]["pixel_values"]
    finally:
        plain.close()
    assert not torch.equal(want, as_rgb)  # the options change the pixels
    assert torch.equal(sent_pixels(first["multimodal"][0]), want)
    side.step([blob1])
    cache = ranks.local_cache()
    cache.discard(first["multimodal"][0][REF_KEY].key)  # evicted on purpose
    before = {k: cache.stats()[SECTION].get(k, 0) for k in ("preprocess_fast", "preprocess_fallback")}

    rows2, calls2 = side.step([blob2])
    stats = cache.stats()[SECTION]
    assert len(calls2) == 1 and stats["pixels_rebuilt"] == 1
    # a grey image: lmdeploy's preprocessing (InternVL-HF's fast path takes RGB only), counted
    assert stats["preprocess_fallback"] == before["preprocess_fallback"] + 1
    assert stats.get("preprocess_fast", 0) == before["preprocess_fast"]
    assert torch.equal(calls2[0], want.to(calls2[0].dtype))
    assert torch.equal(rows2, eng.per_image(tiny.INTERNVL, want))


def test_an_image_without_pixels_or_source_is_refused_loudly(frontend, side):
    prompts, _ = frontend
    (a,) = eng.images(1)
    ids, mm = pickle.loads(request(prompts, a))
    mm[0]["pixel_values"] = mm[0]["pixel_values"][:0]
    with pytest.raises(RuntimeError, match="without pixels or the bytes"):
        side.step([pickle.dumps((ids, mm))])


# -- two ranks -----------------------------------------------------------------------------------

def two_ranks(path, tmp_path, blobs, evict, second=None) -> dict:
    """``_ranks.rank_main`` in two spawned processes (a gloo group); each rank's report."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_ranks.rank_main, args=(r, path, init, blobs, evict, out, second))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(2):
            got = out.get(timeout=120)  # a hang fails here, not forever
            assert len(got) > 2, f"rank {got[0]} failed: {got[1]}"
            results[got[0]] = got
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results


def test_ranks_agree_when_one_rank_lost_an_entry(frontend, path, tmp_path):
    prompts, _ = frontend
    a, b = eng.images(1, 2)
    blobs = [request(prompts, a, b)]
    evict = pickle.loads(blobs[0])[1][0][REF_KEY].key  # a's key
    results = two_ranks(path, tmp_path, blobs, evict)
    (_, first0, second0, calls1_0, calls2_0, stats0, rank0, writes0) = results[0]
    (_, first1, second1, calls1_1, calls2_1, stats1, rank1, writes1) = results[1]
    assert (rank0, rank1) == (0, 1)
    assert (writes0, writes1) == (True, False)  # one shared store: only rank 0 writes it
    pa, pb = (m["pixel_values"] for m in pickle.loads(blobs[0])[1])
    # step 1: both images computed on both ranks; step 2: a recomputed on both (rank 1 lost it),
    # b served from both caches: the same vision call on every rank
    assert calls1_0 == calls1_1 == [pa.shape[0] + pb.shape[0]]
    assert calls2_0 == calls2_1 == [pa.shape[0]]
    want = torch.cat([eng.per_image(tiny.INTERNVL, pa), eng.per_image(tiny.INTERNVL, pb)])
    for rows in (first0, second0, first1, second1):
        assert torch.equal(torch.from_numpy(rows), want)
    assert stats0["agreed_misses"] == 1 and "agreed_misses" not in stats1
    for stats in (stats0, stats1):  # each rank's accounting: 3 images computed, 1 served
        assert (stats["vision_images"], stats["vision_skipped"]) == (3, 1)


def test_ranks_rebuild_the_pixels_of_an_image_one_rank_lost(sourced, path, tmp_path):
    """An image sent again without pixels, lost by rank 1 only: both ranks rebuild its pixels
    from the bytes and make the same vision call, with the pixels the frontend first made."""
    prompts, _ = sourced
    raw = png(tiny.noise_image(120, 90, seed=6))
    first, blob1 = data_url_request(prompts, raw)
    _, blob2 = data_url_request(prompts, raw)
    pixels = sent_pixels(first["multimodal"][0])
    results = two_ranks(path, tmp_path, [blob1], first["multimodal"][0][REF_KEY].key, [blob2])
    (_, first0, again0, calls1_0, calls2_0, stats0, _, _) = results[0]
    (_, first1, again1, calls1_1, calls2_1, stats1, _, _) = results[1]
    assert calls1_0 == calls1_1 == calls2_0 == calls2_1 == [pixels.shape[0]]
    want = eng.per_image(tiny.INTERNVL, pixels)
    for rows in (first0, again0, first1, again1):
        assert torch.equal(torch.from_numpy(rows), want)
    assert stats0["agreed_misses"] == 1  # rank 0 held it; rank 1 did not
    assert stats0["pixels_rebuilt"] == stats1["pixels_rebuilt"] == 1


# -- the channels into lmdeploy's processes ------------------------------------------------------

def _fresh_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=240)


def test_engine_config_unpickled_in_a_fresh_process_installs_the_engine_hooks():
    from lmdeploy import PytorchEngineConfig

    from featcache.lmdeploy.pytorch.processes import FeatcacheEngineConfig

    config = FeatcacheEngineConfig.of(PytorchEngineConfig(enable_mp_engine=True, tp=1,
                                                          enable_prefix_caching=True),
                                      {"default_cache": {"path": "/tmp/x"}})
    blob = pickle.dumps(config)
    code = f"""
import pickle, sys
assert "featcache.lmdeploy.pytorch.processes" not in sys.modules
config = pickle.loads({blob!r})
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.mp_engine.base_worker import EngineWorkerBase
assert Engine.__init__._featcache and callable(EngineWorkerBase.featcache_stats)
print(type(config).__name__, config.enable_mp_engine, config.enable_prefix_caching,
      config.featcache_cache)
"""
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:3] == ["FeatcacheEngineConfig", "True", "True"]


def test_module_map_file_installs_the_model_hooks_through_lmdeploy(tmp_path):
    from featcache.lmdeploy.pytorch.processes import rank_hook_file

    settings = {"feature_cache": {"device": "cpu", "device_bytes": 1 << 20, "host_bytes": 0,
                                  "disk_path": str(tmp_path / "store")}}
    hook = rank_hook_file(settings)
    assert os.path.dirname(rank_hook_file(settings)) != os.path.dirname(hook)  # one per engine
    code = f"""
import os, _ranks
_ranks.stub_xgrammar()
from lmdeploy.pytorch.models.patch import update_custom_module_map
update_custom_module_map({hook!r})  # what lmdeploy's model agent runs in each rank
from featcache.lmdeploy.pytorch import rankstats, ranks, models
from lmdeploy.pytorch.models.internvl3_hf import InternVLForConditionalGeneration as C
assert ranks.installed() and C.prepare_inputs_for_generation._featcache
cache = ranks.local_cache()
cache.count("lmdeploy", "vision_images")
answers = rankstats.gather(os.path.dirname({hook!r}))  # what the driver reads, from outside
assert [a["pid"] for a in answers] == [os.getpid()], answers
print(cache.config.disk_path, answers[0]["rank"], answers[0]["stats"]["lmdeploy"]["vision_images"])
"""
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path / "store"), "0", "1"]


def test_module_map_is_set_on_the_target_model_config_only_while_building(path):
    from lmdeploy.pytorch.config import ModelConfig

    from featcache.lmdeploy.pytorch import processes

    with processes._module_map("/x/featcache_rank_hook.py"):
        config = ModelConfig.from_pretrained(path, device_type="cpu")
        draft = ModelConfig.from_pretrained(path, device_type="cpu", is_draft_model=True)
    after = ModelConfig.from_pretrained(path, device_type="cpu")
    assert config.custom_module_map == "/x/featcache_rank_hook.py"
    assert draft.custom_module_map is None and after.custom_module_map is None


def test_settings_of_a_cache_rebuild_its_tiers(tmp_path):
    from featcache import FeatureCache
    from featcache.lmdeploy.pytorch.processes import cache_settings

    with FeatureCache(device="cpu", device_bytes="8MiB", host_bytes=0,
                      disk_path=str(tmp_path), disk_bytes="64MiB") as cache:
        settings = cache_settings(cache)
    assert "device" not in settings["feature_cache"]
    json.dumps(settings)  # carried as JSON into the rank hook file
    ranks.configure(json.dumps({"feature_cache": {**settings["feature_cache"], "device": "cpu"}}))
    try:
        again = ranks.local_cache()
        assert again.config == cache.config
    finally:
        ranks.reset_for_tests()


def test_engine_stats_read_the_ranks_sockets_never_lmdeploys_executor(tmp_path):
    """At tp > 1 the driver asks each rank on its own socket: lmdeploy's executor buffers are
    read by the running engine (a second reader could take a forward's outputs)."""
    import types

    from featcache.lmdeploy.pytorch import processes, rankstats

    class Executor:
        def collective_rpc(self, *args, **kwargs):
            raise AssertionError("featcache must not use lmdeploy's executor channel")

    answer = {"rank": 1, "pid": 4242, "stats": {"lmdeploy": {"vision_images": 3}}}
    rankstats.serve(str(tmp_path), lambda: answer)
    engine = types.SimpleNamespace(dist_config=types.SimpleNamespace(world_size=2),
                                   featcache_folder=str(tmp_path), executor=Executor())
    assert processes.engine_stats(engine) == [answer]
    # tp=1 on lmdeploy's mp executor: the model's one process answers the same way
    one = types.SimpleNamespace(dist_config=types.SimpleNamespace(world_size=1),
                                featcache_folder=str(tmp_path), executor=Executor())
    assert processes.engine_stats(one) == [answer]
    # no model process answered (none ran the hook): this process's counters
    empty = tmp_path / "empty"
    empty.mkdir()
    alone = types.SimpleNamespace(dist_config=types.SimpleNamespace(world_size=1),
                                  featcache_folder=str(empty), executor=Executor())
    assert processes.engine_stats(alone) == [ranks.stats()]


@pytest.mark.parametrize("settings, env, outside", [
    ({}, None, False),                                     # lmdeploy's uni executor
    ({"tp": 2}, None, True),
    ({"enable_mp_engine": True}, None, True),
    ({"distributed_executor_backend": "mp"}, None, True),  # tp=1, the model in a rank process
    ({"distributed_executor_backend": "ray"}, None, True),
    ({"distributed_executor_backend": "uni"}, "mp", False),  # the config wins over the variable
    ({}, "mp", True),                                      # LMDEPLOY_EXECUTOR_BACKEND=mp
    ({}, "uni", False),
])
def test_multi_process_mode_follows_where_lmdeploy_runs_the_model(monkeypatch, settings, env,
                                                                  outside):
    """An mp or ray executor spawns the model's process even at tp=1: forward inputs are then
    pickled to it, so the in-process mode (whose leases hold CUDA streams) must not be chosen
    (seen on the H200: "cannot pickle 'Stream' object" stopped the engine)."""
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.pytorch import envs

    from featcache.lmdeploy import multi_process

    monkeypatch.setattr(envs, "executor_backend", env)
    assert multi_process(PytorchEngineConfig(**settings)) is outside


# -- an image that cannot be rebuilt fails its own request, never the engine -----------------------

def _png_bytes(seed: int = 40) -> bytes:
    return png(tiny.noise_image(32, 24, seed=seed))


@pytest.mark.parametrize("source, why", [
    (Source(b"\x89PNG not an image at all", '{"io": {}}', "{}"), "not an image"),
    (Source(b"", '{"io": {}}', "{}"), "no bytes"),
    (Source(b"x", "{not json", "{}"), "not JSON"),
    (Source(b"x", '{"io": {}}', "[1]"), "not what the frontend sends"),
    (Source(b"x", '{"io": {}, "pil": {}}', "{}"), "not what the frontend sends"),
    (Source(b"\0" * 11, '{"pil": {"mode": "RGB", "size": [2, 2]}}', "{}"), "do not match"),
    (Source(b"\0" * 12, '{"pil": {"mode": "P", "size": [2, 2]}}', "{}"), "do not match"),
])
def test_a_source_that_cannot_rebuild_is_found_without_decoding(source, why):
    from featcache.lmdeploy.pytorch.rebuild import problem

    assert why in problem(source)


def test_a_source_the_frontend_sends_can_rebuild():
    from featcache.lmdeploy.pytorch.rebuild import problem

    assert problem(Source(_png_bytes(), '{"io": {}}', "{}")) is None
    assert problem(Source(b"\0" * 12, '{"pil": {"mode": "RGB", "size": [2, 2]}}',
                          '{"max_dynamic_patch": 6}')) is None


def test_the_engine_answers_a_request_with_an_unservable_image_alone():
    """lmdeploy's own ``Engine._on_add_message`` (as featcache wraps it), on a stand-in engine:
    the request whose image came without pixels and cannot be rebuilt gets an error response;
    the others are processed and scheduled as before."""
    import types

    from lmdeploy.messages import ResponseType
    from lmdeploy.pytorch.engine.engine import Engine

    import featcache.lmdeploy.pytorch.processes  # noqa: F401  (what installs the engine hooks)
    from featcache.lmdeploy.pytorch.engine import KeyedInputProcessor

    processed, responses, scheduled = [], [], []

    class Inner:
        def preprocess_input(self, input_ids, input_multimodals, **kwargs):
            processed.append(input_ids)
            return types.SimpleNamespace(input_ids=input_ids, input_multimodals={"image": []})

    engine = types.SimpleNamespace(
        scheduler=None, input_processor=KeyedInputProcessor(Inner()),
        engine_config=types.SimpleNamespace(language_model_only=False),
        cache_config=types.SimpleNamespace(enable_prefix_caching=False),
        _response=lambda resp, kind, data=None, err_msg="": responses.append((resp, kind, err_msg)),
        _add_message=lambda reqs: scheduled.extend(r.resp for r in reqs))
    empty = torch.empty(0, 3, 448, 448)
    good = FeatTag(b"k" * 16, b"{}", Source(_png_bytes(), '{"io": {}}', "{}"))
    bad = FeatTag(b"j" * 16, b"{}", Source(b"garbage", '{"io": {}}', "{}"))

    def request(name, tag, tokens):
        return types.SimpleNamespace(resp=name, data={
            "session_id": 1, "token_ids": tokens,
            "input_multimodals": [{"pixel_values": empty, REF_KEY: tag}]})

    Engine._on_add_message(engine, [request("a", good, [1]), request("b", bad, [2]),
                                    request("c", good, [3])])
    assert scheduled == ["a", "c"] and processed == [[1], [3]]
    [(resp, kind, message)] = responses
    assert resp == "b" and kind == ResponseType.INTERNAL_ENGINE_ERROR
    assert "cannot be rebuilt: its bytes are not an image" in message
