"""featcache.lmdeploy.pytorch.rankstats: the model processes' counters read from outside them."""

from __future__ import annotations

import multiprocessing
import os
import socket

import pytest

from featcache.lmdeploy.pytorch import rankstats

if not hasattr(socket, "AF_UNIX"):
    pytest.skip("Unix sockets only", allow_module_level=True)


def _answer_and_wait(folder: str, rank: int, ready, done) -> None:
    rankstats.serve(folder, lambda: {"rank": rank, "pid": os.getpid(),
                                     "stats": {"lmdeploy": {"vision_images": 10 + rank}}})
    ready.set()
    done.wait(30)


def test_the_driver_reads_every_live_process_in_rank_order_and_skips_a_dead_one(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Event()
    procs, readies = [], []
    for rank in (1, 0):  # started out of order
        ready = ctx.Event()
        p = ctx.Process(target=_answer_and_wait, args=(str(tmp_path), rank, ready, done), daemon=True)
        p.start()
        procs.append(p)
        readies.append(ready)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a process gone: its file stays
    dead.bind(str(tmp_path / f"999999{rankstats.SUFFIX}"))
    dead.close()
    try:
        assert all(r.wait(60) for r in readies)
        answers = rankstats.gather(str(tmp_path), timeout=2)
    finally:
        done.set()
        for p in procs:
            p.join(30)
    assert [a["rank"] for a in answers] == [0, 1]
    assert [a["stats"]["lmdeploy"]["vision_images"] for a in answers] == [10, 11]
    assert sorted(a["pid"] for a in answers) == sorted(p.pid for p in procs)


def test_a_failing_answer_costs_that_connection_only(tmp_path):
    calls = []

    def answer():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("stats failed")
        return {"rank": 0, "pid": os.getpid(), "stats": {}}

    rankstats.serve(str(tmp_path), answer)
    assert rankstats.gather(str(tmp_path), timeout=2) == []  # closed without a document
    assert rankstats.gather(str(tmp_path), timeout=2) == [{"rank": 0, "pid": os.getpid(),
                                                          "stats": {}}]


def test_an_empty_folder_has_no_answers(tmp_path):
    assert rankstats.gather(str(tmp_path)) == []
