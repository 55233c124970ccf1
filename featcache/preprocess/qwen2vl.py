"""Qwen2-VL / Qwen2.5-VL preprocessing (lmdeploy 0.18's ``Qwen2VLModel.preprocess`` over
transformers' ``Qwen2VLImageProcessorPil``, or its torchvision-backed ``Qwen2VLImageProcessor``
where torchvision imports), equal to it bit for bit and faster.

lmdeploy's recipe for one RGB image, one processor call per image: ``smart_resize`` picks a size
whose sides are multiples of ``patch_size * merge_size`` and whose area lies in ``[min_pixels,
max_pixels]`` (the processor's ``size``, or the image's ``min_pixels``/``max_pixels``
parameters), PIL's BICUBIC resizes to it (always called: the identity at the same size), then in
NumPy ``float32(float64(x) * rescale_factor)``, ``(x - mean) / std`` in float32, and the patchify:
``[C, H, W]`` reordered to ``[grid_h * grid_w, C * temporal * patch * patch]``, each patch repeated
``temporal_patch_size`` times. ``image_grid_thw`` is ``[[1, grid_h, grid_w]]`` and the image's
token count ``grid_h * grid_w // merge_size**2``. Over a second for a 3000x2000 photo on a loaded
2-core CPU: float64 and float32 copies of the whole image, then the patchified copy.

Here (``PatchMaker``): the processor's own resize (``resizers``: Pillow's for the PIL processor,
torch's uint8 antialias kernel, which torchvision calls, for the torchvision-backed one; skipped
where the size is already right, as both processors skip it), then one pass from the uint8 pixels
to the output. Rescale and normalize are elementwise, so each output value is a function of its
channel and its uint8 value alone: a ``[C, 256]`` table made once by the processor's own
operations (``value_table``: ``rescale`` then ``normalize`` of the PIL processor, the fused float32
``(x - mean / r) / (std / r)`` of the torchvision-backed one; its order and dtypes by
construction); each output value is that table read at its pixel (``np.take``, which releases the
GIL), written straight into the patchified layout, in row bands on a pool. For the
torchvision-backed processor the values are its fused ``rescale_and_normalize`` in multi-threaded
torch ops (``Normalize``: its constants and its two ops, checked against the processor's own call
over every uint8 value), written straight from the resized uint8 pixels into the patch layout
(``normalized_patches``): that processor's torch ops already take every core, which a one-thread
table pass does not (on the H200 machine's 16 cores the table ran at 0.5-0.8x of its time per
image), and it makes two float copies of the whole image before its patchified one, which this
does not. ``qwen2vl_spec`` says whether a model is one this reproduces, and checks it against the
processor itself on probe images before saying yes.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .checks import image_processor, processor_classes
from .resizers import PILLOW, Resizer, for_processor, resize_chw, torchvision_backed

# smart_resize(height, width, factor, min_pixels, max_pixels) -> (height, width): transformers'
SmartResize = Callable[..., tuple[int, int]]
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC (the processor's resample)
MIN_BAND_BYTES = 4 << 20  # output bytes below which one image is one task (a thread's start costs more)
_METHODS = ("__call__", "preprocess", "_preprocess", "_preprocess_image_like_inputs",
            "_prepare_image_like_inputs", "process_image", "convert_to_rgb", "resize", "rescale",
            "normalize", "rescale_and_normalize", "_fuse_mean_std_and_rescale_factor", "patchify",
            "_standardize_kwargs")


@dataclass(frozen=True, eq=False)
class PatchSpec:
    """The processor's constants: ``patch_size``, ``merge_size``, ``temporal_patch_size``, its
    default ``min_pixels``/``max_pixels`` (``size``) and ``table``: float32 ``[C * 256]``, the
    rescaled and normalized value of each uint8 value of each channel."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    table: np.ndarray
    # whether the processor honours a call's min_pixels or max_pixels given alone (transformers
    # 5.24 does; 5.17 ignores either unless both are given): ``_probe`` finds out
    single_limits: bool = False
    # the processor's resize: Pillow's for the PIL processor, torch's uint8 antialias kernel for
    # the torchvision-backed one (``resizers``)
    resize: Resizer = PILLOW
    # the torchvision-backed processor's fused ``rescale_and_normalize`` (``Normalize``: its
    # multi-threaded torch ops, on a many-core machine faster than a one-thread table pass; the
    # table's values, checked); None: the table
    normalize: Normalize | None = None

    @property
    def channels(self) -> int:
        return self.table.shape[0] // 256


def value_table(processor: Any) -> np.ndarray:
    """The processor's own rescale and normalize (its arguments, as its ``_preprocess`` passes
    them) over an image holding every uint8 value of each channel: float32 ``[C * 256]``. The PIL
    processor: ``rescale`` then ``normalize`` in NumPy over ``[C, 1, 256]``; the
    torchvision-backed one: its fused ``rescale_and_normalize`` in torch over ``[1, C, 1, 256]``."""
    channels = len(processor.image_mean)
    norm = _own_normalize(processor)
    if norm is not None:
        pixels = torch.arange(256, dtype=torch.uint8).expand(1, channels, 1, 256).contiguous()
        x = np.asarray(norm(pixels).numpy())
        shape: tuple[int, ...] = tuple(pixels.shape)
    else:
        probe = np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 1, 256)).copy()
        x = processor.rescale(probe, processor.rescale_factor)
        x = processor.normalize(x, processor.image_mean, processor.image_std)
        x = np.asarray(x, dtype=np.float32)  # (patchify's own cast: a no-op on float32)
        shape = probe.shape
    if x.shape != shape:
        raise ValueError(f"rescale and normalize made {x.shape} of {shape}")
    return np.ascontiguousarray(x.reshape(-1))


@dataclass(frozen=True, eq=False)
class Normalize:
    """A torchvision-backed processor's fused ``rescale_and_normalize`` of uint8 pixels: ``(x -
    mean) / std`` in float32 with its fused constants (``image_mean / rescale_factor``, ``image_std
    / rescale_factor``, as its ``_fuse_mean_std_and_rescale_factor`` makes them) by its normalize's
    two ops in their order (torchvision's ``normalize_image``: ``sub``, then ``div_``), written
    straight into a view of the output, so that no float copy of the image is made before the
    layout's (the processor makes two). The uint8 values widen to float32 exactly, so each output
    value is a function of its channel and pixel alone: ``normalizer`` keeps a ``Normalize`` only
    where it equals the processor's own call over every uint8 value of every channel."""

    mean: torch.Tensor  # float32 [C]
    std: torch.Tensor

    def into(self, out: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        """``out = (pixels - mean) / std``: uint8 ``pixels`` and float32 ``out`` of one shape (any
        strides), the channels the third dimension from the end; returns ``out``."""
        c = self.mean.numel()
        torch.sub(pixels, self.mean.view(c, 1, 1), out=out)
        return out.div_(self.std.view(c, 1, 1))

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """The values of uint8 ``pixels`` as a new float32 tensor of their shape."""
        return self.into(torch.empty(pixels.shape, dtype=torch.float32), pixels)


def normalizer(processor: Any, table: np.ndarray) -> Normalize | str | None:
    """The torchvision-backed ``processor``'s ``Normalize``, or why not (a sentence: it does not
    give ``table``, the processor's own values); None for the PIL processor (the table's)."""
    if not torchvision_backed(processor):
        return None
    r = float(processor.rescale_factor)
    mean = torch.tensor(processor.image_mean) * (1.0 / r)
    std = torch.tensor(processor.image_std) * (1.0 / r)
    norm = Normalize(mean.to(torch.float32), std.to(torch.float32))
    c = len(processor.image_mean)
    every = torch.arange(256, dtype=torch.uint8).expand(c, 1, 256)
    if not np.array_equal(norm(every).reshape(-1).numpy(), table):
        return "its rescale_and_normalize is not (x - mean / r) / (std / r) in float32"
    return norm


def _own_normalize(processor: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The torchvision-backed ``processor``'s own fused ``rescale_and_normalize`` with the
    arguments its ``_preprocess`` passes (as ``value_table`` calls it); None for the PIL one."""
    if not torchvision_backed(processor):
        return None
    args = (processor.do_rescale, processor.rescale_factor, processor.do_normalize,
            tuple(processor.image_mean), tuple(processor.image_std))  # (hashable: it is cached)

    def normalize(images: torch.Tensor) -> torch.Tensor:
        return processor.rescale_and_normalize(images, *args).to(torch.float32)  # type: ignore[no-any-return]

    return normalize


def _processor_classes() -> tuple[type, ...]:
    """transformers' Qwen2-VL image processors ``PatchMaker`` may reproduce: the PIL one, and the
    torchvision-backed one where torchvision imports (``_probe`` checks either before it is
    trusted)."""
    return processor_classes("Qwen2VLImageProcessorPil",
                             "transformers.models.qwen2_vl.image_processing_qwen2_vl",
                             "Qwen2VLImageProcessor")


class PatchMaker:
    """``pixel_values`` and ``image_grid_thw`` of one RGB PIL image as the processor makes them.
    ``pool``: threads for the row bands of a large image (none: inline). Thread-safe."""

    device = torch.device("cpu")

    def __init__(self, spec: PatchSpec, smart_resize: SmartResize, pool: Executor | None = None,
                 bands: int = 1) -> None:
        self.spec = spec
        self.smart_resize = smart_resize
        self.pool = pool
        self.bands = max(1, bands)
        c = spec.channels
        self._offsets = (np.arange(c, dtype=np.uint16) * 256).reshape(c, 1, 1)

    def size(self, width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        """(width, height) after ``smart_resize`` (which raises where lmdeploy's call would)."""
        s = self.spec
        h, w = self.smart_resize(height, width, factor=s.patch_size * s.merge_size,
                                 min_pixels=min_pixels, max_pixels=max_pixels)
        return int(w), int(h)

    def __call__(self, image: Any, min_pixels: int, max_pixels: int) -> tuple[torch.Tensor, torch.Tensor]:
        if image.mode != "RGB":
            raise ValueError(f"PatchMaker takes RGB images, not {image.mode}")
        width, height = self.size(image.width, image.height, min_pixels, max_pixels)
        s = self.spec
        p, m, t, c = s.patch_size, s.merge_size, s.temporal_patch_size, s.channels
        gh, gw = height // p, width // p
        thw = torch.tensor([[1, gh, gw]], dtype=torch.int64)
        if s.normalize is not None:  # the processor's torch ops, its patchify's layout
            chw = resize_chw(s.resize.source(image), (width, height))
            return normalized_patches(chw, s.normalize, p, m, t), thw
        pixels = s.resize(image, (width, height))  # [H, W, C] uint8
        # [gh/m, m, p, gw/m, m, p, C] -> patchify's (gh/m, gw/m, mh, mw, C, ph, pw)
        src = pixels.reshape(gh // m, m, p, gw // m, m, p, c).transpose(0, 3, 1, 4, 6, 2, 5)
        out = np.empty((gh // m, gw // m, m, m, c, t, p, p), dtype=np.float32)
        rows = gh // m
        bands = min(self.bands, rows, max(1, out.nbytes // MIN_BAND_BYTES))
        cuts = [rows * i // bands for i in range(bands + 1)]
        spans = list(zip(cuts[:-1], cuts[1:], strict=True))
        if self.pool is None or bands == 1:
            for lo, hi in spans:
                self._band(src, out, lo, hi)
        else:
            for f in [self.pool.submit(self._band, src, out, lo, hi) for lo, hi in spans]:
                f.result()
        return torch.from_numpy(out.reshape(gh * gw, c * t * p * p)), thw

    def _band(self, src: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
        """Rows ``lo:hi`` (of merged patches): each value ``table[channel * 256 + pixel]``."""
        index = np.add(src[lo:hi], self._offsets, dtype=np.uint16)
        band = out[lo:hi]
        np.take(self.spec.table, np.broadcast_to(index[:, :, :, :, :, None], band.shape),
                out=band, mode="clip")


def normalized_patches(chw: torch.Tensor, normalize: Normalize, patch: int, merge: int,
                       temporal: int) -> torch.Tensor:
    """The torchvision-backed processor's ``rescale_and_normalize`` then ``patchify`` of one uint8
    ``[C, H, W]`` image (either memory order): ``[grid_h * grid_w, C * temporal * patch * patch]``,
    each patch repeated ``temporal`` times. The values are written from the pixels straight into
    the patch layout, then copied into each further temporal slot: one float copy of the image
    where the processor makes three (its float32 cast, its ``sub``, its patchified reshape)."""
    c, h, w = chw.shape
    gh, gw, p, m = h // patch, w // patch, patch, merge
    # [C, H, W] -> (gh/m, gw/m, mh, mw, C, ph, pw): a view whatever the memory order
    src = chw.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    out = torch.empty((gh // m, gw // m, m, m, c, temporal, p, p), dtype=torch.float32)
    first = normalize.into(out[:, :, :, :, :, 0], src)
    for k in range(1, temporal):
        out[:, :, :, :, :, k].copy_(first)
    return out.view(gh * gw, c * temporal * p * p)


def qwen2vl_spec(vision_model: Any) -> PatchSpec | str:
    """The ``PatchSpec`` of a vision model whose preprocessing is lmdeploy's Qwen2-VL recipe over
    transformers' PIL ``Qwen2VLImageProcessorPil`` exactly as ``PatchMaker`` reproduces it, else
    why not (a sentence)."""
    try:
        from lmdeploy.vl.model.qwen2 import Qwen2VLModel

        classes = _processor_classes()
    except ImportError as e:
        return f"lmdeploy's Qwen2-VL model or transformers' PIL processor does not import ({e})"
    ip = image_processor(vision_model, Qwen2VLModel, "Qwen2-VL", classes, _METHODS)
    if isinstance(ip, str):
        return ip
    return processor_spec(ip)


def processor_spec(ip: Any) -> PatchSpec | str:
    """The ``PatchSpec`` of one of transformers' Qwen2-VL image processors, whoever calls it
    (lmdeploy's Qwen2-VL recipe; the Qwen3 lineage's processor-level preprocessing, patch 16,
    mean and std 0.5), or of GLM-4.1V's (the same patchify after its own ``smart_resize``:
    ``smart_resize_of``), checked against the processor itself on probe images; else why not."""
    try:
        classes = _processor_classes() + _glm4v_classes()
    except ImportError as e:
        return f"transformers' Qwen2-VL image processor does not import ({e})"
    if type(ip) not in classes:
        return (f"its image processor is {type(ip).__name__}, not one of transformers' "
                f"{' or '.join(c.__name__ for c in classes)}")
    patched = [name for name in _METHODS if name in vars(ip)]
    if patched:
        return f"its image processor's {', '.join(patched)} are replaced on the instance"
    why = _settings(ip)
    if why is not None:
        return why
    table = value_table(ip)
    norm = normalizer(ip, table)
    if isinstance(norm, str):
        return norm
    size: Any = ip.size
    spec = PatchSpec(patch_size=int(ip.patch_size), merge_size=int(ip.merge_size),
                     temporal_patch_size=int(ip.temporal_patch_size),
                     min_pixels=size.shortest_edge, max_pixels=size.longest_edge,
                     table=table, resize=for_processor(ip), normalize=norm)
    return _probe(ip, spec)


def _glm4v_classes() -> tuple[type, ...]:
    """transformers' GLM-4.1V image processors (none where this transformers has none)."""
    try:
        return processor_classes("Glm4vImageProcessorPil",
                                 "transformers.models.glm4v.image_processing_glm4v", "Glm4vImageProcessor")
    except ImportError:
        return ()


def smart_resize_of(ip: Any) -> SmartResize:
    """The ``smart_resize`` of ``ip``'s processor family as ``PatchMaker`` calls it: Qwen2-VL's,
    or GLM-4.1V's (one image: ``temporal_patch_size`` frames, counted in its pixel budget)."""
    if type(ip) in _glm4v_classes():
        from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as glm

        temporal = int(ip.temporal_patch_size)

        def resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
            h, w = glm(num_frames=temporal, height=height, width=width, temporal_factor=temporal,
                       factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
            return int(h), int(w)

        return resize
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize


def _settings(ip: Any) -> str | None:
    """Why the processor's settings are not the ones ``PatchMaker`` reproduces, or None."""
    if ip.do_resize is not True or ip.resample not in (BICUBIC,):
        return f"its resize is do_resize={ip.do_resize} resample={ip.resample}, not BICUBIC"
    if ip.do_rescale is not True or ip.do_normalize is not True:
        return "it does not both rescale and normalize"
    for name in ("device", "input_data_format", "data_format", "min_pixels", "max_pixels"):
        if getattr(ip, name, None) is not None:
            return f"its {name} is set ({getattr(ip, name)!r})"
    size: Any = ip.size
    for v in (size.shortest_edge, size.longest_edge, ip.patch_size, ip.merge_size,
              ip.temporal_patch_size):
        if type(v) is not int or v < 1:
            return f"its sizes are {size} patch {ip.patch_size} merge {ip.merge_size}"
    if len(ip.image_mean) != 3 or len(ip.image_std) != 3:
        return "its mean and std are not per RGB channel"
    return None


def _probe(ip: Any, spec: PatchSpec) -> PatchSpec | str:
    """``spec`` where ``PatchMaker`` equals the processor itself on probe images (one at its
    size, one resized up, one down), else why not."""
    from PIL import Image

    maker = PatchMaker(spec, smart_resize_of(ip))
    rng = np.random.default_rng(20261203)
    f = spec.patch_size * spec.merge_size
    for w, h in ((2 * f, f), (37, 23), (3 * f + 5, 2 * f - 3)):
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
        if _same(ip, maker, image, {}) is False:
            return f"featcache's patches differ from its processor's on a {w}x{h} probe"
    # a call's own limits (lmdeploy passes an image's min_pixels/max_pixels): both given must be
    # honoured as featcache does; one alone is where transformers versions differ
    large = Image.fromarray(rng.integers(0, 256, (7 * f - 5, 10 * f + 3, 3), dtype=np.uint8), "RGB")
    small = Image.fromarray(rng.integers(0, 256, (23, 37, 3), dtype=np.uint8), "RGB")
    low = max(spec.min_pixels, 4 * f * f)  # below the large probe's area: it shrinks to it
    if _same(ip, maker, large, dict(min_pixels=f * f, max_pixels=low)) is not True:
        return "its processor does not honour a call's min_pixels and max_pixels as featcache does"
    single = (_same(ip, maker, large, dict(max_pixels=low)) is True  # shrinks only if honoured
              and _same(ip, maker, small, dict(min_pixels=16 * low)) is True)  # grows more if so
    return PatchSpec(**{**spec.__dict__, "single_limits": single})


def _same(ip: Any, maker: PatchMaker, image: Any, limits: dict[str, int]) -> bool | None:
    """Whether ``maker`` gives what the processor gives for ``image`` called with ``limits``
    (the others its defaults, as ``fastprep`` reads an image's parameters); None where the
    processor refuses the call."""
    import warnings

    s = maker.spec
    call: dict[str, Any] = dict(limits)
    if limits and type(ip) in _glm4v_classes():  # (its call takes the bounds as a size only)
        call = {"size": {"shortest_edge": limits.get("min_pixels", s.min_pixels),
                         "longest_edge": limits.get("max_pixels", s.max_pixels)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (transformers deprecates min_pixels in a call)
        try:
            want = ip(images=[image], return_tensors="pt", **call)
        except ValueError:
            return None  # (a probe outside the processor's own limits)
    got, thw = maker(image, limits.get("min_pixels", s.min_pixels), limits.get("max_pixels", s.max_pixels))
    return bool(torch.equal(got, want["pixel_values"]) and torch.equal(thw, want["image_grid_thw"]))
