"""Prometheus metrics of a ``FeatureCache``: counters and gauges from ``stats()``, plus a latency
histogram of lookups once the cache is ``instrument``-ed.

    from featcache import metrics
    metrics.instrument(cache)        # optional: times cache.get / cache.acquire (and lease)
    text = metrics.render(cache)     # Prometheus text exposition format 0.0.4, no dependency
    metrics.register(cache)          # or: a collector in prometheus_client's registry

What is exported (all per process, since the cache was built), for each tier of the chain
(``featcache.core.chain.KINDS``) as its kind's ``Report`` says:

- a labelled tier (device, host, disk): ``featcache_tier_{hits,misses,evictions,drops,corrupt,
  errors}_total{tier}`` counters and ``featcache_tier_{entries,bytes,capacity_bytes}{tier}``
  gauges (``stats()[tier]``; other numbers a tier reports are exported as
  ``featcache_tier_<name>{tier}``, untyped);
- a tier under its own prefix (remote, present when a ``remote_url`` is set):
  ``featcache_<tier>_<name>_total`` counters (hits, misses, corrupt, incomplete, errors, timeouts,
  published, publish_dropped, bytes_read, ...) and ``featcache_<tier>_<name>`` gauges for the
  numbers its report names (breaker_open, enabled) and its writer's queue (publish_queue);
- ``featcache_lookups_total{result="hit"|"miss"}``, ``featcache_{puts,not_stored,inflight_hits,
  promotions,worker_errors}_total`` counters, ``featcache_<queue>_depth`` gauges of the queues in
  ``stats()["cache"]`` (the demote queue, and a writer's queue its report puts there:
  ``featcache_disk_queue_depth``) and ``featcache_workers_alive`` (``stats()["cache"]``; other
  keys: ``featcache_<name>``, untyped);
- ``featcache_<section>_<event>_total`` counters for each integration section of ``stats()``
  (e.g. ``featcache_lmdeploy_hits_total`` from ``stats()["lmdeploy"]["hits"]``);
- ``featcache_hit_ratio`` (lookups that hit, since the cache was made) and, for a section that
  counts hits, ``featcache_<section>_hit_ratio`` gauges (``featcache stats --url`` reads them
  back with the counters; Prometheus users may prefer ``rate(hits)/rate(lookups)`` windows);
- other processes' caches (``register(..., processes=)``: the model processes of lmdeploy's mp
  engine and tp ranks, ``featcache.lmdeploy.model_stats``): the same families named
  ``featcache_model_*`` and labelled ``rank`` (e.g.
  ``featcache_model_lmdeploy_vision_images_total{rank="0"}``), read afresh at every scrape;
- ``featcache_lookup_seconds{method="get"|"acquire",result="hit"|"miss"}``: a histogram of the
  time ``get``/``acquire`` took in the caller's thread (a ``lease`` is an ``acquire``). Lookups
  return without waiting for the device copy of a promoted entry (it is ordered on the caller's
  stream), so this is the time the caller's thread spent, not the time until the data is on the
  GPU. Only present after ``instrument(cache)``.

Invariants: every number comes from one ``stats()`` call (and one histogram snapshot) per
render/collect, so the values of one scrape are those ``stats()`` returned; metric names and label
values are sanitised/escaped as the text format requires; nothing here changes the cache's
behaviour except ``instrument``, which only wraps the two lookup methods of that instance.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .core.chain import KINDS, Report
from .tiers.base import STAT_FIELDS

if TYPE_CHECKING:
    from .core.cache import FeatureCache

log = logging.getLogger("featcache")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Lookup latency buckets, seconds: a device hit takes microseconds, a disk hit milliseconds.
BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0,
)
_RECORDER_ATTR = "_featcache_metrics_recorder"

Kind = Literal["counter", "gauge", "histogram", "untyped"]
Labels = tuple[tuple[str, str], ...]

_TIER_GAUGES = {
    "entries": "Entries the tier holds.",
    "bytes": "Bytes the tier holds (what its budget counts).",
    "capacity_bytes": "The tier's byte budget (0: disabled).",
}
_TIER_COUNTERS = {
    "hits": "Lookups the tier answered.",
    "misses": "Lookups the tier did not answer.",
    "evictions": "Entries the tier evicted to stay within its budget.",
    "drops": "Writes to the tier dropped (queue full, failed transaction).",
    "corrupt": "Stored values that failed validation (dropped, served as misses).",
    "errors": "Failures of the tier's storage (e.g. LMDB errors), each a miss or a drop.",
}
_CACHE_COUNTERS = {
    "puts": "put() calls that stored the entry in at least one tier.",
    "not_stored": "put() calls whose entry fit no tier.",
    "inflight_hits": "Lookups answered from entries still on their way to a lower tier.",
    "promotions": "Entries copied up from a lower tier to the device.",
    "worker_errors": "Background jobs (demotion, lower-tier writes) that raised.",
}
_CACHE_GAUGES = {
    "demote_queue": ("featcache_demote_queue_depth", "Device-to-host copies waiting."),
    "workers_alive": ("featcache_workers_alive", "1 if every background thread is alive."),
}
_SKIPPED_CACHE = ("gets", "hits", "misses")  # exported as featcache_lookups_total{result}


@dataclass(frozen=True)
class Sample:
    labels: Labels
    value: float


@dataclass(frozen=True)
class HistogramSample:
    labels: Labels
    buckets: tuple[tuple[float, int], ...]  # (upper bound, cumulative count); last is +Inf
    total: float
    count: int


@dataclass
class Family:
    """One metric family: its name (a counter's ends in ``_total``), type, help and samples."""

    name: str
    kind: Kind
    help: str
    samples: list[Sample] = field(default_factory=list)
    histograms: list[HistogramSample] = field(default_factory=list)


# -- lookup latency ------------------------------------------------------------------------------
class _Histogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, the last is (max bound, +Inf)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        i = 0
        while i < len(self.bounds) and seconds > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.total += seconds

    def snapshot(self, labels: Labels) -> HistogramSample:
        cumulative, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return HistogramSample(labels, tuple(cumulative), self.total, running)


class MetricsRecorder:
    """Lookup latencies by (method, result), thread-safe. ``instrument`` installs one."""

    def __init__(self, buckets: Sequence[float] = BUCKETS) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] <= 0:
            raise ValueError("buckets must be positive, increasing and unique")
        self.buckets = tuple(float(b) for b in buckets)
        self._lock = threading.Lock()
        self._histograms: dict[tuple[str, str], _Histogram] = {}

    def observe(self, method: str, result: str, seconds: float) -> None:
        with self._lock:
            histogram = self._histograms.get((method, result))
            if histogram is None:
                histogram = self._histograms[(method, result)] = _Histogram(self.buckets)
            histogram.observe(seconds)

    def snapshot(self) -> list[HistogramSample]:
        """One sample per (method, result) seen, sorted; cumulative buckets ending at +Inf."""
        with self._lock:
            return [
                h.snapshot((("method", method), ("result", result)))
                for (method, result), h in sorted(self._histograms.items())
            ]


def instrument(cache: FeatureCache, buckets: Sequence[float] = BUCKETS) -> MetricsRecorder:
    """Time ``cache.get`` and ``cache.acquire`` (so also ``cache.lease``) of this instance.

    Wraps the two methods by setting instance attributes that shadow the class's: no other
    instance and no code of the cache changes, and the wrappers only add two clock reads and a
    locked counter update per call. A call that raises is not recorded. Idempotent: a second call
    returns the recorder already installed. ``uninstrument`` removes the wrappers.
    """
    existing = recorder_of(cache)
    if existing is not None:
        return existing
    recorder = MetricsRecorder(buckets)
    for method in ("get", "acquire"):
        setattr(cache, method, _timed(getattr(cache, method), method, recorder))
    setattr(cache, _RECORDER_ATTR, recorder)
    return recorder


def uninstrument(cache: FeatureCache) -> None:
    """Remove what ``instrument`` installed (the histogram goes with it)."""
    for name in ("get", "acquire", _RECORDER_ATTR):
        vars(cache).pop(name, None)


def recorder_of(cache: FeatureCache) -> MetricsRecorder | None:
    """The recorder ``instrument`` installed on ``cache``, if any."""
    recorder = vars(cache).get(_RECORDER_ATTR)
    return recorder if isinstance(recorder, MetricsRecorder) else None


def _timed(lookup: Callable[[bytes], Any], method: str, recorder: MetricsRecorder) -> Callable[[bytes], Any]:
    @functools.wraps(lookup)
    def timed(key: bytes) -> Any:
        started = time.perf_counter()
        found = lookup(key)
        recorder.observe(method, "miss" if found is None else "hit", time.perf_counter() - started)
        return found

    return timed


# -- families ------------------------------------------------------------------------------------
def families(cache: FeatureCache) -> list[Family]:
    """Every metric family of ``cache`` from one ``stats()`` call (and its recorder, if any)."""
    out = {f.name: f for f in stats_families(cache.stats())}
    recorder = recorder_of(cache)
    if recorder is not None:
        out["featcache_lookup_seconds"] = Family(
            "featcache_lookup_seconds", "histogram",
            "Time get()/acquire() took in the caller's thread, by method and result.",
            histograms=recorder.snapshot(),
        )
    return list(out.values())


def process_families(processes: Iterable[dict[str, Any]]) -> list[Family]:
    """The families of other processes' caches (``featcache.lmdeploy.model_stats``: dicts with
    ``rank`` and ``stats``, a ``FeatureCache.stats()``), named ``featcache_model_*`` (never a
    family of this process's own cache) and labelled ``rank``."""
    out: dict[str, Family] = {}
    for process in processes:
        rank = (("rank", str(process["rank"])),)
        for family in stats_families(process["stats"]):
            name = "featcache_model_" + family.name.removeprefix("featcache_")
            merged = out.setdefault(name, Family(name, family.kind,
                                                 family.help + " (a model process, by rank)"))
            merged.samples.extend(Sample(rank + s.labels, s.value) for s in family.samples)
    return list(out.values())


def stats_families(stats: dict[str, dict[str, Any]]) -> list[Family]:
    """The families of one ``FeatureCache.stats()`` result (no histogram: that is the recorder's)."""
    out: dict[str, Family] = {}

    def add(name: str, kind: Kind, help_text: str, value: float, labels: Labels = ()) -> None:
        family = out.setdefault(name, Family(name, kind, help_text))
        family.samples.append(Sample(labels, value))

    cache_gauges = dict(_CACHE_GAUGES)
    for tier in KINDS:
        report = tier.rules.report
        if report.queue is not None and report.queue[0] == "cache":
            key = report.queue[1]
            cache_gauges[key] = (f"featcache_{_sanitise(key)}_depth", report.queue_help)
        tier_stats = stats.get(tier.name)
        if tier_stats is not None:
            (_labelled if report.labelled else _prefixed)(add, tier.name, report, tier_stats)

    cache_stats = stats.get("cache", {})
    for result, key in (("hit", "hits"), ("miss", "misses")):
        add("featcache_lookups_total", "counter", "get()/acquire() calls, by result.",
            cache_stats.get(key, 0), (("result", result),))
    lookups = cache_stats.get("hits", 0) + cache_stats.get("misses", 0)
    add("featcache_hit_ratio", "gauge", "Share of get()/acquire() calls that hit, since the cache "
        "was made (0 before the first).", cache_stats.get("hits", 0) / lookups if lookups else 0.0)
    for name, value in cache_stats.items():
        if name in _SKIPPED_CACHE:
            continue
        if name in _CACHE_COUNTERS:
            add(f"featcache_{name}_total", "counter", _CACHE_COUNTERS[name], value)
        elif name in cache_gauges:
            metric, help_text = cache_gauges[name]
            add(metric, "gauge", help_text, value)
        else:
            add(f"featcache_{_sanitise(name)}", "untyped", f"stats()['cache'][{name!r}].", value)

    core = {"cache", *(tier.name for tier in KINDS)}
    for section, events in stats.items():
        if section in core:
            continue
        for event, value in events.items():
            metric = f"featcache_{_sanitise(section)}_{_sanitise(event)}_total"
            if metric not in out:  # an integration never overrides the cache's own families
                add(metric, "counter", f"Events counted by the {section} integration: {event}.",
                    value)
        seen = events.get("hits", 0) + events.get("misses", 0)
        if "hits" in events and f"featcache_{_sanitise(section)}_hit_ratio" not in out:
            add(f"featcache_{_sanitise(section)}_hit_ratio", "gauge",
                f"Share of the {section} integration's lookups that hit (0 before the first).",
                events["hits"] / seen if seen else 0.0)
    return list(out.values())


Add = Callable[[str, Kind, str, float, Labels], None]


def _labelled(add: Add, tier: str, report: Report, tier_stats: dict[str, int]) -> None:
    """A tier in the shared ``featcache_tier_*`` families, labelled ``tier``."""
    labels: Labels = (("tier", tier),)
    for name in STAT_FIELDS:
        if name in tier_stats:
            add(f"featcache_tier_{name}_total", "counter",
                _TIER_COUNTERS.get(name, f"The tier's {name} count."), tier_stats[name], labels)
    for name, help_text in _TIER_GAUGES.items():
        if name in tier_stats:
            add(f"featcache_tier_{name}", "gauge", help_text, tier_stats[name], labels)
    for name, value in tier_stats.items():
        if name not in STAT_FIELDS and name not in _TIER_GAUGES:
            add(f"featcache_tier_{_sanitise(name)}", "untyped",
                f"stats()[tier][{name!r}] of the tier.", value, labels)


def _prefixed(add: Add, tier: str, report: Report, tier_stats: dict[str, int]) -> None:
    """A tier under its own prefix: ``featcache_<tier>_<name>`` gauges for the numbers its report
    names (and its writer's queue, when reported in its section), counters for the rest."""
    gauges = dict(report.gauges)
    if report.queue is not None and report.queue[0] == tier:
        gauges[report.queue[1]] = report.queue_help
    prefix = f"featcache_{_sanitise(tier)}"
    for name, value in tier_stats.items():
        if name in gauges:
            add(f"{prefix}_{_sanitise(name)}", "gauge", gauges[name], value, ())
        else:
            add(f"{prefix}_{_sanitise(name)}_total", "counter",
                f"Events counted by the {tier} tier: {name}.", value, ())


# -- text exposition format ----------------------------------------------------------------------
def render(cache: FeatureCache) -> str:
    """The cache's metrics in Prometheus' text exposition format (``CONTENT_TYPE``)."""
    return render_families(families(cache))


def render_families(fams: Iterable[Family]) -> str:
    lines: list[str] = []
    for family in fams:
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for sample in family.samples:
            lines.append(f"{family.name}{_labels(sample.labels)} {_number(sample.value)}")
        for h in family.histograms:
            for bound, count in h.buckets:
                le = (("le", _number(bound)),)
                lines.append(f"{family.name}_bucket{_labels(h.labels + le)} {count}")
            lines.append(f"{family.name}_sum{_labels(h.labels)} {_number(h.total)}")
            lines.append(f"{family.name}_count{_labels(h.labels)} {h.count}")
    return "\n".join(lines) + "\n"


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels) + "}"


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _sanitise(name: str) -> str:
    """A metric-name fragment: [a-zA-Z0-9_] only, lower case."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name).lower() or "_"


# -- prometheus_client ---------------------------------------------------------------------------
class FeatCacheCollector:
    """A ``prometheus_client`` collector: each scrape reads ``families(cache)`` afresh, and, given
    ``processes`` (a call returning ``featcache.lmdeploy.model_stats``-style dicts), the
    ``process_families`` of the processes that run the model. A failing ``processes`` call costs
    only those families (logged)."""

    def __init__(self, cache: FeatureCache,
                 processes: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.cache = cache
        self.processes = processes

    def _families(self) -> list[Family]:
        out = families(self.cache)
        if self.processes is not None:
            try:
                out += process_families(self.processes())
            except Exception as e:  # an engine still starting, or gone: its families only
                log.warning("featcache: no counters from the model processes this scrape (%s: %s)",
                            type(e).__name__, e)
        return out

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            UnknownMetricFamily,
        )

        classes = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
                   "untyped": UnknownMetricFamily}
        for family in self._families():
            if family.kind == "histogram":
                names = [k for k, _ in family.histograms[0].labels] if family.histograms else []
                metric = HistogramMetricFamily(family.name, family.help, labels=names)
                for h in family.histograms:
                    metric.add_metric(
                        [v for _, v in h.labels],
                        [(_number(bound), count) for bound, count in h.buckets],
                        h.total,
                    )
            else:
                names = [k for k, _ in family.samples[0].labels] if family.samples else []
                metric = classes[family.kind](family.name, family.help, labels=names)
                for sample in family.samples:
                    metric.add_metric([v for _, v in sample.labels], sample.value)
            yield metric


def register(cache: FeatureCache, registry: Any = None,
             processes: Callable[[], list[dict[str, Any]]] | None = None) -> FeatCacheCollector:
    """Register a collector of ``cache``'s metrics (and ``processes``': see ``FeatCacheCollector``)
    in ``registry`` (default: prometheus_client's global ``REGISTRY``, what an app serves with
    prometheus_client's defaults). Needs ``prometheus_client`` (raises ``ImportError`` without
    it; ``render`` needs nothing). Returns the collector, for ``registry.unregister``."""
    import prometheus_client

    collector = FeatCacheCollector(cache, processes)
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector
