"""Which commit ran: ``python bench/runmeta.py which DIGEST [N]`` (the commits among the last N
with that source digest). Run metadata and results files live in bench/lib/results.py; this name
stays for ``from runmeta import run_meta`` in bench/turbomind_bench.py and for the command above.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.lib

from bench.lib.results import (  # noqa: E402,F401
    commit_digest,
    main,
    run_meta,
    source_digest,
    write_report,
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
