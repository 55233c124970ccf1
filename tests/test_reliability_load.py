"""Load: threads in several processes mixing put/get/acquire on shared keys, for seconds.

Three processes (this one and two spawned children) open the same store, each with 4 load
threads and a budget sampler, all over 48 shared keys under small budgets (512 KiB device, 384
KiB host, 384 KiB disk, where one value per key takes 610 KiB) so that every tier evicts all
the time. The workload is ``_procs.load_thread``: every value served must be one that some
writer put under that key, a lease's metadata must name the writer of its tensor, a leased
tensor must not change, a key leased by one thread must stay in the device tier while other
threads' puts evict around it, and no budget may be exceeded at any sampled moment. Afterwards
the store is reopened and every entry it serves is checked the same way.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time

import pytest

from featcache import FeatureCache

try:
    import _procs
    import _reliability as rel
except ImportError:  # tests/ became a package
    from tests import _procs
    from tests import _reliability as rel

SPAWN = mp.get_context("spawn")
PROCESSES = 3  # this one + 2 children
THREADS = 4
SECONDS = 4.0


def message(q, proc, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = q.get(timeout=0.5)
        except queue.Empty:
            assert proc.is_alive(), f"child exited with {proc.exitcode} without reporting"
            assert time.monotonic() < deadline, "child did not report in time"
            continue
        assert msg[0] != "error", f"child failed: {msg[1]}"
        return msg


@pytest.mark.slow
def test_threads_and_processes_on_shared_keys(tmp_path):
    store = tmp_path / "store"
    writers = _procs.load_writers(PROCESSES, THREADS)
    q, go = SPAWN.Queue(), SPAWN.Event()
    children = [
        SPAWN.Process(target=_procs.load_child,
                      args=(str(store), p, THREADS, PROCESSES, SECONDS, q, go), daemon=True)
        for p in range(1, PROCESSES)
    ]
    cache = FeatureCache(device="cpu", disk_path=store, **_procs.LOAD_BUDGETS)
    try:
        for child in children:
            child.start()
        for child in children:
            assert message(q, child)[0] == "ready"
        go.set()
        mine = _procs.run_load(cache, 0, THREADS, writers, SECONDS)
        rel.in_thread(cache.flush)
        mine["stats"] = cache.stats()
        results = [mine]
        for child in children:
            kind, out = message(q, child)
            assert kind == "done"
            results.append(out)
        for child in children:
            child.join(30)
            assert child.exitcode == 0
    finally:
        go.set()
        for child in children:
            if child.is_alive():
                os.kill(child.pid, signal.SIGKILL)
            child.join(30)
        rel.in_thread(cache.close)

    total: dict[str, int] = {}
    for out in results:
        for k, v in out.items():
            if isinstance(v, int):
                total[k] = total.get(k, 0) + v
    per_process = [(out["ops"], out["violations"]) for out in results]
    worker_errors = sum(out["stats"]["cache"]["worker_errors"] for out in results)
    disk_errors = sum(out["stats"]["disk"]["errors"] + out["stats"]["disk"]["corrupt"]
                      for out in results)
    evictions = {tier: sum(out["stats"][tier]["evictions"] for out in results)
                 for tier in ("device", "host", "disk")}

    # After the run: reopen and check every entry the store still serves.
    allowed = _procs.allowed_digests(writers)
    after = {"served": 0, "wrong": 0}
    with rel.disk_cache(store, _procs.LOAD_BUDGETS["disk_bytes"]) as again:
        for key in _procs.LOAD_KEYS:
            got = again.get(key)
            if got is not None:
                after["served"] += 1
                ok = any(allowed[(key, w)] == _procs.digest(got) for w in writers)
                after["wrong"] += not ok

    print(f"\nload: per process (ops, budget violations): {per_process}; evictions {evictions}")
    rel.report(
        "load/3-processes-x-4-threads", runs=1, faults=0,
        wrong=total["wrong"] + total["lease_changed"] + after["wrong"], failed=total["raised"],
        requests=total["puts"] + total["gets"] + total["acquires"], puts=total["puts"],
        gets=total["gets"], acquires=total["acquires"], hits=total["hits"],
        leases=total["leases"] + total["own_leases"], pinned_under_pressure=total["own_leases"],
        leases_evicted=total["lease_evicted"],
        budget_samples=total["samples"], over_budget=total["over_budget"],
        worker_errors=worker_errors, disk_errors=disk_errors, evictions=evictions,
        drops=sum(out["stats"]["host"]["drops"] + out["stats"]["disk"]["drops"] for out in results),
        served_after_reopen=after["served"], seconds=SECONDS,
    )
    assert total["raised"] == 0, "a request raised"
    assert total["wrong"] == 0 and after["wrong"] == 0, "a value no writer put was served"
    assert total["lease_changed"] == 0 and total["lease_evicted"] == 0
    assert total["over_budget"] == 0, [out["violations"] for out in results]
    assert worker_errors == 0 and disk_errors == 0
    assert total["own_leases"] > 0 and total["leases"] > 0 and total["hits"] > 0
    assert min(evictions.values()) > 0, "the budgets were not small enough to evict"
