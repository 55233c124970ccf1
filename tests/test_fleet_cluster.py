"""A fleet's shared tier on a real Redis Cluster under faults (issue 43).

Three primaries with a replica each, started on loopback by ``tests/_cluster.py`` (every node
behind a TCP proxy the test controls), and two featcache replicas in their own processes
(``tests/_fleet_procs.py``), each doing gets and, on a miss, a "compute" and a put, all the time.
The faults, one after the other on the same fleet: a primary killed (failover to its replica), the
old primary back, a slot range resharded while traffic runs (MOVED/ASK/TRYAGAIN), one primary
unreachable (its proxy blackholed: a partition between the clients and that node), every node
killed and started again.

Required at every step: no wrong tensor served, no exception out of ``get``/``put``, every get a
hit or a counted miss and every put published or counted as a failed or dropped publish, no get
slower than the tier's deadline allows, the key secret the same on both replicas and on the
cluster, and the hit ratio back within a bound after each fault (measured: docs/scale.md has the
figures). Without redis-server or redis-cli the tests skip (fail with FEATCACHE_REQUIRE_REDIS=1).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

try:
    import _cluster
    import _fleet_procs
    import _redis
    from _fleet import RECOVERED, RECOVERY_BOUND_S, Fleet
except ImportError:  # tests/ became a package
    from tests import _cluster, _fleet_procs, _redis
    from tests._fleet import RECOVERED, RECOVERY_BOUND_S, Fleet

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    binary = _redis.redis_binary()
    cli = _cluster.cli_binary()
    c = _cluster.RedisCluster(binary, cli, Path(tmp_path_factory.mktemp("cluster")))
    yield c
    c.close()


@pytest.fixture(scope="module")
def fleet(cluster):
    f = Fleet(cluster.url)
    yield f
    f.close()


FIGURES: dict[str, dict[str, float]] = {}  # what each fault cost, printed at the end (-s)


def _record(name: str, **figures: float) -> None:
    FIGURES[name] = figures
    print(f"\nfleet figure {name}: " + ", ".join(f"{k}={v:.3g}" for k, v in figures.items()))


def _owner_of_most_keys(cluster: _cluster.RedisCluster) -> tuple[str, _cluster.Node]:
    """The primary whose slots hold the most of the fleet's entries (heads)."""
    best = max(cluster.primaries(),
               key=lambda p: sum(1 for k in cluster.client(p[1]).scan_iter(match="*:h", count=1000)))
    return best


def _secret_everywhere(fleet: Fleet) -> str:
    fleet.collect()
    (secret,) = {r.secret for r in fleet.replicas}
    assert _fleet_procs.server_secret(fleet.url) == secret
    return secret


def test_steady_state(fleet):
    t0 = time.monotonic()
    took = fleet.wait_recovered(t0, bound_s=60)  # the replicas' first misses publish the set
    time.sleep(1.0)
    figures = fleet.check()
    assert fleet.ratio(time.monotonic() - 1.0, time.monotonic()) >= RECOVERED
    _secret_everywhere(fleet)
    _record("steady", warm_s=took, max_get_ms=figures["max_get_ms"], ratio=figures["ratio"])


def test_primary_killed_fails_over_to_its_replica(fleet, cluster):
    primary_id, primary = _owner_of_most_keys(cluster)
    replica = cluster.replica_of(primary_id)
    fleet.collect()
    t0 = time.monotonic()
    cluster.kill(primary)
    failover_s = cluster.wait_primary(replica)
    took = fleet.wait_recovered(t0)
    time.sleep(0.5)
    figures = fleet.check(t0)
    # the dead shard's keys miss; the other shards' keep hitting (a breaker per node)
    during = fleet.ratio(t0 + 0.2, t0 + failover_s)
    assert during >= 0.3, fleet.timeline(t0, time.monotonic())
    cluster.dead_primary = primary  # type: ignore[attr-defined]  (the next test starts it again)
    _record("failover", failover_s=failover_s, recovered_s=took, ratio_during=during,
            max_get_ms=figures["max_get_ms"])


def test_old_primary_back_as_a_replica(fleet, cluster):
    node = getattr(cluster, "dead_primary", None)
    if node is None:
        pytest.skip("the failover test did not run")
    fleet.collect()
    t0 = time.monotonic()
    cluster.start(node)
    rejoin_s = cluster.wait_ok()
    took = fleet.wait_recovered(t0)
    time.sleep(1.0)
    figures = fleet.check(t0)
    assert not cluster.topology()[cluster.node_id(node)]["primary"]  # it came back a replica
    _secret_everywhere(fleet)
    _record("old_primary_back", rejoin_s=rejoin_s, recovered_s=took, ratio=figures["ratio"],
            max_get_ms=figures["max_get_ms"])


def test_slots_resharded_while_traffic_runs(fleet, cluster):
    source_id, source = _owner_of_most_keys(cluster)
    target_id = next(nid for nid, _ in cluster.primaries() if nid != source_id)
    before = cluster.topology()[source_id]["slots"]
    fleet.collect()
    t0 = time.monotonic()
    proc = cluster.reshard(source_id, target_id, 2000)
    assert proc.wait(120) == 0, (cluster.workdir / "reshard.log").read_text()[-2000:]
    reshard_s = time.monotonic() - t0
    cluster.wait_ok()
    took = fleet.wait_recovered(t0)
    time.sleep(1.0)
    figures = fleet.check(t0)
    assert cluster.topology()[source_id]["slots"] != before
    during = fleet.ratio(t0, t0 + reshard_s)
    assert during >= RECOVERED  # entries move with their slots: MOVED and ASK are followed
    _record("reshard_2000_slots", reshard_s=reshard_s, recovered_s=took, ratio_during=during,
            max_get_ms=figures["max_get_ms"])


def test_one_node_unreachable(fleet, cluster):
    _, primary = _owner_of_most_keys(cluster)
    fleet.collect()
    t0 = time.monotonic()
    assert primary.proxy is not None
    primary.proxy.blackhole()  # clients' packets to it vanish; the cluster bus still works
    time.sleep(3.0)
    fleet.collect()
    during = fleet.ratio(t0 + 0.5, time.monotonic())
    gets_during = len(fleet.gets_between(t0 + 0.5, time.monotonic()))
    t_heal = time.monotonic()
    primary.proxy.heal()
    took = fleet.wait_recovered(t_heal)
    time.sleep(0.5)
    figures = fleet.check(t0)
    assert during >= 0.3, fleet.timeline(t0, time.monotonic())
    assert gets_during >= 100  # skipped, not waited for: the replicas kept serving
    _record("partition_3s", recovered_s=took, ratio_during=during,
            gets_per_s_during=gets_during / (t_heal - t0 - 0.5), max_get_ms=figures["max_get_ms"])


def test_every_node_down_and_back(fleet, cluster, tmp_path):
    secret = _secret_everywhere(fleet)
    fleet.collect()
    t0 = time.monotonic()
    for node in cluster.nodes:
        cluster.kill(node)
    time.sleep(2.0)
    t_up = time.monotonic()
    for node in cluster.nodes:
        cluster.start(node, wait=False)
    up_s = cluster.wait_ok(60)
    took = fleet.wait_recovered(t_up, bound_s=RECOVERY_BOUND_S + 10)
    time.sleep(1.0)
    figures = fleet.check(t0)
    assert fleet.ratio(t0 + 0.5, t_up) < 0.1  # nothing to hit while it was gone...
    # ...and it came back empty (no persistence): what hits now was published again, and so was
    # the fleet's key secret, by the replicas' publishers, before anyone could make up another
    deadline = time.monotonic() + 10
    while _fleet_procs.server_secret(cluster.url) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _secret_everywhere(fleet) == secret
    s = fleet.replicas[0].stats
    assert s["secret_restored"] + fleet.replicas[1].stats["secret_restored"] >= 1
    _record("all_down_2s", cluster_ok_s=up_s, recovered_s=took, max_get_ms=figures["max_get_ms"])

    # a replica that starts now (no store of its own) keys like the fleet and hits its entries
    newcomer = Fleet(cluster.url, n=1)
    try:
        t1 = time.monotonic()
        newcomer.wait_recovered(t1)
        newcomer.check(t1)
        assert newcomer.replicas[0].secret == secret
    finally:
        newcomer.close()


def test_close_drains_and_the_books_balance(fleet):
    fleet.close()
    for r in fleet.replicas:
        s = r.stats
        assert not r.wrong and not r.exceptions
        assert s["misses"] == sum(not hit for _, hit, _ in r.gets)
        assert s["published"] + s["publish_errors"] + s["publish_dropped"] == r.puts
        assert s["publish_queue"] == 0
    print("\nfleet figures:", FIGURES)


def test_a_server_that_lost_the_key_secret_gets_it_back(tmp_path):
    """One server (no cluster needed): flushed, it gets the fleet's secret again from the next
    publish that is due to check; holding another secret, that is counted, never adopted."""
    import torch

    from featcache import FeatureCache
    from featcache.tiers import remote

    server = _redis.RedisServer(_redis.redis_binary(), tmp_path)
    try:
        with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, remote_url=server.url) as cache:
            tier = next(s.tier for s in cache._chain.below if s.tier.name == "remote")
            assert isinstance(tier, remote.RemoteTier)
            secret = cache.hasher.secret
            assert secret is not None
            r = server.client()
            assert r.get("featcache:key-secret") == secret.hex().encode()
            r.flushall()
            tier._secret_due = 0.0  # due now (else after an outage, or SECRET_CHECK_S)
            cache.put(b"a", torch.ones(3))
            cache.flush()
            assert r.get("featcache:key-secret") == secret.hex().encode()
            assert cache.stats()["remote"]["secret_restored"] == 1
            r.set("featcache:key-secret", "ab" * 32)
            tier._secret_due = 0.0
            cache.put(b"b", torch.ones(3))
            cache.flush()
            assert cache.stats()["remote"]["secret_mismatch"] == 1
            assert cache.hasher.secret == secret and r.get("featcache:key-secret") == b"ab" * 32
    finally:
        server.kill()


def test_a_port_taken_between_its_pick_and_its_bind_is_picked_again(tmp_path, monkeypatch):
    """The harness itself: ``free_port`` picks a port it cannot hold, so another process may bind
    it first (a CI run of 2026-12-04 lost 7 tests to a bus port taken so). The node then exits
    with "Address already in use", and the cluster is formed again on new ports."""
    import socket

    binary, cli = _redis.redis_binary(), _cluster.cli_binary()
    real = _redis.free_port
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([real(), taken])  # the first node's port, then its bus port: already bound
        monkeypatch.setattr(_redis, "free_port", lambda: next(picks, None) or real())
        c = _cluster.RedisCluster(binary, cli, tmp_path, primaries=3, replicas=0, proxied=False)
        try:
            assert taken not in {n.bus_port for n in c.nodes}
            assert len(c.live()) == 3 and c.client(c.nodes[0]).ping()
        finally:
            c.close()
    assert any("Address already in use" in p.read_text() for p in tmp_path.glob("node-*/redis.log"))


def test_a_single_servers_taken_port_is_picked_again(tmp_path, monkeypatch):
    """The same for ``_redis.RedisServer``, whose port the harness picks where the test does not."""
    import socket

    binary = _redis.redis_binary()
    real = _redis.free_port
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken])
        monkeypatch.setattr(_redis, "free_port", lambda: next(picks, None) or real())
        server = _redis.RedisServer(binary, tmp_path)
        try:
            assert server.port != taken and server.client().ping()
        finally:
            server.kill()
