"""The tier chain as data: an ordered tuple of slots (tier, its background writer, its rules),
built in one place (``build_chain``), the only module that names the concrete tiers.

    device (top: leases) -> host (staging: host memory) -> disk (LMDB) -> remote (Redis/Valkey)

``KINDS`` declares every kind of tier, top to bottom: how to build it from the config (``None``:
off) and the rules the cache follows for it. The cache, the demoter, ``stats()`` and the metrics
loop over the slots; none of them names a tier. Every tier below the top is written through (each
put goes to every tier it fits, in the background) and every hit below the top is promoted (copied
to the device; kept in the host tier when it was read into host memory).

Adding a tier (S3, Mooncake, ...): its module (a ``WrittenTier``), its settings in the config, and
one ``Kind`` in ``BELOW`` with its builder here. Nothing else names it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from ..config import CacheConfig
from ..store.layout import MAX_KEY_BYTES as _DISK_MAX_KEY_BYTES
from ..store.report import VerifyReport
from ..tiers.base import LeasingTier, PersistentTier, StagingTier, Tier, WrittenTier, empty_stats
from ..tiers.device import DeviceTier
from ..tiers.disk import DiskTier
from ..tiers.host import HostTier
from ..tiers.mooncake import MooncakeTier
from ..tiers.remote import RemoteTier
from .copier import Copier
from .writer import TierWriter

# The longest key the cache takes: every tier can store it (the disk tier's LMDB limit is the
# tightest), so a key is valid or not whatever tiers are on.
MAX_KEY_BYTES = _DISK_MAX_KEY_BYTES

T = TypeVar("T", bound=Tier, covariant=True)
OnCorrupt = Callable[[bytes], None]


@dataclass(frozen=True)
class Writing:
    """A tier's background writer (``TierWriter``): its thread's name, how many puts may be
    pending (from the config) and how many jobs it hands the tier at once."""

    thread: str
    max_puts: Callable[[CacheConfig], int]
    batch_entries: int = 1
    # whether this cache writes the tier at all (False: read only, no writer: puts, touches and
    # discards never reach it; another process writes it)
    on: Callable[[CacheConfig], bool] = lambda config: True


@dataclass(frozen=True)
class Report:
    """How a tier shows in ``stats()`` and in the Prometheus metrics (``featcache.metrics``)."""

    when_off: bool = True  # its section is present, at zero, while the tier is off
    queue: tuple[str, str] | None = None  # (section, key) in stats() of its writer's queue depth
    queue_help: str = ""
    labelled: bool = True  # featcache_tier_<stat>{tier=...}; False: featcache_<name>_<stat>_total
    gauges: tuple[tuple[str, str], ...] = ()  # (stat, help): the unlabelled stats that are gauges


@dataclass(frozen=True)
class Rules:
    """What the cache does with one kind of tier (the writer rules apply to written tiers)."""

    # Never keeps a value older than its key's last put or discard: a put that does not land
    # there (too large, dropped, failed) deletes the key there. False: it keeps the last value
    # that landed (a shared tier whose values, for content keys, are all the same features).
    exact: bool = True
    touch: bool = False  # a hit is recorded through its writer (recency kept by writes)
    local: bool = True  # ``key in cache`` asks it (False: a network call, never made by ``in``)
    close_inherited: bool = False  # a forked child closes the parent's instance (LMDB: one per path)
    # Outlives the process (a ``PersistentTier``): ``len(cache)``, ``keys()``, ``clear()`` and
    # ``verify()`` read and change it; the first such tier that is on is the chain's ``persistent``.
    persistent: bool = False
    writer: Writing | None = None  # None: written by the cache (top) or the demoter (staging)
    report: Report = Report()


@dataclass(frozen=True)
class Kind(Generic[T]):
    """One kind of tier: its name (its ``stats()`` section), its builder and its rules."""

    name: str
    build: Callable[[CacheConfig, Copier, OnCorrupt], T | None]
    rules: Rules


@dataclass(frozen=True, eq=False)
class Slot:
    """A tier that is on, its writer (None for the top and staging tiers) and its rules."""

    tier: Tier
    writer: TierWriter | None
    rules: Rules


# -- the kinds, top to bottom --------------------------------------------------------------------
def _device(config: CacheConfig, copier: Copier, on_corrupt: OnCorrupt) -> DeviceTier:
    return DeviceTier(config.device_bytes, config.eviction)  # always on (a budget of 0: nothing)


def _host(config: CacheConfig, copier: Copier, on_corrupt: OnCorrupt) -> HostTier | None:
    if config.host_bytes <= 0:
        return None
    return HostTier(config.host_bytes, config.host_slab_bytes, pin=copier.pin, eviction=config.eviction)


def _disk(config: CacheConfig, copier: Copier, on_corrupt: OnCorrupt) -> DiskTier | None:
    if config.disk_path is None or config.disk_bytes <= 0:
        return None
    return DiskTier(config.disk_path, config.disk_bytes, sync=config.disk_sync, on_corrupt=on_corrupt)


def _remote(config: CacheConfig, copier: Copier, on_corrupt: OnCorrupt) -> RemoteTier | MooncakeTier | None:
    if config.remote_url is None:
        return None
    if config.remote_url.startswith("mooncake://"):  # Mooncake Store (optional: featcache[mooncake])
        return MooncakeTier.from_config(config, on_corrupt=on_corrupt)
    return RemoteTier.from_config(config, on_corrupt=on_corrupt)


TOP: Kind[LeasingTier] = Kind("device", _device, Rules())
STAGING: Kind[StagingTier] = Kind("host", _host, Rules())
BELOW: tuple[Kind[WrittenTier], ...] = (
    Kind("disk", _disk, Rules(
        touch=True, close_inherited=True, persistent=True,
        writer=Writing("featcache-disk-writer", lambda c: c.disk_queue_entries, batch_entries=32,
                       on=lambda c: c.disk_writes),
        report=Report(queue=("cache", "disk_queue"), queue_help="Disk writes waiting."),
    )),
    Kind("remote", _remote, Rules(
        exact=False, local=False,
        writer=Writing("featcache-remote-publisher", lambda c: c.remote_queue_entries),
        report=Report(
            when_off=False, labelled=False, queue=("remote", "publish_queue"),
            queue_help="Publishes to the remote tier waiting.",
            gauges=(("breaker_open", "1 while the remote tier is skipped (its circuit breaker is open)."),
                    ("breaker_open_nodes", "Redis Cluster nodes skipped (their breakers open)."),
                    ("enabled", "1: a remote tier is configured.")),
        ),
    )),
)
KINDS: tuple[Kind[Any], ...] = (TOP, STAGING, *BELOW)


# -- the chain -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chain:
    """The tiers that are on, top first, and the kinds that are off.

    ``top`` and ``staging`` are the first slots' tiers under the roles the cache uses them in:
    the top tier lends entries (leases); the staging tier, if on, is the host memory that copies
    between the device and the tiers below go through.
    """

    top: LeasingTier
    staging: StagingTier | None
    slots: tuple[Slot, ...]
    off: tuple[Kind[Any], ...]
    persistent: PersistentTier | None = None  # the first tier on whose rules say ``persistent``

    @property
    def below(self) -> tuple[Slot, ...]:
        """Every slot under the top, in order."""
        return self.slots[1:]

    @property
    def writers(self) -> tuple[TierWriter, ...]:
        return tuple(slot.writer for slot in self.slots if slot.writer is not None)

    def stats(self) -> dict[str, dict[str, int]]:
        """The tier sections of ``stats()``, in ``KINDS`` order: each tier's own numbers, and a
        tier that is off at zero if its kind reports it so (``Report.when_off``)."""
        sections = {slot.tier.name: slot.tier.stats() for slot in self.slots}
        sections.update({k.name: empty_stats() for k in self.off if k.rules.report.when_off})
        for name, section in sections.items():
            section.update(self.queue_depths(name))
        return {kind.name: sections[kind.name] for kind in KINDS if kind.name in sections}

    def queue_depths(self, section: str) -> dict[str, int]:
        """The writers' queue depths that ``stats()`` shows in ``section`` (``Report.queue``); a
        tier that is off shows 0 there if its kind reports it when off."""
        depths = {}
        for rules, writer in [*((s.rules, s.writer) for s in self.slots),
                              *((k.rules, None) for k in self.off if k.rules.report.when_off)]:
            where = rules.report.queue
            if where is not None and where[0] == section:
                depths[where[1]] = writer.depth if writer is not None else 0
        return depths

    # -- the whole chain (the cache's len, keys, clear and verify) -----------------------------
    def memory_keys(self) -> set[bytes]:
        """The keys the memory tiers (top and staging) hold, each once."""
        keys = set(self.top.keys())
        if self.staging is not None:
            keys.update(self.staging.keys())
        return keys

    def entries(self) -> int:
        """The persistent tier's entries (all processes'), without one the memory tiers'."""
        if self.persistent is not None:
            return self.persistent.entries()
        return len(self.memory_keys())

    def keys(self) -> Iterator[bytes]:
        """The persistent tier's keys in byte order, without one the memory tiers' (sorted)."""
        if self.persistent is not None:
            return self.persistent.keys()
        return iter(sorted(self.memory_keys()))

    def clear(self) -> int:
        """Empty every local tier (the memory tiers, then the persistent one in one transaction);
        how many keys were removed, each once. The caller holds puts and promotions back."""
        memory = set(self.top.clear())
        if self.staging is not None:
            memory.update(self.staging.clear())
        persistent = self.persistent
        if persistent is None:
            return len(memory)
        only_memory = sum(not persistent.contains(key) for key in memory)
        return persistent.clear() + only_memory

    def verify(self, fix: bool, progress: Callable[[int, int], None] | None) -> VerifyReport:
        """The persistent tier's check (``FeatureCache.verify``); an empty report without one."""
        persistent = self.persistent
        if persistent is None:
            return VerifyReport(deleted=0 if fix else None)
        report = persistent.verify(progress)
        if fix:
            report.deleted = persistent.delete_bad([e.key for e in report.bad]) if report.bad else 0
        return report

    def keep_secret(self, name: str, secret: bytes) -> None:
        """Hand every tier that keeps the fleet's key secret on its server (``keep_secret``: the
        remote tier, which sets it again on a server that lost it) the one the cache keys with."""
        for slot in self.below:
            keep = getattr(slot.tier, "keep_secret", None)
            if keep is not None:
                keep(name, secret)

    def close(self) -> None:
        """Close every tier (the writers are stopped first, by the demoter)."""
        for slot in self.slots:
            slot.tier.close()

    def close_inherited(self) -> None:
        """In a forked child: close what the parent's tiers hold that the child's own tiers must
        reopen (``Rules.close_inherited``); nothing else of theirs is touched."""
        for slot in self.slots:
            if slot.rules.close_inherited:
                slot.tier.close()


class _Forward:
    """A tier's ``on_corrupt`` callback: queue a delete of the bad key on the tier's own writer
    (bound once the writer exists; it holds no reference to the cache)."""

    def __init__(self) -> None:
        self.writer: TierWriter | None = None

    def __call__(self, key: bytes) -> None:
        if self.writer is not None:
            self.writer.discard(key)


def build_chain(config: CacheConfig, copier: Copier) -> Chain:
    """Build the tiers ``config`` turns on, top to bottom, and a writer for each written tier.
    Raises what a tier's constructor raises (``StoreOpenError``, ``ImportError``, ...), after
    closing what was built before it."""
    def ignore(key: bytes) -> None:
        return None

    slots: list[Slot] = []
    off: list[Kind[Any]] = []
    try:
        top = TOP.build(config, copier, ignore)
        assert top is not None, "the top tier is always on"
        slots.append(Slot(top, None, TOP.rules))
        staging = STAGING.build(config, copier, ignore)
        if staging is None:
            off.append(STAGING)
        else:
            slots.append(Slot(staging, None, STAGING.rules))
        pool = staging.pool if staging is not None else None
        for kind in BELOW:
            forward = _Forward()
            tier = kind.build(config, copier, forward)
            if tier is None:
                off.append(kind)
                continue
            writing = kind.rules.writer
            assert writing is not None, f"the {kind.name} tier is written by a writer: Rules.writer"
            if not writing.on(config):  # read only here: no writer (Slot.writer None)
                slots.append(Slot(tier, None, kind.rules))
                continue
            forward.writer = TierWriter(
                tier, name=writing.thread, copier=copier, pool=pool,
                max_puts=writing.max_puts(config), batch_entries=writing.batch_entries,
                exact=kind.rules.exact,
            )
            slots.append(Slot(tier, forward.writer, kind.rules))
    except BaseException:
        for slot in reversed(slots):
            if slot.writer is not None:
                slot.writer.stop()
            slot.tier.close()
        raise
    persistent = next((s.tier for s in slots if s.rules.persistent), None)
    return Chain(top, staging, tuple(slots), tuple(off), cast("PersistentTier | None", persistent))
