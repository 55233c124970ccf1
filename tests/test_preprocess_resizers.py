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


CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # (Qwen2-VL's processor's)
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


class _TorchvisionBackend:
    pass


_TorchvisionBackend.__name__ = "TorchvisionBackend"  # (transformers' base, by name)


class _FusedProcessor(_TorchvisionBackend):
    """transformers 5.17's ``TorchvisionBackend.rescale_and_normalize`` written out: its fused
    constants, the float32 cast, then torchvision's ``normalize_image`` (``sub``, ``div_``)."""

    rescale_factor = 1 / 255
    image_mean = CLIP_MEAN
    image_std = CLIP_STD
    do_rescale = do_normalize = True

    def rescale_and_normalize(self, images, do_rescale, rescale_factor, do_normalize, mean, std):
        mean = torch.tensor(mean) * (1.0 / rescale_factor)
        std = torch.tensor(std) * (1.0 / rescale_factor)
        return images.to(dtype=torch.float32).sub(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))


def _processor_values(chw: torch.Tensor) -> torch.Tensor:
    ip = _FusedProcessor()
    return ip.rescale_and_normalize(chw[None], True, ip.rescale_factor, True, ip.image_mean,
                                    ip.image_std)[0]


def test_torchs_resize_keeps_the_sources_channels_last_order():
    """``resize_chw`` restrides the batch as torchvision's resize does, so torch's kernel writes
    its output channels-last (no repacking); the values are the contiguous input's."""
    image = _image(300, 200, seed=9)
    chw = resizers.TORCH.source(image)
    got = resizers.resize_chw(chw, (150, 101))
    assert got.stride(0) == 1 and tuple(got.shape) == (3, 101, 150)
    want = torch.nn.functional.interpolate(chw.contiguous()[None], size=[101, 150], mode="bicubic",
                                           antialias=True)[0]
    assert want.is_contiguous() and torch.equal(got, want)
    assert resizers.TORCH.resize(chw, (150, 101)).base is not None  # [H, W, C]: a view, no copy


def test_the_fused_normalize_is_the_processors_over_every_value_and_layout():
    from featcache.preprocess import qwen2vl

    ip = _FusedProcessor()
    table = qwen2vl.value_table(ip)
    norm = qwen2vl.normalizer(ip, table)
    assert isinstance(norm, qwen2vl.Normalize)
    every = torch.arange(256, dtype=torch.uint8).expand(3, 1, 256).contiguous()
    assert torch.equal(norm(every), _processor_values(every))
    chw = resizers.TORCH.source(_image(40, 30, seed=2))  # channels-last
    out = torch.empty(30, 3, 40).permute(1, 0, 2)  # a strided view
    assert torch.equal(norm.into(out, chw), _processor_values(chw)) and out.data_ptr() != 0
    assert qwen2vl.normalizer(object(), table) is None  # the PIL processor: the table's


def test_a_fused_normalize_that_differs_from_the_processor_is_refused():
    from featcache.preprocess import qwen2vl

    ip = _FusedProcessor()
    table = qwen2vl.value_table(ip).copy()
    table[3 * 256 - 1] = np.nextafter(table[3 * 256 - 1], np.float32(0))  # one value of 768
    assert isinstance(qwen2vl.normalizer(ip, table), str)


def test_qwens_patches_are_the_processors_normalize_and_layout_from_either_memory_order():
    """``qwen2vl.normalized_patches`` (the torchvision-backed path's) against the processor's own
    ops written out (``rescale_and_normalize``, then transformers' ``Qwen2VLImageProcessor.
    patchify``), from a contiguous and from a channels-last uint8 ``[C, H, W]``."""
    from featcache.preprocess import qwen2vl

    ip = _FusedProcessor()
    norm = qwen2vl.normalizer(ip, qwen2vl.value_table(ip))
    assert isinstance(norm, qwen2vl.Normalize)
    p, m, t = 14, 2, 2
    b, c, h, w = 1, 3, 56, 84
    last = resizers.TORCH.source(_image(w, h, seed=4))
    x = _processor_values(last)
    want = (x[None].reshape(b, c, h // p // m, m, p, w // p // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
            .unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1)
            .reshape(b, (h // p) * (w // p), c * t * p * p))[0]
    assert last.stride(0) == 1 and not last.is_contiguous()
    assert torch.equal(qwen2vl.normalized_patches(last, norm, p, m, t), want)
    assert torch.equal(qwen2vl.normalized_patches(last.contiguous(), norm, p, m, t), want)
    once = want.view(-1, c, t, p * p)[:, :, 0].reshape(-1, c * p * p)  # temporal 1: no repeat
    assert torch.equal(qwen2vl.normalized_patches(last, norm, p, m, 1), once)
