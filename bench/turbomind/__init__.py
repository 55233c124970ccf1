"""Speed on lmdeploy 0.18's real TurboMind: plain TurboMind vs featcache's native and features paths.

    python3 bench/turbomind_bench.py run --model DIR --out bench.json [--n 10 --reps 3 ...]
    python3 bench/turbomind_bench.py dry-run [--out dry.json]      # CPU, a stand-in pipeline

``run`` builds one engine at a time (plain TurboMind, featcache ``turbomind="native"``, ``"features"``
and ``"combined"``; TurboMind prefix caching on for all; GPU memory freed between), warms
each, then sends the same requests to each, one new token per request (greedy), so a request's wall
time is its time to first token:

- (a) the same image in fresh contexts: one priming request, then ``--n`` requests whose text
  *before* the image differs (TurboMind's prefix cache cannot cover the image's span);
- (b) ``--chats`` 4-turn chats resending their image (in the first user message, history resent):
  per-turn time and TurboMind's ``cached_tokens`` per turn;
- (c) ``--n`` all-distinct images (every request a miss, for featcache too);
- (d) ``--clients`` concurrent clients over a pool of 8 images (seen once before), closed loop,
  ``--d-requests`` requests or ``--duration`` seconds: requests/s and TTFT median/p90/p99.

Each series is repeated ``--reps`` times (interleaved: a b c d, a b c d, ...), medians and p90 over
all repetitions, ratios against plain TurboMind measured in the same run. Every request of (a)-(c)
is also broken down with ``time.perf_counter`` around the frontend's steps (wrappers installed on
the live objects, counted per request): lmdeploy's request preprocessing, its image preprocessing,
featcache's hook (keying, cache lookup, tagging, serving: the pinned pixel copy, the put, the
fingerprint), TurboMind's ``mm_input_converter`` (lmdeploy's sha256 over pixels for plain), and the
rest (engine: ViT, prefill, scheduling). ``miss_cost`` sets native and features against plain on the
misses of (c) and (b) turn 1; ``micro`` times the same primitives alone on one 13-tile image;
``targets`` says whether each path met its issue's figures.

``dry-run`` runs all of it on the CPU over a stand-in pipeline (lmdeploy's real TurboMind Python over
the recording stand-in binding, featcache's real frontend, native and features hooks), small images.
Device use: ``bash bench/device/run_turbomind.sh bench`` (docs/benchmarks.md).

The modules, one job each: ``cli`` (the command line), ``runner`` (one engine at a time, the
results file), ``series`` (the requests, (a)-(d), warming), ``probes`` (the per-step timers),
``summary`` (a path's figures from its raw rows), ``compare`` (ratios, miss cost, targets, the
log's summary), ``micro`` (the primitives alone), ``standin`` and ``dryrun`` (the CPU stand-in).
"""
