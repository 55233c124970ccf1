"""featcache's preprocessing of new images against lmdeploy 0.18's own (issue 38): equal bit for
bit, or lmdeploy's own code, counted.

The reference is lmdeploy's real ``InternVLVisionModel`` for the seed InternVL2-2B checkpoint
(config, remote code and tokenizer: ``make_seed_models`` dry run; 448-pixel tiles, up to 12 and a
thumbnail), its preprocessing built from torchvision's own transforms (bench/lib/torchvision_ref.py).
Images are generated files (tests/image_corpus.py) decoded as lmdeploy decodes a request's image
(``ImageMediaIO``). Every comparison also checks that the fast path ran (its counter), so that
a fallback cannot pass for exactness. The CUDA variants run on the GPU machine (marked ``gpu``).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import _lmdeploy_stack
import numpy as np
import pytest
import torch
from PIL import Image

_lmdeploy_stack.require()

import image_corpus as corpus  # noqa: E402  (puts the checkout on sys.path)

from bench.lib import torchvision_ref as tv  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "bench", "device"))
import make_seed_models as seed  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy import fastprep  # noqa: E402
from featcache.preprocess.resample import Resampler, matches_pillow, pillow_major  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DEVICES = ["cpu", CUDA]


# -- the resize alone, against the installed Pillow ------------------------------------------------

def _sizes(n: int, seed_: int) -> list[tuple[int, int, int, int]]:
    rng = np.random.default_rng(seed_)
    fixed = [(1, 1, 448, 448), (1344, 1008, 1792, 1344), (1344, 1008, 448, 448), (40, 2000, 448, 448),
             (2000, 40, 448, 448), (8000, 60, 5376, 448), (95, 99, 266, 26), (447, 448, 448, 448),
             (449, 897, 448, 896), (3, 5, 1344, 448)]
    rand = [tuple(int(v) for v in rng.integers(1, 1600, 4)) for _ in range(n)]
    return fixed + rand  # type: ignore[return-value]


@pytest.mark.parametrize("device", DEVICES)
def test_resampler_equals_pillows_bicubic_resize(device):
    r = Resampler(device)
    rng = np.random.default_rng(1)
    for w, h, ow, oh in _sizes(40, 2):
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        want = np.asarray(Image.fromarray(pixels).resize((ow, oh)))
        chw = torch.from_numpy(pixels).permute(2, 0, 1).contiguous().to(device)
        got = r.resize(chw, (ow, oh)).permute(1, 2, 0).cpu().numpy()
        assert np.array_equal(got, want), f"{w}x{h} -> {ow}x{oh}"


def test_the_pillow_check_refuses_another_pillows_pass_order():
    """Pillow 13 runs the vertical pass first where the height shrinks most; a resampler that
    follows the other order is caught by the check that guards the CUDA path."""
    assert matches_pillow(Resampler("cpu"))
    other = 12 if pillow_major() >= 13 else 13
    assert not matches_pillow(Resampler("cpu", pillow=other))


# -- InternVL-Chat-V1-5 preprocessing, against lmdeploy's -------------------------------------------

@pytest.fixture(scope="module")
def vision_model(tmp_path_factory):
    _lmdeploy_stack.need_transforms()
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.vl.engine import ImageEncoder

    path = seed.build("2b", str(tmp_path_factory.mktemp("seed")), dry_run=True)["path"]
    with tv.installed():  # lmdeploy imports torchvision's transforms while building its preprocessor
        encoder = ImageEncoder(path, "pytorch", backend_config=PytorchEngineConfig(dtype="float16"),
                               trust_remote_code=True)
    vm = encoder.model
    vm.mm_feature_dtype = torch.bfloat16  # the seed checkpoint's (a CPU would ask CUDA for bf16)
    yield vm
    encoder.executor.shutdown(wait=True)


@pytest.fixture(scope="module")
def images():
    from lmdeploy.vl.media.image import ImageMediaIO

    return {name: ImageMediaIO().load_bytes(make()) for name, make in corpus.CASES.items()}


def _messages(*items):
    return [dict(role="user", content=[dict(type="text", text="describe"), *items])]


def _item(image, **params):
    return dict(type="image", data=image, **params)


def _fast(vision_model, device, monkeypatch):
    monkeypatch.setenv(fastprep.ENV, device)
    cache = FeatureCache(device="cpu", device_bytes=0, host_bytes=0)
    fast = fastprep.FastPreprocess(vision_model, vision_model.preprocess, cache)
    assert fast.maker is not None, fast.why
    assert fast.maker.device.type == device
    return fast, cache


def _outputs(messages):
    return messages[-1]["content"]


def _assert_same(got, want, what):
    assert len(got) == len(want), what
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys(), what
        assert g["pixel_values"].dtype == w["pixel_values"].dtype, what
        assert g["pixel_values"].device.type == "cpu", what
        assert torch.equal(g["pixel_values"], w["pixel_values"]), what
        assert {k: v for k, v in g.items() if k != "pixel_values"} == \
            {k: v for k, v in w.items() if k != "pixel_values"}, what


def _check(fast, cache, vision_model, items, what):
    before = cache.stats().get("lmdeploy", {}).get("preprocess_fast", 0)
    got = _outputs(fast(_messages(*items)))
    want = _outputs(vision_model.preprocess(_messages(*items)))
    _assert_same(got, want, what)
    assert cache.stats()["lmdeploy"]["preprocess_fast"] == before + len(items), what


@pytest.mark.parametrize("device", DEVICES)
def test_every_corpus_image_at_the_models_defaults(vision_model, images, device, monkeypatch):
    fast, cache = _fast(vision_model, device, monkeypatch)
    for name, image in images.items():
        assert image.mode == "RGB"
        _check(fast, cache, vision_model, [_item(image)], name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("thumbnail", [True, False])
def test_every_tile_budget_with_and_without_the_thumbnail(vision_model, images, device, thumbnail,
                                                          monkeypatch):
    monkeypatch.setattr(vision_model.config, "use_thumbnail", thumbnail)
    fast, cache = _fast(vision_model, device, monkeypatch)
    assert fast.maker.spec.use_thumbnail is thumbnail
    names = ["jpeg-420-photo-1344x1008", "png-1-to-50-40x2000", "png-895x449", "png-rgb-1x1",
             "jpeg-444-1000x700", "png-50-to-1-2000x40"]
    for max_num in range(1, 13):
        for name in names:
            _check(fast, cache, vision_model, [_item(images[name], max_dynamic_patch=max_num)],
                   f"{name} max_dynamic_patch={max_num}")


@pytest.mark.parametrize("device", DEVICES)
def test_a_large_photo(vision_model, device, monkeypatch):
    from lmdeploy.vl.media.image import ImageMediaIO

    fast, cache = _fast(vision_model, device, monkeypatch)
    for name, make in corpus.LARGE.items():
        _check(fast, cache, vision_model, [_item(ImageMediaIO().load_bytes(make()))], name)


@pytest.mark.parametrize("device", DEVICES)
def test_many_images_in_one_request_keep_their_order_and_parameters(vision_model, images, device,
                                                                   monkeypatch):
    """Items of one request are made side by side on the GPU path: each output stays its item's."""
    fast, cache = _fast(vision_model, device, monkeypatch)
    names = list(images)[:9]
    params = [dict(max_dynamic_patch=n) for n in (1, 12, 6)] + [dict(detail="low"), dict(detail="high"),
                                                                 dict(detail="medium"), {}, {}, {}]
    items = [_item(images[n], **p) for n, p in zip(names, params, strict=True)]
    _check(fast, cache, vision_model, items, "nine images")


def test_the_per_image_parameters_are_read_as_lmdeploy_reads_them(vision_model, images, monkeypatch):
    """``detail`` levels, a bool (an int in Python, as lmdeploy takes it), a string (not an int:
    the default), an unknown level: each as lmdeploy's ``_preprocess_v1_5`` reads it."""
    fast, cache = _fast(vision_model, "cpu", monkeypatch)
    image = images["jpeg-420-photo-1344x1008"]
    for params in (dict(detail="low"), dict(detail="high"), dict(detail="nonsense"),
                   dict(max_dynamic_patch=True), dict(max_dynamic_patch="4"),
                   dict(max_dynamic_patch=None, detail="medium"), dict(max_dynamic_patch=24)):
        _check(fast, cache, vision_model, [_item(image, **params)], str(params))


def test_what_it_does_not_reproduce_goes_to_lmdeploy_counted(vision_model, images, monkeypatch):
    """A grey image (a request's ``image_mode``), a tile budget past ``MAX_FAST_TILES``, one
    below the model's minimum: lmdeploy's own output, counted as ``preprocess_fallback``."""
    fast, cache = _fast(vision_model, "cpu", monkeypatch)
    grey = images["png-448x448"].convert("L")
    photo = images["png-895x449"]
    for item in (_item(grey), _item(photo, max_dynamic_patch=fastprep.MAX_FAST_TILES + 1),
                 _item(photo, max_dynamic_patch=0)):
        before = cache.stats().get("lmdeploy", {}).get("preprocess_fallback", 0)
        got = _outputs(fast(_messages(_item(photo), item)))  # one such item: the request falls back
        _assert_same(got, _outputs(vision_model.preprocess(_messages(_item(photo), item))), str(item))
        assert cache.stats()["lmdeploy"]["preprocess_fallback"] == before + 2
    assert cache.stats()["lmdeploy"].get("preprocess_fast", 0) == 0
    # refused before the fast path ran (a planned fallback), not a failure of it caught after
    assert cache.stats()["lmdeploy"].get("preprocess_errors", 0) == 0


def test_a_failure_of_the_fast_path_is_lmdeploys_output_counted(vision_model, images, monkeypatch):
    fast, cache = _fast(vision_model, "cpu", monkeypatch)

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(fast.maker, "_on_cpu", broken)
    items = [_item(images["png-449x448"]), _item(images["bmp-333x222"])]
    got = _outputs(fast(_messages(*items)))
    _assert_same(got, _outputs(vision_model.preprocess(_messages(*items))), "planted failure")
    stats = cache.stats()["lmdeploy"]
    assert stats["preprocess_errors"] == 2 and stats["preprocess_fallback"] == 2


def test_lmdeploy_mode_and_other_models_keep_lmdeploys_code(vision_model, monkeypatch):
    monkeypatch.setenv(fastprep.ENV, "lmdeploy")
    cache = FeatureCache(device="cpu", device_bytes=0, host_bytes=0)
    assert fastprep.FastPreprocess(vision_model, vision_model.preprocess, cache).maker is None
    monkeypatch.setenv(fastprep.ENV, "auto")
    assert "not lmdeploy's InternVL" in str(fastprep.internvl_spec(object()))
    monkeypatch.setenv(fastprep.ENV, "sideways")
    with pytest.raises(ValueError, match="FEATCACHE_PREPROCESS must be one of"):
        fastprep.mode()


def test_a_changed_transform_is_not_reproduced(vision_model, monkeypatch):
    steps = vision_model.transform.transforms
    monkeypatch.setattr(vision_model.transform, "transforms", steps[:3])  # no Normalize
    assert "transform is" in str(fastprep.internvl_spec(vision_model))


# -- new images are not serialized -------------------------------------------------------------------

class _Encoder:
    """lmdeploy's ``ImageEncoder.preprocess`` over a model whose preprocess waits for another."""

    def __init__(self, barrier: threading.Barrier) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from lmdeploy.vl.engine import ImageEncoder

        def preprocess(messages):
            barrier.wait()  # both requests inside preprocess at once, or a BrokenBarrierError
            return messages

        preprocess._featcache = True
        self.model = type("Model", (), {"preprocess": staticmethod(preprocess)})()
        self.executor = ThreadPoolExecutor(max_workers=1)  # as lmdeploy builds it
        self._uses_new_preprocess = False
        self.preprocess = ImageEncoder.preprocess.__get__(self)


def test_widen_lets_two_requests_preprocess_at_once(monkeypatch):
    monkeypatch.setattr(fastprep, "THREADS", 2)

    async def two(encoder):
        return await asyncio.gather(encoder.preprocess([]), encoder.preprocess([]))

    narrow = _Encoder(threading.Barrier(2, timeout=0.5))
    with pytest.raises(threading.BrokenBarrierError):  # lmdeploy's one worker: one at a time
        asyncio.run(two(narrow))
    narrow.executor.shutdown(wait=True)

    wide = _Encoder(threading.Barrier(2, timeout=30))
    forward = wide.executor
    fastprep.widen(wide)
    assert wide._featcache_wide._max_workers == 2
    assert asyncio.run(two(wide)) == [[], []]
    fastprep.widen(wide)  # twice: once
    assert wide.executor is forward and forward._max_workers == 1  # forward keeps its one worker
    wide._featcache_wide.shutdown(wait=True)
    forward.shutdown(wait=True)


def test_a_model_processes_rebuild_preprocesses_with_featcache(vision_model, images, tmp_path,
                                                                 monkeypatch):
    """A model process rebuilding the pixels of an image it lost (``rebuild.pixels``) runs
    featcache's preprocessing over the model its settings name: lmdeploy's output, counted as
    fast on the process's cache; lmdeploy's own where no cache is open there."""
    from featcache.lmdeploy.pytorch import rebuild

    monkeypatch.setenv(fastprep.ENV, "cpu")
    settings = {"model_path": vision_model.model_path, "dtype": "float16", "device_type": "cpu",
                "trust_remote_code": True}
    cache = FeatureCache(device="cpu", device_bytes=0, host_bytes=0)
    try:
        with tv.installed():
            model = rebuild.vision_model(settings)
            fast = rebuild.preprocessor(settings, cache)
        assert isinstance(fast, fastprep.FastPreprocess) and fast.maker is not None, fast
        assert rebuild.preprocessor(settings, cache) is fast  # one per process
        assert rebuild.preprocessor(settings, None) == model.preprocess  # no cache: lmdeploy's
        photo = images[next(iter(images))]
        got = _outputs(fast(_messages(_item(photo))))
        _assert_same(got, _outputs(model.preprocess(_messages(_item(photo)))), "rebuild")
        assert cache.stats()["lmdeploy"]["preprocess_fast"] == 1
    finally:
        cache.close()
        rebuild._models.clear()
        rebuild._preprocessors.clear()
