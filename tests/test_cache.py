"""FeatureCache behaviour across tiers: promotion, leases, overload, failures, misuse."""

import threading

import pytest
import torch

from featcache import FeatCacheError, FeatureCache

MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def feats(i: int, n: int = 64) -> torch.Tensor:
    return torch.full((n, 256), float(i), dtype=torch.bfloat16)  # n * 512 bytes


@pytest.fixture
def cache(tmp_path):
    c = FeatureCache(device="cpu", device_bytes=MiB, host_bytes=2 * MiB,
                     disk_path=tmp_path / "s", disk_bytes=8 * MiB)
    yield c
    c.close()


def test_write_through_reaches_every_tier(cache):
    cache.put(key(1), feats(1))
    cache.flush()
    s = cache.stats()
    assert (s["device"]["entries"], s["host"]["entries"], s["disk"]["entries"]) == (1, 1, 1)


def test_host_hit_is_promoted_to_the_device(cache):
    cache.put(key(1), feats(1))
    cache.flush()
    cache._chain.top.discard(key(1))  # as if evicted
    assert torch.equal(cache.get(key(1)), feats(1))
    assert cache.stats()["host"]["hits"] == 1
    assert torch.equal(cache.get(key(1)), feats(1))
    assert cache.stats()["device"]["hits"] == 1


def test_disk_hit_is_promoted_to_host_and_device(cache, tmp_path):
    cache.put(key(1), feats(1))
    cache.close()
    with FeatureCache(device="cpu", device_bytes=MiB, host_bytes=2 * MiB,
                      disk_path=tmp_path / "s", disk_bytes=8 * MiB) as again:
        assert torch.equal(again.get(key(1)), feats(1))
        assert again.get(key(1)) is not None
        s = again.stats()
        assert (s["disk"]["hits"], s["device"]["hits"], s["host"]["entries"]) == (1, 1, 1)


def test_returned_tensor_does_not_change_when_the_host_block_is_reused(tmp_path):
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=64 * 1024,
                      host_slab_bytes=64 * 1024) as c:
        c.put(key(1), feats(1))
        c.flush()
        out = c.get(key(1))
        for i in range(2, 10):  # evicts key 1; its block is rewritten
            c.put(key(i), feats(i))
            c.flush()
        assert torch.equal(out, feats(1))


def test_lease_is_never_evicted_until_released():
    with FeatureCache(device="cpu", device_bytes=4 * 32 * 1024, host_bytes=0) as c:
        c.put(key(0), feats(0))
        lease = c.acquire(key(0))
        assert lease is not None and torch.equal(lease.tensor, feats(0))
        for i in range(1, 20):
            c.put(key(i), feats(i))
            assert key(0) in c, f"leased entry evicted by put {i}"
        lease.release()
        lease.release()  # idempotent
        for i in range(20, 30):
            c.put(key(i), feats(i))
        assert key(0) not in c


def test_lease_context_manager_and_miss():
    with FeatureCache(device="cpu", device_bytes=MiB, host_bytes=0) as c:
        with c.lease(key(5)) as missing:
            assert missing is None
        c.put(key(5), feats(5))
        with c.lease(key(5)) as t:
            assert torch.equal(t, feats(5))
            assert c._chain.top._books.pinned(key(5))
        assert not c._chain.top._books.pinned(key(5))


def test_when_every_entry_is_leased_a_new_put_skips_the_device_tier():
    with FeatureCache(device="cpu", device_bytes=2 * 32 * 1024, host_bytes=MiB) as c:
        leases = []
        for i in range(2):
            c.put(key(i), feats(i))
            leases.append(c.acquire(key(i)))
        c.put(key(9), feats(9))
        assert key(0) in c._chain.top._entries and key(1) in c._chain.top._entries
        assert key(9) not in c._chain.top._entries
        c.flush()
        assert torch.equal(c.get(key(9)), feats(9))  # from the host tier
        for lease in leases:
            lease.release()


class _Gate:
    """Holds the demotion thread inside its copy until opened: overload without sleeping."""

    def __init__(self, copier):
        self.entered = threading.Event()
        self.open = threading.Event()
        self._to_host = copier.to_host
        copier.to_host = self

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.open.wait(10)
        return self._to_host(*args, **kwargs)


def test_overload_drops_copies_instead_of_blocking_put(tmp_path):
    c = FeatureCache(device="cpu", device_bytes=4 * MiB, host_bytes=4 * MiB,
                     disk_path=tmp_path / "s", disk_bytes=8 * MiB, demote_queue_entries=2)
    gate = _Gate(c._copier)
    c.put(key(0), feats(0))
    assert gate.entered.wait(10)  # the worker is stuck on job 0; the queue holds 2 more
    for i in range(1, 6):
        c.put(key(i), feats(i))  # returns at once
    s = c.stats()
    assert s["host"]["drops"] == 3 and s["disk"]["drops"] == 3
    for i in range(6):  # every entry is still served, from the device tier
        assert torch.equal(c.get(key(i)), feats(i))
    gate.open.set()
    c.flush()
    assert c.stats()["disk"]["entries"] == 3
    c.close()


def test_reads_see_entries_still_on_their_way_down(tmp_path):
    c = FeatureCache(device="cpu", device_bytes=0, host_bytes=MiB,
                     disk_path=tmp_path / "s", disk_bytes=8 * MiB)
    gate = _Gate(c._copier)
    c.put(key(1), feats(1))
    assert gate.entered.wait(10)
    assert torch.equal(c.get(key(1)), feats(1))  # from the demoter's in-flight map
    assert c.stats()["cache"]["inflight_hits"] == 1
    gate.open.set()
    c.close()


def test_a_failing_worker_is_counted_and_requests_still_work(tmp_path, caplog):
    c = FeatureCache(device="cpu", device_bytes=MiB, host_bytes=MiB,
                     disk_path=tmp_path / "s", disk_bytes=8 * MiB)

    def broken(*args, **kwargs):
        raise RuntimeError("copy engine on fire")

    c._copier.to_host = broken
    for i in range(3):
        c.put(key(i), feats(i))
    c.flush()
    s = c.stats()
    assert s["cache"]["worker_errors"] == 3 and s["cache"]["workers_alive"] == 1
    assert sum("failed a job" in r.message for r in caplog.records) == 1  # logged once
    assert all(torch.equal(c.get(key(i)), feats(i)) for i in range(3))
    c.close()


def test_views_are_stored_as_compact_copies():
    base = torch.arange(1 << 16, dtype=torch.float32)
    with FeatureCache(device="cpu", device_bytes=MiB, host_bytes=0) as c:
        c.put(key(1), base[:256])
        c.put(key(2), base.view(256, 256).t())  # non-contiguous
        assert c.stats()["device"]["bytes"] == 1024 + 256 * 256 * 4
        assert torch.equal(c.get(key(2)), base.view(256, 256).t())
        whole = torch.ones(64)
        c.put(key(3), whole)
        assert c.get(key(3)).data_ptr() == whole.data_ptr()  # a whole tensor is kept, not copied


def test_inference_mode_tensors_round_trip(tmp_path):
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=MiB,
                      disk_path=tmp_path / "s", disk_bytes=8 * MiB) as c:
        with torch.inference_mode():
            c.put(key(1), feats(1))
            c.flush()
            assert torch.equal(c.get(key(1)), feats(1))
        c._chain.staging.discard(key(1))
        assert torch.equal(c.get(key(1)), feats(1))  # disk -> host block outside inference mode


def test_misuse_raises_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="CUDA is not available") if not torch.cuda.is_available() \
            else pytest.raises(ValueError, match="device"):
        FeatureCache(device="cuda" if not torch.cuda.is_available() else "meta")
    with pytest.raises(ValueError, match="cannot parse size"):
        FeatureCache(device="cpu", host_bytes="lots")
    with pytest.raises(TypeError, match="unknown cache option"):
        FeatureCache(device="cpu", host_byte=5)
    with FeatureCache(device="cpu", host_bytes=0) as c:
        with pytest.raises(TypeError, match="keys are bytes"):
            c.put("abc", torch.ones(2))
        with pytest.raises(ValueError, match="1 to 503"):
            c.get(b"")
        with pytest.raises(TypeError, match="torch.Tensor"):
            c.put(b"k", [1.0])
        with pytest.raises(TypeError, match="dtype"):
            c.put(b"k", torch.ones(2, dtype=torch.complex64))
    with pytest.raises(FeatCacheError, match="closed"):
        c.get(b"k")
    c.close()  # idempotent


def test_no_tiers_at_all_stores_nothing():
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0) as c:
        c.put(key(1), feats(1))
        assert c.get(key(1)) is None
        assert c.stats()["cache"]["not_stored"] == 1


def test_default_device_and_sizes():
    with FeatureCache(host_bytes="8MiB") as c:
        assert c.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        assert c.stats()["host"]["capacity_bytes"] == 8 * MiB
        assert c.stats()["disk"]["capacity_bytes"] == 0  # no disk_path: no disk tier


def test_metadata_is_served_with_the_tensor_from_every_tier(tmp_path):
    meta = b'{"image_tokens": 3328, "image_token_id": 151667}'
    path = tmp_path / "s"
    with FeatureCache(device="cpu", device_bytes=MiB, host_bytes=MiB, disk_path=path,
                      disk_bytes=8 * MiB) as c:
        c.put(key(1), feats(1), meta=meta)
        c.put(key(2), feats(2))
        with c.lease(key(1)):
            pass
        lease = c.acquire(key(1))
        assert lease.meta == meta and c.acquire(key(2)).meta == b""
        c.flush()
        c._chain.top.discard(key(1))
        assert c.acquire(key(1)).meta == meta  # host tier
    with FeatureCache(device="cpu", device_bytes=MiB, host_bytes=MiB, disk_path=path,
                      disk_bytes=8 * MiB) as c:
        lease = c.acquire(key(1))  # disk tier
        assert lease.meta == meta and torch.equal(lease.ready(), feats(1))
    with pytest.raises(TypeError, match="meta must be bytes"):
        FeatureCache(device="cpu").put(key(3), feats(3), meta="text")


def test_discard_cancels_a_put_still_on_its_way_down(tmp_path):
    path = tmp_path / "s"
    c = FeatureCache(device="cpu", device_bytes=MiB, host_bytes=MiB,
                     disk_path=path, disk_bytes=8 * MiB)
    gate = _Gate(c._copier)
    c.put(key(0), feats(0))
    assert gate.entered.wait(10)  # the demoter is copying key 0
    c.put(key(1), feats(1))  # queued behind it
    c.put(key(2), feats(2))
    for k in (key(0), key(1), key(2)):
        c.discard(k)
    c.put(key(2), feats(3))  # put, discard, put again: the last put wins
    assert key(0) not in c and key(1) not in c and c.get(key(1)) is None
    gate.open.set()
    c.flush()
    assert key(0) not in c and key(1) not in c
    s = c.stats()
    assert (s["host"]["entries"], s["disk"]["entries"]) == (1, 1)
    c.close()
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0,
                      disk_path=path, disk_bytes=8 * MiB) as again:
        assert again.get(key(0)) is None and again.get(key(1)) is None
        assert torch.equal(again.get(key(2)), feats(3))


def test_a_put_too_large_for_the_device_replaces_the_device_entry():
    with FeatureCache(device="cpu", device_bytes=64 * 1024, host_bytes=MiB) as c:
        c.put(key(1), feats(1))  # 32 KiB: on the device
        c.put(key(1), feats(2, n=256))  # 128 KiB: host only
        assert torch.equal(c.get(key(1)), feats(2, n=256))
        c.flush()
        assert torch.equal(c.get(key(1)), feats(2, n=256))


def test_a_put_too_large_for_every_tier_removes_the_old_value():
    with FeatureCache(device="cpu", device_bytes=64 * 1024, host_bytes=0) as c:
        c.put(key(1), feats(1))
        c.put(key(1), feats(2, n=256))  # fits nowhere: not stored, and the old value is gone
        assert c.stats()["cache"]["not_stored"] == 1
        assert c.get(key(1)) is None and key(1) not in c


def test_disk_values_are_written_from_the_host_block_without_a_copy(tmp_path, monkeypatch):
    from featcache import codec

    copies = []
    monkeypatch.setattr(codec, "encode", lambda *a, **k: copies.append(1) or b"")
    with FeatureCache(device="cpu", device_bytes=MiB, host_bytes=MiB, disk_path=tmp_path / "s",
                      disk_bytes=8 * MiB) as c:
        c.put(key(1), feats(1), meta=b"meta")
        c.flush()
        assert copies == []  # framed in place, not encode()d into a new bytes object
        c._chain.top.discard(key(1))
        c._chain.staging.discard(key(1))
        lease = c.acquire(key(1))
        assert torch.equal(lease.tensor, feats(1)) and lease.meta == b"meta"
        assert c.stats()["disk"]["hits"] == 1


def test_an_unreferenced_cache_is_closed_at_once(tmp_path):
    """Nothing the cache builds refers back to it (the finalizer holds the chain, a tier's
    callback goes to its writer, the read path counts without it): dropping the last reference
    closes it, threads joined and the store released, without waiting for the garbage collector."""
    import gc
    import weakref

    gc.disable()
    try:
        c = FeatureCache(device="cpu", device_bytes=MiB, host_bytes=MiB,
                         disk_path=tmp_path / "s", disk_bytes=8 * MiB)
        c.put(key(1), feats(1))
        assert c.get(key(1)) is not None
        ref, finalizer = weakref.ref(c), c._finalizer
        del c
        assert ref() is None and not finalizer.alive
    finally:
        gc.enable()
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=tmp_path / "s",
                      disk_bytes=8 * MiB) as again:  # the store was flushed and released
        assert torch.equal(again.get(key(1)), feats(1))


def test_a_cache_that_does_not_write_the_disk_reads_it_and_leaves_it_as_it_was(tmp_path):
    """``disk_writes=False`` (tp ranks > 0 over rank 0's store): disk hits are served and
    promoted; its own puts, discards and hits' touches never reach the disk."""
    store = dict(disk_path=tmp_path / "s", disk_bytes=8 * MiB)
    with FeatureCache(device="cpu", device_bytes=MiB, host_bytes=2 * MiB, **store) as writer:
        writer.put(key(1), feats(1))
    with FeatureCache(device="cpu", device_bytes=MiB, host_bytes=2 * MiB, disk_writes=False,
                      **store) as reader:
        assert torch.equal(reader.get(key(1)), feats(1))  # from the disk, promoted
        assert reader.stats()["disk"]["hits"] == 1
        reader.put(key(2), feats(2))
        reader.discard(key(1))
        reader.flush()
        assert reader.get(key(2)) is not None  # its own memory tiers hold what it puts
    with FeatureCache(device="cpu", device_bytes=MiB, host_bytes=0, **store) as after:
        assert torch.equal(after.get(key(1)), feats(1))  # not discarded there
        assert key(2) not in after and after.stats()["disk"]["entries"] == 1
    with pytest.raises(TypeError, match="disk_writes"):
        FeatureCache(device="cpu", disk_writes="no")
