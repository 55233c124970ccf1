"""The in-process server's CPU threads (issue 27 item 3): where lmdeploy's engine runs in the
server's process, torch's per-thread OpenMP teams are narrowed before it is built, so the
engine's and the image preprocessing's teams do not oversubscribe the cores (on the H200 a miss's
preprocessing took 540 ms instead of 25 ms when they did). The stall itself is measured on the
GPU (docs/benchmarks.md "Stalls"); here: the width, who decides it, and that the server sets it
for the in-process engine only."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

from featcache import threads


def test_each_team_gets_a_quarter_of_the_cores_between_one_and_eight():
    assert [threads.team_width(c) for c in (1, 2, 4, 16, 32, 64, 256)] == [1, 1, 1, 4, 8, 8, 8]


def test_the_users_width_wins(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    width, why = threads.share_cores()
    assert (width, torch.get_num_threads()) == (before, before)
    assert "OMP_NUM_THREADS=3" in why
    assert threads.share_cores(0)[0] == before  # 0: torch's default, left alone


def test_a_thread_started_after_it_runs_its_torch_ops_at_the_new_width():
    # in a child: the width is process-wide; the preprocessing worker is such a later thread
    code = textwrap.dedent("""
        import os, threading, torch
        os.environ.pop("OMP_NUM_THREADS", None)
        torch.set_num_threads(2)
        torch.ones(1 << 20).sum()                 # the main thread's team, before
        from featcache.threads import share_cores
        width, why = share_cores(1)
        seen = []
        def worker():
            torch.ones(1 << 20).sum()             # its first parallel op sizes its team
            seen.append(torch.get_num_threads())
        t = threading.Thread(target=worker); t.start(); t.join()
        print(width, torch.get_num_threads(), seen[0], why)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:4] == ["1", "1", "1", "asked"]


@pytest.mark.parametrize("engine_process, narrowed", [("in", True), ("mp", False)])
def test_the_server_narrows_the_teams_for_an_engine_in_its_own_process(monkeypatch, engine_process,
                                                                      narrowed):
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.openai import api_server

    import featcache.server.serve as serve

    calls = []
    monkeypatch.setattr(threads, "share_cores", lambda *a: calls.append(a) or (1, "test"))
    monkeypatch.setattr(serve, "wrap", lambda *a, **k: None)
    monkeypatch.setattr(serve, "multi_process", lambda config: False)
    monkeypatch.setattr(api_server, "get_task", lambda *a, **k: ("task", types.SimpleNamespace))
    with serve.featcache_engine(types.SimpleNamespace(), None, engine_process=engine_process):
        _, build = api_server.get_task()
        build(backend_config=PytorchEngineConfig())
    assert bool(calls) is narrowed
