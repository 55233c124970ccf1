"""What the benchmarks share, one home each:

- ``servers``: ``lmdeploy serve api_server`` / ``featcache serve`` command lines (the served
  benches' server set: ports, stores), start, wait, run for a block, stop;
- ``client``: the ``openai`` client's side of a served chat, featcache's counters from /metrics;
- ``load``: chat traffic by request class (concurrent clients, one request at a time);
- ``stages``: reading the per-stage records bench/serve_stages.py writes in a server's process;
- ``engines``: lmdeploy pipelines, plain and featcache (PyTorch engine, TurboMind), and closing
  them;
- ``models``: the checkpoints (names, builders under bench/device/, labels);
- ``images``: the seeded noise images every run sends;
- ``timing``: quantiles, medians, spreads and noise flags, timed calls;
- ``patching``: wrappers installed over library code for a measurement, and undone;
- ``results``: run metadata and the one way a results JSON is written;
- ``standin``: the CPU stand-ins for lmdeploy's pipelines the dry runs share.
"""
