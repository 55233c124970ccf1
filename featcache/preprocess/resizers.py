"""The two BICUBIC resizes of transformers' image processors, each made as its processor makes it,
giving the resized pixels as a uint8 ``[H, W, C]`` array (a view where no copy is needed):

- ``pil_bicubic``: the PIL processors' ``PIL.Image.resize(size, BICUBIC)`` (Pillow's
  ``Resample.c``); at the same size Pillow's resize is a copy, so it is skipped.
- ``torch_bicubic``: the torchvision-backed processors' ``tvF.resize(..., BICUBIC,
  antialias=True)`` of the decoded image as a contiguous uint8 ``[1, C, H, W]`` tensor on the CPU,
  which torchvision hands to torch's own ``interpolate(mode="bicubic", antialias=True)`` (its
  native uint8 kernel: ATen's ``_upsample_bicubic2d_aa``, int16 weights at a precision of their
  own, not Pillow's); at the same size torchvision returns the image itself.

The two differ by one level on some pixels (torchvision 0.26 against Pillow 12.3 on the GPU
machine, 2026-12-03), so a fast path takes the one its processor uses (``for_processor``), and its
probes compare the result with the processor's own before it is trusted. Both release the GIL
while they resample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
# (a PIL RGB image, (width, height)) -> uint8 [height, width, C]
Resize = Callable[[Any, tuple[int, int]], np.ndarray]


def pil_bicubic(image: Any, size: tuple[int, int]) -> np.ndarray:
    return np.asarray(image if image.size == size else image.resize(size, BICUBIC))


def torch_bicubic(image: Any, size: tuple[int, int]) -> np.ndarray:
    hwc = np.asarray(image)
    if image.size == size:
        return hwc
    width, height = size
    chw = torch.from_numpy(np.ascontiguousarray(hwc.transpose(2, 0, 1)))  # (pil_to_tensor, contiguous)
    out = torch.nn.functional.interpolate(chw[None], size=[height, width], mode="bicubic",
                                          antialias=True)
    return out[0].permute(1, 2, 0).numpy()


def torchvision_backed(processor: Any) -> bool:
    """Whether ``processor`` is one of transformers' torchvision-backed image processors."""
    return any(c.__name__ == "TorchvisionBackend" for c in type(processor).__mro__)


def for_processor(processor: Any) -> Resize:
    """The resize ``processor`` makes: torch's for a torchvision-backed one, else Pillow's."""
    return torch_bicubic if torchvision_backed(processor) else pil_bicubic


__all__ = ["Resize", "for_processor", "pil_bicubic", "torch_bicubic", "torchvision_backed"]
