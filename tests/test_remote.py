"""The remote tier against a real redis-server on loopback (tests/_redis.py starts one per test).

Without redis-server the tests skip; with FEATCACHE_REQUIRE_REDIS=1 (CI) they fail instead.
Timing is injected (the breaker's clock) or waited for by events; the only real timeout is the
one test of a server that never answers (50 ms).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import multiprocessing as mp
import socket
import threading
from pathlib import Path

import pytest
import torch

from featcache import FeatureCache
from featcache.config import CacheConfig, redact_url
from featcache.tiers import remote_layout
from featcache.tiers.breaker import Breaker

try:
    import _procs
    import _redis
    import _remote_procs
except ImportError:  # tests/ became a package
    from tests import _procs, _redis, _remote_procs

SPAWN = mp.get_context("spawn")
CHUNK = 4096  # small chunks: values of a few dozen KB span many of them


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="session")
def redis_bin() -> str:
    return _redis.redis_binary()


@pytest.fixture
def server(redis_bin: str, tmp_path: Path):
    srv = _redis.RedisServer(redis_bin, tmp_path)
    yield srv
    srv.kill()


def replica(url: str, **options) -> FeatureCache:
    """A cache with small local tiers (device and host on), remote on ``url``."""
    options = {"device_bytes": "16MiB", "host_bytes": "16MiB", "remote_chunk_bytes": CHUNK,
               **options}
    return FeatureCache(device="cpu", remote_url=url, **options)


def remote_only(url: str, **options) -> FeatureCache:
    """A cache with no local tier at all: every get goes to the server."""
    return replica(url, device_bytes=0, host_bytes=0, **options)


def assert_same(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None, "entry missing"
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
    assert _procs.same_bits(got, want)


def values() -> dict[bytes, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = {
        b"f32-multi-chunk": torch.randn(40, 512, generator=gen),  # 80 KiB: 21 chunks
        b"bf16-multi-chunk": torch.randn(13, 16, 200, generator=gen).to(torch.bfloat16),
        b"f16-exact-chunk": torch.randn(CHUNK, generator=gen).to(torch.float16),  # 2 chunks
        b"f64-inline": torch.randn(8, 8, generator=gen, dtype=torch.float64),
        b"i64": torch.randint(-(2**62), 2**62, (3000,), generator=gen),
        b"u8-odd": torch.randint(0, 255, (9999,), generator=gen, dtype=torch.uint8),
        b"bool": torch.rand(5000, generator=gen) > 0.5,
        b"f8": torch.randn(7000, generator=gen).to(torch.float8_e4m3fn),
        b"empty": torch.empty(0, 3),
        b"scalar": torch.tensor(3.5),
    }
    nan = torch.randn(2000, generator=gen)
    nan[::7] = float("nan")
    out[b"f32-nan"] = nan
    return out


# -- round trips ---------------------------------------------------------------------------------
def test_chunked_values_round_trip_bit_exactly(server):
    want = values()
    with replica(server.url) as writer:
        for key, tensor in want.items():
            writer.put(key, tensor, meta=b"meta-" + key)
        writer.flush()
        assert writer.stats()["remote"]["published"] == len(want)
    with remote_only(server.url) as reader:
        for key, tensor in want.items():
            lease = reader.acquire(key)
            assert lease is not None
            assert_same(lease.tensor, tensor)
            assert lease.meta == b"meta-" + key
            lease.release()
        s = reader.stats()["remote"]
        assert s["hits"] == len(want) and s["misses"] == 0 and s["corrupt"] == 0
    chunks = [k for k in entry_keys(server) if not k.endswith(b":h")]
    assert len(chunks) > 40  # the large values really were split


def test_remote_hit_is_promoted_into_the_local_tiers(server):
    t = torch.randn(64, 256).to(torch.bfloat16)
    with replica(server.url) as a:
        a.put(b"k", t)
    with replica(server.url) as b:
        assert_same(b.get(b"k"), t)
        server.kill()  # from now on only local tiers can answer
        b._chain.top.discard(b"k")
        assert_same(b.get(b"k"), t)  # from the host tier the remote hit was kept in
        assert b.stats()["host"]["hits"] == 1
        assert b.stats()["remote"]["hits"] == 1


def test_two_replica_processes_share_features(server, tmp_path):
    keys = [b"shared-%d" % i for i in range(6)]
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=SPAWN) as pool:
        first = pool.submit(_remote_procs.replica_compute, server.url, str(tmp_path / "a"), keys)
        first_stats = first.result(timeout=120)
    assert first_stats["published"] == len(keys)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=SPAWN) as pool:
        second = pool.submit(_remote_procs.replica_read, server.url, str(tmp_path / "b"), keys)
        second_stats = second.result(timeout=120)
    assert second_stats["hits"] == len(keys) and second_stats["misses"] == 0


def test_put_replaces_the_remote_value_and_unlinks_old_chunks(server):
    old, new = torch.zeros(20000), torch.ones(20000)
    with remote_only(server.url) as cache:
        cache.put(b"k", old)
        cache.flush()
        cache.put(b"k", new)
        cache.flush()
        assert_same(cache.get(b"k"), new)
    chunk_keys = [k for k in entry_keys(server) if not k.endswith(b":h")]
    assert len(chunk_keys) == -(-(20000 * 4 + 104) // CHUNK)  # only the new value's chunks


def test_discard_deletes_the_remote_entry(server):
    with remote_only(server.url) as a, remote_only(server.url) as b:
        a.put(b"k", torch.ones(3000))
        a.flush()
        a.discard(b"k")
        assert a.get(b"k") is None  # the delete may be queued still: never read the server then
        a.flush()
        assert b.get(b"k") is None
        assert entry_keys(server) == []


def test_entry_larger_than_every_local_tier_still_goes_remote(server):
    big = torch.randn(300_000)  # 1.2 MB
    with replica(server.url, device_bytes="64KiB", host_bytes="64KiB") as a:
        a.put(b"big", big)
        a.flush()
        assert a.stats()["cache"]["not_stored"] == 0
    with remote_only(server.url) as b:
        assert_same(b.get(b"big"), big)


# -- half-written, corrupt and expired entries ---------------------------------------------------
def entry_keys(server) -> list[bytes]:
    """The server's keys that belong to entries (the fleet's key secret is the other one:
    ``featcache.keysecret``)."""
    return [k for k in server.client().keys("*") if not k.endswith(b":key-secret")]


def head_and_chunks(server, key: bytes) -> tuple[bytes, list[bytes]]:
    keys = entry_keys(server)
    tag = b"{" + key.hex().encode() + b"}"
    head = [k for k in keys if tag in k and k.endswith(b":h")]
    chunks = sorted((k for k in keys if tag in k and not k.endswith(b":h")),
                    key=lambda k: int(k.rsplit(b":", 1)[1]))
    return (head[0] if head else b""), chunks


def publish(server, key: bytes, tensor: torch.Tensor, **options) -> None:
    with remote_only(server.url, **options) as cache:
        cache.put(key, tensor)


def test_head_without_chunks_is_a_miss(server):
    publish(server, b"k", torch.randn(10000))
    head, chunks = head_and_chunks(server, b"k")
    server.client().delete(chunks[3])  # e.g. evicted by maxmemory-policy allkeys-lru
    with remote_only(server.url) as reader:
        assert reader.get(b"k") is None
        reader.flush()
        s = reader.stats()["remote"]
        assert s["incomplete"] == 1 and s["hits"] == 0
    assert not server.client().exists(head)  # the dangling head was deleted in the background


def test_head_naming_chunks_never_written_is_a_miss(server):
    key = b"k"
    with remote_only(server.url) as cache:
        tier = _procs.tier_slot(cache, "remote").tier
        head = remote_layout.pack_head(remote_layout.CHUNKED, b"\1" * 8, 50_000, CHUNK, -(-50_000 // CHUNK))
        server.client().set(tier.head_key(key), head)
        assert cache.get(key) is None
        assert cache.stats()["remote"]["incomplete"] == 1


def test_chunks_without_head_are_never_read(server):
    publish(server, b"k", torch.randn(10000))
    head, chunks = head_and_chunks(server, b"k")
    server.client().delete(head)
    assert chunks
    with remote_only(server.url) as reader:
        assert reader.get(b"k") is None
        assert reader.stats()["remote"]["misses"] == 1


class PausingClient:
    """Wraps a redis client: the head write (SET ... GET) waits until ``go`` is set."""

    def __init__(self, client, reached: threading.Event, go: threading.Event) -> None:
        self._client, self._reached, self._go = client, reached, go

    def set(self, *args, **kw):
        if kw.get("get"):
            self._reached.set()
            assert self._go.wait(30)
        return self._client.set(*args, **kw)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_a_reader_never_sees_an_entry_before_its_head(server):
    reached, go = threading.Event(), threading.Event()
    t = torch.randn(20000)
    with remote_only(server.url) as writer, remote_only(server.url) as reader:
        tier = _procs.tier_slot(writer, "remote").tier
        real = tier._factory
        tier._factory = lambda: PausingClient(real(), reached, go)
        writer.put(b"k", t)
        assert reached.wait(30)  # every chunk is on the server, the head not yet
        assert reader.get(b"k") is None
        go.set()
        writer.flush()
        assert_same(reader.get(b"k"), t)


@pytest.mark.parametrize("damage", ["chunk_byte", "chunk_length", "inline_byte", "head_digest"])
def test_corrupt_remote_value_is_never_served(server, damage):
    t = torch.randn(10000) if damage.startswith("chunk") else torch.randn(100)
    publish(server, b"k", t)
    head, chunks = head_and_chunks(server, b"k")
    r = server.client()
    if damage == "chunk_byte":
        original = r.getrange(chunks[1], 100, 100)
        r.setrange(chunks[1], 100, bytes([original[0] ^ 0x01]))
    elif damage == "chunk_length":
        r.append(chunks[-1], b"x")
    elif damage == "inline_byte":
        value = bytearray(r.get(head))
        value[-1] ^= 0x80
        r.set(head, bytes(value))
    else:
        value = bytearray(r.get(head))
        value[20] ^= 0x01  # inside the manifest: its digest no longer matches
        r.set(head, bytes(value))
    with remote_only(server.url) as reader:
        assert reader.get(b"k") is None
        reader.flush()
        assert reader.stats()["remote"]["corrupt"] == 1
        assert reader.stats()["remote"]["hits"] == 0
    assert not r.exists(head)  # dropped on the server too


def test_ttl_on_heads_and_longer_on_chunks(server):
    publish(server, b"k", torch.randn(10000), remote_ttl_s=100)
    head, chunks = head_and_chunks(server, b"k")
    r = server.client()
    assert 90 < r.ttl(head) <= 100
    assert all(100 < r.ttl(c) <= 100 + remote_layout.CHUNK_TTL_MARGIN_S for c in chunks)
    with remote_only(server.url) as reader:
        assert reader.get(b"k") is not None
        r.pexpireat(head, 1)  # the head's time is up (an instant in the past: no waiting)
        assert reader.get(b"k") is None


def test_ttl_zero_means_no_expiry(server):
    publish(server, b"k", torch.randn(10000), remote_ttl_s=0)
    head, chunks = head_and_chunks(server, b"k")
    assert server.client().ttl(head) == -1 and server.client().ttl(chunks[0]) == -1


# -- outages ---------------------------------------------------------------------------------
def test_server_killed_and_restarted_mid_run(server):
    """No request fails, no wrong value is served, and the tier comes back by itself."""
    clock = FakeClock()
    want = {b"r-%d" % i: _procs.value_for(b"r-%d" % i) for i in range(60)}
    keys = list(want)
    with replica(server.url, device_bytes="64KiB", host_bytes=0,
                 remote_breaker_failures=2, remote_breaker_cooldown_ms=1000) as cache:
        _procs.tier_slot(cache, "remote").tier.breaker.clock = clock
        served = 0
        for i, key in enumerate(keys):
            if i == 20:
                server.kill()
            if i == 40:
                server.start()
                clock.now += 2  # past the cooldown: the next call is the trial
            got = cache.get(key)
            if got is not None:
                assert_same(got, want[key])
            else:
                cache.put(key, want[key])
            for earlier in keys[max(0, i - 5) : i]:  # re-read recent keys (local or remote)
                got = cache.get(earlier)
                if got is not None:
                    assert_same(got, want[earlier])
                    served += 1
            cache._demoter.join_queue()
            _procs.tier_slot(cache, "remote").writer.join_queue()
        s = cache.stats()["remote"]
        assert s["errors"] + s["timeouts"] >= 2 and s["breaker_opened"] >= 1
        assert s["breaker_open"] == 0
        assert served > 0
    with remote_only(server.url) as fresh:  # published after the restart: served to others
        for key in keys[41:]:
            assert_same(fresh.get(key), want[key])


def test_breaker_opens_skips_and_recovers(redis_bin, tmp_path):
    port = _redis.free_port()  # nothing listens here yet: connections are refused at once
    clock = FakeClock()
    url = f"redis://127.0.0.1:{port}/0"
    with remote_only(url, remote_breaker_failures=2, remote_breaker_cooldown_ms=5000) as cache:
        _procs.tier_slot(cache, "remote").tier.breaker.clock = clock

        def remote() -> dict[str, int]:
            return cache.stats()["remote"]

        assert cache.get(b"a") is None and remote()["errors"] == 1 and remote()["breaker_open"] == 0
        assert cache.get(b"a") is None and remote()["errors"] == 2 and remote()["breaker_open"] == 1
        for _ in range(5):  # open: no call goes out
            assert cache.get(b"a") is None
        assert remote()["errors"] == 2 and remote()["breaker_skips"] == 5
        clock.now += 5.1  # cooldown over: one trial, which fails and re-opens the breaker
        assert cache.get(b"a") is None
        assert remote()["errors"] == 3 and remote()["breaker_opened"] == 2
        assert cache.get(b"a") is None and remote()["breaker_skips"] == 6
        server = _redis.RedisServer(redis_bin, tmp_path, port)
        try:
            clock.now += 5.1
            assert cache.get(b"a") is None  # the trial succeeds (a plain miss): closed again
            assert remote()["breaker_open"] == 0 and remote()["errors"] == 3
            t = torch.randn(5000)
            cache.put(b"a", t)
            cache.flush()
            assert_same(cache.get(b"a"), t)
        finally:
            server.kill()


def test_server_that_never_answers_times_out(tmp_path):
    with socket.socket() as silent:  # accepts connections (backlog) and never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        with remote_only(url, remote_timeout_ms=50, remote_breaker_failures=1) as cache:
            t = torch.ones(10)
            assert cache.get(b"k") is None
            assert cache.stats()["remote"]["timeouts"] == 1
            assert cache.get(b"k") is None  # the breaker is open: no second wait
            assert cache.stats()["remote"]["breaker_skips"] == 1
            cache.put(b"k", t)  # the publish is skipped too; close() does not hang


def test_publish_queue_drops_under_overload_and_close_drains(server):
    reached, go = threading.Event(), threading.Event()
    cache = remote_only(server.url, remote_queue_entries=1)
    tier = _procs.tier_slot(cache, "remote").tier
    real = tier._factory
    tier._factory = lambda: PausingClient(real(), reached, go)
    try:
        for i in range(5):
            cache.put(b"q-%d" % i, torch.full((10,), float(i)))
        cache._demoter.join_queue()  # every put handed to the publisher (or dropped there)
        assert cache.stats()["remote"]["publish_dropped"] == 4  # one publish pending at a time
    finally:
        go.set()
        cache.close()  # drains the publisher and joins it
    s = cache.stats()["remote"]
    assert s["published"] == 1 and s["publish_queue"] == 0
    with remote_only(server.url) as reader:
        assert_same(reader.get(b"q-0"), torch.full((10,), 0.0))
        assert reader.get(b"q-1") is None


def test_a_dropped_publish_leaves_the_servers_value(server):
    """The remote tier is not exact (``Rules.exact``): a put that does not reach it keeps the
    value published before (for content keys, the same features), where the disk would delete."""
    reached, go = threading.Event(), threading.Event()
    with remote_only(server.url) as a:
        a.put(b"k", torch.full((10,), 1.0))
    cache = remote_only(server.url, remote_queue_entries=1)
    tier = _procs.tier_slot(cache, "remote").tier
    real = tier._factory
    tier._factory = lambda: PausingClient(real(), reached, go)
    try:
        cache.put(b"other", torch.ones(3))
        assert reached.wait(30)  # the publisher is busy with "other"
        cache.put(b"k", torch.full((10,), 2.0))
        cache._demoter.join_queue()
        assert cache.stats()["remote"]["publish_dropped"] == 1
    finally:
        go.set()
        cache.close()
    with remote_only(server.url) as reader:
        assert_same(reader.get(b"k"), torch.full((10,), 1.0))


def test_in_never_asks_the_server(server):
    with remote_only(server.url) as a:
        a.put(b"k", torch.ones(3))
    with remote_only(server.url) as b:
        before = b.stats()["remote"]
        assert b"k" not in b  # only local tiers are asked (``Rules.local``)
        assert b.stats()["remote"] == before
        assert b.get(b"k") is not None


# -- auth, secrets, settings ---------------------------------------------------------------------
def test_password_from_url_is_used_and_never_shown(redis_bin, tmp_path, caplog):
    secret = "s3cr3t-pass"
    srv = _redis.RedisServer(redis_bin, tmp_path, None, "--requirepass", secret)
    try:
        url = f"redis://:{secret}@127.0.0.1:{srv.port}/0"
        t = torch.randn(3000)
        with remote_only(url) as a:
            a.put(b"k", t)
            assert secret not in repr(a) and "***" in repr(a)
            assert secret not in repr(a.config)
        with remote_only(url) as b:
            assert_same(b.get(b"k"), t)
        caplog.set_level(logging.DEBUG, logger="featcache")
        bad = f"redis://:wrong-{secret}@127.0.0.1:{srv.port}/0"
        with remote_only(bad, remote_breaker_failures=1) as c:
            assert c.get(b"k") is None
            assert c.stats()["remote"]["errors"] == 1
            assert secret not in str(c.stats())
        assert "unreachable" in caplog.text and secret not in caplog.text
    finally:
        srv.kill()


def test_redact_url():
    assert redact_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url("rediss://:pw@h:1") == "rediss://:***@h:1"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


@pytest.mark.parametrize("options, message", [
    ({"remote_url": "http://h:1"}, "remote_url must start"),
    ({"remote_url": "redis://h:1", "remote_prefix": "a{b}"}, "no braces"),
    ({"remote_url": "redis://h:1", "remote_tls_ca_file": "/ca.pem"}, "rediss://"),
    ({"remote_url": "redis://h:1", "remote_chunk_bytes": 100}, "at least 4KiB"),
    ({"remote_url": "redis://h:1", "remote_ttl_s": -1}, "remote_ttl_s"),
    ({"remote_url": "redis://h:1", "remote_queue_entries": 0}, "remote_queue_entries"),
])
def test_bad_remote_settings_raise(options, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig.create("cpu", **options)


def test_bad_url_error_hides_the_password():
    with pytest.raises(ValueError) as info:
        CacheConfig.create("cpu", remote_url="http://u:topsecret@h:1")
    assert "topsecret" not in str(info.value)


def test_no_remote_section_without_remote_url():
    with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes=0) as cache:
        assert "remote" not in cache.stats()
        with pytest.raises(ValueError):
            cache.count("remote", "x")


def test_missing_server_fails_when_required(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(_redis.BINARY_ENV, raising=False)
    monkeypatch.setenv(_redis.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception):
        _redis.redis_binary()
    monkeypatch.setenv(_redis.REQUIRE_ENV, "0")
    with pytest.raises(pytest.skip.Exception):
        _redis.redis_binary()


# -- the breaker alone ---------------------------------------------------------------------------
def test_breaker_state_machine():
    clock = FakeClock()
    b = Breaker(3, 10.0, clock)
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.allow()
    b.success()  # a success resets the count
    for _ in range(3):
        assert b.allow()
        b.failure()
    assert b.is_open and not b.allow() and b.opened == 1
    clock.now += 10
    assert b.allow()  # the trial
    assert not b.allow()  # only one trial at a time
    b.failure()
    assert b.opened == 2 and not b.allow()
    clock.now += 10
    assert b.allow()
    b.success()
    assert not b.is_open and b.allow() and b.refused == 3


# -- Redis Cluster (one node owning every slot) ---------------------------------------------------
def test_cluster_url_round_trip(redis_bin, tmp_path):
    srv = _redis.RedisServer(redis_bin, tmp_path, None, "--cluster-enabled", "yes",
                             "--cluster-config-file", str(tmp_path / "nodes.conf"),
                             "--cluster-port", str(_redis.free_port()))  # not port + 10000
    try:
        r = srv.client()
        r.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        for _ in range(500):  # the node takes a moment to call its state ok
            if b"cluster_state:ok" in r.execute_command("CLUSTER", "INFO"):
                break
            threading.Event().wait(0.01)
        url = f"redis-cluster://127.0.0.1:{srv.port}"
        want = values()
        with replica(url) as a:
            for key, t in want.items():
                a.put(key, t)
        with remote_only(url) as b:
            for key, t in want.items():
                assert_same(b.get(key), t)
            assert b.stats()["remote"]["hits"] == len(want)
    finally:
        srv.kill()


def test_metrics_export_the_remote_section(server):
    from featcache import metrics

    with remote_only(server.url) as cache:
        cache.put(b"k", torch.ones(10))
        cache.flush()
        cache.get(b"k")
        text = metrics.render(cache)
    assert "featcache_remote_hits_total 1" in text
    assert "featcache_remote_published_total 1" in text
    assert "# TYPE featcache_remote_breaker_open gauge" in text
    assert "featcache_remote_breaker_open 0" in text


def test_unexpected_client_errors_are_misses(server):
    class Broken:
        def __getattr__(self, name):
            raise ValueError("a client bug")

    with remote_only(server.url) as cache:
        _procs.tier_slot(cache, "remote").tier._factory = Broken
        assert cache.get(b"k") is None
        cache.put(b"k", torch.ones(3))
        cache.flush()
        s = cache.stats()["remote"]
        assert s["errors"] == 2 and s["publish_errors"] == 1


def test_featcache_stats_reports_the_remote_tier(redis_bin, tmp_path, capsys):
    from featcache.cli import main as cli

    srv = _redis.RedisServer(redis_bin, tmp_path, None, "--requirepass", "s3cret")
    try:
        url = srv.url.replace("redis://", "redis://:s3cret@")
        with replica(url, remote_prefix="model-a") as cache:
            for i in range(3):
                cache.put(bytes([i]) * 16, torch.randn(64, 256))
            cache.put(b"a fourth, tiny", torch.randn(4))
        with replica(url, remote_prefix="model-b") as cache:
            cache.put(b"k" * 16, torch.randn(4))
        assert cli(["stats", "--remote-url", url, "--remote-prefix", "model-a", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)["remote"]
        assert doc["entries"] == 4 and doc["prefix"] == "model-a:v2" and not doc["entries_capped"]
        assert doc["used_memory_bytes"] > 64 * 256 * 4 * 3
        assert "s3cret" not in json.dumps(doc)
        assert cli(["stats", "--remote-url", url, "--remote-prefix", "model-b"]) == 0
        out = capsys.readouterr().out
        assert "entries  1" in out and "s3cret" not in out
    finally:
        srv.kill()
    # the server gone: one line on stderr, exit 1, still no password
    assert cli(["stats", "--remote-url", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith("featcache stats: error: cannot read redis://:***@") and "s3cret" not in err
