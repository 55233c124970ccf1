"""``FeatureCache.get_or_compute``: one computation per miss, its result or its failure shared by
every caller that waited for it (issue 18 item 8). The race is made deterministic: the first
caller's compute blocks until a second caller is known to be waiting on it."""

from __future__ import annotations

import threading

import pytest
import torch

import featcache.core.singleflight as singleflight
from featcache import FeatureCache, image_key

KEY = image_key(b"photo", namespace="m")


@pytest.fixture
def cache(tmp_path):
    with FeatureCache(device="cpu", host_bytes="16MiB", disk_path=tmp_path / "s", disk_bytes="64MiB") as c:
        yield c


@pytest.fixture
def waiting(monkeypatch):
    """Set when a caller starts waiting for another's computation."""
    event = threading.Event()
    result = singleflight.Flight.result

    def waits(self):
        event.set()
        return result(self)

    monkeypatch.setattr(singleflight.Flight, "result", waits)
    return event


def test_a_hit_does_not_compute_and_a_miss_is_put(cache):
    calls = []
    value = torch.arange(8.0)
    assert torch.equal(cache.get_or_compute(KEY, lambda: calls.append(1) or value, meta=b"m"), value)
    assert torch.equal(cache.get_or_compute(KEY, lambda: calls.append(1) or value), value)
    assert calls == [1]
    cache.flush()
    with cache.lease(KEY) as got:
        assert torch.equal(got, value)
    assert cache.acquire(KEY).meta == b"m"


def test_concurrent_callers_of_one_key_wait_for_the_first_computation(cache, waiting):
    started, release, calls = threading.Event(), threading.Event(), []

    def slow():
        calls.append("first")
        started.set()
        assert release.wait(10)
        return torch.ones(4)

    got = {}
    first = threading.Thread(target=lambda: got.setdefault("first", cache.get_or_compute(KEY, slow)),
                             daemon=True)
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: got.setdefault(
        "second", cache.get_or_compute(KEY, lambda: calls.append("second") or torch.zeros(4))),
        daemon=True)
    second.start()
    assert waiting.wait(10)  # the second caller waits for the first's computation
    release.set()
    first.join(10)
    second.join(10)
    assert calls == ["first"]
    assert torch.equal(got["first"], torch.ones(4)) and torch.equal(got["second"], torch.ones(4))


def test_a_failed_computation_reaches_every_waiter_and_stores_nothing(cache, waiting):
    started, release = threading.Event(), threading.Event()

    def fails():
        started.set()
        assert release.wait(10)
        raise RuntimeError("encoder out of memory")

    errors = []

    def call(fn):
        try:
            cache.get_or_compute(KEY, fn)
        except RuntimeError as e:
            errors.append(e)

    first = threading.Thread(target=call, args=(fails,), daemon=True)
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=call, args=(lambda: pytest.fail("computed twice"),),
                              daemon=True)
    second.start()
    assert waiting.wait(10)
    release.set()
    first.join(10)
    second.join(10)
    assert len(errors) == 2 and errors[0] is errors[1] and "out of memory" in str(errors[0])
    assert KEY not in cache and cache.get(KEY) is None
    assert torch.equal(cache.get_or_compute(KEY, lambda: torch.full((2,), 3.0)), torch.full((2,), 3.0))
