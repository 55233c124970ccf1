"""Eviction by value (GDSF) against LRU, replayed through the memory tiers' own books, on the CPU.

    PYTHONPATH=$PWD python bench/eviction.py [--requests N] [--budgets 1GiB,4GiB,16GiB]
                                             [--seed S] [--json OUT] [--dry-run]

Each trace is a sequence of image requests; every image has a size (its features' bytes) and a
cost (its vision model's time on a miss), from one of four classes:

    InternVL2-2B,  13 tiles: 3328 tokens x 2048 x bf16 = 13.6 MB, vision 24.6 ms
    InternVL2-26B, 13 tiles: 3328 tokens x 6144 x bf16 = 40.9 MB, vision 271.4 ms
    the same models at 1 tile (256 tokens): 1.0 MB / 1.9 ms and 3.1 MB / 20.9 ms

The 13-tile times are the H200 measurements of docs/benchmarks.md ("InternVL2-26B and
InternVL2-2B, the seed models", the `breakdown` tables: the vision model's GPU time from CUDA
events); the 1-tile times are those divided by 13 (the tiles go through the vision model as one
batch; a 1-tile call was not measured). Each image's class is drawn at random (MIX), independent
of its popularity. The traces:

- zipf:    independent requests, Zipf(ALPHA) popularity over IMAGES images;
- chat:    chat sessions (CONCURRENT at a time, interleaved) each resending its 1-3 images at
           every one of its 2-10 turns; a quarter of the images are shared ones (Zipf over
           IMAGES), the rest the session's own;
- chat-crowd: the same with CROWD sessions at a time (a busy server: the live sessions' images
           no longer fit the smaller budgets);
- scan:    the zipf trace with scans of one-off images (every SCAN_EVERY requests, SCAN_LEN
           images seen once);
- uniform: independent requests, every one of IMAGES images equally likely.

Each trace is replayed at each budget through ``featcache.eviction.books_for("lru" | "value")``
(the books the device and host tiers keep; nothing is re-implemented here): a request is a hit if
the books hold the key (``touch``), else a miss whose features are added (``evict_for`` then
``add`` with the image's cost, as the tier's ``put``). The last LEASES requests' keys stay pinned
(leases of in-flight requests), as the device tier pins them. Reported: hit ratio, vision seconds
saved (the sum of the hits' costs), value against LRU, the ceiling (what an unbounded cache saves:
every request of an image seen before a hit), and the books' cost per call (the whole replay
loop's wall time divided by its books calls: pin, lookup, touch or evict and add, unpin; an upper
bound). Targets (issue 30 item 2): value saves >= 20% more vision time than LRU on the skewed
traces (zipf, chat, chat-crowd, scan) at the same bytes, is never more than 2% worse on the
uniform trace, and costs < 2 us per operation.
--dry-run: a tiny run (3000 requests, 200 images, budgets of 64, 256 and 1024 MiB) that checks the
plumbing, not the targets.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # featcache, bench.lib

from bench.lib.results import write_report  # noqa: E402
from featcache.eviction import books_for  # noqa: E402
from featcache.sizes import parse_bytes  # noqa: E402


@dataclass(frozen=True)
class ImageClass:
    name: str
    nbytes: int  # the features' bytes: image tokens x hidden size x 2 (bf16)
    cost_s: float  # the vision model's time on a miss


VISION_2B_13_S = 24.6e-3  # docs/benchmarks.md: InternVL2-2B breakdown, vision (13 tiles)
VISION_26B_13_S = 271.4e-3  # docs/benchmarks.md: InternVL2-26B breakdown, vision (13 tiles)
CLASSES = (
    ImageClass("2B 1 tile", 256 * 2048 * 2, VISION_2B_13_S / 13),
    ImageClass("2B 13 tiles", 3328 * 2048 * 2, VISION_2B_13_S),
    ImageClass("26B 1 tile", 256 * 6144 * 2, VISION_26B_13_S / 13),
    ImageClass("26B 13 tiles", 3328 * 6144 * 2, VISION_26B_13_S),
)
MIX = (0.3, 0.3, 0.2, 0.2)  # the share of images of each class
ALPHA = 0.9  # Zipf exponent of image popularity
IMAGES = 4000
CONCURRENT = 32  # chat sessions at a time
CROWD = 256  # chat sessions at a time in chat-crowd
SHARED = 0.25  # a chat image is a shared (popular) one with this probability, else the session's
SCAN_EVERY, SCAN_LEN = 10_000, 1_500
LEASES = 4  # requests in flight: their keys stay pinned
SKEWED = ("zipf", "chat", "chat-crowd", "scan")
GAIN_TARGET, UNIFORM_FLOOR, OP_TARGET_US = 0.20, -0.02, 2.0


@dataclass
class Trace:
    name: str
    keys: list[bytes]
    nbytes: list[int]
    costs: list[float]

    @property
    def distinct_bytes(self) -> int:
        return sum(dict(zip(self.keys, self.nbytes, strict=True)).values())

    @property
    def ceiling_s(self) -> float:
        """The vision seconds an unbounded cache saves: every request of a key seen before."""
        seen: set[bytes] = set()
        saved = 0.0
        for key, cost in zip(self.keys, self.costs, strict=True):
            if key in seen:
                saved += cost
            seen.add(key)
        return saved


class Images:
    """Images with a class each, drawn at random (MIX); ids are their keys."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.classes: list[int] = []

    def new(self, n: int = 1) -> list[int]:
        first = len(self.classes)
        self.classes.extend(int(c) for c in self.rng.choice(len(CLASSES), size=n, p=MIX))
        return list(range(first, first + n))

    def trace(self, name: str, ids: list[int]) -> Trace:
        keys = [i.to_bytes(8, "little") for i in range(len(self.classes))]
        cls = [CLASSES[c] for c in self.classes]
        return Trace(name, [keys[i] for i in ids], [cls[i].nbytes for i in ids],
                     [cls[i].cost_s for i in ids])


def zipf_ids(rng: np.random.Generator, pool: list[int], n: int, alpha: float) -> list[int]:
    """``n`` draws from ``pool`` with Zipf(``alpha``) popularity (rank order shuffled, so that
    popularity is independent of the images' classes)."""
    weights = np.arange(1, len(pool) + 1, dtype=np.float64) ** -alpha
    ranked = rng.permutation(pool)
    return [int(ranked[i]) for i in rng.choice(len(pool), size=n, p=weights / weights.sum())]


def zipf_trace(seed: int, n: int, images: int) -> Trace:
    rng = np.random.default_rng(seed)
    made = Images(rng)
    return made.trace("zipf", zipf_ids(rng, made.new(images), n, ALPHA))


def uniform_trace(seed: int, n: int, images: int) -> Trace:
    rng = np.random.default_rng(seed)
    made = Images(rng)
    pool = made.new(images)
    return made.trace("uniform", [pool[int(i)] for i in rng.integers(0, images, size=n)])


def scan_trace(seed: int, n: int, images: int, every: int = SCAN_EVERY, length: int = SCAN_LEN) -> Trace:
    rng = np.random.default_rng(seed)
    made = Images(rng)
    background = iter(zipf_ids(rng, made.new(images), n, ALPHA))
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(next(background) for _ in range(min(every, n - len(ids))))
        ids.extend(made.new(min(length, n - len(ids))))
    return made.trace("scan", ids)


def chat_trace(seed: int, n: int, images: int, concurrent: int = CONCURRENT,
               name: str = "chat") -> Trace:
    rng = np.random.default_rng(seed)
    made = Images(rng)
    shared = iter(zipf_ids(rng, made.new(images), n, ALPHA))

    def session() -> list[int]:  # [turns left, image ids...]
        count = int(rng.choice(3, p=(0.6, 0.3, 0.1))) + 1
        own = [next(shared) if rng.random() < SHARED else made.new()[0] for _ in range(count)]
        return [int(rng.integers(2, 11)), *own]

    live = [session() for _ in range(concurrent)]
    ids: list[int] = []
    while len(ids) < n:
        s = int(rng.integers(concurrent))
        ids.extend(live[s][1:])  # a turn resends every image of the conversation
        live[s][0] -= 1
        if not live[s][0]:
            live[s] = session()
    return made.trace(name, ids[:n])


def crowd_trace(seed: int, n: int, images: int) -> Trace:
    return chat_trace(seed, n, images, CROWD, "chat-crowd")


TRACES = {"zipf": zipf_trace, "chat": chat_trace, "chat-crowd": crowd_trace, "scan": scan_trace,
          "uniform": uniform_trace}


@dataclass
class Replay:
    trace: str
    budget_bytes: int
    policy: str
    requests: int
    hits: int
    saved_s: float  # vision seconds the hits saved
    spent_s: float  # vision seconds the misses cost
    calls: int  # books calls made (pin, lookup, touch or evict_for and add, unpin)
    us_per_call: float  # the replay loop's wall time per books call (the loop's own included)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests


def replay(trace: Trace, budget_bytes: int, policy: str, leases: int = LEASES) -> Replay:
    """Replay ``trace`` through new books of ``policy``: a hit touches, a miss evicts for room
    and adds (with the image's cost), the last ``leases`` requests' keys stay pinned."""
    books = books_for(policy, budget_bytes)
    held: deque[bytes] = deque()
    hits, saved, spent, added = 0, 0.0, 0.0, 0
    began = time.perf_counter()
    for key, nbytes, cost in zip(trace.keys, trace.nbytes, trace.costs, strict=True):
        books.pin(key)
        if key in books:
            books.touch(key)
            hits += 1
            saved += cost
        else:
            spent += cost
            if books.evict_for(nbytes, replacing=key) is not None:
                books.add(key, nbytes, cost)
                added += 1
        held.append(key)
        if len(held) > leases:
            books.unpin(held.popleft())
    took = time.perf_counter() - began
    assert books.used_bytes <= budget_bytes
    requests = len(trace.keys)
    calls = 4 * requests + added - len(held)  # pin, in, touch | evict_for (+ add), unpin
    return Replay(trace.name, budget_bytes, policy, requests, hits, saved, spent, calls,
                  took / calls * 1e6)


def run(requests: int, images: int, budgets: list[int], seed: int) -> dict[str, object]:
    rows = []
    replays: list[Replay] = []
    for i, (name, make) in enumerate(TRACES.items()):
        trace = make(seed + i, requests, images)
        ceiling = trace.ceiling_s
        for budget in budgets:
            lru, value = (replay(trace, budget, p) for p in ("lru", "value"))
            replays += [lru, value]
            rows.append({
                "trace": name, "budget_bytes": budget,
                "budget_of_distinct": round(budget / trace.distinct_bytes, 4),
                "hit_ratio": {"lru": round(lru.hit_ratio, 4), "value": round(value.hit_ratio, 4)},
                "saved_s": {"lru": round(lru.saved_s, 2), "value": round(value.saved_s, 2)},
                "spent_s": {"lru": round(lru.spent_s, 2), "value": round(value.spent_s, 2)},
                "ceiling_s": round(ceiling, 2),
                "gain": round(value.saved_s / lru.saved_s - 1, 4) if lru.saved_s else None,
            })
    per_op = {p: [r.us_per_call for r in replays if r.policy == p] for p in ("lru", "value")}
    return {"rows": rows, "replays": [asdict(r) for r in replays],
            "us_per_call": {p: {"median": round(statistics.median(v), 3), "max": round(max(v), 3)}
                            for p, v in per_op.items()}}


def cost_at(entries: int, requests: int, seed: int) -> dict[str, float]:
    """The books' cost per call (us) holding ``entries`` keys of one size: a Zipf trace over
    twice as many keys through books of room for ``entries`` (O(log n): the heap's depth)."""
    rng = np.random.default_rng(seed)
    ids = zipf_ids(rng, list(range(2 * entries)), requests, ALPHA)
    keys = [i.to_bytes(8, "little") for i in range(2 * entries)]
    trace = Trace(f"{entries} entries", [keys[i] for i in ids], [1] * requests,
                  [float(rng.random()) for _ in ids])
    return {p: round(replay(trace, entries, p).us_per_call, 3) for p in ("lru", "value")}


def verdicts(result: dict[str, object]) -> dict[str, object]:
    rows = result["rows"]
    assert isinstance(rows, list)
    skewed = [r["gain"] for r in rows if r["trace"] in SKEWED]
    uniform = [r["gain"] for r in rows if r["trace"] == "uniform"]
    ops = result["us_per_call"]
    scale = result["us_per_call_by_entries"]
    assert isinstance(ops, dict) and isinstance(scale, dict)
    worst_op = max([v["max"] for v in ops.values()] + [c for v in scale.values() for c in v.values()])
    met = [f"{r['trace']}@{mib(r['budget_bytes'])}" for r in rows
           if r["trace"] in SKEWED and r["gain"] is not None and r["gain"] >= GAIN_TARGET]
    return {
        "skewed_min_gain": min(skewed), "skewed_gain_met": min(skewed) >= GAIN_TARGET,
        "skewed_cells_met": met, "skewed_cells": len(skewed),
        "uniform_min_gain": min(uniform), "uniform_met": min(uniform) >= UNIFORM_FLOOR,
        "worst_us_per_call": worst_op, "cost_met": worst_op < OP_TARGET_US,
    }


def mib(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


def table(result: dict[str, object]) -> str:
    lines = ["| trace | budget (of distinct bytes) | hit ratio LRU / value | vision s saved LRU / "
             "value (ceiling) | value vs LRU |", "|---|---|---|---|---|"]
    rows = result["rows"]
    assert isinstance(rows, list)
    for r in rows:
        gain = "n/a" if r["gain"] is None else f"{r['gain']:+.1%}"
        lines.append(
            f"| {r['trace']} | {mib(r['budget_bytes'])} ({r['budget_of_distinct']:.1%}) | "
            f"{r['hit_ratio']['lru']:.3f} / {r['hit_ratio']['value']:.3f} | "
            f"{r['saved_s']['lru']:.1f} / {r['saved_s']['value']:.1f} ({r['ceiling_s']:.1f}) | "
            f"{gain} |")
    ops = result["us_per_call"]
    assert isinstance(ops, dict)
    lines.append("")
    lines.append("books' cost per call (replay loop wall time / books calls, us): " + ", ".join(
        f"{p} median {v['median']:.2f}, max {v['max']:.2f}" for p, v in ops.items()))
    scale = result["us_per_call_by_entries"]
    assert isinstance(scale, dict)
    lines.append("holding N entries (us per call, LRU / value): " + ", ".join(
        f"{n}: {v['lru']:.2f} / {v['value']:.2f}" for n, v in scale.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=100_000, help="requests per trace (100000)")
    p.add_argument("--images", type=int, default=IMAGES, help=f"images in the popular pool ({IMAGES})")
    p.add_argument("--budgets", default="1GiB,4GiB,16GiB", help="byte budgets (1GiB,4GiB,16GiB)")
    p.add_argument("--seed", type=int, default=30)
    p.add_argument("--json", metavar="OUT", help="write the report (with the run's metadata) here")
    p.add_argument("--dry-run", action="store_true",
                   help="a tiny run (3000 requests, 200 images, 64/256/1024 MiB): the plumbing only")
    args = p.parse_args(argv)
    if args.dry_run:
        args.requests, args.images, args.budgets = 3000, 200, "64MiB,256MiB,1GiB"
    budgets = [parse_bytes(b) for b in args.budgets.split(",")]
    began = time.perf_counter()
    result = run(args.requests, args.images, budgets, args.seed)
    result["us_per_call_by_entries"] = {n: cost_at(n, max(args.requests, 4 * n), args.seed)
                                        for n in ((100, 1000) if args.dry_run else (1000, 100_000))}
    result["verdicts"] = verdicts(result)
    result["settings"] = {
        "requests": args.requests, "images": args.images, "budgets": budgets, "seed": args.seed,
        "dry_run": args.dry_run, "classes": [asdict(c) for c in CLASSES], "mix": MIX,
        "alpha": ALPHA, "concurrent_chats": CONCURRENT, "crowd_chats": CROWD, "shared": SHARED,
        "scan_every": SCAN_EVERY, "scan_len": SCAN_LEN, "leases": LEASES,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                   f"Python {platform.python_version()}",
    }
    result["seconds"] = round(time.perf_counter() - began, 1)
    print(table(result))
    v = result["verdicts"]
    assert isinstance(v, dict)
    print(f"\nskewed traces ({', '.join(SKEWED)}): value saves {v['skewed_min_gain']:+.1%} or more "
          f"vision time than LRU (target +{GAIN_TARGET:.0%}): {'met' if v['skewed_gain_met'] else 'NOT met'}"
          f"; met in {len(v['skewed_cells_met'])} of {v['skewed_cells']} trace x budget cells "
          f"({', '.join(v['skewed_cells_met']) or 'none'})")
    print(f"uniform trace: {v['uniform_min_gain']:+.1%} at worst (target >= {UNIFORM_FLOOR:+.0%}): "
          f"{'met' if v['uniform_met'] else 'NOT met'}")
    print(f"books' cost: {v['worst_us_per_call']:.2f} us per call at worst (target < "
          f"{OP_TARGET_US:g} us): {'met' if v['cost_met'] else 'NOT met'}")
    print(f"({result['seconds']} s)")
    if args.json:
        write_report(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
