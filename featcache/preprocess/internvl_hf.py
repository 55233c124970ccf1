"""InternVL-HF preprocessing (lmdeploy 0.18's ``InternVL3VisionModel.preprocess``: HF-format
InternVL3 checkpoints over transformers' ``GotOcr2ImageProcessorPil``, or its torchvision-backed
``GotOcr2ImageProcessor`` where torchvision imports), equal to it bit for bit and faster.

lmdeploy's recipe: one processor call for all the images of a request, with the images kwargs of
the processor's own config (``_merge_kwargs(InternVLProcessorKwargs, ...)``: ``crop_to_patches``
true by lmdeploy's default, the processor's ``min_patches``/``max_patches``/``size``; a request's
per-image parameters are ignored), ``pixel_values`` split per image by ``num_patches``, each cast
to the model's ``mm_feature_dtype``. Per image, with ``crop_to_patches`` and ``max_patches > 1``:
a grid of ``cols x rows`` tiles of side ``S`` by transformers' ``get_optimal_tiled_canvas``, the
whole image resized to ``cols*S x rows*S`` (PIL's BICUBIC), the tiles cropped row by row, and a
thumbnail (the whole image resized to ``S x S``) when there is more than one tile; else one resize
to ``S x S``. Then per tile, in NumPy: ``float32(float64(x) * rescale_factor)`` and ``(x - mean) /
std``; the PIL processor converts the decoded image (a copy), makes an array, a PIL image of it
again, and the float64 and float32 copies of every tile.

Here (``HFTileMaker``): the processor's own resizes of the decoded image (``resizers``: Pillow's
for the PIL processor, torch's uint8 antialias kernel for the torchvision-backed one, which
torchvision calls; the thumbnail's on a second thread while the grid's runs; both release the GIL
while they resample), then one table pass per channel: rescale and normalize are elementwise, so
each value is a function of its channel and uint8 value alone, read from ``qwen2vl.value_table``
(made by the processor's own ``rescale`` and ``normalize``, or the torchvision-backed one's fused
``rescale_and_normalize``: exact by construction) with ``np.take`` (which releases the GIL)
straight into ``[N, C, S, S]`` (a row of tiles a task on the pool where they are large); then
the elementwise cast to the model's dtype. For the torchvision-backed processor, whose torch ops
already take every core, its fused ``rescale_and_normalize`` (``qwen2vl.Normalize``, checked
against its own call over every uint8 value) from the resized grid and thumbnail straight into
``[N, C, S, S]`` in place of the table, the grid's and the thumbnail's resizes one after the
other. ``internvl_hf_spec`` says whether a model is one this reproduces, and checks it against the
processor itself on probe images (a 1x1 grid, wide, tall, with and without a thumbnail, in one
call as lmdeploy calls it) before saying yes. The torchvision-backed processor crops on every call
(``crop_to_patches`` alone: a 1x1 grid where ``max_patches`` is 1, the same as one resize).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .checks import image_processor, processor_classes
from .qwen2vl import MIN_BAND_BYTES, Normalize, normalizer, value_table
from .resizers import PILLOW, Resizer, for_processor, resize_chw

# get_optimal_tiled_canvas((height, width), (tile_h, tile_w), min_tiles, max_tiles) -> (cols, rows)
Canvas = Callable[..., tuple[int, int]]
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
# the images kwargs of lmdeploy's call that featcache reads (any other: lmdeploy's code)
KWARGS = ("crop_to_patches", "min_patches", "max_patches", "return_tensors")
_METHODS = ("__call__", "preprocess", "_preprocess", "_preprocess_image_like_inputs",
            "_prepare_image_like_inputs", "process_image", "convert_to_rgb", "resize", "rescale",
            "normalize", "rescale_and_normalize", "_fuse_mean_std_and_rescale_factor",
            "crop_image_to_patches", "_standardize_kwargs", "_further_process_kwargs",
            "_validate_preprocess_kwargs")


@dataclass(frozen=True, eq=False)
class HFTileSpec:
    """The recipe's constants as lmdeploy's call makes them: tile side ``size``, whether it crops
    (``crop_to_patches`` and ``max_patches > 1``), ``min_patches``/``max_patches``, ``table``
    (float32 ``[C * 256]``: each uint8 value of each channel rescaled and normalized), the output
    ``dtype`` and ``kwargs``, the images kwargs lmdeploy passes (the probe's call)."""

    size: int
    crop: bool
    min_patches: int
    max_patches: int
    table: np.ndarray
    dtype: torch.dtype
    kwargs: dict[str, Any]
    resize: Resizer = PILLOW  # the processor's own (``resizers``)
    # the torchvision-backed processor's fused ``rescale_and_normalize`` (``qwen2vl.Normalize``:
    # its multi-threaded torch ops, the table's values, checked); None: the table
    normalize: Normalize | None = None

    @property
    def channels(self) -> int:
        return self.table.shape[0] // 256


def _processor_classes() -> tuple[type, ...]:
    """transformers' GotOcr2 image processors ``HFTileMaker`` may reproduce: the PIL one, and the
    torchvision-backed one where torchvision imports (the probe checks it before it is trusted)."""
    return processor_classes("GotOcr2ImageProcessorPil",
                             "transformers.models.got_ocr2.image_processing_got_ocr2",
                             "GotOcr2ImageProcessor")


def canvas_of(ip: Any) -> Canvas:
    """transformers' ``get_optimal_tiled_canvas``, from the module of the processor's class."""
    import sys

    return sys.modules[type(ip).__module__].get_optimal_tiled_canvas  # type: ignore[no-any-return]


class HFTileMaker:
    """One RGB PIL image's ``pixel_values`` as lmdeploy's InternVL-HF recipe makes them (cast to
    the model's dtype). ``pool``: a thread for the thumbnail (none: inline). Thread-safe."""

    device = torch.device("cpu")

    def __init__(self, spec: HFTileSpec, canvas: Canvas, pool: Executor | None = None) -> None:
        self.spec = spec
        self.canvas = canvas
        self.pool = pool

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(cols, rows) of the tiles; (1, 1) where the processor makes one resize."""
        s = self.spec
        if not s.crop:
            return 1, 1
        cols, rows = self.canvas((height, width), (s.size, s.size), s.min_patches, s.max_patches)
        return int(cols), int(rows)

    def __call__(self, image: Any) -> torch.Tensor:
        return self.values(image).to(self.spec.dtype)

    def values(self, image: Any) -> torch.Tensor:
        """float32 ``[N, C, S, S]``: the processor's own output for this image (before the cast
        to the model's dtype)."""
        if self.spec.normalize is not None:
            return self._normalized(image)
        return torch.from_numpy(self._tabled(image))

    def _normalized(self, image: Any) -> torch.Tensor:
        """float32 ``[N, C, S, S]`` by the torchvision-backed processor's ops: its resizes of
        one source tensor, its ``rescale_and_normalize`` from the grid's pixels straight into the
        tiles (cut row by row) and from the thumbnail's into the last."""
        if image.mode != "RGB":
            raise ValueError(f"HFTileMaker takes RGB images, not {image.mode}")
        spec = self.spec
        norm = spec.normalize
        assert norm is not None
        s, c = spec.size, spec.channels
        cols, rows = self.grid(image.width, image.height)
        n = cols * rows
        out = torch.empty((n + (n != 1), c, s, s), dtype=torch.float32)
        chw = spec.resize.source(image)
        grid = resize_chw(chw, (cols * s, rows * s))
        norm.into(out[:n].view(rows, cols, c, s, s),
                  grid.reshape(c, rows, s, cols, s).permute(1, 3, 0, 2, 4))
        if n != 1:
            norm.into(out[n], resize_chw(chw, (s, s)))
        return out

    def _tabled(self, image: Any) -> np.ndarray:
        """``values`` by Pillow's resizes and the table."""
        if image.mode != "RGB":
            raise ValueError(f"HFTileMaker takes RGB images, not {image.mode}")
        s, c = self.spec.size, self.spec.channels
        cols, rows = self.grid(image.width, image.height)
        n = cols * rows
        thumbnail = n != 1
        out = np.empty((n + thumbnail, c, s, s), dtype=np.float32)
        r = self.spec.resize
        src = r.source(image)
        job = None  # the thumbnail's resize beside the grid's, where one call takes one core
        if thumbnail and self.pool is not None and not r.threaded:
            job = self.pool.submit(self._thumbnail, src, out)
        resized = r.resize(src, (cols * s, rows * s))
        tiles = resized.reshape(rows, s, cols, s, c).transpose(0, 2, 4, 1, 3)
        self._fill_rows(tiles, out[:n].reshape(rows, cols, c, s, s))
        if thumbnail:
            if job is not None:
                job.result()
            else:
                self._thumbnail(src, out)
        return out

    def _thumbnail(self, src: Any, out: np.ndarray) -> None:
        s, c = self.spec.size, self.spec.channels
        small = self.spec.resize.resize(src, (s, s))
        self._fill(small.transpose(2, 0, 1)[None, None], out[-1:].reshape(1, 1, c, s, s))

    def _fill_rows(self, tiles: np.ndarray, out: np.ndarray) -> None:
        """``_fill`` of the grid, a row of tiles a task on the pool where the output is large."""
        rows = out.shape[0]
        if self.pool is None or rows == 1 or out.nbytes < MIN_BAND_BYTES:
            self._fill(tiles, out)
            return
        for f in [self.pool.submit(self._fill, tiles[i:i + 1], out[i:i + 1]) for i in range(rows)]:
            f.result()

    def _fill(self, src: np.ndarray, out: np.ndarray) -> None:
        """``out[..., ch, :, :] = table[ch * 256 + src[..., ch, :, :]]``, one pass per channel
        (``src`` uint8 and ``out`` float32, both ``[rows, cols, C, S, S]``)."""
        table = self.spec.table
        for ch in range(self.spec.channels):
            np.take(table[ch * 256:(ch + 1) * 256], src[:, :, ch], out=out[:, :, ch], mode="clip")


def lmdeploy_images_kwargs(vision_model: Any) -> dict[str, Any]:
    """The images kwargs of lmdeploy's processor call, made as its ``preprocess`` makes them."""
    from lmdeploy.vl.model.internvl3_hf import InternVLProcessorKwargs

    output_kwargs = vision_model.processor._merge_kwargs(
        InternVLProcessorKwargs, tokenizer_init_kwargs=vision_model.tokenizer_init_kwargs,
        **{"return_tensors": "pt", "add_special_tokens": False})
    return dict(output_kwargs["images_kwargs"])


def internvl_hf_spec(vision_model: Any) -> HFTileSpec | str:
    """The ``HFTileSpec`` of a vision model whose preprocessing is lmdeploy's InternVL-HF recipe
    over transformers' GotOcr2 image processor exactly as ``HFTileMaker`` reproduces it, else why
    not (a sentence)."""
    try:
        from lmdeploy.vl.model.internvl3_hf import InternVL3VisionModel

        classes = _processor_classes()
    except ImportError as e:
        return f"lmdeploy's InternVL-HF model or transformers' GotOcr2 processor does not import ({e})"
    ip = image_processor(vision_model, InternVL3VisionModel, "InternVL-HF", classes, _METHODS)
    if isinstance(ip, str):
        return ip
    dtype = getattr(vision_model, "mm_feature_dtype", None)
    if not isinstance(dtype, torch.dtype):
        return f"its feature dtype is {dtype!r}"
    kwargs = lmdeploy_images_kwargs(vision_model)
    other = sorted(set(kwargs) - set(KWARGS))
    if other or kwargs.get("return_tensors", "pt") != "pt":
        return f"lmdeploy's call passes images kwargs featcache does not read ({other or kwargs})"
    why = _settings(ip, kwargs)
    if why is not None:
        return why
    crop = kwargs.get("crop_to_patches", ip.crop_to_patches)
    low = kwargs.get("min_patches", ip.min_patches)
    high = kwargs.get("max_patches", ip.max_patches)
    table = value_table(ip)
    norm = normalizer(ip, table)
    if isinstance(norm, str):
        return norm
    spec = HFTileSpec(size=int(ip.size.height), crop=bool(crop) and high > 1, min_patches=low,
                      max_patches=high, table=table, dtype=dtype, kwargs=kwargs,
                      resize=for_processor(ip), normalize=norm)
    return _probe(ip, spec)


def _settings(ip: Any, kwargs: dict[str, Any]) -> str | None:
    """Why the processor's settings (those lmdeploy's call overrides, as it passes them) are not
    the ones ``HFTileMaker`` reproduces, or None."""
    if ip.do_resize is not True or ip.resample not in (BICUBIC,):
        return f"its resize is do_resize={ip.do_resize} resample={ip.resample}, not BICUBIC"
    if ip.do_rescale is not True or ip.do_normalize is not True:
        return "it does not both rescale and normalize"
    if ip.do_convert_rgb is not True:
        return "it does not convert images to RGB"
    for name in ("device", "input_data_format", "data_format"):
        if getattr(ip, name, None) is not None:
            return f"its {name} is set ({getattr(ip, name)!r})"
    size: Any = ip.size
    others = [k for k in ("longest_edge", "shortest_edge", "max_height", "max_width", "min_pixels",
                          "max_pixels") if getattr(size, k, None) is not None]
    if type(size.height) is not int or size.height < 1 or size.width != size.height or others:
        return f"its size is {size}, not a square"
    crop = kwargs.get("crop_to_patches", ip.crop_to_patches)
    low = kwargs.get("min_patches", ip.min_patches)
    high = kwargs.get("max_patches", ip.max_patches)
    if type(crop) is not bool or type(low) is not int or type(high) is not int:
        return f"its crop_to_patches={crop!r} min_patches={low!r} max_patches={high!r}"
    if len(ip.image_mean) != 3 or len(ip.image_std) != 3:
        return "its mean and std are not per RGB channel"
    return None


def _probe(ip: Any, spec: HFTileSpec) -> HFTileSpec | str:
    """``spec`` where ``HFTileMaker`` equals the processor itself on probe images (square, wide,
    tall, tiny, large: a 1x1 grid, others with a thumbnail where it crops), called once for all
    of them with lmdeploy's images kwargs, else why not."""
    from PIL import Image

    maker = HFTileMaker(spec, canvas_of(ip))
    rng = np.random.default_rng(20261203)
    s = spec.size
    sizes = ((s, s), (3 * s + 5, s - 3), (s - 3, 2 * s + 7), (37, 23), (5 * s + 11, 4 * s - 7))
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
              for w, h in sizes]
    want = ip(images, **spec.kwargs)
    got = [maker.values(image) for image in images]
    counts = torch.tensor([len(g) for g in got], dtype=torch.int64)
    if not torch.equal(counts, torch.as_tensor(want["num_patches"])):
        return (f"featcache's tile counts {counts.tolist()} differ from its processor's "
                f"{list(want['num_patches'])} on probes {sizes}")
    if not torch.equal(torch.cat(got), want["pixel_values"]):
        return f"featcache's tiles differ from its processor's on probes {sizes}"
    return spec


__all__ = ["HFTileMaker", "HFTileSpec", "canvas_of", "internvl_hf_spec"]
