"""featcache/tiers/mooncake_client.py's ``read_or_set_secret`` when replicas start together: a
put of the secret by another replica's client may be in flight, and this one's calls fail until it
lands. They are tried again for a bounded time, so that both replicas key with one secret (a CI
run of 2026-12-04 saw two replicas started within a millisecond key apart); an unreachable master
is not waited on. The real race runs in tests/test_fleet_mooncake.py."""

from __future__ import annotations

import time
import types

import pytest

from featcache.tiers import mooncake_client as mc

URL = "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata"


class RacingStore:
    """A store where another client's put of the secret is in flight for its first ``busy``
    calls: each fails with ``failure`` (an error code), or finds the secret there but gets
    nothing back (``failure`` None); after that it reads the other's value."""

    def __init__(self, busy: int, failure: int | None = None, theirs: bytes = b"ab" * 32) -> None:
        self.busy, self.failure, self.theirs = busy, failure, theirs
        self.calls = 0

    def is_exist(self, name: str) -> int:
        self.calls += 1
        if self.calls <= self.busy and self.failure is not None:
            return self.failure
        return 1

    def put(self, name: str, value: bytes) -> int:
        raise AssertionError("the secret exists: no put")

    def get(self, name: str) -> bytes:
        return b"" if self.calls <= self.busy else self.theirs


def _read(store, monkeypatch, settle_s: float = 2.0) -> bytes:
    monkeypatch.setattr(mc, "shared_client", lambda settings, hold=False: store)
    config = types.SimpleNamespace(remote_url=URL)  # (all the call reads of a CacheConfig)
    return mc.read_or_set_secret(config, "featcache:secret", b"cd" * 32, settle_s=settle_s)


def test_a_secret_whose_put_is_in_flight_is_read_once_it_lands(monkeypatch):
    store = RacingStore(busy=3)
    assert _read(store, monkeypatch) == store.theirs and store.calls == 4


@pytest.mark.parametrize("failure", [mc.OBJECT_NOT_FOUND, mc.TRANSFER_FAIL])
def test_a_call_refused_while_the_other_put_lands_is_tried_again(monkeypatch, failure):
    store = RacingStore(busy=2, failure=failure)
    assert _read(store, monkeypatch) == store.theirs and store.calls == 3


def test_a_put_that_never_lands_fails_after_the_settle_time(monkeypatch):
    store = RacingStore(busy=10**9)
    t = time.monotonic()
    with pytest.raises(mc.Failed):
        _read(store, monkeypatch, settle_s=0.3)
    assert 0.3 <= time.monotonic() - t < 2.0


def test_an_unreachable_master_is_not_waited_on(monkeypatch):
    class Down(RacingStore):
        def is_exist(self, name: str) -> int:
            self.calls += 1
            return mc.RPC_FAIL

    store = Down(busy=0)
    t = time.monotonic()
    with pytest.raises(mc.Failed):
        _read(store, monkeypatch, settle_s=5.0)
    assert store.calls == 1 and time.monotonic() - t < 1.0
