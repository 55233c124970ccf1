"""featcache's InternVL-HF preprocessing against lmdeploy 0.18's own: every per-image output
equal (``torch.equal`` tensors, same keys in the same order, same types), or lmdeploy's own code,
counted.

The reference is lmdeploy's real ``InternVL3VisionModel.preprocess`` over transformers' PIL
``GotOcr2ImageProcessorPil`` of the tiny checkpoint (tests/lmdeploy_tiny.py: 56-pixel tiles,
``min_patches`` 1, ``max_patches`` 4, lmdeploy's ``crop_to_patches``; float16 features), and the
same processor with other patch limits. Images are generated files (tests/image_corpus.py)
decoded as lmdeploy decodes a request's image, and noise images of chosen sizes. Every comparison
also checks that the fast path ran (its counter), so that a fallback cannot pass for exactness.
"""

from __future__ import annotations

import _lmdeploy_stack
import numpy as np
import pytest
import torch

_lmdeploy_stack.require()

import _exact_prep  # noqa: E402
import image_corpus as corpus  # noqa: E402  (puts the checkout on sys.path)
import lmdeploy_tiny as tiny  # noqa: E402
from _exact_prep import NEEDS_TORCHVISION, encoder, with_pil  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy import fastprep  # noqa: E402
from featcache.preprocess import internvl_hf, resizers  # noqa: E402

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
S = 56  # the tiny checkpoint's tile side


@pytest.fixture(scope="module")
def images():
    return _exact_prep.corpus_images()


PIL = "GotOcr2ImageProcessorPil"  # the processor lmdeploy's code is compared over (tests/_exact_prep.py)


def _encoder(path):
    return encoder(path, PIL)


def _with_pil(vision_model, path):
    with_pil(vision_model, path, PIL)


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory):
    yield from _exact_prep.tiny_vision_model(tiny.INTERNVL, PIL, tmp_path_factory)


def test_the_tiny_checkpoints_processor_is_reproduced(vision_model, monkeypatch):
    fast, _ = _fast(vision_model, monkeypatch)
    assert isinstance(fast.maker, internvl_hf.HFTileMaker), fast.why
    spec = fast.maker.spec
    assert (spec.size, spec.crop, spec.min_patches, spec.max_patches) == (S, True, 1, 4)
    assert spec.dtype == torch.float16 and vision_model.mm_feature_dtype == torch.float16


def test_every_corpus_image(vision_model, images, monkeypatch):
    fast, cache = _fast(vision_model, monkeypatch)
    for name, image in images.items():
        assert image.mode == "RGB"
        _check(fast, cache, vision_model, [_item(image)], name)


SIZES = [(1, 1), (3, 5), (55, 55), (56, 56), (57, 56), (56, 57), (111, 56), (112, 56), (113, 57),
         (56, 112), (168, 56), (56, 168), (112, 112), (224, 224), (225, 223), (640, 480),
         (1344, 1008), (1008, 1344), (50, 1), (1, 50), (40, 2000), (2000, 40), (1999, 13)]


def test_generated_sizes_and_their_grids(vision_model, monkeypatch):
    """Sizes around the tile side and its multiples, tiny, 1:50 both ways: 1x1 grids (no
    thumbnail), wide and tall grids (with one), each equal to lmdeploy's, its tile count too."""
    fast, cache = _fast(vision_model, monkeypatch)
    grids = set()
    for i, (w, h) in enumerate(SIZES):
        got = _check(fast, cache, vision_model, [_item(_noise(w, h, seed=i))], f"{w}x{h}")
        cols, rows = fast.maker.grid(w, h)
        grids.add((cols, rows))
        assert got[0]["pixel_values"].shape[0] == cols * rows + (cols * rows != 1), (w, h)
    assert {(1, 1), (2, 1), (1, 2), (3, 1), (1, 3), (4, 1), (1, 4), (2, 2)} <= grids, grids


@pytest.mark.parametrize("patches", [(1, 12), (3, 6), (1, 1), (2, 2)])
def test_other_patch_limits_of_the_processor(vision_model, images, patches, monkeypatch):
    """The processor's min_patches/max_patches (lmdeploy's call passes them from its config):
    more tiles, a floor of three, one resize only (max 1), a fixed 2x2-or-so."""
    ip = vision_model.processor.image_processor
    monkeypatch.setattr(ip, "min_patches", patches[0])
    monkeypatch.setattr(ip, "max_patches", patches[1])
    fast, cache = _fast(vision_model, monkeypatch)
    assert isinstance(fast.maker, internvl_hf.HFTileMaker), fast.why
    assert (fast.maker.spec.min_patches, fast.maker.spec.max_patches) == patches
    for i, (w, h) in enumerate([(1, 1), (56, 56), (300, 100), (100, 300), (640, 480), (2000, 40)]):
        _check(fast, cache, vision_model, [_item(_noise(w, h, seed=i))], f"{patches} {w}x{h}")
    _check(fast, cache, vision_model, [_item(images["jpeg-420-photo-1344x1008"])], f"{patches} photo")


def test_the_large_photo(vision_model, monkeypatch):
    fast, cache = _fast(vision_model, monkeypatch)
    from lmdeploy.vl.media.image import ImageMediaIO

    image = ImageMediaIO().load_bytes(corpus.LARGE["jpeg-8000x6000"]())
    got = _check(fast, cache, vision_model, [_item(image)], "8000x6000")
    assert got[0]["pixel_values"].shape == (4 + 1, 3, S, S)  # 4:3: a 2x2 grid and the thumbnail


def test_a_large_grids_rows_of_tiles_on_the_pool(vision_model, images, monkeypatch):
    """Where the tiles' bytes pass ``MIN_BAND_BYTES`` (a real checkpoint's 448-pixel tiles do),
    each row of tiles is a task on featcache's threads: forced here at the tiny tiles' size, and
    the pool seen running them."""
    fast, cache = _fast(vision_model, monkeypatch)
    monkeypatch.setattr(internvl_hf, "MIN_BAND_BYTES", 0)
    ran = []
    fill = internvl_hf.HFTileMaker._fill

    def counted(self, src, out):
        ran.append(out.shape[0])
        return fill(self, src, out)

    monkeypatch.setattr(internvl_hf.HFTileMaker, "_fill", counted)
    for name in ("jpeg-420-photo-1344x1008", "png-895x449"):
        _check(fast, cache, vision_model, [_item(images[name])], name)
    assert ran.count(1) >= 4  # (2 rows of the 2x2 grids, and each thumbnail)


def test_many_images_in_one_request_keep_their_order(vision_model, images, monkeypatch):
    """lmdeploy calls the processor once for all of them and splits by num_patches: the same
    per-image dicts in the same order, whatever each one's grid; per-image parameters ignored
    (as lmdeploy ignores them)."""
    fast, cache = _fast(vision_model, monkeypatch)
    names = ["png-895x449", "png-448x448", "png-1-to-50-40x2000", "png-rgb-1x1", "webp-720x540",
             "png-50-to-1-2000x40", "jpeg-420-photo-1344x1008"]
    items = [_item(images[n]) for n in names]
    items[1]["max_dynamic_patch"] = 1
    items[4]["max_pixels"] = 3136
    got = _check(fast, cache, vision_model, items, "seven images")
    assert len({g["pixel_values"].shape[0] for g in got}) > 2


def test_the_prompt_lmdeploy_builds_is_the_same(tmp_path_factory, monkeypatch):
    """What the engine gets (input_ids, every per-image input, the token spans) through
    lmdeploy's own prompt path, its model's preprocess featcache's or lmdeploy's."""
    path = tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)
    plain, ours = tiny.PromptPath(path), tiny.PromptPath(path)
    _with_pil(plain.model, path)
    _with_pil(ours.model, path)
    monkeypatch.setenv(fastprep.ENV, "auto")
    cache = FeatureCache(device="cpu", device_bytes=0, host_bytes=0)
    try:
        ours.model.preprocess = fastprep.FastPreprocess(ours.model, ours.model.preprocess, cache)
        msgs = lambda: tiny.messages(tiny.image_item(_noise(300, 200, 1)),  # noqa: E731
                                     tiny.image_item(_noise(90, 700, 2)),
                                     tiny.image_item(_noise(56, 56, 3)))
        want, got = plain.prompt(msgs()), ours.prompt(msgs())
        assert ours.calls == [] and _stat(cache, "preprocess_fast") == 3
        assert got.keys() == want.keys() and got["prompt"] == want["prompt"]
        assert got["input_ids"] == want["input_ids"]
        _assert_same(got["multimodal"], want["multimodal"], "prompt")
    finally:
        plain.close()
        ours.close()


# -- what is not reproduced: lmdeploy's own code, counted ---------------------------------------------


def test_images_it_does_not_reproduce_send_the_request_to_lmdeploy_counted(vision_model, images,
                                                                          monkeypatch):
    """A grey image, an RGBA one, a palette one, an RGB image with a transparency key (the
    processor composites those onto white): the whole request is lmdeploy's, counted as
    ``preprocess_fallback`` for every image in it."""
    fast, cache = _fast(vision_model, monkeypatch)
    photo = images["png-895x449"]
    keyed = _noise(64, 48)
    keyed.info["transparency"] = (0, 0, 0)
    for other in (photo.convert("L"), photo.convert("RGBA"), photo.convert("P"), keyed):
        _assert_fallback(fast, cache, vision_model, [_item(photo), _item(other)], other.mode)
    assert _stat(cache, "preprocess_fast") == 0
    assert _stat(cache, "preprocess_errors") == 0  # refused before it ran, not failed after


def test_a_failure_of_the_fast_path_is_lmdeploys_output_counted(vision_model, images, monkeypatch):
    fast, cache = _fast(vision_model, monkeypatch)

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(fast.maker, "_fill", broken)
    items = [_item(images["png-449x448"]), _item(images["bmp-333x222"])]
    _assert_same(_outputs(fast(_messages(*items))),
                 _outputs(vision_model.preprocess(_messages(*items))), "planted failure")
    assert _stat(cache, "preprocess_errors") == 2 and _stat(cache, "preprocess_fallback") == 2
    assert _stat(cache, "preprocess_fast") == 0


@pytest.mark.parametrize("change", ["bilinear", "no_normalize", "no_rescale", "not_square",
                                    "patched_resize", "patched_crop", "device", "subclass",
                                    "float_patches", "lmdeploy_mode"])
def test_a_processor_config_it_does_not_reproduce_is_lmdeploys_counted(vision_model, images, change,
                                                                      monkeypatch):
    """Each change to the processor (or ``FEATCACHE_PREPROCESS=lmdeploy``) is detected: no fast
    maker, a reason, lmdeploy's own output, every image counted as a fallback."""
    from transformers.image_utils import SizeDict

    ip = vision_model.processor.image_processor
    mode = "auto"
    if change == "bilinear":
        monkeypatch.setattr(ip, "resample", 2)
    elif change == "no_normalize":
        monkeypatch.setattr(ip, "do_normalize", False)
    elif change == "no_rescale":
        monkeypatch.setattr(ip, "do_rescale", False)
    elif change == "not_square":
        monkeypatch.setattr(ip, "size", SizeDict(height=56, width=84))
    elif change == "patched_resize":
        monkeypatch.setitem(vars(ip), "resize", ip.resize)  # an instance attribute
    elif change == "patched_crop":
        monkeypatch.setitem(vars(ip), "crop_image_to_patches", ip.crop_image_to_patches)
    elif change == "device":
        monkeypatch.setattr(ip, "device", "cpu")
    elif change == "subclass":
        monkeypatch.setattr(ip, "__class__", type("Mine", (type(ip),), {}))
    elif change == "float_patches":
        monkeypatch.setattr(ip, "max_patches", 4.0)
    else:
        mode = "lmdeploy"
    fast, cache = _fast(vision_model, monkeypatch, mode)
    assert fast.maker is None and fast.why, change
    items = [_item(images["png-895x449"]), _item(images["jpeg-444-1000x700"])]
    _assert_fallback(fast, cache, vision_model, items, change)
    assert _stat(cache, "preprocess_fast") == 0


def test_a_model_with_a_preprocess_of_its_own_is_lmdeploys(vision_model, monkeypatch):
    mine = type("Mine", (type(vision_model),), {"preprocess": lambda self, messages: messages})
    monkeypatch.setattr(vision_model, "__class__", mine)
    assert "preprocess of its own" in str(internvl_hf.internvl_hf_spec(vision_model))
    assert "not lmdeploy's InternVL-HF" in str(internvl_hf.internvl_hf_spec(object()))


def test_a_table_that_differs_from_the_processor_is_caught_by_the_probe(vision_model):
    spec = internvl_hf.internvl_hf_spec(vision_model)
    assert isinstance(spec, internvl_hf.HFTileSpec)
    ip = vision_model.processor.image_processor
    wrong = internvl_hf.HFTileSpec(**{**spec.__dict__, "table": np.nextafter(spec.table, np.float32(9))})
    assert "differ" in str(internvl_hf._probe(ip, wrong))
    few = internvl_hf.HFTileSpec(**{**spec.__dict__, "max_patches": 3})  # other grids
    assert "differ" in str(internvl_hf._probe(ip, few))
    again = internvl_hf._probe(ip, spec)
    assert again is spec


@NEEDS_TORCHVISION
def test_the_torchvision_backed_processor_is_reproduced(tmp_path_factory, images, monkeypatch):
    """transformers' torchvision-backed ``GotOcr2ImageProcessor`` (what a GPU install of lmdeploy
    has): featcache's maker, with torch's uint8 resize, passes its probes and equals the processor
    over the corpus, the generated sizes, and all of them in one request (the processor groups
    them by shape)."""
    from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor

    path = tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)
    encoder = _encoder(path)
    try:
        vm = encoder.model
        vm.processor.image_processor = GotOcr2ImageProcessor.from_pretrained(path)
        fast, cache = _fast(vm, monkeypatch)
        assert isinstance(fast.maker, internvl_hf.HFTileMaker), fast.why
        assert fast.maker.spec.resize is resizers.TORCH
        for name, image in images.items():
            _check(fast, cache, vm, [_item(image)], name)
        for i, (w, h) in enumerate(SIZES):
            _check(fast, cache, vm, [_item(_noise(w, h, seed=i))], f"{w}x{h}")
        _check(fast, cache, vm, [_item(_noise(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)],
               "all sizes in one request")
    finally:
        encoder.executor.shutdown(wait=True)
