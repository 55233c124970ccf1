"""A video's engine item rebuilt in a model process from the video's bytes (and, for the same
processor-level models, an image's: ``processor_image_pixels``) (several processes:
``entries.sent_hit`` sends a video the model processes were sent before as its bytes, without
pixels; ``featcache.lmdeploy.pytorch.rebuild`` calls here for a video item's tag).

The item's pixels are made as the frontend's process made them: the video decoded with the
request's options (``read.decode``, lmdeploy's loader), the checkpoint's video processor with
lmdeploy's arguments and the request's video size (``expand.plan_videos``), the item's frame group
taken, then the model's own input processor (the tensor lmdeploy's engine would have put in the
item's ``MultiModalData``). Decoding and preprocessing are deterministic, so the features computed
from them equal the ones first computed; every rank makes the same."""

from __future__ import annotations

from typing import Any

import torch

from .entries import KeyedVideo
from .expand import merged_kwargs, plan_videos
from .read import CONTAINER, JPEG, BadVideoError, frames_problem, read_frames_url, stated, video_io_options


def video_problem(raw: bytes, how: Any) -> str | None:
    """Why a video item's source could not rebuild it, found without decoding a frame (its
    options, its item index, its size, the container's header), or None."""
    from ..media import MediaOptionError

    if not isinstance(how, dict) or set(how) - {"form"} != {"io", "item", "size"} or how.get(
            "form", CONTAINER) not in (CONTAINER, JPEG):
        return "its decode options are not what the frontend sends"
    item, size = how["item"], how["size"]
    if isinstance(item, bool) or not isinstance(item, int) or item < 0:
        return "its item index is not one"
    if size is not None and not (isinstance(size, dict) and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size.values())):
        return "its video size is not one"
    try:  # (its limits were checked when the frontend read it)
        video_io_options({"video": how["io"]})
        if how.get("form", CONTAINER) == JPEG:
            frames_problem(read_frames_url(raw))
        else:
            stated(raw)
    except (BadVideoError, MediaOptionError) as e:
        return f"its bytes or options cannot rebuild the video ({str(e)[:120]})"
    return None


def video_pixels(raw: bytes, how: dict[str, Any], model: Any, vision_model: Any) -> torch.Tensor:
    """Item ``how["item"]``'s ``MultiModalData.data``, from the video's bytes (module docstring).
    ``model``: the language model (its input processor); ``vision_model``: lmdeploy's
    ``VisionModel`` of the checkpoint (its processor; ``rebuild.vision_model``)."""
    from lmdeploy.vl.constants import Modality

    options = video_io_options({"video": how["io"]})
    processor = vision_model.processor
    kwargs = merged_kwargs(processor, video_size=how["size"])["videos_kwargs"]
    (plan,) = plan_videos(vision_model, [KeyedVideo(b"", raw, options, form=how.get("form", CONTAINER))],
                          kwargs)
    index = how["item"]
    if index >= len(plan.items):
        raise RuntimeError(f"featcache: the video holds {len(plan.items)} items, not item {index}")
    fields = plan.items[index]
    merge = processor.video_processor.merge_size ** 2
    tokens = int(torch.as_tensor(fields["video_grid_thw"]).prod()) // merge
    item = dict(modality=Modality.VIDEO, offset=(0, tokens), **fields)
    result = model.get_input_processor().preprocess_input([0] * tokens, [item])
    (data,) = [d for datas in result.input_multimodals.values() for d in datas]
    out: torch.Tensor = data.data
    return out


def processor_image_pixels(image: Any, model: Any, vision_model: Any) -> torch.Tensor:
    """An image's ``MultiModalData.data`` for a processor-level model (its new-API ``preprocess``):
    the checkpoint's image processor with the processor's own arguments (the size a request asks is
    in its key, and such an image travels with its pixels: ``ProcessorLevel._preprocess``), cast
    as lmdeploy casts it, then the model's input processor."""
    from lmdeploy.vl.constants import Modality

    processor = vision_model.processor
    out = processor.image_processor([image], **merged_kwargs(processor)["images_kwargs"])
    values = vision_model._postprocess_mm_output(out["pixel_values"], vision_model.mm_feature_dtype)
    grid = out["image_grid_thw"][0]
    tokens = int(torch.as_tensor(grid).prod()) // processor.image_processor.merge_size ** 2
    item = dict(modality=Modality.IMAGE, pixel_values=values, image_grid_thw=grid, offset=(0, tokens),
                image_token_id=vision_model.mm_tokens.image_token_id)
    result = model.get_input_processor().preprocess_input([0] * tokens, [item])
    (data,) = [d for datas in result.input_multimodals.values() for d in datas]
    return data.data
