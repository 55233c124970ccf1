"""featcache: a content-hashed, tiered image-feature cache for vision-language models."""

from ._version import __version__
from .cache import FeatureCache, Lease
from .config import CacheConfig
from .errors import CorruptEntryError, FeatCacheError, StoreFormatError, StoreOpenError
from .keys import KeyHasher, image_key
from .sizes import parse_bytes

__all__ = [
    "CacheConfig",
    "CorruptEntryError",
    "FeatCacheError",
    "FeatureCache",
    "KeyHasher",
    "Lease",
    "StoreFormatError",
    "StoreOpenError",
    "__version__",
    "image_key",
    "parse_bytes",
]
