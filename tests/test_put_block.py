"""``put(..., block=True)`` (issue 29 item 1): a batch job that fills a store loses no write.

By default a put never waits: past a queue's bound the write-through is dropped and counted (a
server's request path must not wait for a disk). With ``block=True`` (or inside
``cache.blocking_puts()``, which ``featcache warm`` uses) it waits for room in the demote queue and
the background copy waits for room in the disk writer's queue. The disk writer is held inside a
write (an event in its tier's ``write``) so that the queues are full for certain, without sleeps;
``join(timeout)`` on the putting thread only tells a put that waits from one that returned.
"""

from __future__ import annotations

import os
import queue
import threading

import pytest
import torch

from featcache import FeatureCache
from featcache.errors import FeatCacheError

MiB = 1 << 20
N = 40  # puts, far more than the queues hold (1 + 1 + 1 being written)


def key(i: int) -> bytes:
    return f"key-{i:05d}".encode()


def feats(i: int) -> torch.Tensor:
    return torch.full((64, 256), float(i))  # 64 KiB


def small_queues(path, **options) -> FeatureCache:
    """The issue's shape, small: a device tier, no host tier, a disk tier; queues of one."""
    return FeatureCache(device="cpu", device_bytes=4 * MiB, host_bytes=0, disk_path=path,
                        disk_bytes=64 * MiB, demote_queue_entries=1, disk_queue_entries=1,
                        disk_sync=False, **options)


class HeldDisk:
    """Holds the disk writer inside its first write until ``release()``. ``run(fn)`` runs ``fn``
    in the writer's thread while it is held and returns what it returned."""

    def __init__(self, cache: FeatureCache) -> None:
        (self.tier,) = [s.tier for s in cache._chain.below if s.tier.name == "disk"]
        self.entered = threading.Event()
        self._calls: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._write = self.tier.write
        self.tier.write = self  # the writer calls tier.write(ops)
        self._held = True

    def __call__(self, ops):
        if self._held:
            self._held = False
            self.entered.set()
            while (fn := self._calls.get(timeout=30)) is not None:
                self._results.put(fn())
        return self._write(ops)

    def run(self, fn):
        self._calls.put(fn)
        return self._results.get(timeout=30)

    def release(self) -> None:
        self._calls.put(None)


def put_all(cache: FeatureCache, **kw) -> None:
    for i in range(N):
        cache.put(key(i), feats(i), **kw)


def fill_while_held(cache: FeatureCache, fill) -> bool:
    """Run ``fill`` in a thread while the disk writer is held; True if it was still running
    (waiting) a second after the writer was caught. Then release the writer, finish, flush."""
    held = HeldDisk(cache)
    cache.put(key(-1), feats(-1))  # the write the writer is held in
    assert held.entered.wait(30)
    filler = threading.Thread(target=fill, name="filler", daemon=True)
    filler.start()
    filler.join(1.0)
    waited = filler.is_alive()
    held.release()
    filler.join(60)
    assert not filler.is_alive()
    cache.flush()
    return waited


def stored_on_disk(path) -> set[bytes]:
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=path,
                      disk_bytes=64 * MiB) as reopened:
        return set(reopened.keys())


def test_the_default_put_drops_past_the_queues_and_counts_it(tmp_path):
    """Today's behaviour, kept: a server's put never waits; what does not fit the queues is not
    written down, counted as drops (the entry stays in the device tier)."""
    with small_queues(tmp_path / "s") as c:
        waited = fill_while_held(c, lambda: put_all(c))
        drops = c.stats()["disk"]["drops"]
        assert all(torch.equal(c.get(key(i)), feats(i)) for i in range(N))  # device tier
    assert not waited
    assert drops > 0
    assert len(stored_on_disk(tmp_path / "s") - {key(-1)}) == N - drops


@pytest.mark.parametrize("how", ["put", "get_or_compute", "blocking_puts"])
def test_a_blocking_put_waits_for_room_and_loses_no_write(tmp_path, how):
    fills = {
        "put": lambda c: put_all(c, block=True),
        "get_or_compute": lambda c: [c.get_or_compute(key(i), lambda i=i: feats(i), block=True)
                                     for i in range(N)],
    }
    with small_queues(tmp_path / "s") as c:
        if how == "blocking_puts":
            with c.blocking_puts():
                waited = fill_while_held(c, lambda: put_all(c))
        else:
            waited = fill_while_held(c, lambda: fills[how](c))
        s = c.stats()
        assert s["disk"]["drops"] == 0 and s["host"]["drops"] == 0
        assert s["disk"]["entries"] == N + 1
    assert waited  # it waited for the held writer instead of dropping
    assert stored_on_disk(tmp_path / "s") == {key(i) for i in range(-1, N)}


def test_many_blocking_puts_all_land_bit_identical(tmp_path):
    """No writer held: a stream of puts faster than the disk, queues of one, every one on disk."""
    n = 300
    with small_queues(tmp_path / "s") as c:
        for i in range(n):
            c.put(key(i), torch.full((16, 256), float(i)), block=True)
        c.flush()
        assert c.stats()["disk"]["drops"] == 0
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=tmp_path / "s",
                      disk_bytes=64 * MiB) as reopened:
        assert len(reopened) == n
        assert all(torch.equal(reopened.get(key(i)), torch.full((16, 256), float(i)))
                   for i in range(n))


def test_an_explicit_block_false_inside_blocking_puts_still_drops(tmp_path):
    with small_queues(tmp_path / "s") as c, c.blocking_puts():
        waited = fill_while_held(c, lambda: put_all(c, block=False))
        assert not waited and c.stats()["disk"]["drops"] > 0


def test_a_blocking_put_from_the_writer_thread_does_not_wait_for_itself(tmp_path):
    """The writer thread makes the room a blocking put waits for: a put from it (or from the
    demotion thread) does not wait, it drops and counts as the default put does."""
    with small_queues(tmp_path / "s") as c:
        held = HeldDisk(c)
        c.put(key(0), feats(0))
        assert held.entered.wait(30)  # the writer holds key 0: its queue is full
        c.put(key(1), feats(1), block=True)  # the demoter takes it and waits for the writer
        c.put(key(2), feats(2), block=True)  # returns once key 1 left the demote queue: full again
        held.run(lambda: c.put(key(3), feats(3), block=True))  # in the writer's thread: returns
        assert c.stats()["disk"]["drops"] == 1  # key 3, at the full demote queue
        held.release()
        c.flush()
        assert c.stats()["disk"]["drops"] == 1
        assert torch.equal(c.get(key(3)), feats(3))  # still served from the device tier
    assert stored_on_disk(tmp_path / "s") == {key(0), key(1), key(2)}


def test_a_closed_room_ends_every_wait():
    from featcache.core.writer import Room

    room = Room(1)
    assert room.take() and not room.take()
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(room.take(wait=True)), daemon=True)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waiting for room
    room.close()
    waiter.join(10)
    assert results == [False] and not room.take(wait=True)


def test_a_stopped_writer_refuses_to_reserve_instead_of_waiting(tmp_path):
    from featcache.core.writer import TierWriter

    with small_queues(tmp_path / "s") as c:
        (writer,) = [s.writer for s in c._chain.below if isinstance(s.writer, TierWriter)]
        demoter = c._demoter
    assert not writer.reserve(wait=True)  # closed: no thread will make room
    assert not demoter.reserve(wait=True)
    with pytest.raises(FeatCacheError, match="closed"):
        c.put(key(0), feats(0), block=True)


def test_warm_blocks_its_puts_so_no_image_is_lost(tmp_path, monkeypatch):
    """`featcache warm` runs lmdeploy's pipeline, whose engine puts each image's features through
    featcache's model hook (a plain ``cache.put``): warm makes those puts block. The stand-in
    pipeline puts from an engine thread of its own, as lmdeploy's engine loop does."""
    import _lmdeploy_stack

    _lmdeploy_stack.need("lmdeploy")
    import featcache.lmdeploy as fc_lmdeploy
    from featcache.lmdeploy import SECTION
    from featcache.warm import warm_images

    paths = []
    for i in range(N):
        paths.append(str(tmp_path / f"{i}.png"))
        with open(paths[-1], "wb") as f:
            f.write(b"%d" % i)
    cache = small_queues(tmp_path / "s")
    held = HeldDisk(cache)
    cache.put(key(-1), feats(-1))  # the write the disk writer is held in
    assert held.entered.wait(30)
    waited = []

    class StandInPipe:
        def __call__(self, requests, gen_config):
            def engine():
                for r in requests:
                    i = int(os.path.basename(r[0]["content"][1]["image_url"]["url"]).split(".")[0])
                    cache.count(SECTION, "misses")
                    cache.put(key(i), feats(i))  # what featcache/lmdeploy/pytorch/models.py does
            thread = threading.Thread(target=engine, name="engine", daemon=True)
            thread.start()
            thread.join(1.0)
            waited.append(thread.is_alive())
            held.release()
            thread.join(60)

        def close(self):
            pass

    monkeypatch.setattr(fc_lmdeploy, "pipeline", lambda model, cache, **kw: StandInPipe())
    try:
        report = warm_images("m", cache, paths, params={}, batch=N)
        s = cache.stats()
    finally:
        cache.close()
    assert s["disk"]["drops"] == 0
    assert waited == [True]
    assert (report.computed, report.entries) == (N, N + 1)
    assert stored_on_disk(tmp_path / "s") == {key(i) for i in range(-1, N)}
