"""What both TurboMind paths (``native``, ``features``) need: TurboMind takes host tensors,
and its C++ vision model runs in a dtype of its own."""

from __future__ import annotations

from typing import Any

import torch

from ...core.cache import FeatureCache


def check_host_cache(cache: FeatureCache) -> None:
    """Raise ``ValueError`` unless ``cache`` serves host tensors (its device is "cpu")."""
    if cache.device.type != "cpu":
        raise ValueError(
            "TurboMind takes host tensors: build the cache with FeatureCache(device='cpu', "
            "device_bytes=..., host_bytes=0, ...) (its device tier is then host memory), or let "
            "featcache.lmdeploy.pipeline build one (cache=None)")


def engine_vision_dtype(turbomind: Any) -> torch.dtype | None:
    """The dtype TurboMind's C++ vision model takes pixels in (what ``to_tm_tensor`` casts to), or
    None when the engine does not say (no TurboMind engine, or no C++ vision model)."""
    vision = getattr(getattr(turbomind, "source_model", None), "vision_model", None)
    ctx = getattr(vision, "_ctx", None)
    dtype = getattr(ctx, "dtype", None) if ctx is not None else None
    return dtype if isinstance(dtype, torch.dtype) else None
