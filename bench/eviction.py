"""Eviction policies (lru, value, admit) replayed through FeatureCache's device tier, on the CPU.

    PYTHONPATH=$PWD python bench/eviction.py [--set dev|adversaries|held-out|all|none] [--scale F]
                                             [--budgets 1GiB,4GiB,16GiB] [--policies lru,value,admit]
                                             [--ops-entries N] [--json OUT] [--dry-run]

The traces (bench/eviction_traces.py): the first set (zipf, chat, chat-crowd, scan, uniform) and
the second (documents: 90% one-off images, 10% retry bursts; chat-server: Poisson sessions, 200
live, 1-4 images resent for 2-20 turns, 2B/26B 70/30; catalog-scan: Zipf(0.8) over 100,000 images
with a scan of 20,000 new ones; twice-far and twice-near: small cheap images used often and large
26B images each used exactly twice, 15-25k or 500-3000 requests apart). ``--set dev`` replays
them at the seeds the policies were developed against; ``--set adversaries`` the adversaries of
admission written after the policy (``eviction_traces.ADVERSARIES``: moving popularity, the LRU
stack model, ...; one of them, lru-stack-deep, found a loss that was then fixed on it);
``--set held-out`` all of them at other seeds, plus shapes written before any tuning
(``eviction_traces.UNSEEN``), reported apart.

Each trace is replayed at each budget through a new ``FeatureCache(device="cpu", host_bytes=0,
eviction=policy)`` (the device tier only, its own books: nothing re-implemented here): a request
``acquire``s its image's key; a hit is leased until 4 requests later (requests in flight), a miss
is ``put`` with its cost (``put(..., cost_s=)``, as the lmdeploy hook records its vision time).
Sizes are divided by ``SCALE`` (4096: the features' bytes and the budgets alike, so that the CPU
holds them; every policy's order depends on bytes only through ratios). Reported: the vision
seconds the hits saved, each policy's against LRU's, the ceiling (what an unbounded cache saves)
and the worst cell of each set. The target: the admission policy within 2% of LRU in every
cell (``GAIN_FLOOR``).

Then the books' cost per call holding ``--ops-entries`` entries (100,000): ``touch`` (a hit),
``add`` (after the ``evict_for`` that made room), ``evict_for`` making room for a new key (one
victim, its miss counted and judged) and ``evict_one``; each the best over rounds of 2000 calls
(per-call timer overhead subtracted), on fresh keys. Target: <= 2 us (``OP_TARGET_US``).
--dry-run: a tiny run (the development set at 2% of its length, budgets of 64, 256 and 1024 MiB,
1000 entries for the costs) that checks the plumbing, not the targets.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # featcache, bench.lib

import torch  # noqa: E402

from bench.eviction_traces import (  # noqa: E402,F401 - re-exported: the traces' generators
    ADVERSARIES,
    ADVERSARY_SEED,
    CLASSES,
    DEV_SEED,
    HELD_OUT_SEED,
    ISSUE30,
    ISSUE44,
    UNSEEN,
    Shape,
    Trace,
    adversaries,
    catalog_trace,
    chat_trace,
    crowd_trace,
    dev,
    documents_trace,
    held_out,
    scan_trace,
    sessions_trace,
    twice_trace,
    uniform_trace,
    zipf_trace,
)
from bench.lib.results import write_report  # noqa: E402
from featcache import FeatureCache  # noqa: E402
from featcache.core.lease import Lease  # noqa: E402
from featcache.eviction import books_for  # noqa: E402
from featcache.sizes import parse_bytes  # noqa: E402

SCALE = 4096  # bytes of the replay per byte of features (sizes and budgets alike)
LEASES = 4  # requests in flight: their hits stay leased
POLICIES = ("lru", "value", "admit")
NEW = "admit"  # the policy issue 44 asks for
GAIN_FLOOR, OP_TARGET_US = -0.02, 2.0
TRACES = {s.name: s for s in ISSUE30 + ISSUE44 + UNSEEN + ADVERSARIES}


@dataclass
class Replay:
    trace: str
    budget_bytes: int
    policy: str
    requests: int
    hits: int
    saved_s: float  # vision seconds the hits saved
    spent_s: float  # vision seconds the misses cost
    not_stored: int  # puts the device tier did not keep (not admitted, or no room)
    evictions: int
    seconds: float  # the replay's wall time

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests


def replay(trace: Trace, budget_bytes: int, policy: str, leases: int = LEASES) -> Replay:
    """Replay ``trace`` through a FeatureCache of ``policy`` whose device tier has ``budget_bytes``
    (scaled by ``SCALE``, as the trace's sizes): a hit is leased for ``leases`` requests, a miss
    is put with its cost."""
    tensors: dict[int, torch.Tensor] = {}
    held: deque[Lease | None] = deque()
    hits, saved, spent, refused = 0, 0.0, 0.0, 0
    began = time.perf_counter()
    with FeatureCache(device="cpu", device_bytes=max(1, budget_bytes // SCALE), host_bytes=0,
                      disk_path=None, eviction=policy) as cache:
        for i, (key, nbytes, cost) in enumerate(zip(trace.keys, trace.nbytes, trace.costs,
                                                    strict=True)):
            lease = cache.acquire(key)
            if lease is not None:
                hits += 1
                saved += cost
            else:
                spent += cost
                size = max(1, nbytes // SCALE)
                tensor = tensors.get(size)
                if tensor is None:
                    tensor = tensors[size] = torch.zeros(size, dtype=torch.uint8)
                cache.put(key, tensor, cost_s=cost)
                refused += key not in cache  # not admitted (or no room beside the leases)
            held.append(lease)
            if len(held) > leases:
                old = held.popleft()
                if old is not None:
                    old.release()
            if i % 1000 == 0:
                device = cache.stats()["device"]
                assert device["bytes"] <= device["capacity_bytes"], device
        for old in held:
            if old is not None:
                old.release()
        device = cache.stats()["device"]
        assert device["bytes"] <= device["capacity_bytes"], device
    return Replay(trace.name, budget_bytes, policy, len(trace.keys), hits, saved, spent, refused,
                  device["evictions"], round(time.perf_counter() - began, 2))


def run_set(name: str, shapes: list[tuple[Shape, int]], budgets: list[int], policies: list[str],
            scale: float, log: bool = True) -> dict[str, object]:
    rows = []
    for shape, seed in shapes:
        trace = shape.build(seed, scale)
        ceiling = trace.ceiling_s
        for budget in budgets:
            got = {p: replay(trace, budget, p) for p in policies}
            lru = got["lru"].saved_s if "lru" in got else 0.0
            row = {
                "trace": shape.name, "seed": seed, "requests": len(trace.keys),
                "budget_bytes": budget,
                "budget_of_distinct": round(budget / trace.distinct_bytes, 4),
                "ceiling_s": round(ceiling, 2),
                "saved_s": {p: round(r.saved_s, 2) for p, r in got.items()},
                "hit_ratio": {p: round(r.hit_ratio, 4) for p, r in got.items()},
                "vs_lru": {p: (round(r.saved_s / lru - 1, 4) if lru else None)
                           for p, r in got.items() if p != "lru"},
                "replays": [asdict(r) for r in got.values()],
            }
            rows.append(row)
            if log:
                print(f"  {name} {shape.name} seed {seed} @ {mib(budget)}: " + ", ".join(
                    f"{p} {r.saved_s:.1f} s" for p, r in got.items()), flush=True)
    worst = {p: min((r["vs_lru"][p] for r in rows if r["vs_lru"].get(p) is not None), default=None)
             for p in policies if p != "lru"}
    return {"set": name, "rows": rows, "worst_vs_lru": worst}


# -- the books' cost per call ------------------------------------------------------------------
def _timer_overhead(n: int = 20_000) -> float:
    pc = time.perf_counter
    best = 1.0
    for _ in range(3):
        total = 0.0
        for _ in range(n):
            t0 = pc()
            total += pc() - t0
        best = min(best, total / n)
    return best


def op_costs(policy: str, entries: int, rounds: int = 10, batch: int = 2000,
             seed: int = 44) -> dict[str, float]:
    """The books' cost per call (us) holding ``entries`` keys of one byte each (costs of the two
    13-tile classes, +-10%: the cost classes of two models), after as many hits as entries:
    touch, add (after evict_for), evict_for of a new key (one victim), evict_one; each the best
    round of ``batch`` calls."""
    rng = np.random.default_rng(seed)
    keys = [int(i).to_bytes(32, "little") for i in rng.permutation(entries + 3 * batch * rounds)]
    base = np.array([CLASSES[1].cost_s, CLASSES[3].cost_s])[rng.integers(0, 2, len(keys))]
    costs = (base * rng.uniform(0.9, 1.1, len(keys))).tolist()
    books = books_for(policy, entries)
    for i in range(entries):
        books.evict_for(1, replacing=keys[i], cost_s=costs[i])
        books.add(keys[i], 1, costs[i])
    for i in rng.integers(0, entries, entries):
        books.touch(keys[i])
    fresh = iter(range(entries, len(keys)))
    overhead = _timer_overhead()
    pc = time.perf_counter
    best = {"touch": 1.0, "add": 1.0, "evict_for": 1.0, "evict_one": 1.0}
    for _ in range(rounds):
        hits = [k for k in (keys[i] for i in rng.integers(0, entries, batch)) if k in books]
        t = pc()
        for k in hits:
            books.touch(k)
        best["touch"] = min(best["touch"], (pc() - t) / max(1, len(hits)))
        spent_evict = spent_add = 0.0
        for i in [next(fresh) for _ in range(batch)]:
            key, cost = keys[i], costs[i]
            t0 = pc()
            victims = books.evict_for(1, replacing=key, cost_s=cost)
            t1 = pc()
            if victims is not None:
                books.add(key, 1, cost)
            t2 = pc()
            spent_evict += t1 - t0
            spent_add += t2 - t1
        best["evict_for"] = min(best["evict_for"], spent_evict / batch - overhead)
        best["add"] = min(best["add"], spent_add / batch - overhead)
        t = pc()
        for _ in range(batch):
            books.evict_one()
        best["evict_one"] = min(best["evict_one"], (pc() - t) / batch)
        for i in [next(fresh) for _ in range(batch)]:  # full again
            books.evict_for(1, replacing=keys[i], cost_s=costs[i])
            books.add(keys[i], 1, costs[i])
    return {op: round(v * 1e6, 2) for op, v in best.items()}


# -- report ----------------------------------------------------------------------------------
def mib(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


def table(result: dict[str, object], policies: list[str]) -> str:
    others = [p for p in policies if p != "lru"]
    lines = ["| trace | seed | budget (of distinct bytes) | vision s saved: LRU (ceiling) | "
             + " | ".join(f"{p} vs LRU" for p in others) + " |",
             "|---|---|---|---|" + "---|" * len(others)]
    rows = result["rows"]
    assert isinstance(rows, list)
    for r in rows:
        cells = " | ".join("n/a" if r["vs_lru"][p] is None else f"{r['vs_lru'][p]:+.1%}" for p in others)
        lines.append(f"| {r['trace']} | {r['seed']} | {mib(r['budget_bytes'])} "
                     f"({r['budget_of_distinct']:.1%}) | {r['saved_s'].get('lru', 0):.1f} "
                     f"({r['ceiling_s']:.1f}) | {cells} |")
    worst = result["worst_vs_lru"]
    assert isinstance(worst, dict)
    lines.append("worst cell vs LRU: " + ", ".join(
        f"{p} {'n/a' if v is None else format(v, '+.1%')}" for p, v in worst.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", choices=("dev", "adversaries", "held-out", "all", "none"),
                   default="all", help="the development traces, the adversaries, the held-out "
                   "ones, all three (all), or none (the books' costs only)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="trace length, as a share of each trace's own (1: 100,000 requests; 150,000 "
                        "for the catalogs)")
    p.add_argument("--budgets", default="1GiB,4GiB,16GiB", help="byte budgets (1GiB,4GiB,16GiB)")
    p.add_argument("--policies", default=",".join(POLICIES), help="lru first (the reference)")
    p.add_argument("--ops-entries", type=int, default=100_000, help="entries held for the costs")
    p.add_argument("--no-ops", action="store_true", help="skip the books' cost per call")
    p.add_argument("--json", metavar="OUT", help="write the report (with the run's metadata) here")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny: the development set at 2%% length, 64/256/1024 MiB, 1000 entries")
    args = p.parse_args(argv)
    if args.dry_run:
        args.set, args.scale, args.budgets, args.ops_entries = "dev", 0.02, "64MiB,256MiB,1GiB", 1000
    policies = args.policies.split(",")
    if policies[0] != "lru":
        p.error("--policies must start with lru (the reference)")
    budgets = [parse_bytes(b) for b in args.budgets.split(",")]
    began = time.perf_counter()
    sets = {"dev": dev, "adversaries": adversaries, "held-out": held_out}
    chosen = list(sets) if args.set == "all" else [] if args.set == "none" else [args.set]
    result: dict[str, object] = {"sets": {}}
    for name in chosen:
        result["sets"][name] = run_set(name, sets[name](), budgets, policies, args.scale)  # type: ignore[index]
    if not args.no_ops:
        result["us_per_call"] = {pol: op_costs(pol, args.ops_entries) for pol in policies}
    result["settings"] = {
        "set": args.set, "scale": args.scale, "budgets": budgets, "policies": policies,
        "scale_bytes": SCALE, "leases": LEASES, "ops_entries": args.ops_entries,
        "dry_run": args.dry_run, "classes": [asdict(c) for c in CLASSES],
        "dev_seed": DEV_SEED, "held_out_seed": HELD_OUT_SEED, "adversary_seed": ADVERSARY_SEED,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                   f"Python {platform.python_version()}",
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    verdicts: dict[str, object] = {}
    for name in chosen:
        s = result["sets"][name]  # type: ignore[index]
        print(f"\n## {name} traces\n")
        print(table(s, policies))
        worst = s["worst_vs_lru"].get(NEW)
        if worst is not None:
            verdicts[f"{name}_within_2pct"] = worst >= GAIN_FLOOR
            print(f"{NEW} within {-GAIN_FLOOR:.0%} of LRU in every {name} cell: "
                  f"{'met' if worst >= GAIN_FLOOR else 'NOT met'} (worst {worst:+.1%})")
    if "us_per_call" in result:
        ops = result["us_per_call"]
        assert isinstance(ops, dict)
        print(f"\nbooks' cost per call holding {args.ops_entries} entries (us, best round): " + "; ".join(
            f"{pol} " + ", ".join(f"{op} {v:.2f}" for op, v in c.items()) for pol, c in ops.items()))
        if NEW in ops:
            worst_op = max(ops[NEW].values())
            verdicts["cost_met"] = worst_op <= OP_TARGET_US
            print(f"{NEW}: {worst_op:.2f} us per call at worst (target <= {OP_TARGET_US:g} us): "
                  f"{'met' if worst_op <= OP_TARGET_US else 'NOT met'}")
    result["verdicts"] = verdicts
    result["seconds"] = round(time.perf_counter() - began, 1)
    print(f"({result['seconds']} s)")
    if args.json:
        write_report(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
