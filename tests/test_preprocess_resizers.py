"""featcache/preprocess/resizers.py: each fast path resizes as its processor does (Pillow's
arithmetic for the PIL processors, torch's uint8 antialias kernel for the torchvision-backed ones),
and the two are not interchangeable. (That torchvision's own ``resize`` is torch's kernel as
featcache calls it is checked where torchvision loads: tests/test_preprocess_exact_qwen.py, the GPU
run list.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from featcache.preprocess import resizers


def _image(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize("resize", [resizers.PILLOW, resizers.TORCH])
@pytest.mark.parametrize("w, h, ow, oh", [(1000, 20, 28, 560), (37, 23, 448, 448), (1, 1, 5, 3),
                                          (1344, 1008, 448, 448), (640, 480, 640, 240)])
def test_each_resize_gives_hwc_uint8_of_the_asked_size(resize, w, h, ow, oh):
    got = resize(_image(w, h), (ow, oh))
    assert got.dtype == np.uint8 and got.shape == (oh, ow, 3)


@pytest.mark.parametrize("resize", [resizers.PILLOW, resizers.TORCH])
def test_at_the_same_size_the_pixels_are_the_images_own(resize):
    image = _image(56, 28)
    assert np.array_equal(resize(image, (56, 28)), np.asarray(image))


def test_one_source_serves_many_resizes_and_the_source_is_the_processors_view():
    image = _image(300, 200, seed=5)
    chw = resizers.TORCH.source(image)
    assert chw.dtype == torch.uint8 and tuple(chw.shape) == (3, 200, 300)
    assert np.array_equal(chw.permute(1, 2, 0).numpy(), np.asarray(image))
    for size in ((56, 56), (112, 168), (300, 200)):
        assert np.array_equal(resizers.TORCH.resize(chw, size), resizers.TORCH(image, size))
    assert resizers.PILLOW.source(image) is image
    assert resizers.TORCH.threaded and not resizers.PILLOW.threaded


@pytest.mark.parametrize("seed", range(3))
def test_torchs_kernel_gives_the_same_pixels_from_either_layout(seed):
    """featcache hands torch's kernel the pixels in their own [H, W, C] order (faster); transformers
    5.24's processor makes them a contiguous [C, H, W] first: the same values, 60 size pairs."""
    rng = np.random.default_rng(seed)
    for _ in range(20):
        w, h, ow, oh = (int(v) for v in rng.integers(1, 600, 4))
        image = _image(w, h, seed=w * h)
        chw = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()
        want = torch.nn.functional.interpolate(chw[None], size=[oh, ow], mode="bicubic", antialias=True)
        got = resizers.TORCH(image, (ow, oh))
        assert np.array_equal(got, want[0].permute(1, 2, 0).numpy()), (w, h, ow, oh)


def test_torchs_resize_is_torchs_uint8_kernel_on_the_contiguous_chw_tensor():
    image = _image(901, 333, seed=3)
    chw = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()
    want = torch.nn.functional.interpolate(chw[None].float(), size=[210, 448], mode="bicubic",
                                           antialias=True)  # float: not the uint8 kernel
    got = resizers.TORCH(image, (448, 210))
    uint8 = torch.nn.functional.interpolate(chw[None], size=[210, 448], mode="bicubic", antialias=True)
    assert np.array_equal(got, uint8[0].permute(1, 2, 0).numpy())
    assert not np.array_equal(got, want.round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 0).numpy())


def test_pillows_and_torchs_bicubic_differ_so_the_processor_decides():
    """Why ``for_processor`` matters: on noise, about 0.3% of pixels differ by one level at a
    1000x20 -> 28x560 resize, and 30% near the identity (3000x2000 -> 2996x1988)."""
    for (w, h), size in (((1000, 20), (28, 560)), ((3000, 2000), (2996, 1988))):
        image = _image(w, h, seed=w)
        assert not np.array_equal(resizers.PILLOW(image, size), resizers.TORCH(image, size))


def test_for_processor_follows_the_torchvision_backend():
    class TorchvisionBackend:  # (transformers' base of its torchvision-backed processors, by name)
        pass

    class Fast(TorchvisionBackend):
        pass

    class Pil:
        pass

    assert resizers.for_processor(Fast()) is resizers.TORCH
    assert resizers.for_processor(Pil()) is resizers.PILLOW
    assert resizers.torchvision_backed(Fast()) and not resizers.torchvision_backed(Pil())


def test_qwens_patchify_is_the_processors_layout_from_either_memory_order():
    """``qwen2vl.patchify`` (the torchvision-backed path's) against the processor's own reshape
    (transformers' ``Qwen2VLImageProcessor.patchify``, written out), from a contiguous and from a
    channels-last ``[C, H, W]``."""
    from featcache.preprocess.qwen2vl import patchify

    p, m, t = 14, 2, 2
    x = torch.randn(3, 56, 84)
    b, c, h, w = 1, 3, 56, 84
    want = (x[None].reshape(b, c, h // p // m, m, p, w // p // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
            .unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1)
            .reshape(b, (h // p) * (w // p), c * t * p * p))[0]
    last = x.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    assert last.stride(0) == 1 and not last.is_contiguous()
    assert torch.equal(patchify(x, p, m, t), want)
    assert torch.equal(patchify(last, p, m, t), want)
