"""featcache for lmdeploy 0.18's TurboMind backend: ``wrap`` hands a TurboMind pipeline here.

TurboMind runs the vision model of every VLM it accepts in C++, and takes host tensors. Two paths:

- ``"native"`` (the default, ``native``): the cache holds each image's engine-ready pixels and
  hands TurboMind a fingerprint derived from the key; TurboMind's own vision model still runs on
  a miss and its prefix cache covers repeated images;
- ``"features"`` (opt-in, InternVL, ``features``): the cache holds vision features, served
  to TurboMind's LLM as ``input_embeddings``; the vision tower runs in Python on misses only;
- ``"combined"`` (opt-in, InternVL, ``combined``): both, routed per request (``route``): a
  chat turn continuing a context TurboMind indexed goes native (its prefix cache skips the ViT
  and the history's prefill), a fresh context whose images featcache holds goes features.

See docs/turbomind.md for when each wins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...core.cache import FeatureCache
from ..fastprep import widen
from ..request.media import LOCAL_FILES, MediaPolicy
from ..request.sources import read_sources_under, trust_image_ids
from .combined import install_combined
from .features import install_features
from .native import install_native_path

PATHS: dict[str, Callable[[Any, FeatureCache, str, str | None], None]] = {
    "native": install_native_path,
    "features": install_features,
    "combined": install_combined,
}


def install_turbomind(pipe: Any, cache: FeatureCache, arch: str, namespace: str | None,
                      path: str) -> Any:
    """Install featcache's TurboMind ``path`` on a TurboMind pipeline (called by ``wrap``);
    returns ``pipe``. Raises ``ValueError`` for an unknown path or one that cannot serve ``arch``."""
    if path not in PATHS:
        raise ValueError(f"turbomind= must be one of {tuple(PATHS)}, not {path!r}")
    PATHS[path](pipe, cache, arch, namespace)
    return pipe


def wrap_turbomind(pipe: Any, cache: FeatureCache, arch: str, namespace: str | None, path: str,
                   trust_ids: bool | str = False, media: MediaPolicy = LOCAL_FILES) -> Any:
    """``featcache.lmdeploy.wrap`` on a TurboMind pipeline (and ``warm``'s): the ``path``
    installed, the encoder's preprocessing widened (``fastprep``), client image ids honoured as
    asked, image sources read under ``media``; returns ``pipe``."""
    engine = pipe.async_engine
    install_turbomind(pipe, cache, arch, namespace, path)
    widen(engine.vl_encoder)  # the preprocessing of different requests overlaps
    trust_image_ids(engine.prompt_processor, trust_ids)
    read_sources_under(engine.prompt_processor, media)
    return pipe
