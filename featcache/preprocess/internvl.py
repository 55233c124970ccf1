"""InternVL's dynamic-tile preprocessing (lmdeploy 0.18's ``InternVLVisionModel._preprocess_v1_5``,
the InternVL-Chat-V1-5 recipe), equal to it bit for bit and faster.

lmdeploy's recipe for one RGB image: choose a grid of ``cols x rows`` tiles whose aspect ratio is
closest to the image's (``dynamic_preprocess``, its ``find_closest_aspect_ratio``), resize the
image to ``cols*S x rows*S`` with PIL's BICUBIC, crop the ``S x S`` tiles row by row, add a
thumbnail (the whole image resized to ``S x S``) when there is more than one tile; then each tile
through torchvision's ``Resize((S, S))`` (the identity on an ``S x S`` image), ``ToTensor``
(float32 ``x / 255``) and ``Normalize`` (``(x - mean) / std`` in float32), stacked and cast to
the model's dtype. About 67 ms for a 13-tile 1344x1008 photo with 16 threads, on one thread.

Here the same values, computed in one of two ways (``TileMaker``):

- ``cpu``: the two resizes are PIL's own calls (so exact by construction), the thumbnail's on a
  second thread while the grid's runs (PIL releases the GIL while it resamples); the crops are
  views of the resized array and the normalization runs once over every tile, with torch's ops
  in torchvision's order and dtypes (elementwise: the same value per element);
- ``cuda``: the decoded image goes to the GPU as uint8; both resizes are ``resample.Resampler``
  (Pillow's fixed-point arithmetic in int32), the normalization divides by a 0-dim CUDA tensor
  (dividing by the Python number 255 is not exact on CUDA: it multiplies by 1/255), and the
  pixel values come back to pinned host memory, on a stream of the calling thread's own.

Nothing here imports lmdeploy: the grid is chosen by the function lmdeploy uses, handed in
(``closest``), and the recipe's constants come from the model (``TileSpec``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .resample import Resampler

# find_closest_aspect_ratio(aspect_ratio, target_ratios, width, height, image_size) -> (cols, rows)
Closest = Callable[[float, list[tuple[int, int]], int, int, int], tuple[int, int]]


@dataclass(frozen=True)
class TileSpec:
    """The recipe's constants, read from the model: tile side ``size`` (px), the fewest tiles
    ``min_num``, whether a thumbnail is added, Normalize's ``mean``/``std`` and the output dtype."""

    size: int
    min_num: int
    use_thumbnail: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]
    dtype: torch.dtype


def grid(width: int, height: int, min_num: int, max_num: int, size: int,
         closest: Closest) -> tuple[int, int]:
    """(cols, rows) as ``dynamic_preprocess`` chooses them (its candidate list, built the same
    way, and lmdeploy's own ``closest``)."""
    ratios = {(i, j) for n in range(min_num, max_num + 1) for i in range(1, n + 1)
              for j in range(1, n + 1) if min_num <= i * j <= max_num}
    cols, rows = closest(width / height, sorted(ratios, key=lambda x: x[0] * x[1]), width, height,
                         size)
    return int(cols), int(rows)


class TileMaker:
    """``pixel_values`` of one RGB PIL image, as lmdeploy's recipe makes them, on ``device``
    ("cpu" or a CUDA device). ``pool``: threads for the CPU path's thumbnail (none: inline).
    Thread-safe: each calling thread gets its own CUDA stream."""

    def __init__(self, spec: TileSpec, closest: Closest, device: torch.device | str = "cpu",
                 pool: Executor | None = None) -> None:
        self.spec = spec
        self.closest = closest
        self.device = torch.device(device)
        self.pool = pool
        self.resampler = Resampler(self.device) if self.device.type == "cuda" else None
        self._local = threading.local()
        on = self.device
        self._mean = torch.as_tensor(spec.mean, dtype=torch.float32, device=on).view(-1, 1, 1)
        self._std = torch.as_tensor(spec.std, dtype=torch.float32, device=on).view(-1, 1, 1)
        self._255 = torch.tensor(255.0, dtype=torch.float32, device=on)  # 0-dim: see the docstring

    def grid(self, image: Any, max_num: int) -> tuple[int, int]:
        width, height = image.size
        return grid(width, height, self.spec.min_num, max_num, self.spec.size, self.closest)

    def __call__(self, image: Any, max_num: int) -> torch.Tensor:
        if image.mode != "RGB":
            raise ValueError(f"TileMaker takes RGB images, not {image.mode}")
        cols, rows = self.grid(image, max_num)
        thumbnail = self.spec.use_thumbnail and cols * rows != 1
        if self.device.type == "cuda":
            return self._on_cuda(image, cols, rows, thumbnail)
        return self._on_cpu(image, cols, rows, thumbnail)

    # -- the CPU path: PIL's resizes, one normalization over every tile ------------------------

    def _on_cpu(self, image: Any, cols: int, rows: int, thumbnail: bool) -> torch.Tensor:
        s = self.spec.size
        thumb = None
        if thumbnail:
            resize = image.resize
            thumb = self.pool.submit(resize, (s, s)) if self.pool is not None else None
        resized = _hwc(image.resize((cols * s, rows * s)))
        tiles = _tiles(resized.permute(2, 0, 1), cols, rows, s)
        if thumbnail:
            small = thumb.result() if thumb is not None else image.resize((s, s))
            tiles = torch.cat([tiles, _hwc(small).permute(2, 0, 1)[None]])
        return self._normalized(tiles.contiguous(), 255)

    # -- the CUDA path: Pillow's arithmetic on the GPU -------------------------------------------

    def _stream(self) -> torch.cuda.Stream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        return stream

    def _on_cuda(self, image: Any, cols: int, rows: int, thumbnail: bool) -> torch.Tensor:
        assert self.resampler is not None
        s = self.spec.size
        pixels = _hwc(image, pinned=True)
        stream = self._stream()
        with torch.cuda.stream(stream):
            chw = pixels.to(self.device, non_blocking=True).permute(2, 0, 1).contiguous()
            resized = self.resampler.resize(chw, (cols * s, rows * s))
            tiles = _tiles(resized, cols, rows, s)
            if thumbnail:
                tiles = torch.cat([tiles, self.resampler.resize(chw, (s, s))[None]])
            values = self._normalized(tiles.contiguous(), self._255)
            out = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            out.copy_(values, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # (this thread's stream only: the engine's streams are not waited on)
        return out

    def _normalized(self, tiles: torch.Tensor, by: Any) -> torch.Tensor:
        """torchvision's ToTensor and Normalize over uint8 ``[N, C, S, S]``, then the cast."""
        x = tiles.to(dtype=torch.float32).div(by)
        return x.sub_(self._mean).div_(self._std).to(self.spec.dtype)


def _hwc(image: Any, pinned: bool = False) -> torch.Tensor:
    """An RGB PIL image's pixels as a writable uint8 ``[H, W, 3]`` tensor (one copy of PIL's
    bytes, into pinned memory with ``pinned``)."""
    out = torch.empty((image.height, image.width, 3), dtype=torch.uint8, pin_memory=pinned)
    out.numpy()[...] = np.asarray(image)
    return out


def _tiles(chw: torch.Tensor, cols: int, rows: int, s: int) -> torch.Tensor:
    """The ``s x s`` crops of a ``[C, rows*s, cols*s]`` image, row by row: ``[rows*cols, C, s, s]``."""
    c = chw.shape[0]
    return chw.reshape(c, rows, s, cols, s).permute(1, 3, 0, 2, 4).reshape(rows * cols, c, s, s)
