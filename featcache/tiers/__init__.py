"""The storage tiers, top to bottom: device (GPU), host (pinned RAM), disk (LMDB).

Each tier is synchronous and knows nothing of the others; the cache chains them and the demoter
moves data between them in the background.
"""

from .base import Entry, Tier
from .device import DeviceTier
from .disk import DiskTier
from .host import HostTier

__all__ = ["DeviceTier", "DiskTier", "Entry", "HostTier", "Tier"]
