"""The fleet of the fleet tests (tests/test_fleet_cluster.py, tests/test_fleet_mooncake.py):
featcache replicas in their own processes (``tests/_fleet_procs.py``) under a steady load against
one shared tier, what each get did (when, hit or miss, how long), and the invariants.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Any

try:
    import _fleet_procs
except ImportError:  # tests/ became a package
    from tests import _fleet_procs

SPAWN = mp.get_context("spawn")
IMAGES = 48  # the fleet's working set: each replica asks for these at random
TIMEOUT_MS = 250  # remote_timeout_ms (the default)
COOLDOWN_MS = 1000  # remote_breaker_cooldown_ms (5000 by default: recoveries scale with it)
# A get's worst case: the head's GET and the chunks' MGET, each bounded by the timeout (a node
# that accepts and never answers), with scheduling slack on a 2-core machine shared with others.
GET_BOUND_MS = 2 * TIMEOUT_MS + 400
RECOVERY_BOUND_S = 15.0  # generous: measured recoveries are a few seconds (docs/scale.md)
WINDOW_S = 0.5  # hit ratio over windows this long
RECOVERED = 0.9  # "back": a window's hit ratio at least this


@dataclass
class Replica:
    proc: Any
    conn: Any
    gets: list[tuple[float, bool, float]] = field(default_factory=list)
    puts: int = 0
    wrong: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    secret: str = ""


class Fleet:
    def __init__(self, url: str, n: int = 2, **options: Any) -> None:
        self.url = url
        self.replicas: list[Replica] = []
        options = {"remote_timeout_ms": TIMEOUT_MS, "remote_breaker_cooldown_ms": COOLDOWN_MS,
                   **options}
        for i in range(n):
            parent, child = SPAWN.Pipe()
            proc = SPAWN.Process(target=_fleet_procs.replica,
                                 args=(url, child, IMAGES, 100 + i, options), daemon=True)
            proc.start()
            self.replicas.append(Replica(proc, parent))
        for r in self.replicas:
            if not r.conn.poll(120):
                raise RuntimeError("a replica did not start")
            assert r.conn.recv() == "ready"

    def collect(self) -> None:
        """Bring every replica's records since the last collect into ``self``."""
        for r in self.replicas:
            r.conn.send("report")
        for r in self.replicas:
            self._take(r, r.conn.recv())

    def _take(self, r: Replica, doc: dict[str, Any]) -> None:
        r.gets.extend(doc["gets"])
        r.puts += doc["puts"]
        r.wrong.extend(doc["wrong"])
        r.exceptions.extend(doc["exceptions"])
        r.stats = doc["stats"]
        r.secret = doc["secret"]

    def close(self) -> None:
        for r in self.replicas:
            if r.proc.is_alive():
                try:
                    r.conn.send("stop")
                    if r.conn.poll(60):
                        self._take(r, r.conn.recv())
                except (OSError, EOFError):
                    pass
            r.proc.join(30)
            if r.proc.is_alive():
                r.proc.kill()
                r.proc.join()

    # -- what happened -------------------------------------------------------------------------
    def gets_between(self, t0: float, t1: float) -> list[tuple[float, bool, float]]:
        return sorted(g for r in self.replicas for g in r.gets if t0 <= g[0] < t1)

    def ratio(self, t0: float, t1: float) -> float:
        gets = self.gets_between(t0, t1)
        return sum(hit for _, hit, _ in gets) / len(gets) if gets else 0.0

    def recovered_at(self, since: float, until: float) -> float | None:
        """The first time after ``since`` from which a window's hit ratio is at least
        ``RECOVERED`` (seconds after ``since``), or None."""
        t = since
        while t + WINDOW_S <= until:
            if len(self.gets_between(t, t + WINDOW_S)) >= 5 and self.ratio(t, t + WINDOW_S) >= RECOVERED:
                return t - since
            t += 0.1
        return None

    def wait_recovered(self, since: float, bound_s: float = RECOVERY_BOUND_S) -> float:
        """Collect until the hit ratio is back (the seconds after ``since``), failing after
        ``bound_s``."""
        while True:
            time.sleep(0.5)
            self.collect()
            now = time.monotonic()
            took = self.recovered_at(since, now)
            if took is not None:
                return took
            if now - since > bound_s:
                raise AssertionError(f"hit ratio not back {bound_s} s after the fault: "
                                     f"{self.timeline(since, now)}")

    def timeline(self, t0: float, t1: float, step: float = 0.5) -> str:
        out = []
        t = t0
        while t < t1:
            gets = self.gets_between(t, t + step)
            out.append(f"{t - t0:+.1f}s:{self.ratio(t, t + step):.2f}/{len(gets)}")
            t += step
        return " ".join(out)

    def check(self, since: float = 0.0) -> dict[str, Any]:
        """The invariants, over everything since ``since``; returns the figures."""
        self.collect()
        gets = self.gets_between(since, float("inf"))
        for r in self.replicas:
            assert not r.wrong, f"wrong tensors served: {r.wrong[:5]}"
            assert not r.exceptions, "exception out of get/put:\n" + r.exceptions[0]
            s = r.stats
            # every get that came back empty was a counted miss of the remote tier (remote-only
            # replicas); the others, remote hits, or puts still queued for publishing
            misses = sum(not hit for _, hit, _ in r.gets)
            assert s["misses"] == misses and s["hits"] <= len(r.gets) - misses, (s, misses)
            # every put is published, failed (counted) or dropped (counted), or still on its way
            # (the demoter's queue, then the publisher's): equal once closed (the last test)
            assert s["published"] + s["publish_errors"] + s["publish_dropped"] <= r.puts, (s, r.puts)
        secrets = {r.secret for r in self.replicas}
        assert len(secrets) == 1, "replicas key with different secrets"
        slowest = max((ms for _, _, ms in gets), default=0.0)
        assert slowest <= GET_BOUND_MS, f"a get took {slowest:.0f} ms (bound {GET_BOUND_MS} ms)"
        return {"gets": len(gets), "max_get_ms": slowest,
                "ratio": sum(h for _, h, _ in gets) / len(gets) if gets else 0.0}
