"""featcache's Qwen2-VL / Qwen2.5-VL preprocessing against lmdeploy 0.18's own (issue 38): every
per-image output equal (``torch.equal`` tensors, same keys in the same order, same types), or
lmdeploy's own code, counted.

The reference is lmdeploy's real ``Qwen2VLModel.preprocess`` over transformers' PIL
``Qwen2VLImageProcessorPil`` of the tiny checkpoint (tests/lmdeploy_tiny.py: ``min_pixels``
56*56, ``max_pixels`` 28*28*64), and per-image ``min_pixels``/``max_pixels`` (which lmdeploy
passes to the processor) for sizes that keep their pixels, shrink or grow. Images are generated
files (tests/image_corpus.py) decoded as lmdeploy decodes a request's image, and noise images of
chosen sizes. Every comparison also checks that the fast path ran (its counter), so that a
fallback cannot pass for exactness.
"""

from __future__ import annotations

import json
import os
import shutil

import _lmdeploy_stack
import numpy as np
import pytest
import torch
from PIL import Image

_lmdeploy_stack.require()

import _exact_prep  # noqa: E402
import image_corpus as corpus  # noqa: E402  (puts the checkout on sys.path)
import lmdeploy_tiny as tiny  # noqa: E402
from _exact_prep import NEEDS_TORCHVISION, encoder, with_pil  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy import fastprep  # noqa: E402
from featcache.preprocess import qwen2vl, resizers  # noqa: E402

# the shared helpers (tests/_exact_prep.py), under the names these tests use
_messages = _exact_prep.messages
_item = _exact_prep.item
_fast = _exact_prep.fast_preprocess
_outputs = _exact_prep.outputs
_assert_same = _exact_prep.assert_same
_stat = _exact_prep.stat
_check = _exact_prep.check
_noise = _exact_prep.noise
_assert_fallback = _exact_prep.assert_fallback
_torchvision_functional = _exact_prep.torchvision_functional
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
QWEN_MAX = 12845056  # Qwen2-VL-7B-Instruct's max_pixels (its preprocessor_config.json)


@pytest.fixture(scope="module")
def images():
    return _exact_prep.corpus_images()


PIL = "Qwen2VLImageProcessorPil"  # the processor lmdeploy's code is compared over (tests/_exact_prep.py)


def _encoder(path):
    return encoder(path, PIL)


def _with_pil(vision_model, path):
    with_pil(vision_model, path, PIL)


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory):
    yield from _exact_prep.tiny_vision_model(tiny.QWEN2VL, PIL, tmp_path_factory)


def test_the_tiny_checkpoints_processor_is_reproduced(vision_model, monkeypatch):
    fast, _ = _fast(vision_model, monkeypatch)
    assert isinstance(fast.maker, qwen2vl.PatchMaker), fast.why
    assert (fast.maker.spec.min_pixels, fast.maker.spec.max_pixels) == (56 * 56, 28 * 28 * 64)


def test_every_corpus_image_at_the_processors_defaults(vision_model, images, monkeypatch):
    fast, cache = _fast(vision_model, monkeypatch)
    for name, image in images.items():
        assert image.mode == "RGB"
        _check(fast, cache, vision_model, [_item(image)], name)


SIZES = [(1, 1), (3, 5), (27, 29), (28, 28), (56, 56), (57, 55), (224, 224), (640, 480),
         (1344, 1008), (1000, 7), (7, 1000), (5600, 28), (28, 5600), (1999, 13)]
def _lim(vision_model, params):
    """``params`` as they are where this transformers honours a call's min_pixels or max_pixels
    given alone (5.24); else (5.17, the GPU machine's) the other limit added at the processor's
    default, so that the image is one featcache reproduces there: one limit alone on such a
    transformers goes to lmdeploy's code, which
    test_a_processor_that_ignores_one_limit_alone_keeps_those_images_on_lmdeploys_code checks."""
    ip = vision_model.processor.image_processor
    if _single_limits(ip) or len(params) != 1:
        return dict(params)
    size = ip.size
    return {"min_pixels": size.shortest_edge, "max_pixels": size.longest_edge, **params}


def _single_limits(ip) -> bool:
    """Whether ``ip`` honours max_pixels given alone (an oracle of its own: the grid it makes)."""
    image = Image.fromarray(np.zeros((280, 280, 3), dtype=np.uint8), "RGB")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = ip(images=[image], return_tensors="pt", max_pixels=28 * 28 * 4)["image_grid_thw"]
    return alone.tolist() == [[1, 4, 4]]


PIXELS = [{}, dict(max_pixels=QWEN_MAX), dict(min_pixels=200 * 200), dict(max_pixels=28 * 28 * 4),
          dict(min_pixels=28 * 28, max_pixels=28 * 28 * 16)]


def test_generated_sizes_and_pixel_limits(vision_model, monkeypatch):
    """Sizes a multiple of 28 and not, tiny, 1:200 both ways; limits that keep the pixels (so no
    resize), shrink or grow them, or one side only."""
    fast, cache = _fast(vision_model, monkeypatch)
    for i, (w, h) in enumerate(SIZES):
        image = _noise(w, h, seed=i)
        for params in PIXELS:
            _check(fast, cache, vision_model, [_item(image, **_lim(vision_model, params))],
                   f"{w}x{h} {params}")


def test_a_size_that_needs_no_resize_is_not_resized(vision_model, monkeypatch):
    fast, cache = _fast(vision_model, monkeypatch)
    image = corpus._rgb(1344, 1008)
    limits = _lim(vision_model, dict(max_pixels=QWEN_MAX))

    def refused(*args, **kwargs):
        raise AssertionError("resized")

    monkeypatch.setattr(Image.Image, "resize", refused)
    got = _outputs(fast(_messages(_item(image, **limits))))
    monkeypatch.undo()
    _assert_same(got, _outputs(vision_model.preprocess(_messages(_item(image, **limits)))),
                 "1344x1008")
    assert got[0]["image_grid_thw"].tolist() == [[1, 72, 96]]


@pytest.mark.parametrize("size", [(3000, 2000), (1344, 1008)])
def test_large_photos_at_qwen2vls_real_limit(vision_model, size, monkeypatch):
    """Many row bands on the pool: 3000x2000 resized to 2996x1988, 1344x1008 as it is."""
    fast, cache = _fast(vision_model, monkeypatch)
    assert fast.maker.bands == fastprep.THREADS
    monkeypatch.setattr(fast.maker, "bands", 8)  # more bands than this machine's threads
    _check(fast, cache, vision_model,
           [_item(corpus._rgb(*size, seed=5), **_lim(vision_model, dict(max_pixels=QWEN_MAX)))],
           f"{size}")


def test_many_images_in_one_request_keep_their_order_and_parameters(vision_model, images,
                                                                   monkeypatch):
    fast, cache = _fast(vision_model, monkeypatch)
    names = list(images)[:6]
    params = [{}, dict(max_pixels=QWEN_MAX), dict(min_pixels=100 * 100), {}, dict(max_pixels=3136), {}]
    _check(fast, cache, vision_model,
           [_item(images[n], **_lim(vision_model, p)) for n, p in zip(names, params, strict=True)],
           "six images")


def test_the_prompt_lmdeploy_builds_is_the_same(tmp_path_factory, monkeypatch):
    """What the engine gets (input_ids, every per-image input, the token spans) through
    lmdeploy's own prompt path, its model's preprocess featcache's or lmdeploy's."""
    path = tiny.checkpoint(tiny.QWEN2VL, tmp_path_factory)
    plain, ours = tiny.PromptPath(path), tiny.PromptPath(path)
    _with_pil(plain.model, path)
    _with_pil(ours.model, path)
    monkeypatch.setenv(fastprep.ENV, "auto")
    cache = FeatureCache(device="cpu", device_bytes=0, host_bytes=0)
    try:
        ours.model.preprocess = fastprep.FastPreprocess(ours.model, ours.model.preprocess, cache)
        msgs = lambda: tiny.messages(tiny.image_item(_noise(300, 200, 1)),  # noqa: E731
                                     tiny.image_item(_noise(90, 700, 2),
                                                     **_lim(ours.model, dict(max_pixels=QWEN_MAX))))
        want, got = plain.prompt(msgs()), ours.prompt(msgs())
        assert ours.calls == [] and _stat(cache, "preprocess_fast") == 2
        assert got.keys() == want.keys() and got["prompt"] == want["prompt"]
        assert got["input_ids"] == want["input_ids"]
        _assert_same(got["multimodal"], want["multimodal"], "prompt")
    finally:
        plain.close()
        ours.close()


def test_qwen25vl_checkpoints_are_reproduced_too(tmp_path_factory, monkeypatch):
    """lmdeploy's ``Qwen2VLModel`` serves both architectures with the same processor call."""
    src = tiny.checkpoint(tiny.QWEN2VL, tmp_path_factory)
    path = str(tmp_path_factory.mktemp("qwen25") / "qwen25vl_tiny")
    shutil.copytree(src, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    encoder = _encoder(path)
    try:
        fast, cache = _fast(encoder.model, monkeypatch)
        assert isinstance(fast.maker, qwen2vl.PatchMaker), fast.why
        _check(fast, cache, encoder.model, [_item(_noise(500, 300))], "qwen2.5-vl")
    finally:
        encoder.executor.shutdown(wait=True)


# -- what is not reproduced: lmdeploy's own code, counted ---------------------------------------------


def test_images_and_parameters_it_does_not_reproduce_go_to_lmdeploy_counted(vision_model, images,
                                                                            monkeypatch):
    """A grey image, an RGB image with a transparency key (the processor composites it onto
    white), parameters that are not ints (None fails the processor's check), an aspect past
    1:200 (the processor refuses it): the
    request is lmdeploy's, counted as ``preprocess_fallback`` for every image in it."""
    fast, cache = _fast(vision_model, monkeypatch)
    photo = images["png-895x449"]
    keyed = _noise(64, 48)
    keyed.info["transparency"] = (0, 0, 0)
    for item in (_item(images["png-448x448"].convert("L")), _item(keyed),
                 _item(photo, max_pixels="50176"), _item(photo, min_pixels=3136.0),
                 _item(photo, max_pixels=True), _item(photo, min_pixels=None),
                 _item(_noise(2010, 10))):
        _assert_fallback(fast, cache, vision_model, [_item(photo), item], str(item))
    assert _stat(cache, "preprocess_fast") == 0
    assert _stat(cache, "preprocess_errors") == 0  # refused before it ran, not failed after


def test_a_failure_of_the_fast_path_is_lmdeploys_output_counted(vision_model, images, monkeypatch):
    fast, cache = _fast(vision_model, monkeypatch)

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(fast.maker, "_band", broken)
    items = [_item(images["png-449x448"]), _item(images["bmp-333x222"])]
    _assert_same(_outputs(fast(_messages(*items))),
                 _outputs(vision_model.preprocess(_messages(*items))), "planted failure")
    assert _stat(cache, "preprocess_errors") == 2 and _stat(cache, "preprocess_fallback") == 2


@pytest.mark.parametrize("change", ["bilinear", "no_normalize", "patched_resize", "device",
                                    "subclass", "lmdeploy_mode"])
def test_a_processor_config_it_does_not_reproduce_is_lmdeploys_counted(vision_model, images, change,
                                                                      monkeypatch):
    """Each change to the processor (or ``FEATCACHE_PREPROCESS=lmdeploy``) is detected: no fast
    maker, a reason, lmdeploy's own output, every image counted as a fallback."""
    ip = vision_model.processor.image_processor
    mode = "auto"
    if change == "bilinear":
        monkeypatch.setattr(ip, "resample", 2)
    elif change == "no_normalize":
        monkeypatch.setattr(ip, "do_normalize", False)
    elif change == "patched_resize":
        monkeypatch.setitem(vars(ip), "resize", ip.resize)  # an instance attribute
    elif change == "device":
        monkeypatch.setattr(ip, "device", "cpu")
    elif change == "subclass":
        monkeypatch.setattr(ip, "__class__", type("Mine", (type(ip),), {}))
    else:
        mode = "lmdeploy"
    fast, cache = _fast(vision_model, monkeypatch, mode)
    assert fast.maker is None and fast.why, change
    items = [_item(images["png-895x449"]), _item(images["jpeg-444-1000x700"], max_pixels=QWEN_MAX)]
    _assert_fallback(fast, cache, vision_model, items, change)
    assert _stat(cache, "preprocess_fast") == 0


def test_a_table_that_differs_from_the_processor_is_caught_by_the_probe(vision_model):
    spec = qwen2vl.qwen2vl_spec(vision_model)
    assert isinstance(spec, qwen2vl.PatchSpec)
    ip = vision_model.processor.image_processor
    wrong = qwen2vl.PatchSpec(**{**spec.__dict__, "table": np.nextafter(spec.table, np.float32(9))})
    assert "differ" in str(qwen2vl._probe(ip, wrong))
    again = qwen2vl._probe(ip, spec)
    assert isinstance(again, qwen2vl.PatchSpec) and np.array_equal(again.table, spec.table)
    assert again.single_limits == _single_limits(ip)  # (5.24 honours one limit alone, 5.17 not)
    assert "not lmdeploy's Qwen2-VL" in str(qwen2vl.qwen2vl_spec(object()))


def test_a_processor_that_ignores_one_limit_alone_keeps_those_images_on_lmdeploys_code(
        vision_model, images, monkeypatch):
    """transformers 5.17 (the GPU machine's) honours a call's min_pixels/max_pixels only when both
    are given; 5.24 each alone. The probe finds out which: with 5.17's behaviour planted in the
    processor class, an image with one limit alone is lmdeploy's output, counted as a fallback,
    and one with both (or none) is still featcache's and equal."""
    from transformers.image_processing_utils import BaseImageProcessor

    ip = vision_model.processor.image_processor
    base = BaseImageProcessor._standardize_kwargs

    def as_5_17(self, size=None, min_pixels=None, max_pixels=None, **kwargs):
        if min_pixels is not None and max_pixels is not None:
            from transformers.image_utils import SizeDict

            size = SizeDict(shortest_edge=min_pixels, longest_edge=max_pixels)
        return super(type(self), self)._standardize_kwargs(size=size, **kwargs)

    monkeypatch.setattr(type(ip), "_standardize_kwargs", as_5_17)
    fast, cache = _fast(vision_model, monkeypatch)
    assert isinstance(fast.maker, qwen2vl.PatchMaker) and not fast.maker.spec.single_limits
    alone = [_item(images["png-895x449"], max_pixels=28 * 28 * 4)]
    _assert_fallback(fast, cache, vision_model, alone, "max_pixels alone")
    both = [_item(images["png-895x449"], min_pixels=28 * 28, max_pixels=28 * 28 * 4),
            _item(images["jpeg-444-1000x700"])]
    _check(fast, cache, vision_model, both, "both limits, and none")
    assert base is BaseImageProcessor._standardize_kwargs


@NEEDS_TORCHVISION
def test_torchvisions_uint8_bicubic_is_torchs_kernel_as_featcache_calls_it():
    """``resizers.TORCH`` (torch's uint8 ``interpolate(bicubic, antialias=True)``) equals
    torchvision's ``resize`` of the image as the torchvision-backed processors make it (a
    contiguous uint8 ``[C, H, W]`` tensor on the CPU) over 120 size pairs: down, up, one side, 1
    pixel, 1:50; and Pillow's differs (why the PIL processors get ``resizers.PILLOW``)."""
    tvF = _torchvision_functional()
    rng = np.random.default_rng(7)
    sizes = [(1000, 20, 28, 560), (1344, 1008, 448, 448), (3000, 2000, 2996, 1988), (1, 1, 28, 28)]
    sizes += [tuple(int(v) for v in rng.integers(1, 700, 4)) for _ in range(116)]
    pillow_differs = 0
    for w, h, ow, oh in sizes:
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
        chw = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()
        want = tvF.resize(chw, [oh, ow], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        got = resizers.TORCH(image, (ow, oh))
        assert np.array_equal(got, want.permute(1, 2, 0).numpy()), (w, h, ow, oh)
        pillow_differs += not np.array_equal(resizers.PILLOW(image, (ow, oh)), got)
    assert pillow_differs > 60


@NEEDS_TORCHVISION
def test_the_torchvision_backed_processor_is_reproduced(tmp_path_factory, images, monkeypatch):
    """transformers' torchvision-backed ``Qwen2VLImageProcessor`` (what a GPU install of lmdeploy
    has): featcache's maker, with torch's uint8 resize, passes its probes and equals the processor
    over the corpus, sizes and limits. (Before 2026-12-03's fix, featcache resized it with
    Pillow's arithmetic, and its probe refused it on the GPU machine: transformers 5.17,
    torchvision 0.26, Pillow 12.3.)"""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    path = tiny.checkpoint(tiny.QWEN2VL, tmp_path_factory)
    encoder = _encoder(path)
    try:
        vm = encoder.model
        vm.processor.image_processor = Qwen2VLImageProcessor.from_pretrained(path)
        fast, cache = _fast(vm, monkeypatch)
        assert isinstance(fast.maker, qwen2vl.PatchMaker), fast.why
        assert fast.maker.spec.resize is resizers.TORCH
        items = [[_item(image)] for image in images.values()]
        items += [[_item(_noise(w, h, seed=i), **_lim(vm, params))] for i, (w, h) in enumerate(SIZES)
                  for params in PIXELS]
        for request in items:
            _check(fast, cache, vm, request, str(request[0]["data"].size))
    finally:
        encoder.executor.shutdown(wait=True)
