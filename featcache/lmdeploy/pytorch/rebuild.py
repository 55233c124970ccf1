"""Pixels rebuilt in a model process, for an image the frontend sent without them.

In the multi-process mode an encoded image the frontend sent before travels without pixels: its
tag carries the encoded bytes (``tags.Source``) and the frontend skipped decoding and
preprocessing it (``frontend``). When the ranks agree that some rank no longer holds its
features (``ranks.resolve``), every rank rebuilds the pixels here, exactly as the frontend's
process would have made them, and the step computes the image like any miss:

1. decode the bytes with lmdeploy's ``ImageMediaIO`` and the request's decode options (or, for an
   in-memory image given to a pipeline, rebuild it from its pixel bytes: ``image``);
2. the model's preprocessing, with the item's per-image parameters: featcache's
   (``fastprep.FastPreprocess``: lmdeploy's output exactly, faster; lmdeploy's own
   ``VisionModel.preprocess`` for what it does not reproduce), over lmdeploy's preprocessor for
   the model, built once per process with the feature dtype lmdeploy's ``ImageEncoder`` would use;
3. the model's own input processor (``get_input_processor().preprocess_input``): the tensor
   lmdeploy's engine would have put in the image's ``MultiModalData``.

Invariant: the same bytes, options and settings give the same pixels on every rank and in the
frontend's process (decoding and preprocessing are deterministic), so a rebuilt image's features
equal the ones the model computed the first time; each rank makes the same vision call. An image
travels without pixels only after the frontend decoded and preprocessed the same bytes with the
same options and parameters (all three are in its key); the engine still checks each such
source before scheduling its request (``problem``, without decoding), so a damaged one fails
its own request, not a model process's step.
"""

from __future__ import annotations

import inspect
import json
import threading
import types
from typing import Any

import torch

from ...core.cache import FeatureCache
from ..request.tags import FeatTag, Source
from ..request.video.rebuild import processor_image_pixels, video_pixels, video_problem

_lock = threading.Lock()
_models: dict[str, Any] = {}  # settings JSON -> lmdeploy VisionModel (its preprocessor)
_preprocessors: dict[str, Any] = {}  # settings JSON -> its FastPreprocess


def vision_model(settings: dict[str, Any]) -> Any:
    """lmdeploy's ``VisionModel`` for ``settings`` (``model_path``, ``dtype``, ``device_type``,
    ``trust_remote_code``: the engine's), its preprocessor built; one per process."""
    text = json.dumps(settings, sort_keys=True)
    with _lock:
        model = _models.get(text)
        if model is None:
            from lmdeploy.vl.engine import _resolve_mm_feature_dtype
            from lmdeploy.vl.model.builder import load_vl_model

            model = load_vl_model(settings["model_path"], "pytorch",
                                  trust_remote_code=bool(settings.get("trust_remote_code")))
            engine = types.SimpleNamespace(dtype=settings.get("dtype", "auto"),
                                           device_type=settings.get("device_type", "cuda"))
            model.set_mm_feature_dtype(
                _resolve_mm_feature_dtype(getattr(model, "hf_config", None), engine))
            _models[text] = model
        return model


def preprocessor(settings: dict[str, Any], cache: FeatureCache | None) -> Any:
    """``preprocess(messages)`` for ``settings``' model: featcache's, counted on ``cache``
    (``preprocess_fast``/``_fallback``/``_errors``, as in the frontend's process), or
    lmdeploy's own where no cache is open in this process. One per process and cache."""
    model = vision_model(settings)
    if cache is None:
        return model.preprocess
    from ..fastprep import FastPreprocess

    text = json.dumps(settings, sort_keys=True)
    with _lock:
        fast = _preprocessors.get(text)
        if fast is None or fast.cache is not cache:  # (a cache built again: count on the new one)
            fast = _preprocessors[text] = FastPreprocess(model, model.preprocess, cache)
        return fast


def image(source: Source) -> Any:
    """The PIL image ``source`` holds, as lmdeploy had it before preprocessing."""
    how = json.loads(source.decode)
    if "pil" in how:
        from PIL import Image

        layout = how["pil"]
        return Image.frombytes(layout["mode"], tuple(layout["size"]), source.raw)
    from lmdeploy.vl.media.image import ImageMediaIO

    return ImageMediaIO(**how["io"]).load_bytes(source.raw)


# the bytes per pixel of the PIL modes an in-memory image may travel in (frontend.RAW_MODES)
_BYTES_PER_PIXEL = {"RGB": 3, "RGBA": 4, "L": 1}


def problem(source: Source) -> str | None:
    """Why ``source`` could not rebuild its image, found without decoding it (its options and
    parameters, the pixel layout, the encoded image's header), or None. The engine asks this of
    every image sent without pixels before it schedules the request (``engine.unservable``):
    an image that cannot be rebuilt fails its own request, never a model process's step."""
    import io

    try:
        how = json.loads(source.decode)
        params = json.loads(source.params)
    except ValueError:
        return "its decode options or parameters are not JSON"
    if not isinstance(how, dict) or len(how) != 1 or not isinstance(params, dict):
        return "its decode options or parameters are not what the frontend sends"
    if not source.raw:
        return "it has no bytes"
    if "video" in how:
        return video_problem(source.raw, how["video"])
    if "pil" in how:
        layout = how["pil"]
        mode, size = (layout.get("mode"), layout.get("size")) if isinstance(layout, dict) else (None, None)
        if (mode not in _BYTES_PER_PIXEL or not isinstance(size, list) or len(size) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in size)
                or len(source.raw) != size[0] * size[1] * _BYTES_PER_PIXEL[mode]):
            return "its pixel bytes do not match their layout"
        return None
    if not isinstance(how.get("io"), dict):
        return "its decode options are not what the frontend sends"
    from PIL import Image

    try:
        with Image.open(io.BytesIO(source.raw)) as image:  # the header only: no decoding
            image.size  # noqa: B018
    except Exception as e:  # PIL raises several kinds for bytes that are no image
        return f"its bytes are not an image ({type(e).__name__})"
    return None


def pixels(tag: FeatTag, model: Any, settings: dict[str, Any], device: torch.device,
           cache: FeatureCache | None = None) -> torch.Tensor:
    """The image's ``MultiModalData.data`` as lmdeploy's engine would have received it, on
    ``device``; raises where it cannot be rebuilt (no source; a decode or preprocessing error).
    ``cache``: the process's, where its preprocessing is counted (``preprocessor``)."""
    from ..request.messages import preprocessed

    if tag.source is None:
        raise RuntimeError(f"featcache: image {tag.key.hex()} reached the model without pixels "
                           "or the bytes to rebuild them")
    how = json.loads(tag.source.decode)
    if "video" in how:  # a video's item: its frame group rebuilt from the video's bytes
        return video_pixels(tag.source.raw, how["video"], model, vision_model(settings)).to(device)
    vm = vision_model(settings)
    if "mm_processor_kwargs" in inspect.signature(type(vm).preprocess).parameters:
        return processor_image_pixels(image(tag.source), model, vm).to(device)
    params = json.loads(tag.source.params)
    messages = [{"role": "user", "content": [{"type": "image", "data": image(tag.source), **params}]}]
    (item,) = preprocessed(preprocessor(settings, cache)(messages))
    result = model.get_input_processor().preprocess_input([0], [dict(item, offset=0)])
    (data,) = result.input_multimodals["image"]
    out: torch.Tensor = data.data
    return out.to(device)
