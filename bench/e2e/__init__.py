"""featcache on the real lmdeploy 0.18 PyTorch engine, against plain lmdeploy in the same run.

    python bench/e2e_lmdeploy.py check --model DIR [--json OUT]   # fidelity (tiny checkpoints)
    python bench/e2e_lmdeploy.py bench --model DIR [--json OUT]   # speed (real-shape checkpoint)
    python bench/e2e_lmdeploy.py breakdown --model DIR [--json OUT]  # where a request's time goes
    python bench/e2e_lmdeploy.py merge A.json B.json --json OUT   # engines run in separate calls
    python bench/e2e_lmdeploy.py dry-run [--json PREFIX]          # CPU: both over a stand-in pipeline

check: the same requests (repeated, distinct, multi-image, batched, a multi-turn chat resending
its images, identical text over different images) through plain lmdeploy and through featcache
with prefix caching off and on; greedy token ids must be identical, the vision model must run once
per distinct image, and the prefix cache must never serve one image's KV for another.

bench: time to first token (one new token) and requests/s for (a) the same image in fresh
contexts, (b) a 4-turn chat resending its image, (c) all-distinct images, (d) 32 concurrent clients
over a pool of 8 images; plain lmdeploy and featcache (prefix caching on), one engine at a time
(``--engines``). Each engine is warmed first (every path once), then the series run ``--reps`` times
interleaved (a b c d, a b c d, ...). Per series and chat turn: median, p10/p90, min/max over all
reps and each rep's median; ratios from the medians over all reps; a series whose p90 exceeds
``--spread-limit`` (2) x its median, or (d) whose reps' requests/s differ by more than that factor,
is flagged and makes no ratio. The JSON is rewritten after every rep; plot it with
bench/plot_bench.py.

breakdown: where a request's time goes, per engine, for ``--n`` distinct images (misses) and ``--n``
repeats of one image in fresh contexts (featcache: hits; the text before the image differs, so the
prefix cache cannot cover it): lmdeploy's request preprocessing and image preprocessing, featcache's
frontend (host time); the vision model, featcache's serving and the prefill forward minus both (GPU
time: CUDA events around the live model's vision call and forward, class-level wrappers as
``VisionCounter``); engine overhead = wall - preprocessing - forwards; then a few requests with
``Tensor.cpu()`` / ``.to(cpu)`` / ``copy_`` from a CUDA tensor counted (feature-sized: >= 1 MiB).
Prints a table and an ANSWER line (the D2H copies where lmdeploy 0.5/0.6 did its ``.cpu()``; a
featcache hit's own cost and what it saves), writes it all to ``--json``.

Needs a GPU and lmdeploy 0.18 (see docs/benchmarks.md for how it was run), except ``dry-run``.

The modules, one mode or part each: ``cli`` (the command line), ``check``, ``series`` (the
requests and series the speed modes send), ``speed`` (bench, merge, ratios), ``runner`` (one
engine at a time), ``breakdown``, ``floor`` (floor, profile), ``probes`` (class-level timers and
counters on lmdeploy's models), ``standin`` and ``dryrun`` (the CPU stand-in pipeline).
"""
