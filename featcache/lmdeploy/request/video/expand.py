"""A request's videos in the processor-level frontend's output (``processor.ProcessorLevel``):
lmdeploy's per-frame-group items and the prompt text of each video, made from its entries (a hit:
no decode, no processor, no tower) or by the checkpoint's video processor (a miss), exactly as
lmdeploy's ``VisionModel.preprocess`` and ``get_expanded_mm_items`` make them.

- a miss's pixels: the processor's ``video_processor`` over the request's missing videos in one
  call, with the arguments lmdeploy's call gives it (``video_metadata``, ``do_resize=True``,
  ``do_sample_frames=False``, the size asked), cast as lmdeploy casts them, split per video by its
  grid and per frame group (``[1, h, w]`` items, lmdeploy's ``_expand_bundled_video_items``);
- a video's prompt text: the processor's own ``replace_video_token`` over every video's grid and
  metadata (the frame timestamps: ``<0.5 seconds>`` before each group's span), a hit's from the
  record its entries hold (``entries.INFO``);
- invariant: the items and the text equal lmdeploy's for the same request; the frontend's startup
  probe checks it on the installation it runs on (a video, missing and held), and caches no video
  where it differs (``ProcessorLevel.probe_video``).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from .entries import STATED, KeyedVideo
from .read import facts_record

VIDEO_ITEM_FIELDS = ("pixel_values_videos", "video_grid_thw", "second_per_grid", "video_token_id")


@dataclass
class VideoPlan:
    """One video of a request: its grid ``[t, h, w]``, its metadata for the processor's prompt
    text, its items (without offsets), its hit's refs (None: a miss) and its record."""

    grid: torch.Tensor
    metadata: Any
    items: list[dict[str, Any]]
    info: dict[str, Any]
    video: KeyedVideo | None
    refs: list[Any] = field(default_factory=list)


def metadata_record(metadata: Any) -> dict[str, Any]:
    """The processor's ``VideoMetadata`` (or lmdeploy's dict) as plain JSON values."""
    raw = dataclasses.asdict(metadata) if dataclasses.is_dataclass(metadata) else dict(metadata)
    return {k: _plain(v) for k, v in raw.items()}


def _plain(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "tolist"):
        return v.tolist()
    return v


def _metadata(record: dict[str, Any]) -> Any:
    from transformers.video_utils import VideoMetadata

    names = {f.name for f in dataclasses.fields(VideoMetadata)}
    return VideoMetadata(**{k: v for k, v in record.items() if k in names})


def plan_videos(model: Any, videos: list[KeyedVideo], videos_kwargs: dict[str, Any]) -> list[VideoPlan]:
    """Each video's plan, in the request's order: a hit's from its entries, the misses' from one
    call of the video processor (module docstring)."""
    token_id = model.mm_tokens.video_token_id
    plans: dict[int, VideoPlan] = {}
    for i, video in enumerate(videos):
        hit = video.hit
        if hit is None:
            continue
        items = [{"pixel_values_videos": x["pixel_values_videos"], "video_grid_thw": x["video_grid_thw"],
                  "second_per_grid": x.get("second_per_grid"), "video_token_id": x["video_token_id"]}
                 for x in hit.items]
        plans[i] = VideoPlan(torch.tensor(hit.info["grid"]), _metadata(hit.info["metadata"]), items,
                             hit.info, video, list(hit.refs))
    missed = [i for i in range(len(videos)) if i not in plans]
    if missed:
        frames, metas = zip(*(videos[i].decoded() for i in missed), strict=True)
        kwargs = dict(videos_kwargs, video_metadata=list(metas), do_resize=True, do_sample_frames=False)
        out = model.processor.video_processor(list(frames), **kwargs)
        bundle = model._postprocess_mm_output(out["pixel_values_videos"], model.mm_feature_dtype)
        grids = out["video_grid_thw"]
        seconds = out.get("video_second_per_grid")
        returned = out.get("video_metadata") or [None] * len(missed)
        start = 0
        for n, i in enumerate(missed):
            grid = grids[n]
            t, h, w = (int(x) for x in grid)
            rows = bundle[start:start + t * h * w]
            start += t * h * w
            spg = None if seconds is None else seconds[n].item()
            items = [{"pixel_values_videos": rows[f * h * w:(f + 1) * h * w].clone(),
                      "video_grid_thw": torch.tensor([1, h, w]), "second_per_grid": spg,
                      "video_token_id": token_id} for f in range(t)]
            meta = returned[n] if returned[n] is not None else _metadata(metas[n])
            info = {"items": t, "grid": [t, h, w], "metadata": metadata_record(meta),
                    "options": videos[i].options}
            if videos[i].facts is not None:  # (a hit is checked against them, not probed again)
                info[STATED] = facts_record(videos[i].facts)
            plans[i] = VideoPlan(grid, meta, items, info, videos[i])
        if start != bundle.shape[0]:
            raise RuntimeError(f"the video processor made {bundle.shape[0]} rows for {start}")
    return [plans[i] for i in range(len(videos))]


def kwargs_class(processor: Any) -> Any:
    """The kwargs class (its defaults) the processor's call hands ``_merge_kwargs``: 5.24's
    ``valid_processor_kwargs``, else its module's ``<Name>Kwargs`` (5.17 requires it)."""
    found = getattr(processor, "valid_processor_kwargs", None)
    if found is not None:
        return found
    for k in type(processor).__mro__:
        named = getattr(sys.modules.get(k.__module__), f"{k.__name__}Kwargs", None)
        if named is not None:
            return named
    return None


def merged_kwargs(processor: Any, image_size: dict[str, int] | None = None,
                  video_size: dict[str, int] | None = None) -> dict[str, Any]:
    """The processor's call arguments, merged as lmdeploy's processor-level ``preprocess`` has the
    processor merge them (its defaults, with the image and video sizes a request asks): by part,
    ``images_kwargs``, ``videos_kwargs``, ``text_kwargs``, ..."""
    call: dict[str, Any] = {"padding": True, "return_tensors": "pt"}
    if image_size is not None:
        call["images_kwargs"] = {"size": image_size}
    if video_size is not None:
        call["videos_kwargs"] = {"size": video_size}
    merged: dict[str, Any] = processor._merge_kwargs(
        kwargs_class(processor), tokenizer_init_kwargs=processor.tokenizer.init_kwargs, **call)
    return merged


def video_replacements(processor: Any, plans: list[VideoPlan]) -> list[str]:
    """Each video's prompt text, by the processor's own ``replace_video_token``."""
    if not plans:
        return []
    inputs = {"video_grid_thw": torch.stack([torch.as_tensor(p.grid) for p in plans]),
              "video_metadata": [p.metadata for p in plans]}
    return [processor.replace_video_token(inputs, video_idx=i) for i in range(len(plans))]
