"""Pixels rebuilt in a model process, for an image the frontend sent without them.

In the multi-process mode an encoded image the frontend sent before travels without pixels: its
tag carries the encoded bytes (``tags.Source``) and the frontend skipped decoding and
preprocessing it (``frontend``). When the ranks agree that some rank no longer holds its
features (``ranks.resolve``), every rank rebuilds the pixels here, exactly as the frontend's
process would have made them, and the step computes the image like any miss:

1. decode the bytes with lmdeploy's ``ImageMediaIO`` and the request's decode options (or, for an
   in-memory image given to a pipeline, rebuild it from its pixel bytes: ``image``);
2. lmdeploy's ``VisionModel.preprocess`` for the model (its preprocessor only, built once per
   process with the feature dtype lmdeploy's ``ImageEncoder`` would use), with the item's
   per-image parameters;
3. the model's own input processor (``get_input_processor().preprocess_input``): the tensor
   lmdeploy's engine would have put in the image's ``MultiModalData``.

Invariant: the same bytes, options and settings give the same pixels on every rank and in the
frontend's process (decoding and preprocessing are deterministic), so a rebuilt image's features
equal the ones the model computed the first time; each rank makes the same vision call.
"""

from __future__ import annotations

import json
import threading
import types
from typing import Any

import torch

from .tags import FeatTag, Source

_lock = threading.Lock()
_models: dict[str, Any] = {}  # settings JSON -> lmdeploy VisionModel (its preprocessor)


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


def image(source: Source) -> Any:
    """The PIL image ``source`` holds, as lmdeploy had it before preprocessing."""
    how = json.loads(source.decode)
    if "pil" in how:
        from PIL import Image

        layout = how["pil"]
        return Image.frombytes(layout["mode"], tuple(layout["size"]), source.raw)
    from lmdeploy.vl.media.image import ImageMediaIO

    return ImageMediaIO(**how["io"]).load_bytes(source.raw)


def pixels(tag: FeatTag, model: Any, settings: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The image's ``MultiModalData.data`` as lmdeploy's engine would have received it, on
    ``device``; raises where it cannot be rebuilt (no source; a decode or preprocessing error)."""
    from .frontend import _preprocessed

    if tag.source is None:
        raise RuntimeError(f"featcache: image {tag.key.hex()} reached the model without pixels "
                           "or the bytes to rebuild them")
    params = json.loads(tag.source.params)
    messages = [{"role": "user", "content": [{"type": "image", "data": image(tag.source), **params}]}]
    (item,) = _preprocessed(vision_model(settings).preprocess(messages))
    result = model.get_input_processor().preprocess_input([0], [dict(item, offset=0)])
    (data,) = result.input_multimodals["image"]
    out: torch.Tensor = data.data
    return out.to(device)
