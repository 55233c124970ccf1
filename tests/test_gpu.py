"""The real CUDA paths: the D2H side stream, events, pinned memory. Skipped without CUDA; they run
on the GPU machine, on the GPU run list (docs/benchmarks.md, "The GPU run list"), whenever a change
touches what they cover."""

import pytest
import torch

from featcache import FeatureCache

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def cache(tmp_path):
    c = FeatureCache(device="cuda", device_bytes=64 * MiB, host_bytes=64 * MiB,
                     disk_path=tmp_path / "s", disk_bytes=256 * MiB)
    yield c
    c.close()


def slow_fill(shape, value, stream) -> torch.Tensor:
    """A tensor that becomes `value` only after ~50 ms of GPU time on `stream`."""
    with torch.cuda.stream(stream):
        t = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
        torch.cuda._sleep(100_000_000)
        t.fill_(value)
    return t


def test_host_tier_is_pinned_and_pooled(cache):
    for i in range(8):
        cache.put(key(i), torch.randn(13, 256, 512, device="cuda").to(torch.bfloat16))
    cache.flush()
    pool = cache._chain.staging.pool
    assert all(slab.tensor.is_pinned() for slab in pool._slabs)
    assert len(pool._slabs) == 1  # 8 entries, one page-locked allocation


def test_demotion_waits_for_the_producer_stream(cache):
    producer = torch.cuda.Stream()
    t = slow_fill((13, 256, 256), 7.0, producer)
    with torch.cuda.stream(producer):
        cache.put(key(1), t)  # returns before the fill has run
    cache.flush()
    host = cache._chain.staging.get(key(1))
    assert host is not None and bool((host.tensor == 7.0).all())  # the copy saw the final value
    cache._chain.staging.release(host.block)
    cache._chain.top.discard(key(1))
    with torch.cuda.stream(producer):
        assert bool((cache.get(key(1)) == 7.0).all())


def test_device_hit_on_another_stream_is_ordered_after_the_producer(cache):
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    t = slow_fill((1024, 1024), 3.0, producer)
    with torch.cuda.stream(producer):
        cache.put(key(2), t)
    with torch.cuda.stream(consumer):
        out = cache.get(key(2))
        total = out.float().sum()  # queued on the consumer stream, must wait for the fill
    torch.cuda.synchronize()
    assert float(total) == 3.0 * 1024 * 1024


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_tier_is_bit_identical_on_cuda(cache, tmp_path, dtype):
    t = (torch.randn(13, 256, 64, device="cuda") * 1000).to(dtype)
    t.view(-1)[0] = float("nan")
    cache.put(key(3), t)
    assert torch.equal(cache.get(key(3)).view(torch.uint8), t.view(torch.uint8))  # device
    cache.flush()
    cache._chain.top.discard(key(3))
    out = cache.get(key(3))  # host, promoted
    assert out.device.type == "cuda" and torch.equal(out.view(torch.uint8), t.view(torch.uint8))
    cache.close()
    with FeatureCache(device="cuda", device_bytes=64 * MiB, host_bytes=64 * MiB,
                      disk_path=tmp_path / "s", disk_bytes=256 * MiB) as again:
        out = again.get(key(3))  # disk
        assert out.device.type == "cuda" and torch.equal(out.view(torch.uint8), t.view(torch.uint8))


def test_put_and_hits_never_synchronize_the_request_path(cache):
    t = torch.randn(13, 256, 2048, device="cuda").to(torch.bfloat16)
    cache.put(key(0), t)
    cache.flush()
    cache._chain.top.discard(key(0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises
    try:
        cache.put(key(4), t.clone())
        out_device = cache.get(key(4))
        out_host = cache.get(key(0))  # host hit: async H2D on the caller's stream
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out_device, t) and torch.equal(out_host, t)


def test_promotion_is_safe_on_the_callers_stream_while_blocks_are_reused(tmp_path):
    # a host tier of 2 entries (2 MiB each, plus the room each block keeps for the disk header):
    # every promotion's block is rewritten soon after
    with FeatureCache(device="cuda", device_bytes=0, host_bytes=4 * MiB + 8192,
                      host_slab_bytes=4 * MiB + 8192) as c:
        values = [torch.full((1024, 1024), float(i), device="cuda", dtype=torch.bfloat16)
                  for i in range(6)]
        for i, v in enumerate(values):
            c.put(key(i), v)
            c.flush()
            got = [c.get(key(j)) for j in range(max(0, i - 1), i + 1)]
            for j, g in zip(range(max(0, i - 1), i + 1), got, strict=True):
                assert g is not None and bool((g == float(j)).all())


def test_lease_pins_on_cuda(cache):
    t = torch.ones(1024, 1024, device="cuda", dtype=torch.bfloat16)
    cache.put(key(9), t)
    with cache.lease(key(9)) as leased:
        for i in range(40):  # 80 MiB through a 64 MiB device tier
            cache.put(key(100 + i), torch.zeros(1024, 1024, device="cuda", dtype=torch.bfloat16))
        assert key(9) in cache._chain.top._entries
        assert bool((leased == 1).all())
