"""featcache: a content-hashed, tiered image-feature cache for vision-language models.

The public names are imported on first use (PEP 562), so that ``import featcache.cli`` and the
store tools start without torch or numpy: ``featcache --version``, ``--help``, ``stats`` and ``ls``
never load them (tests/test_cli_start.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import CorruptEntryError, FeatCacheError, StoreFormatError, StoreOpenError
from .sizes import parse_bytes

if TYPE_CHECKING:
    from .config import CacheConfig
    from .core.cache import FeatureCache, Lease
    from .keys import ImageKey, KeyHasher, image_key

_LAZY = {"FeatureCache": ".core.cache", "Lease": ".core.cache", "CacheConfig": ".config",
         "ImageKey": ".keys", "KeyHasher": ".keys", "image_key": ".keys"}

__all__ = [
    "CacheConfig",
    "CorruptEntryError",
    "FeatCacheError",
    "FeatureCache",
    "ImageKey",
    "KeyHasher",
    "Lease",
    "StoreFormatError",
    "StoreOpenError",
    "__version__",
    "image_key",
    "parse_bytes",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'featcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
