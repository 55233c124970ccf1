"""The storage tiers, one module each: device (GPU), host (pinned RAM), disk (LMDB), remote
(Redis/Valkey), mooncake (Mooncake Store); ``base`` holds the protocol they share and the entry
they hold; the remote tiers' parts: their calls (``remote_calls``), the layout on the server
(``remote_layout``), Mooncake's client (``mooncake_client``) and the circuit breaker (``breaker``).

Each tier is synchronous and knows nothing of the others; ``featcache.core.chain`` builds and orders
them (the only module that names the concrete tiers), the cache loops over that chain, and the
demoter and the tier writers move data between them in the background.
"""

from .base import Entry, LeasingTier, Op, StagingTier, Tier, WrittenTier

__all__ = ["Entry", "LeasingTier", "Op", "StagingTier", "Tier", "WrittenTier"]
