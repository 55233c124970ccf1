"""Speed on lmdeploy 0.18's real TurboMind: plain TurboMind vs featcache's native and features paths.

    python3 bench/turbomind_bench.py run --model DIR --out bench.json [--n 10 --reps 3 ...]
    python3 bench/turbomind_bench.py run --model DIR --paths plain,native,combined ...  # `targets`
    python3 bench/turbomind_bench.py dry-run [--out dry.json]      # CPU, a stand-in pipeline

The series, the paths and what each figure means: ``--help``, bench/turbomind/ (one module a job).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.turbomind

from bench.turbomind.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
