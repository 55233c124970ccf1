"""Pillow's BICUBIC resize of 8-bit images, re-done in integer tensor ops: equal to
``PIL.Image.resize(size)`` (its default filter for RGB) byte for byte, on the CPU or a GPU.

Pillow's ``ImagingResample`` (``libImaging/Resample.c``) resizes in two separable passes, each
skipped where that dimension keeps its size. Up to Pillow 12 the horizontal pass runs first; from
Pillow 13 the vertical one does where the height shrinks by more than twice as many pixels as the
width (``vertical_first``): the order changes the 8-bit intermediate, hence the result. The rest
is the same in every Pillow read (11.3, 12.0, 12.3, 13.0):

- ``precompute_coeffs``: per output pixel, a window of input pixels and their weights, in
  double precision (``center = (xx + 0.5) * scale``, support ``2 * max(scale, 1)``, weights
  ``bicubic((x + xmin - center + 0.5) / max(scale, 1))`` summed left to right, then divided by
  their sum);
- ``normalize_coeffs_8bpc``: each weight to fixed point, ``(int)(w * 2**22 +- 0.5)``;
- each pass: ``2**21 + sum(pixel * weight)`` in 32-bit integers, then ``>> 22`` clipped to
  0..255: the intermediate image is 8-bit, as Pillow's.

``Coeffs`` mirrors the first two in NumPy float64 with the same operations in the same order (no
fused multiply-add: Pillow's x86-64 wheels are built for the baseline ISA, which has none); the
passes are gathers and integer multiply-adds, exact in any order. Exactness is a property with a
corpus, not of this reading: ``matches_pillow`` checks it against the Pillow that is installed,
and tests/test_preprocess_exact.py over generated sizes; a Pillow that changes Resample.c fails
the check and the caller falls back to Pillow itself.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch

PRECISION_BITS = 32 - 8 - 2  # Resample.c: 8 bits of result, 2 for overflow and sign
BICUBIC_SUPPORT = 2.0
COEFF_CACHE = 256  # (in, out) size pairs whose fixed-point coefficients are kept, per device


def pillow_major() -> int:
    import PIL

    return int(PIL.__version__.split(".")[0])


def vertical_first(in_w: int, in_h: int, w: int, h: int, pillow: int) -> bool:
    """Whether Pillow ``pillow`` (major version) runs the vertical pass first for this resize:
    from 13 on, where the height shrinks by more than twice as many pixels as the width
    (Resample.c's ``horizontal_first``); never before."""
    return pillow >= 13 and (in_h - h) > 0 and (in_h - h) > (in_w - w) * 2


def _bicubic(x: np.ndarray) -> np.ndarray:
    """Resample.c's ``bicubic_filter`` (a = -0.5), elementwise, in its operation order."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@dataclass(frozen=True)
class Coeffs:
    """One pass's window per output pixel: ``index[out, k]`` input positions (clamped into the
    image; their weight is 0 past the window) and ``weight[out, k]`` fixed-point int32 weights."""

    index: np.ndarray
    weight: np.ndarray

    @classmethod
    def bicubic(cls, in_size: int, out_size: int) -> Coeffs:
        if in_size < 1 or out_size < 1:
            raise ValueError(f"sizes must be >= 1, not {in_size} -> {out_size}")
        scale = float(in_size) / out_size  # (in1 - in0) / outSize with in0 = 0
        filterscale = max(scale, 1.0)
        support = BICUBIC_SUPPORT * filterscale
        ksize = int(np.ceil(support)) * 2 + 1
        center = 0.0 + (np.arange(out_size, dtype=np.float64) + 0.5) * scale
        ss = 1.0 / filterscale
        xmin = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
        xmax = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin
        taps = np.arange(ksize, dtype=np.int64)
        live = taps[None, :] < xmax[:, None]
        w = np.where(live, _bicubic(((taps[None, :] + xmin[:, None]).astype(np.float64)
                                     - center[:, None] + 0.5) * ss), 0.0)
        ww = np.zeros(out_size, dtype=np.float64)
        for t in range(ksize):  # summed left to right, as the C loop does
            ww = ww + w[:, t]
        w = np.where((ww != 0.0)[:, None], w / np.where(ww != 0.0, ww, 1.0)[:, None], w)
        fixed = w * (1 << PRECISION_BITS)
        weight = np.where(w < 0, np.trunc(-0.5 + fixed), np.trunc(0.5 + fixed)).astype(np.int32)
        index = np.minimum(xmin[:, None] + taps[None, :], in_size - 1)
        return cls(index=index, weight=np.where(live, weight, 0).astype(np.int32))


class Resampler:
    """Pillow-exact BICUBIC resizes of uint8 ``[C, H, W]`` tensors on one device, the
    coefficients of each size pair computed once (``COEFF_CACHE`` pairs kept). Thread-safe."""

    def __init__(self, device: torch.device | str = "cpu", pillow: int | None = None) -> None:
        self.device = torch.device(device)
        self.pillow = pillow_major() if pillow is None else pillow  # whose pass order to follow
        self._lock = threading.Lock()
        self._coeffs = functools.lru_cache(maxsize=COEFF_CACHE)(self._on_device)

    def _on_device(self, in_size: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = Coeffs.bicubic(in_size, out_size)
        return (torch.from_numpy(c.index).to(self.device),
                torch.from_numpy(c.weight).to(self.device))

    def coeffs(self, in_size: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:  # (lru_cache is thread-safe, but would compute a pair twice)
            return self._coeffs(in_size, out_size)

    def resize(self, image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """``image`` (uint8 ``[C, H, W]`` on this device) resized to ``size`` = (width, height),
        as ``PIL.Image.fromarray(hwc).resize(size)`` would: uint8 ``[C, h, w]``."""
        if image.dtype != torch.uint8 or image.dim() != 3:
            raise ValueError(f"expected a uint8 [C, H, W] tensor, got {image.dtype} {tuple(image.shape)}")
        width, height = size
        _, in_h, in_w = image.shape
        # Pillow's need_horizontal / need_vertical (the box at the origin, the whole image)
        passes = [(2, in_w, width), (1, in_h, height)]
        if vertical_first(in_w, in_h, width, height, self.pillow):
            passes.reverse()
        out = image
        for dim, n_in, n_out in passes:
            if n_in != n_out:
                out = self._pass(out, *self.coeffs(n_in, n_out), dim=dim)
        return out if out is not image else image.clone()

    @staticmethod
    def _pass(image: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, dim: int) -> torch.Tensor:
        """One separable pass along ``dim``: ``2**21 + sum_k pixel[index[:, k]] * weight[:, k]``
        in int32 (as Resample.c's ``int ss``), then ``>> 22`` clipped to 0..255."""
        shape = [1, 1, 1]
        shape[dim] = -1
        acc: torch.Tensor | None = None
        for k in range(index.shape[1]):
            term = image.index_select(dim, index[:, k]).to(torch.int32) * weight[:, k].view(shape)
            acc = term if acc is None else acc.add_(term)
        assert acc is not None
        acc.add_(1 << (PRECISION_BITS - 1))
        return (acc >> PRECISION_BITS).clamp_(0, 255).to(torch.uint8)


def matches_pillow(resampler: Resampler) -> bool:
    """Whether ``resampler`` reproduces the installed Pillow on a probe set (down- and up-scales,
    one pass and two, a 1-pixel side, extreme ratios): the check that stands between a Pillow
    whose Resample.c changed and a wrong pixel. A few milliseconds."""
    from PIL import Image

    rng = np.random.default_rng(20261202)
    cases = [((37, 23), (448, 448)), ((1344, 1008), (448, 448)), ((1344, 1008), (1792, 1344)),
             ((1, 1), (448, 448)), ((3000, 60), (448, 448)), ((451, 449), (448, 896)),
             ((448, 300), (448, 448)), ((997, 13), (5, 7)),
             ((95, 99), (266, 26)), ((1008, 1344), (448, 448))]  # (the two orders differ)
    for (w, h), size in cases:
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        want = np.asarray(Image.fromarray(pixels).resize(size))
        chw = torch.from_numpy(pixels).permute(2, 0, 1).contiguous().to(resampler.device)
        got = resampler.resize(chw, size).permute(1, 2, 0).cpu().numpy()
        if not np.array_equal(got, want):
            return False
    return True
