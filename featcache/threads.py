"""CPU threads for a process that runs the engine and the image preprocessing side by side.

torch's CPU ops run on an OpenMP team per calling thread, ``torch.get_num_threads()`` wide (by
default one per core). Where lmdeploy's PyTorch engine runs in the server's process
(``featcache serve --engine-process in``), two threads of that process use such teams: the
engine's loop and the vision encoder's preprocessing worker. Two full-width teams on one set of
cores oversubscribe it; their spinning workers then take turns, and an image's preprocessing,
25 ms alone, took 540 ms for several misses in a row on the H200's 16-core host (issue 27,
docs/benchmarks.md "Stalls"). With 4 threads per team no miss stalled there. Plain lmdeploy does
not meet this: its engine runs in a second process by default.

``share_cores`` narrows the teams before the engine is built, unless the user chose a width
(``OMP_NUM_THREADS``, or ``threads`` given): each thread's team is sized on its first parallel
op from torch's setting, so the engine's and the preprocessing worker's both get the new width.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("featcache")

ENV = "OMP_NUM_THREADS"
MAX_THREADS = 8  # a team wider than this gains nothing on a 13-tile image's preprocessing


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def team_width(cores: int) -> int:
    """The width for each of the two teams on ``cores`` cores: a quarter of them (room for the
    two teams, the server's other threads and a model process's own), 1 to ``MAX_THREADS``. On
    the H200's 16 cores: 4, the width measured."""
    return max(1, min(MAX_THREADS, cores // 4))


def share_cores(threads: int | None = None) -> tuple[int, str]:
    """Set torch's intra-op width for this process (before the engine is built); returns the
    width and why, also logged. ``threads``: the user's width (0: leave torch's default)."""
    import torch

    if threads == 0:
        return torch.get_num_threads(), "torch's default (asked for)"
    if threads is None and os.environ.get(ENV):
        return torch.get_num_threads(), f"{ENV}={os.environ[ENV]} (the user's)"
    cores = usable_cores()
    width = threads if threads is not None else team_width(cores)
    why = ("asked for" if threads is not None
           else f"{cores} cores shared by the engine and the image preprocessing in one process")
    torch.set_num_threads(width)
    log.info("featcache: torch CPU threads per team: %d (%s)", width, why)
    return width, why
