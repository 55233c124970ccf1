"""The two BICUBIC resizes of transformers' image processors, each made as its processor makes it:

- ``PILLOW``: the PIL processors' ``PIL.Image.resize(size, BICUBIC)`` (Pillow's ``Resample.c``),
  of the decoded PIL image. One core per call.
- ``TORCH``: the torchvision-backed processors' ``tvF.resize(..., BICUBIC, antialias=True)`` of
  the decoded image as a uint8 ``[C, H, W]`` tensor on the CPU (``pil_to_tensor``'s view of the
  pixels; transformers 5.24 then makes it contiguous, which changes the speed, not the values),
  which torchvision hands to torch's own
  ``interpolate(mode="bicubic", antialias=True)``: its native uint8 kernel (ATen's
  ``_upsample_bicubic2d_aa``, int16 weights at a precision of their own, not Pillow's), which
  takes the machine's cores itself.

A resizer's ``source`` makes the processor's view of an image once; ``resize`` then gives the
pixels at a size as a uint8 ``[H, W, C]`` array (a view where no copy is needed). At the image's
own size both give its pixels: Pillow's resize is then a copy, and torchvision returns the image
itself. The two differ by a level on some pixels (torchvision 0.26 against Pillow 12.3 on the GPU
machine, 2026-12-03), so a fast path takes the one its processor uses (``for_processor``), and its
probes compare the result with the processor's own before it is trusted. Both release the GIL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


def _pillow(image: Any, size: tuple[int, int]) -> np.ndarray:
    return np.asarray(image if image.size == size else image.resize(size, BICUBIC))


def _chw(image: Any) -> torch.Tensor:
    # (the pixels' own [H, W, C] order, as pil_to_tensor makes them: torch's kernel resizes that
    # layout without repacking it, 1.7x faster than from a contiguous [C, H, W] on 2 cores, and
    # the same values: tests/test_preprocess_resizers.py)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def resize_chw(chw: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``TORCH``'s resize of a source, as a uint8 ``[C, H, W]`` tensor in the source's memory
    order (channels-last from ``TORCH.source``, as torchvision's is; the source itself at its own
    size, as torchvision returns it)."""
    width, height = size
    if tuple(chw.shape[1:]) == (height, width):
        return chw
    c, h, w = chw.shape
    batch = chw[None]
    if chw.stride(0) == 1 and c > 1:  # [H, W, C] in memory: say so unambiguously
        # (torch allocates the output of a [1, C, H, W] whose batch stride is not its size as
        # contiguous, pytorch#68430, and its kernel then repacks it: torchvision's resize restrides
        # the batch as here, so its output is channels-last too; same values, 1.6x faster for
        # 3000x2000 -> 2996x1988 on 2 cores)
        batch = chw.as_strided((1, c, h, w), (c * h * w, *chw.stride()))
    return torch.nn.functional.interpolate(batch, size=[height, width], mode="bicubic",
                                           antialias=True)[0]


def _torch(chw: torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    return resize_chw(chw, size).permute(1, 2, 0).numpy()


@dataclass(frozen=True)
class Resizer:
    """``source(image)``: the processor's view of a decoded RGB PIL image; ``resize(source,
    (width, height))``: uint8 ``[height, width, C]``. ``threaded``: whether one call already uses
    many cores (then running two of one image's resizes at once only makes them contend)."""

    name: str
    source: Callable[[Any], Any]
    resize: Callable[[Any, tuple[int, int]], np.ndarray]
    threaded: bool

    def __call__(self, image: Any, size: tuple[int, int]) -> np.ndarray:
        """One resize of ``image`` (its own pixels, unconverted, where it is that size)."""
        if image.size == size:
            return np.asarray(image)
        return self.resize(self.source(image), size)


PILLOW = Resizer("Pillow's BICUBIC", lambda image: image, _pillow, threaded=False)
TORCH = Resizer("torch's uint8 BICUBIC with antialias", _chw, _torch, threaded=True)


def torchvision_backed(processor: Any) -> bool:
    """Whether ``processor`` is one of transformers' torchvision-backed image processors."""
    return any(c.__name__ == "TorchvisionBackend" for c in type(processor).__mro__)


def for_processor(processor: Any) -> Resizer:
    """The resize ``processor`` makes: torch's for a torchvision-backed one, else Pillow's."""
    return TORCH if torchvision_backed(processor) else PILLOW


__all__ = ["PILLOW", "TORCH", "Resizer", "for_processor", "resize_chw", "torchvision_backed"]
