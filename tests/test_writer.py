"""TierWriter, the one writer class of every lower tier, against a CPU fake tier: its rules
(``exact`` or not), its bounds, its batches and its failure paths. Races are made deterministic
with events injected into the fake tier's ``write``."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from featcache.core.copier import make_copier
from featcache.core.writer import TierWriter
from featcache.tiers.base import Entry, Op


class FakeTier:
    """A ``WrittenTier`` in a dict. ``hold`` makes ``write`` wait (after signalling ``entered``);
    ``fail`` makes it raise."""

    name = "fake"
    capacity_bytes = 0
    used_bytes = 0

    def __init__(self) -> None:
        self.values: dict[bytes, torch.Tensor] = {}
        self.drops = 0
        self.batches: list[list[str]] = []
        self.entered = threading.Event()
        self.hold: threading.Event | None = None
        self.fail = False

    def fits(self, nbytes: int, meta_bytes: int = 0) -> bool:
        return True

    def contains(self, key: bytes) -> bool:
        return key in self.values

    def get(self, key: bytes, alloc=None) -> Entry | None:
        value = self.values.get(key)
        return None if value is None else Entry(value)

    def put(self, key: bytes, entry: Entry) -> bool:
        self.values[key] = entry.tensor.clone()
        return True

    def discard(self, key: bytes) -> bool:
        return self.values.pop(key, None) is not None

    def count_drops(self, n: int = 1) -> None:
        self.drops += n

    def stats(self) -> dict[str, int]:
        return {"hits": 0, "misses": 0, "drops": self.drops}

    def close(self) -> None:
        pass

    def write(self, ops: Sequence[Op]) -> None:
        self.entered.set()
        if self.hold is not None:
            assert self.hold.wait(10)
        self.batches.append([op.kind for op in ops])
        if self.fail and any(op.kind == "put" for op in ops):
            raise RuntimeError("the tier is on fire")
        for op in ops:
            if op.kind == "put":
                assert op.entry is not None
                self.put(op.key, op.entry)
            elif op.kind == "discard":
                self.discard(op.key)


def writer(tier: FakeTier, *, exact: bool, max_puts: int = 8, batch_entries: int = 32) -> TierWriter:
    return TierWriter(tier, name="test-writer", copier=make_copier(torch.device("cpu")), pool=None,
                      max_puts=max_puts, batch_entries=batch_entries, exact=exact)


def entry(value: float) -> Entry:
    return Entry(torch.full((4,), value))


@pytest.fixture
def tier() -> FakeTier:
    return FakeTier()


def stuck(tier: FakeTier, w: TierWriter) -> threading.Event:
    """Hold the writer inside a write of key b"first"; returns the event that lets it go."""
    tier.hold = threading.Event()
    w.submit(b"first", entry(0))
    assert tier.entered.wait(10)
    return tier.hold


@pytest.mark.parametrize("exact", [True, False])
def test_a_put_over_the_limit_is_dropped_and_the_rule_decides_the_old_value(tier, exact):
    tier.values[b"k"] = torch.full((4,), -1.0)  # an older value of the key
    w = writer(tier, exact=exact, max_puts=1)
    go = stuck(tier, w)
    assert not w.submit(b"k", entry(1))  # one put pending already: dropped
    assert tier.drops == 1
    assert w.pending(b"k") == ((True, None) if exact else (False, None))
    go.set()
    w.join_queue()
    assert (b"k" in tier.values) == (not exact)  # exact: deleted; else: the old value kept
    w.stop()


@pytest.mark.parametrize("exact", [True, False])
def test_a_batch_the_tier_fails_counts_drops_and_an_exact_tier_loses_its_keys(tier, exact):
    for k in (b"a", b"b"):
        tier.values[k] = torch.full((4,), -1.0)
    w = writer(tier, exact=exact)
    go = stuck(tier, w)
    tier.fail = True
    w.submit(b"a", entry(1))
    w.submit(b"b", entry(2))
    go.set()
    w.join_queue()
    assert tier.drops == 3 and w.errors == 2  # "first", then the batch of a and b
    assert sorted(tier.values) == ([] if exact else [b"a", b"b"])
    assert w.pending(b"a") == (False, None) and w.alive
    w.stop()


def test_a_put_whose_copy_failed_becomes_a_discard_in_its_place(tier):
    class Fence:
        def synchronize(self) -> None:
            raise RuntimeError("copy failed")

    w = writer(tier, exact=True)
    w._copier = type("C", (), {"wait": staticmethod(lambda fence: fence and fence.synchronize())})()
    go = stuck(tier, w)
    w.submit(b"k", entry(1))
    w.submit(b"k", Entry(torch.full((4,), 2.0), fence=Fence()))
    go.set()
    w.join_queue()
    assert tier.batches[-1] == ["put", "discard"]  # in queue order: v1 lands, then is deleted
    assert b"k" not in tier.values and tier.drops == 1 and w.errors == 1
    w.stop()


def test_batches_keep_queue_order_and_their_size(tier):
    w = writer(tier, exact=True, batch_entries=3)
    go = stuck(tier, w)
    for i in range(5):
        w.submit(b"k%d" % i, entry(i))
    w.discard(b"k0")
    w.touch(b"k1")
    go.set()
    w.join_queue()
    assert tier.batches == [["put"], ["put", "put", "put"], ["put", "put", "discard"], ["touch"]]
    assert sorted(tier.values) == [b"first", b"k1", b"k2", b"k3", b"k4"]
    w.stop()


def test_touches_are_skipped_while_the_queue_is_long(tier, monkeypatch):
    monkeypatch.setattr(TierWriter, "TOUCH_QUEUE_LIMIT", 2)
    w = writer(tier, exact=True)
    go = stuck(tier, w)
    for _ in range(5):
        w.touch(b"k")
    assert w.depth == 2  # touches are hints: reads never grow a stuck writer's queue
    w.discard(b"k")  # a discard is always queued
    assert w.depth == 3
    go.set()
    w.stop()


def test_a_dead_writer_keeps_its_discards_in_flight(tier):
    w = writer(tier, exact=True)
    w.stop()
    assert not w.alive
    w.discard(b"k")
    assert w.pending(b"k") == (True, None)  # the tier's value of k is never served again
    assert not w.submit(b"j", entry(1)) and tier.drops == 1
