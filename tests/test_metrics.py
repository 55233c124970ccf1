"""featcache.metrics: the text exposition format parses, its values are stats()'s, the lookup
histogram counts what instrument() timed, and prometheus_client (when installed) agrees."""

from __future__ import annotations

import math
import re

import pytest
import torch

from featcache import FeatureCache, metrics
from featcache.errors import FeatCacheError

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
SAMPLE = re.compile(rf"^({NAME})(\{{{LABEL}(?:,{LABEL})*\}})? (\S+)$")
LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def parse(text: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """Check the text format's structure; return (family -> type, (sample, labels) -> value)."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    helps: set[str] = set()
    samples: dict[tuple[str, frozenset], float] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert re.fullmatch(NAME, name) and name not in helps, line
            helps.add(name)
            current = name
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name == current and name not in types, "TYPE must follow its HELP, once"
            assert kind in ("counter", "gauge", "histogram", "untyped")
            types[name] = kind
        else:
            match = SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, labels, value = match.groups()
            assert current is not None and current in types
            family = current
            if types[family] == "histogram":
                assert name in (f"{family}_bucket", f"{family}_sum", f"{family}_count"), line
            else:
                assert name == family, f"{name} outside its family {family}"
            if types[family] == "counter":
                assert name.endswith("_total")
            pairs = frozenset(LABEL_PAIR.findall(labels or ""))
            assert (name, pairs) not in samples, f"duplicate sample {line!r}"
            samples[(name, pairs)] = float(value)
    return types, samples


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def cache(tmp_path):
    with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes="1MiB",
                      disk_path=tmp_path / "store", disk_bytes="16MiB") as c:
        yield c


def exercise(cache: FeatureCache) -> None:
    for i in range(3):
        cache.put(b"key-%d" % i, torch.full((8, 8), float(i)))
    cache.flush()
    assert cache.get(b"key-0") is not None
    assert cache.get(b"missing") is None
    with cache.lease(b"key-1") as t:
        assert t is not None
    cache.count("lmdeploy", "hits", 3)
    cache.count("lmdeploy", "misses")


def test_text_format_parses_and_values_are_stats(cache):
    exercise(cache)
    text = metrics.render(cache)
    stats = cache.stats()
    types, samples = parse(text)
    for tier in ("device", "host", "disk"):
        for field in ("hits", "misses", "evictions", "drops", "corrupt", "errors"):
            assert types[f"featcache_tier_{field}_total"] == "counter"
            assert value(samples, f"featcache_tier_{field}_total", tier=tier) == stats[tier][field]
        for field in ("entries", "bytes", "capacity_bytes"):
            assert types[f"featcache_tier_{field}"] == "gauge"
            assert value(samples, f"featcache_tier_{field}", tier=tier) == stats[tier][field]
    assert value(samples, "featcache_tier_pool_bytes", tier="host") == stats["host"]["pool_bytes"]
    assert types["featcache_tier_pool_bytes"] == "untyped"
    c = stats["cache"]
    assert value(samples, "featcache_lookups_total", result="hit") == c["hits"] == 2
    assert value(samples, "featcache_lookups_total", result="miss") == c["misses"] == 1
    for field in ("puts", "not_stored", "inflight_hits", "promotions", "worker_errors"):
        assert value(samples, f"featcache_{field}_total") == c[field]
    assert value(samples, "featcache_demote_queue_depth") == c["demote_queue"]
    assert value(samples, "featcache_disk_queue_depth") == c["disk_queue"]
    assert value(samples, "featcache_workers_alive") == 1
    assert value(samples, "featcache_lmdeploy_hits_total") == 3
    assert value(samples, "featcache_lmdeploy_misses_total") == 1
    assert "featcache_lookup_seconds" not in types  # only once instrumented


def test_integration_names_are_sanitised(cache):
    cache.count("my-integration", "odd event.name", 2)
    _, samples = parse(metrics.render(cache))
    assert value(samples, "featcache_my_integration_odd_event_name_total") == 2


def test_lookup_histogram_counts_what_instrument_timed(cache):
    exercise(cache)  # before instrument: not timed
    recorder = metrics.instrument(cache)
    assert metrics.instrument(cache) is recorder  # idempotent
    assert cache.get(b"key-2") is not None
    assert cache.get(b"nope") is None
    assert cache.get(b"nope-2") is None
    lease = cache.acquire(b"key-0")
    assert lease is not None
    lease.release()
    with cache.lease(b"key-1") as t:  # a lease is an acquire
        assert torch.equal(t, torch.full((8, 8), 1.0))
    with pytest.raises(TypeError):
        cache.get("not bytes")  # raises: not recorded
    types, samples = parse(metrics.render(cache))
    assert types["featcache_lookup_seconds"] == "histogram"
    counts = {
        (m, r): value(samples, "featcache_lookup_seconds_count", method=m, result=r)
        for m, r in (("get", "hit"), ("get", "miss"), ("acquire", "hit"))
    }
    assert counts == {("get", "hit"): 1, ("get", "miss"): 2, ("acquire", "hit"): 2}
    assert ("featcache_lookup_seconds_count",
            frozenset({("method", "acquire"), ("result", "miss")})) not in samples
    for (m, r), n in counts.items():
        buckets = sorted(
            (float(dict(labels)["le"]), v) for (name, labels), v in samples.items()
            if name == "featcache_lookup_seconds_bucket"
            and dict(labels).get("method") == m and dict(labels).get("result") == r
        )
        assert [le for le, _ in buckets] == [*metrics.BUCKETS, math.inf]
        assert all(a <= b for (_, a), (_, b) in zip(buckets, buckets[1:], strict=False))
        assert buckets[-1][1] == n
        assert value(samples, "featcache_lookup_seconds_sum", method=m, result=r) > 0
    metrics.uninstrument(cache)
    assert metrics.recorder_of(cache) is None and "get" not in vars(cache)
    assert "featcache_lookup_seconds" not in metrics.render(cache)
    assert cache.get(b"key-2") is not None


def test_instrument_touches_only_that_instance(tmp_path):
    with FeatureCache(device="cpu", host_bytes=0) as a, FeatureCache(device="cpu", host_bytes=0) as b:
        metrics.instrument(a)
        b.put(b"k", torch.ones(2))
        assert b.get(b"k") is not None
        assert metrics.recorder_of(b) is None
        assert metrics.recorder_of(a).snapshot() == []
        a.close()
        with pytest.raises(FeatCacheError):
            a.get(b"k")  # a closed cache still raises through the wrapper
        assert metrics.recorder_of(a).snapshot() == []


def test_escaping_and_numbers():
    fam = metrics.Family("featcache_x", "gauge", "a \\ help\nline", [
        metrics.Sample((("path", 'a"b\\c\nd'),), 1.5),
        metrics.Sample((("path", "inf"),), math.inf),
    ])
    text = metrics.render_families([fam])
    assert "# HELP featcache_x a \\\\ help\\nline\n" in text
    assert 'featcache_x{path="a\\"b\\\\c\\nd"} 1.5\n' in text
    assert 'featcache_x{path="inf"} +Inf\n' in text
    parse(text)
    with pytest.raises(ValueError):
        metrics.MetricsRecorder(buckets=(0.1, 0.01))


def test_prometheus_client_collector_agrees_with_render(cache):
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    exercise(cache)
    metrics.instrument(cache)
    cache.get(b"key-0")
    registry = prometheus_client.CollectorRegistry()
    collector = metrics.register(cache, registry)
    exported = prometheus_client.generate_latest(registry).decode()
    theirs = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(exported) for s in family.samples
        if not s.name.endswith("_created")
    }
    _, ours = parse(metrics.render(cache))
    for key, v in ours.items():
        if key[0].startswith("featcache_lookup_seconds"):
            continue  # labels of le differ in float formatting; checked below
        assert theirs[key] == v, key
    assert theirs[("featcache_lookup_seconds_count",
                   frozenset({("method", "get"), ("result", "hit")}))] == 1
    registry.unregister(collector)


def test_text_parses_with_prometheus_client_parser(cache):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    exercise(cache)
    metrics.instrument(cache)
    cache.get(b"key-0")
    names = {f.name for f in text_string_to_metric_families(metrics.render(cache))}
    assert {"featcache_tier_hits", "featcache_lookup_seconds", "featcache_lmdeploy_hits"} <= names


def test_model_processes_are_exported_by_rank_beside_this_process(cache):
    prometheus_client = pytest.importorskip("prometheus_client")
    exercise(cache)
    ranks = [{"rank": r, "pid": 100 + r,
              "stats": {"cache": {"hits": 3 + r, "misses": 1},
                        "lmdeploy": {"vision_images": 5, "vision_skipped": 7 + r}}}
             for r in (0, 1)]
    registry = prometheus_client.CollectorRegistry()
    collector = metrics.register(cache, registry, processes=lambda: ranks)
    _, samples = parse(prometheus_client.generate_latest(registry).decode())
    assert samples[("featcache_model_lmdeploy_vision_skipped_total",
                    frozenset({("rank", "1")}))] == 8
    assert samples[("featcache_model_lookups_total",
                    frozenset({("rank", "0"), ("result", "hit")}))] == 3
    assert samples[("featcache_model_lmdeploy_vision_images_total", frozenset({("rank", "0")}))] == 5
    own = cache.stats()["cache"]["hits"]  # this process's families keep their names and labels
    assert samples[("featcache_lookups_total", frozenset({("result", "hit")}))] == own
    registry.unregister(collector)


def test_a_failing_model_process_read_costs_only_its_families(cache, caplog):
    prometheus_client = pytest.importorskip("prometheus_client")

    def gone() -> list:
        raise ConnectionRefusedError("engine gone")

    registry = prometheus_client.CollectorRegistry()
    collector = metrics.register(cache, registry, processes=gone)
    text = prometheus_client.generate_latest(registry).decode()
    assert "featcache_lookups_total" in text and "featcache_model_" not in text
    assert "engine gone" in caplog.text
    registry.unregister(collector)
