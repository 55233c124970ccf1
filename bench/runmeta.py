"""Which commit ran: ``python3 bench/runmeta.py which DIGEST [N]`` prints the commits among the
last N (50) whose sources have that digest (a results file's ``source_digest``).

Run metadata and results files themselves live in bench/lib/results.py (``run_meta``,
``write_report``, ``source_digest``, ``commit_digest``); this file is the command.
"""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.lib

from bench.lib.results import ROOT, commit_digest, source_digest  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "which":
        n = int(argv[2]) if len(argv) > 2 else 50
        commits = subprocess.run(["git", "-C", ROOT, "log", f"-{n}", "--format=%h"], capture_output=True,
                                 text=True, check=True).stdout.split()
        hits = [c for c in commits if commit_digest(c) == argv[1]]
        print("\n".join(hits) if hits else f"no commit among the last {n} has digest {argv[1]}")
        return 0 if hits else 1
    print(f"usage: python3 bench/runmeta.py which DIGEST [N]  (this tree: {source_digest()})")
    return 0 if argv and argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
