"""featcache's benchmarks: ``python -m bench`` lists them, ``python -m bench NAME ARGS...`` runs
one as ``python3 bench/NAME.py ARGS...`` does (both forms work; docs/benchmarks.md has the runs).

The layout: a benchmark is a file here (``NAME.py``, its command line and what it measures) over
shared parts with one home each in ``lib/`` (servers, client, engines, models, images, timing,
results, stand-ins); a benchmark too large for one file is a package of its own (``e2e/``, behind
``e2e_lmdeploy.py``; ``turbomind/``, behind ``turbomind_bench.py``); ``device/`` holds the scripts
that run on the GPU machine (checkpoint builders, the bundle and run scripts); ``results/`` the
recorded results files.
"""
