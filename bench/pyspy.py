"""Where a loaded server's processes spend their time: py-spy, sampling from outside.

    profiler = Profile(pid, seconds, out_path)   # starts ``py-spy record`` on pid and its children
    ...                                          # the load
    summary = profiler.summary()                 # waits; top frames per process and thread
    summary = profiler.stop()                    # or: ends the recording now (a phase of unknown length)

``py-spy`` ships as a wheel with its binary (bench/device/make_server_wheels.sh carries it to the
GPU machine). It needs ptrace rights over the server; where it has none (or is missing) the
summary says why and the run goes on. Samples are read from py-spy's ``raw`` output (collapsed
stacks: ``frame;frame;... count``); the summary keeps, per process and thread, the samples, the
frames that were running (self) and the frames on the stack (inclusive), the top ``TOP`` each.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Any

TOP = 25


def binary() -> str | None:
    """The py-spy executable: on PATH, or in the bin/ beside a sys.path entry (pip --target)."""
    found = shutil.which("py-spy")
    if found:
        return found
    for entry in sys.path:
        candidate = os.path.join(entry, "bin", "py-spy")
        if os.access(candidate, os.X_OK):
            return candidate
    return None


class Profile:
    def __init__(self, pid: int, seconds: float, out_path: str, rate: int = 50) -> None:
        self.out_path = out_path
        self.error: str | None = None
        self.proc: subprocess.Popen | None = None
        exe = binary()
        if exe is None:
            self.error = "py-spy not found (bench/device/make_server_wheels.sh carries it)"
            return
        cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--threads", "--nonblocking",
               "--rate", str(rate), "--duration", str(max(1, int(seconds))), "--format", "raw",
               "--output", out_path]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def stop(self) -> dict[str, Any]:
        """End the recording now (py-spy writes what it sampled on SIGINT), then ``summary``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.summary()

    def summary(self, timeout: float = 60) -> dict[str, Any]:
        if self.proc is not None:
            try:
                out, _ = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, _ = self.proc.communicate()
            if self.proc.returncode != 0 and not os.path.exists(self.out_path):
                self.error = f"py-spy exited {self.proc.returncode}: {out.strip()[-400:]}"
        if self.error:
            return {"error": self.error}
        try:
            with open(self.out_path) as f:
                return summarize(f.read())
        except OSError as e:
            return {"error": f"no samples: {e}"}


def records(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw output as (frames, count): one record per line, except that a process frame
    quotes its command line, which may hold newlines and semicolons (kept whole, shortened)."""
    out = []
    pending = ""
    for line in text.splitlines():
        pending = f"{pending} {line}" if pending else line
        stack, _, count_text = pending.rpartition(" ")
        if not count_text.isdigit() or not stack:
            continue
        frames: list[str] = []
        match = re.match(r'(process \d+:".*?");', stack, re.S) if stack.startswith("process ") else None
        if match:
            name = " ".join(match.group(1).split())
            frames.append((name[:-2] + '"' if name.endswith(' "') else name)[:120])
            stack = stack[match.end():]
        out.append((frames + stack.split(";"), int(count_text)))
        pending = ""
    return out


def summarize(text: str, top: int = TOP) -> dict[str, Any]:
    """Per root (process, then thread: the first frames py-spy writes with --subprocesses
    --threads) the samples, and the top frames by self and inclusive samples."""
    groups: dict[str, dict[str, Any]] = {}
    for frames, count in records(text):
        roots = []
        while frames and (frames[0].startswith("process ") or frames[0].startswith("thread ")):
            roots.append(frames.pop(0)[:120])
        g = groups.setdefault(" / ".join(roots) or "?", {"samples": 0, "self": collections.Counter(),
                                                           "inclusive": collections.Counter()})
        g["samples"] += count
        if frames:
            g["self"][frames[-1]] += count
            for frame in set(frames):
                g["inclusive"][frame] += count
    ranked = sorted(groups.items(), key=lambda kv: -kv[1]["samples"])
    return {name: {"samples": g["samples"], "self": g["self"].most_common(top),
                   "inclusive": g["inclusive"].most_common(top)} for name, g in ranked}
