"""featcache's preprocessing of a miss: lmdeploy's own output, faster and off its one thread.

lmdeploy 0.18 preprocesses every image on a one-worker executor (``ImageEncoder.executor``), so
new images queue behind each other whatever the GPU (shared notes: 8-9 images/s for 13-tile
photos). Two changes, installed by ``wrap`` on every path that preprocesses (the frontend's
misses, the PyTorch engine in one process or several, TurboMind native, features, combined):

- ``FastPreprocess`` stands in for the vision model's ``preprocess(messages)``: for a model and
  image it reproduces exactly, it makes the same per-image dicts: legacy InternVL
  (``internvl_spec``: lmdeploy's InternVL-Chat-V1-5 recipe, RGB images, a grid of at most
  ``MAX_FAST_TILES``) with ``preprocess.internvl.TileMaker`` (on the GPU where there is one, else
  PIL in threads); Qwen2-VL / Qwen2.5-VL (``preprocess.qwen2vl.qwen2vl_spec``: transformers' PIL
  image processor, PIL or torchvision-backed, RGB images) with ``preprocess.qwen2vl.PatchMaker`` on
  the CPU; InternVL-HF
  (``preprocess.internvl_hf.internvl_hf_spec``: lmdeploy's ``InternVL3VisionModel`` over
  transformers' GotOcr2 image processor, every image of the request RGB without transparency)
  with ``preprocess.internvl_hf.HFTileMaker`` on the CPU (both with their processor's own resize:
  ``preprocess.resizers``). For anything else, lmdeploy's own code
  runs, counted as ``preprocess_fallback``. A failure of the fast path
  is a fallback too (``preprocess_errors``), never a failed request.
- ``widen`` runs the encoder's preprocessing on a bounded pool (``THREADS``) in place of its
  single worker, so the preprocessing of different requests overlaps (the vision model's
  ``forward`` stays on that worker).

``FEATCACHE_PREPROCESS``: ``auto`` (the default: cuda when available, else cpu), ``cuda``,
``cpu``, or ``lmdeploy`` (lmdeploy's own preprocessing for every image, its single worker kept).
The CUDA path must first reproduce the installed Pillow on a probe set
(``resample.matches_pillow``), else the CPU path is used and the reason logged.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..core.cache import FeatureCache
from ..preprocess.internvl import TileMaker, TileSpec
from ..preprocess.internvl_hf import HFTileMaker, canvas_of, internvl_hf_spec
from ..preprocess.qwen2vl import PatchMaker, processor_spec, qwen2vl_spec, smart_resize_of
from ..preprocess.resample import Resampler, matches_pillow
from ..threads import usable_cores

log = logging.getLogger("featcache")
SECTION = "lmdeploy"
ENV = "FEATCACHE_PREPROCESS"
MODES = ("auto", "cuda", "cpu", "lmdeploy")
MAX_THREADS = 8
MAX_FAST_TILES = 64  # a request asking for more tiles than this gets lmdeploy's own code
IMAGE_RES = {"low": 6, "medium": 12, "high": 24}  # lmdeploy's _preprocess_v1_5 "detail" levels


THREADS = max(1, min(MAX_THREADS, usable_cores()))
_pool: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    """The process's threads for the parts of one image's preprocessing that overlap (a
    thumbnail beside its grid, the images of one request on the GPU path): ``THREADS`` wide.
    Their tasks never wait on each other, so a request thread waiting on them cannot deadlock."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="featcache-prep")
    return _pool


def mode() -> str:
    value = os.environ.get(ENV, "auto") or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, not {value!r}")
    return value


def widen(encoder: Any) -> None:
    """Run lmdeploy's ``ImageEncoder.preprocess`` on a pool of ``THREADS`` workers in place of
    its one worker, where featcache's hook is installed on its model (unless
    ``FEATCACHE_PREPROCESS=lmdeploy``), so that the preprocessing of different requests overlaps.
    The preprocess hooks are thread-safe. The encoder's own executor is kept for everything else
    it runs (``async_infer``: the vision model's ``forward``, which TurboMind's combined path
    routes through for every image request): that stays on one thread, as lmdeploy designed it.
    Either preprocessing API is widened (the processor-level one: ``ProcessorFrontend``)."""
    if mode() == "lmdeploy" or getattr(encoder, "_featcache_wide", None) is not None:
        return
    model = encoder.model
    if not getattr(getattr(model, "preprocess", None), "_featcache", False):
        return  # featcache is not installed on this model: lmdeploy's as it is
    wide = ThreadPoolExecutor(THREADS, thread_name_prefix="featcache-encoder")

    new_api = bool(getattr(encoder, "_uses_new_preprocess", False))

    async def preprocess(messages: list[dict[str, Any]], input_prompt: Any = None,
                         mm_processor_kwargs: Any = None) -> Any:
        loop = asyncio.get_running_loop()
        if new_api:  # the processor-level API: the prompt and the request's processor options
            return await loop.run_in_executor(wide, model.preprocess, messages, input_prompt,
                                              mm_processor_kwargs)
        # (the legacy API ignores the prompt and the processor options, as lmdeploy's does)
        return await loop.run_in_executor(wide, model.preprocess, messages)

    encoder.preprocess = preprocess
    encoder._featcache_wide = wide


def internvl_spec(vision_model: Any) -> TileSpec | str:
    """The ``TileSpec`` of a vision model whose preprocessing is lmdeploy's InternVL-Chat-V1-5
    recipe exactly as ``TileMaker`` reproduces it, else why not (a sentence)."""
    try:
        from lmdeploy.vl.model.internvl import InternVLVisionModel
    except ImportError as e:
        return f"lmdeploy's InternVL model does not import ({e})"
    if not isinstance(vision_model, InternVLVisionModel):
        return f"{type(vision_model).__name__} is not lmdeploy's InternVL model"
    if type(vision_model).preprocess is not InternVLVisionModel.preprocess:
        return f"{type(vision_model).__name__} has a preprocess of its own"
    if getattr(vision_model.processor, "__func__", None) is not InternVLVisionModel._preprocess_v1_5:
        return "the model uses its CLIP image processor (InternVL-Chat-V1-1/V1-2), not V1-5 tiling"
    steps = list(getattr(vision_model.transform, "transforms", []))
    names = [type(t).__name__ for t in steps]
    if names != ["Lambda", "Resize", "ToTensor", "Normalize"]:
        return f"its transform is {names}, not lmdeploy's"
    resize, normalize = steps[1], steps[3]
    size = int(vision_model.vision_config.image_size)
    interpolation = getattr(resize.interpolation, "value", resize.interpolation)
    if list(resize.size) != [size, size] or interpolation not in ("bicubic", 3):
        return f"its Resize is {resize.size} {interpolation}, not ({size}, {size}) bicubic"
    if getattr(normalize, "inplace", False) or getattr(resize, "max_size", None) is not None:
        return "its transform has options featcache does not reproduce"
    dtype = vision_model.mm_feature_dtype
    if not isinstance(dtype, torch.dtype):
        return f"its feature dtype is {dtype!r}"
    config = vision_model.config
    return TileSpec(size=size, min_num=int(config.min_dynamic_patch),
                    use_thumbnail=bool(config.use_thumbnail),
                    mean=tuple(float(x) for x in normalize.mean),
                    std=tuple(float(x) for x in normalize.std), dtype=dtype)


def _device(wanted: str) -> tuple[torch.device, str]:
    """Where the fast path runs, and why."""
    if wanted == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu"), "asked for" if wanted == "cpu" else "no CUDA device"
    device = torch.device("cuda", torch.cuda.current_device())
    if not matches_pillow(Resampler(device)):
        import PIL

        return torch.device("cpu"), (f"the GPU resize does not reproduce Pillow {PIL.__version__} "
                                     "(its Resample.c changed): PIL's own resizes, in threads")
    return device, "the engine's GPU"


def _is_model(vision_model: Any, module: str, name: str) -> bool:
    """Whether ``vision_model`` is lmdeploy's class ``name`` of ``module`` (False where it does
    not import)."""
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(vision_model, cls)


def _probed(spec_of: Callable[[Any], Any], vision_model: Any) -> Any:
    """``spec_of(vision_model)``: a fast path's spec, or why not (a sentence), also where the
    processor cannot even be probed (then lmdeploy's own code runs)."""
    try:
        return spec_of(vision_model)
    except Exception as e:
        return f"its processor could not be probed ({type(e).__name__}: {e})"


def _plain_rgb(modality: Any, image: Any) -> bool:
    """Whether an item is an RGB image without a transparency key (which transformers'
    processors composite onto white): what the Qwen2-VL and InternVL-HF makers take."""
    return (getattr(modality, "value", modality) == "image" and getattr(image, "mode", None) == "RGB"
            and image.info.get("transparency") is None)


def _on_cpu(spec: Any) -> str:
    """How a CPU maker makes its values (the log's and ``FastPreprocess.why``'s words)."""
    values = ("the processor's fused rescale_and_normalize into its layout" if spec.normalize is not None
              else "a value table")
    return f"on cpu ({spec.resize.name}, {values})"


def _hf_tile_maker(vision_model: Any) -> tuple[HFTileMaker | None, str]:
    """InternVL-HF's maker (on the CPU: its processor's resizes, Pillow's or torch's), or None
    and why not."""
    spec = _probed(internvl_hf_spec, vision_model)
    if isinstance(spec, str):
        return None, spec
    canvas = canvas_of(vision_model.processor.image_processor)
    return HFTileMaker(spec, canvas, pool()), _on_cpu(spec)


def _hf_tile_plan(items: list[tuple[str, Any, dict[str, Any]]]) -> list[Any] | None:
    """The images of a request, or None where any item is not one ``HFTileMaker`` reproduces
    (not an RGB image, or one with a transparency key: the processor composites it onto white).
    lmdeploy's call ignores a request's per-image parameters, and so does this."""
    plan = []
    for modality, image, _ in items:
        if not _plain_rgb(modality, image):
            return None
        plan.append(image)
    return plan


def _patch_maker(vision_model: Any) -> tuple[PatchMaker | None, str]:
    """Qwen2-VL's maker (on the CPU: its output is float32 twice the image's size, which a GPU
    would only send back), or None and why not."""
    spec = _probed(qwen2vl_spec, vision_model)
    if isinstance(spec, str):
        return None, spec
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return PatchMaker(spec, smart_resize, pool(), bands=THREADS), _on_cpu(spec)


def processor_patch_maker(image_processor: Any) -> tuple[PatchMaker | None, str]:
    """The processor-level frontend's maker for a new-API model's image processor (the Qwen3
    lineage's: transformers' Qwen2-VL image processor at patch 16, checked on probes), or None and
    why not; none where ``FEATCACHE_PREPROCESS=lmdeploy``."""
    if mode() == "lmdeploy":
        return None, f"{ENV}=lmdeploy"
    try:
        spec = processor_spec(image_processor)
    except Exception as e:
        spec = f"its processor could not be probed ({type(e).__name__}: {e})"
    if isinstance(spec, str):
        return None, spec
    return PatchMaker(spec, smart_resize_of(image_processor), pool(), bands=THREADS), _on_cpu(spec)


def processor_patches(maker: PatchMaker, images: list[Any], size: dict[str, int] | None
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``pixel_values`` and ``image_grid_thw`` of ``images`` as one call of the processor makes
    them (every image's patches in order, one grid row each), at the request's ``size`` override
    (``shortest_edge``/``longest_edge``) or the processor's own; None where any image is not one
    ``maker`` reproduces (not plain RGB, a size ``smart_resize`` refuses)."""
    if size is not None and set(size) != {"shortest_edge", "longest_edge"}:
        return None
    low = maker.spec.min_pixels if size is None else size["shortest_edge"]
    high = maker.spec.max_pixels if size is None else size["longest_edge"]
    for image in images:
        if not _plain_rgb("image", image):
            return None
        try:
            maker.size(image.width, image.height, low, high)
        except (ValueError, ZeroDivisionError):
            return None
    made = [maker(image, low, high) for image in images]
    return torch.cat([values for values, _ in made]), torch.cat([thw for _, thw in made])


def _pixels_param(params: dict[str, Any], key: str, default: int) -> int | None:
    """``min_pixels``/``max_pixels`` as the processor's call reads an image's parameter (absent:
    its own), or None where it is not a positive int (lmdeploy's code decides what it means: a
    None given, for one, fails transformers' check of the call's arguments)."""
    if key not in params:
        return default
    value = params[key]
    return value if type(value) is int and value > 0 else None


def _patch_plan(maker: PatchMaker, items: list[tuple[str, Any, dict[str, Any]]]
                ) -> list[tuple[Any, int, int]] | None:
    """(image, min_pixels, max_pixels) per item, or None where any is not one ``maker``
    reproduces (not an RGB image, a transparency key, parameters lmdeploy's code must judge,
    a size ``smart_resize`` refuses)."""
    plan = []
    for modality, image, params in items:
        if not _plain_rgb(modality, image):
            return None
        low = _pixels_param(params, "min_pixels", maker.spec.min_pixels)
        high = _pixels_param(params, "max_pixels", maker.spec.max_pixels)
        if low is None or high is None:
            return None
        if ("min_pixels" in params) != ("max_pixels" in params) and not maker.spec.single_limits:
            return None  # (one alone: this transformers' processor ignores it, by its probe)
        try:
            maker.size(image.width, image.height, low, high)
        except (ValueError, ZeroDivisionError):
            return None
        plan.append((image, low, high))
    return plan


class FastPreprocess:
    """``preprocess(messages)`` as lmdeploy's vision model does it, by ``TileMaker``,
    ``PatchMaker`` or ``HFTileMaker`` where it is exact, else by ``original`` (lmdeploy's).
    Counts on ``cache``: ``preprocess_fast``, ``preprocess_fallback`` and ``preprocess_errors``
    (images)."""

    def __init__(self, vision_model: Any, original: Any, cache: FeatureCache) -> None:
        self.vision_model = vision_model
        self.original = original
        self.cache = cache
        self.maker: TileMaker | PatchMaker | HFTileMaker | None = None
        self._logged = False
        wanted = mode()
        spec = internvl_spec(vision_model) if wanted != "lmdeploy" else f"{ENV}=lmdeploy"
        if isinstance(spec, TileSpec):
            from lmdeploy.vl.model.internvl import find_closest_aspect_ratio

            device, why = _device(wanted)
            self.maker = TileMaker(spec, find_closest_aspect_ratio, device, pool())
            self.why = f"on {device} ({why})"
        elif wanted != "lmdeploy" and _is_model(vision_model, "lmdeploy.vl.model.qwen2", "Qwen2VLModel"):
            self.maker, self.why = _patch_maker(vision_model)
        elif wanted != "lmdeploy" and _is_model(vision_model, "lmdeploy.vl.model.internvl3_hf",
                                                 "InternVL3VisionModel"):
            self.maker, self.why = _hf_tile_maker(vision_model)
        else:
            self.why = spec
        log.info("featcache: preprocessing of new images: %s", "featcache's, " + self.why
                 if self.maker is not None else f"lmdeploy's ({self.why})")

    def __call__(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from lmdeploy.vl.model.base import VisionModel

        # lmdeploy's own walk of the items (a static method: a stand-in model need not have it),
        # whose order the per-image dicts keep
        items = VisionModel.collect_multimodal_items(messages)
        plan: list[Any] | None = None
        if isinstance(self.maker, PatchMaker):
            plan = _patch_plan(self.maker, items)
        elif isinstance(self.maker, HFTileMaker):
            plan = _hf_tile_plan(items)
        elif self.maker is not None:
            plan = self._plan(items)
        if plan is None:
            self.cache.count(SECTION, "preprocess_fallback", len(items))
            return self.original(messages)
        try:
            outputs = self._outputs(plan)
        except Exception:
            if not self._logged:  # (once: counted every time)
                self._logged = True
                log.error("featcache: fast preprocessing failed; lmdeploy's preprocessing runs "
                          "(logged once, counted as preprocess_errors)\n%s", traceback.format_exc())
            self.cache.count(SECTION, "preprocess_errors", len(items))
            self.cache.count(SECTION, "preprocess_fallback", len(items))
            return self.original(messages)
        self.cache.count(SECTION, "preprocess_fast", len(items))
        messages.append(dict(role="preprocess", content=outputs))
        return messages

    def _outputs(self, plan: list[Any]) -> list[Any]:
        if isinstance(self.maker, PatchMaker):
            return self._patches(plan)
        if isinstance(self.maker, HFTileMaker):
            return self._hf_tiles(plan)
        return self._tiles(plan)

    def _hf_tiles(self, plan: list[Any]) -> list[dict[str, Any]]:
        """InternVL-HF's per-image dicts, as ``InternVL3VisionModel.preprocess`` makes them (its
        keys in its order; no image_size)."""
        vm, maker = self.vision_model, self.maker
        assert isinstance(maker, HFTileMaker)
        outputs = []
        for image in plan:
            pv = maker(image)
            outputs.append(dict(pixel_values=pv, image_tokens=vm.image_tokens_per_patch * pv.shape[0],
                                image_token_id=vm.image_token_id))
        return outputs

    def _tiles(self, plan: list[tuple[Any, int]]) -> list[dict[str, Any]]:
        """InternVL's per-image dicts, as ``_preprocess_v1_5`` makes them."""
        vm = self.vision_model
        return [dict(pixel_values=pv, image_tokens=pv.shape[0] * vm.image_tokens_per_patch,
                     image_token_id=vm.image_token_id, image_size=image.size)
                for (image, _), pv in zip(plan, self._pixel_values(plan), strict=True)]

    def _patches(self, plan: list[tuple[Any, int, int]]) -> list[Any]:
        """Qwen2-VL's per-image ``BatchFeature``s, as ``Qwen2VLModel.preprocess`` makes them
        (its keys in its order, its token count from the grid)."""
        # (the processor's own class: transformers has two of that name)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import BatchFeature

        maker = self.maker
        assert isinstance(maker, PatchMaker)
        merge_length = maker.spec.merge_size ** 2
        outputs = []
        for image, min_pixels, max_pixels in plan:
            values, thw = maker(image, min_pixels, max_pixels)
            result = BatchFeature(data={"pixel_values": values, "image_grid_thw": thw})
            result.update(dict(image_size=image.size, image_tokens=thw.prod(dim=1) // merge_length,
                               image_token_id=self.vision_model.image_token_id))
            outputs.append(result)
        return outputs

    def _plan(self, items: list[tuple[str, Any, dict[str, Any]]]) -> list[tuple[Any, int]] | None:
        """(image, max tiles) per item, or None where any is not one the fast path reproduces."""
        plan = []
        for modality, image, params in items:
            if getattr(modality, "value", modality) != "image" or getattr(image, "mode", None) != "RGB":
                return None
            max_num = self._max_tiles(params)
            if max_num is None:
                return None
            plan.append((image, max_num))
        return plan

    def _max_tiles(self, params: dict[str, Any]) -> int | None:
        """``_preprocess_v1_5``'s ``max_num`` for these per-image parameters (its rules, bool an
        int as there), or None where it is not a grid the fast path makes."""
        max_num = params.get("max_dynamic_patch")
        if max_num is None or not isinstance(max_num, int):
            detail = params.get("detail", "default")
            if not isinstance(detail, str):
                return None
            max_num = IMAGE_RES.get(detail, self.vision_model.config.max_dynamic_patch)
        assert isinstance(self.maker, TileMaker)
        if not isinstance(max_num, int) or not self.maker.spec.min_num <= max_num <= MAX_FAST_TILES:
            return None
        return int(max_num)

    def _pixel_values(self, plan: list[tuple[Any, int]]) -> list[torch.Tensor]:
        maker = self.maker
        assert isinstance(maker, TileMaker)
        if maker.device.type == "cuda" and len(plan) > 1:  # the images side by side
            return list(pool().map(lambda p: maker(*p), plan))
        return [maker(image, max_num) for image, max_num in plan]

