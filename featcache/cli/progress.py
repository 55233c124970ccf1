"""A one-line progress bar on stderr, for the commands that take a while (``verify``, ``warm``)."""

from __future__ import annotations

import sys
import time
from typing import IO

from ..sizes import format_bytes


class ProgressBar:
    """A one-line progress bar on ``stream`` (stderr), redrawn at most 10 times a second.

    Draws only when ``enabled`` (default: the stream is a terminal), so logs and pipes get no
    carriage returns; ``close`` ends the line it drew.
    """

    WIDTH = 28

    def __init__(self, total: int, label: str, stream: IO[str] | None = None,
                 enabled: bool | None = None) -> None:
        self.total = max(total, 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled if enabled is not None else self.stream.isatty()
        self.started = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def update(self, done: int, nbytes: int, force: bool = False) -> None:
        """``done`` of ``total`` items, ``nbytes`` bytes so far."""
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < 0.1):
            return
        self._last = now
        frac = min(done / self.total, 1.0) if self.total else 1.0
        filled = int(frac * self.WIDTH)
        rate = nbytes / max(now - self.started, 1e-9)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{self.total} "
            f"{format_bytes(nbytes)} {format_bytes(int(rate))}/s"
        )
        self.stream.flush()
        self._drawn = True

    def close(self, done: int, nbytes: int) -> None:
        if self.enabled:
            self.update(done, nbytes, force=True)
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
