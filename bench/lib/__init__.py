"""What the benchmarks share, one home each:

- ``servers``: ``lmdeploy serve api_server`` / ``featcache serve`` command lines, start, wait, stop;
- ``client``: the ``openai`` client's side of a served chat, featcache's counters from /metrics;
- ``engines``: lmdeploy PyTorch-engine pipelines, plain and featcache, and closing them;
- ``models``: the checkpoints (names, builders under bench/device/, labels);
- ``images``: the seeded noise images every run sends;
- ``timing``: quantiles, medians, spreads and noise flags;
- ``results``: run metadata and the one way a results JSON is written.
"""
