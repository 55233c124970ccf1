import random

from featcache.core.hostpool import ALIGN, HostPool


class FakeFence:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_blocks_never_overlap_and_capacity_holds():
    pool = HostPool(capacity_bytes=1 << 20, slab_bytes=256 << 10, pin=False)
    rng = random.Random(0)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            pool.release(live.pop(rng.randrange(len(live))))
            continue
        block = pool.alloc(rng.randrange(1, 100_000))
        if block is not None:
            live.append(block)
        assert pool.allocated_bytes <= pool.capacity_bytes
        spans = sorted((b.slab, b.offset, b.offset + b.size) for b in live)
        for (s1, _, e1), (s2, b2, _) in zip(spans, spans[1:], strict=False):
            assert s1 != s2 or e1 <= b2
        assert pool.block_bytes == sum(b.size for b in live)
    for block in live:
        pool.release(block)
    assert pool.block_bytes == 0
    # everything coalesced: each slab can hand out one block of its full size again
    assert all(pool.alloc(pool.slab_bytes) is not None for _ in range(4))


def test_block_contents_are_private():
    pool = HostPool(capacity_bytes=8 * ALIGN, slab_bytes=8 * ALIGN, pin=False)
    a, b = pool.alloc(ALIGN), pool.alloc(ALIGN)
    a.tensor.fill_(1)
    b.tensor.fill_(2)
    assert int(a.tensor.sum()) == ALIGN


def test_block_with_pending_fence_is_not_reused_until_done():
    pool = HostPool(capacity_bytes=ALIGN, slab_bytes=ALIGN, pin=False)
    block = pool.alloc(ALIGN)
    block.fence = FakeFence()
    pool.release(block)
    assert pool.alloc(ALIGN) is None  # its last copy has not finished
    block.fence.done = True
    assert pool.alloc(ALIGN) is not None


def test_referenced_block_is_not_reused():
    pool = HostPool(capacity_bytes=ALIGN, slab_bytes=ALIGN, pin=False)
    block = pool.alloc(10)
    pool.retain(block)
    pool.release(block)
    assert pool.alloc(10) is None
    pool.release(block)
    assert pool.alloc(10) is not None


def test_too_large_for_a_slab_is_refused():
    pool = HostPool(capacity_bytes=1 << 20, slab_bytes=64 << 10, pin=False)
    assert pool.alloc((64 << 10) + 1) is None
    assert pool.alloc(64 << 10) is not None
