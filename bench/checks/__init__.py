"""Checks of one mechanism, each run once on a GPU (or the CPU) when that mechanism changed: the
multi-process mode, the per-request report, budgets that size themselves, TurboMind's features
path and its envelope, a hit's CPU costs, the data file's structural check. Not benchmarks a user
runs to compare with plain lmdeploy (those are bench/'s top-level files); ``python -m bench``
lists them apart and runs them by name."""
