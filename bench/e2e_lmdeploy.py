"""featcache on the real lmdeploy 0.18 PyTorch engine, against plain lmdeploy in the same run.

    python bench/e2e_lmdeploy.py check|bench|breakdown|floor|profile --model DIR [--json OUT] ...
    python bench/e2e_lmdeploy.py merge A.json B.json --json OUT
    python bench/e2e_lmdeploy.py dry-run [--json PREFIX]          # CPU: over a stand-in pipeline

The modes and what each measures: ``--help``, bench/e2e/ (one module a mode).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.e2e

from bench.e2e.cli import main  # noqa: E402
from bench.lib.engines import exit_after_close  # noqa: E402

if __name__ == "__main__":
    exit_after_close(main())
