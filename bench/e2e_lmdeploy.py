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
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import types
from typing import Any, NamedTuple

import numpy as np
import torch


def image(seed: int, size: tuple[int, int]) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


class VisionCounter:
    """Counts vision-model calls of the supported classes (patched under featcache's wrappers)."""

    def __init__(self) -> None:
        import lmdeploy.pytorch.models.internvl as legacy
        import lmdeploy.pytorch.models.internvl3_hf as ivl
        import lmdeploy.pytorch.models.qwen2_5_vl as q25
        import lmdeploy.pytorch.models.qwen2_vl as q2

        self.calls = 0
        self.rows = 0
        counter = self

        def wrap(cls: Any, name: str) -> None:
            original = getattr(cls, name)

            def counted(self_: Any, pixel_values: Any, *a: Any, **k: Any) -> Any:
                counter.calls += 1
                counter.rows += int(pixel_values.shape[0])
                return original(self_, pixel_values, *a, **k)

            setattr(cls, name, counted)

        wrap(ivl.InternVLForConditionalGeneration, "get_image_features")
        wrap(legacy.InternVLChatModel, "extract_feature")  # InternVL2 (the seed models)
        for vt in (q2.Qwen2VisionTransformerPretrainedModel,
                   q25.Qwen2_5_VisionTransformerPretrainedModel):
            wrap(getattr(vt, "__wrapped__", vt), "forward")

    def take(self) -> tuple[int, int]:
        out = (self.calls, self.rows)
        self.calls = self.rows = 0
        return out


class PromptLogits:
    """Digests (sha256 of the raw bytes) of the prompt logits of every prefill forward, one per
    sequence of the step (split by ``attn_metadata.q_seqlens``): the supported model classes'
    ``forward`` is wrapped at class level and ``get_logits`` run on its hidden states. lmdeploy's
    PyTorch engine returns prompt logits only with ``max_new_tokens=0`` and prefix caching off, so
    ``check`` reads them here; random weights often emit the same tokens for different images, the
    logits decide. Only for ``check`` (eager, untimed): one extra lm-head projection a prefill."""

    def __init__(self) -> None:
        import hashlib
        import importlib

        import featcache.lmdeploy.models as fcm

        self.rows: list[dict[str, Any]] = []
        self.last: list[torch.Tensor] = []  # the last prefill's last-position logits, per sequence
        rec = self

        def make(orig: Any) -> Any:
            def forward(self_: Any, *a: Any, **k: Any) -> Any:
                out = orig(self_, *a, **k)
                if not _is_decoding(a, k):
                    meta = k.get("attn_metadata", a[3] if len(a) > 3 else None)
                    logits = self_.get_logits(out)
                    flat = logits.reshape(-1, logits.shape[-1])
                    lens = [int(x) for x in getattr(meta, "q_seqlens", torch.tensor([flat.shape[0]]))]
                    parts = flat.split(lens) if sum(lens) == flat.shape[0] else [flat]
                    mask = k.get("image_mask")  # the image's tokens in this step (a prefill with pixels)
                    first = mask.reshape(-1).nonzero() if mask is not None else None
                    rec.last = [q[-1].float().cpu() for q in parts]
                    rec.rows.append(dict(seqlens=lens, image_at=int(first[0]) if first is not None
                                         and len(first) else None, digests=[
                        hashlib.sha256(p.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]
                        for p in parts]))
                return out
            return forward

        for spec in fcm.SPECS.values():
            cls = getattr(importlib.import_module(f"lmdeploy.pytorch.models.{spec.module}"), spec.cls)
            _patch(getattr(cls, "__wrapped__", cls), "forward", make)

    def take(self) -> list[dict[str, Any]]:
        out, self.rows = self.rows, []
        return out

    def take_last(self) -> list[torch.Tensor]:
        out, self.last = self.last, []
        return out


CLOSE_LEFT_BEHIND: list[str] = []  # pipelines whose close() never returned (see close_pipeline)


def close_pipeline(pipe: Any, grace: float = 10.0, limit: float = 60.0) -> None:
    """``pipe.close()`` that cannot hang a benchmark: lmdeploy 0.18's ``Pipeline.close`` at tp > 1
    on its mp executor never returned on the nvidia-h200-x2 (2026-12-01; plain lmdeploy, no
    featcache in the pipeline). A likely cause, not confirmed: that executor's output prefetch
    waits for rank 0's reply on a ``multiprocessing.Event`` in a thread of the event loop's
    pool, which nothing wakes once the loop stops.

    When ``close`` has not returned within ``grace`` seconds, every thread's stack goes to
    stderr (where it hangs, for the log), the executor's return-buffer events are set (what its
    own ``release`` does) and ``close`` gets ``limit`` more seconds. If it still hangs, the
    engine's model processes are terminated (their GPU memory freed for the next engine) and
    the pipeline is recorded in ``CLOSE_LEFT_BEHIND``: the script must then leave with
    ``os._exit``, as the pipeline's event-loop thread would block the interpreter's exit."""
    closer = threading.Thread(target=pipe.close, daemon=True, name="close-pipeline")
    closer.start()
    closer.join(grace)
    if not closer.is_alive():
        return
    import faulthandler

    print(f"[e2e] pipeline close hangs after {grace:.0f} s; threads:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(all_threads=True)
    engine = getattr(getattr(pipe, "async_engine", None), "engine", None)
    executor = getattr(engine, "executor", None)
    for buf in getattr(executor, "ret_bufs", ()):
        for event in buf.notifier.events:
            event.set()
    closer.join(limit)
    if not closer.is_alive():
        print("[e2e] pipeline closed once the executor's events were set", flush=True)
        return
    print("[e2e] pipeline close still hangs; its model processes are terminated", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    for proc in getattr(executor, "procs", ()):
        proc.close()
    for proc in getattr(executor, "procs", ()):
        proc.join()
    CLOSE_LEFT_BEHIND.append(type(pipe).__name__)


def exit_after_close(rc: int) -> None:
    """Leave a benchmark script with ``rc``: through ``os._exit`` when a pipeline's close was
    left behind (``close_pipeline``), whose event-loop thread would block the interpreter's exit."""
    if CLOSE_LEFT_BEHIND:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


def remote_code(model: str) -> bool:
    """Whether the checkpoint brings its own config classes (``auto_map``: legacy InternVL2)."""
    import os

    with open(os.path.join(model, "config.json")) as f:
        return "auto_map" in json.load(f)


def build(kind: str, model: str, prefix: bool, cache: Any = None, eager: bool = True,
          kv_fraction: float = 0.05, session_len: int = 8192, tp: int = 1,
          mp_engine: bool = False) -> Any:
    """``kv_fraction``: ``cache_max_entry_count``, the share of free GPU memory for the KV cache
    (0.05 fits the 2B's series; the 26B's 32 clients of (d) need ~0.3). ``tp`` and ``mp_engine``
    (lmdeploy's engine in a second process): the same for every engine of a run; featcache then
    runs in its multi-process mode (one cache per model process, ``cache``'s settings)."""
    from lmdeploy import PytorchEngineConfig
    from lmdeploy import pipeline as plain_pipeline

    cfg = PytorchEngineConfig(session_len=session_len, cache_max_entry_count=kv_fraction,
                              eager_mode=eager, enable_prefix_caching=prefix, tp=tp,
                              enable_mp_engine=mp_engine)
    kw = dict(backend_config=cfg, log_level="ERROR", trust_remote_code=remote_code(model))
    if kind == "plain":
        return plain_pipeline(model, **kw)
    if kind == "plain_prefix":  # lmdeploy alone, its prefix caching kept on (its own pixel hashes)
        from featcache.lmdeploy.engine import keep_prefix_caching
        from featcache.lmdeploy.models import SPECS

        with keep_prefix_caching(True, supported=set(SPECS)):
            return plain_pipeline(model, **kw)
    from featcache.lmdeploy import pipeline

    return pipeline(model, cache=cache, **kw)


# -- check ---------------------------------------------------------------------------------------

LONG_PREFIX = "".join(f"line {i:03d} of a long shared instruction. " for i in range(6))[:200]
LONG_SUFFIX = ("then answer in one word, please, and nothing else at all; thank you very much, "
               "my friend, for reading this far.")


LONG_TEXT = " ".join([LONG_PREFIX] * 10) + " " + LONG_SUFFIX
# Texts of 225-245 characters before the image and a short question after it: with the tiny
# models' ~30-token images the prompt's last whole 64-token block ends at 256, inside the image, so
# the repeat's prefix match ends inside an image featcache holds (featcache.lmdeploy.prefix);
# lmdeploy alone rewinds it to 192. (A long text after the image lets the match run past the
# image's end: measured on the H200, 2026-11-30, both engines then reuse 320 or 384.)
STRADDLE = [(LONG_PREFIX + " and a few more words of it, before the picture.")[:n] for n in (225, 235, 245)]


def last_logits_diff(plain: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, float]:
    """Max |difference| of the last prompt position's logits, request by request (first
    sequence): where a prefill over cached KV makes the logits differ, by how much."""
    out = {}
    for p, o in zip(plain, other, strict=True):
        if p["_last"] and o["_last"]:
            out[p["label"]] = round(float((p["_last"][0] - o["_last"][0]).abs().max()), 4)
    return out


def check_requests() -> list[tuple[str, Any]]:
    """(label, prompt) in order; a prompt is a (text, image(s)) tuple, a list of them (one batch),
    or OpenAI-style messages."""
    a, b, c, d, e = (image(s, size) for s, size in
                     [(1, (120, 90)), (2, (64, 64)), (3, (200, 60)), (4, (90, 130)), (5, (56, 56))])
    chat = [dict(role="user", content=[dict(type="text", text="look at this"),
                                       dict(type="image_data", image_data=dict(data=c))])]
    def long(img: Any) -> list[dict[str, Any]]:
        # 200 characters of text (byte-level tokenizers: ~200 tokens, 3 full KV blocks of 64),
        # the image, then 100 more: prefix caching can reuse the text blocks before the image for
        # any image, and blocks holding the image only for the same image.
        return [dict(role="user", content=[
            dict(type="text", text=LONG_PREFIX), dict(type="image_data", image_data=dict(data=img)),
            dict(type="text", text=LONG_SUFFIX)])]

    return [
        ("long D", long(d)),
        ("long E (same text)", long(e)),
        ("long D again", long(d)),
        # control: the same long prompt without an image, twice: what the engine's prefix cache
        # does to greedy tokens by itself (a prefill of the tail over cached KV is other kernels)
        ("long text", [dict(role="user", content=LONG_TEXT)]),
        ("long text again", [dict(role="user", content=LONG_TEXT)]),
        # a repeat whose cached prefix ends inside the image (the partial-image path)
        *[(f"straddle {len(t)}{again}", [dict(role="user", content=[
            dict(type="text", text=t), dict(type="image_data", image_data=dict(data=d)),
            dict(type="text", text="what is it?")])]) for t in STRADDLE for again in ("", " again")],
        ("A", ("describe the image", a)),
        ("A again", ("describe the image", a)),
        ("B", ("describe the image", b)),
        ("A third time, other text", ("what colour dominates?", a)),
        ("A+C (hit+miss)", ("compare these", [a, c])),
        ("C+B (hit+hit)", ("compare these", [c, b])),
        ("batch D,A,E", [("one", d), ("two", a), ("three", e)]),
        ("same text, image D", ("same words for both", d)),
        ("same text, image E", ("same words for both", e)),
        ("chat turn 1", chat),
        ("chat turn 2", chat + [dict(role="assistant", content="ok"),
                                dict(role="user", content="and now?")]),
        ("chat turn 3", chat + [dict(role="assistant", content="ok"),
                                dict(role="user", content="and now?"),
                                dict(role="assistant", content="fine"),
                                dict(role="user", content="last one")]),
    ]


def rows_by(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["label"]: r for r in result["rows"]}


def run_check(pipe: Any, counter: VisionCounter, logits: PromptLogits) -> list[dict[str, Any]]:
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=12, do_sample=False, ignore_eos=True)
    rows = []
    for label, prompt in check_requests():
        counter.take()
        logits.take()
        logits.take_last()
        batch = isinstance(prompt, list) and isinstance(prompt[0], tuple)
        if batch:
            outs = pipe(prompt, gen_config=gen)
        elif isinstance(prompt, list):
            outs = [pipe([prompt], gen_config=gen)[0]]
        else:
            outs = [pipe(prompt, gen_config=gen)]
        calls, vrows = counter.take()
        rows.append(dict(label=label, token_ids=[o.token_ids for o in outs],
                         cached_tokens=[o.cached_tokens for o in outs],
                         input_tokens=[o.input_token_len for o in outs],
                         vision_calls=calls, vision_rows=vrows, prefill_logits=logits.take(),
                         _last=logits.take_last()))
    return rows


def logits_verdict(plain: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """Prompt logits, request by request: compared where both runs reused the same number of
    cached tokens (a prefill over another part of the prompt computes other positions) and the
    steps held the same sequences (a batch scheduled otherwise runs other kernel shapes); ``differ``
    must be empty."""
    same, differ, skipped = [], [], []
    for p, o in zip(plain, other, strict=True):
        if p["cached_tokens"] != o["cached_tokens"]:
            skipped.append(f"{p['label']} (cached tokens)")
        elif [r["seqlens"] for r in p["prefill_logits"]] != [r["seqlens"] for r in o["prefill_logits"]]:
            skipped.append(f"{p['label']} (scheduled otherwise)")
        elif p["prefill_logits"] == o["prefill_logits"]:
            same.append(p["label"])
        else:
            differ.append(p["label"])
    return dict(identical=len(same), differ=differ, not_compared=skipped)


CHECK_CONFIGS = ("plain", "plain_prefix", "featcache", "featcache_prefix", "featcache_restart")


def check(model: str, tier_bytes: int = 12 << 10, configs: tuple[str, ...] = CHECK_CONFIGS) -> dict[str, Any]:
    """``tier_bytes``: device and host tier sizes, about one image's features (the default fits the
    tiny models; a real-shape model needs its own: 256 tokens x LLM hidden x 2 bytes a tile).
    ``configs``: which of ``CHECK_CONFIGS`` run (plain and, for the prefix passes, plain_prefix and
    featcache_prefix always: the references and the store featcache_restart reopens)."""
    wanted = set(configs) | {"plain", "plain_prefix", "featcache_prefix"}
    configs = tuple(c for c in CHECK_CONFIGS if c in wanted)
    from featcache import FeatureCache

    counter = VisionCounter()
    logits = PromptLogits()
    results: dict[str, Any] = {"model": model}
    dirs = [tempfile.mkdtemp(prefix="fc-check-") for _ in range(2)]
    # featcache_restart reopens featcache_prefix's store in a new pipeline: a restarted server
    # plain_prefix: lmdeploy without featcache, its prefix caching forced on (0.18 switches it off
    # for these models; its own sha256 over the pixels keys the images): the reference for the
    # prefix-on passes, whose prefills over cached KV run other kernels than a full prefill
    for name, kind, prefix, store in [("plain", "plain", True, None),
                                      ("plain_prefix", "plain_prefix", True, None),
                                      ("featcache", "fc", False, 0),
                                      ("featcache_prefix", "fc", True, 1),
                                      ("featcache_restart", "fc", True, 1)]:
        if name not in configs:
            continue
        # memory tiers of about one image each, so requests are served from host and disk too; a
        # disk of 32 such (every image of the check: the restart must find them all)
        disk_bytes = max(64 << 20, 32 * tier_bytes)
        cache = FeatureCache(device="cuda", device_bytes=tier_bytes, host_bytes=tier_bytes,
                             disk_path=dirs[store], disk_bytes=disk_bytes) if kind == "fc" else None
        t = time.time()
        pipe = build(kind, model, prefix, cache)
        rows = run_check(pipe, counter, logits)
        stats = cache.stats() if cache is not None else None
        close_pipeline(pipe)
        if cache is not None:
            cache.close()
        results[name] = dict(rows=rows, stats=stats, seconds=round(time.time() - t, 1),
                             prefix_kept=getattr(pipe.async_engine.backend_config,
                                                 "enable_prefix_caching", None))
        del pipe
        gc.collect()
        torch.cuda.empty_cache()
        print(f"[e2e] {name}: done in {results[name]['seconds']} s; stats "
              f"{stats and stats.get('lmdeploy')}", flush=True)
    plain_rows = {r["label"]: r for r in results["plain"]["rows"]}
    base = {label: r["token_ids"] for label, r in plain_rows.items()}
    verdict = {}
    fc_names = [n for n in CHECK_CONFIGS if n.startswith("featcache") and n in results]
    for name in fc_names:
        mismatched = [r["label"] for r in results[name]["rows"] if r["token_ids"] != base[r["label"]]]
        verdict[name] = dict(token_identical=not mismatched, mismatched=mismatched,
                             vision_images=results[name]["stats"]["lmdeploy"].get("vision_images", 0),
                             tier_hits={t: results[name]["stats"][t]["hits"]
                                        for t in ("device", "host", "disk")},
                             vision_calls=sum(r["vision_calls"] for r in results[name]["rows"]),
                             plain_vision_calls=sum(r["vision_calls"] for r in results["plain"]["rows"]),
                             prompt_logits=logits_verdict(results["plain"]["rows"], results[name]["rows"]))
        if name != "featcache":  # against lmdeploy with the same prefix caching
            # like for like where both engines reused the same prefix; where featcache reused
            # more (a match ending inside an image it holds, featcache.lmdeploy.prefix) there is no
            # plain-prefix equivalent: those rows are held to plain lmdeploy without prefix caching
            ref = {r["label"]: r for r in results["plain_prefix"]["rows"]}
            more = [r["label"] for r in results[name]["rows"]
                    if r["cached_tokens"] != ref[r["label"]]["cached_tokens"]]
            other = [r["label"] for r in results[name]["rows"]
                     if r["label"] not in more and r["token_ids"] != ref[r["label"]]["token_ids"]]
            verdict[name]["vs_plain_prefix"] = dict(
                token_identical=not other, mismatched=other, cached_tokens_differ=more,
                cached_tokens={label: dict(featcache=rows_by(results[name])[label]["cached_tokens"],
                                           plain_prefix=ref[label]["cached_tokens"]) for label in more},
                more_cached_tokens_vs_plain=dict(
                    token_identical=all(rows_by(results[name])[label]["token_ids"] == base[label]
                                        for label in more),
                    mismatched=[label for label in more
                                if rows_by(results[name])[label]["token_ids"] != base[label]]),
                prompt_logits=logits_verdict(results["plain_prefix"]["rows"], results[name]["rows"]))
    same_text = [r for r in results["plain"]["rows"] if r["label"].startswith("same text")]
    verdict["different_images_same_text_differ"] = same_text[0]["token_ids"] != same_text[1]["token_ids"]
    # Prefix safety by the engine's own accounting: over an identical text prefix, another image
    # may reuse at most the text blocks before the image; the same image reuses blocks holding it.
    # The image's first token in plain's "long D" prefill (no prefix cache there: the whole prompt)
    # bounds what another image may reuse; 200 (the text's characters) where it is not known.
    steps = plain_rows["long D"]["prefill_logits"]
    image_at = next((s["image_at"] for s in steps if s.get("image_at") is not None), 200)
    rows = {r["label"]: r for r in results["featcache_prefix"]["rows"]}
    other, same = rows["long E (same text)"]["cached_tokens"][0], rows["long D again"]["cached_tokens"][0]
    verdict["prefix"] = dict(other_image_cached_tokens=other, same_image_cached_tokens=same,
                             image_at=image_at, safe=other <= image_at, reused=same > image_at,
                             input_tokens=rows["long D again"]["input_tokens"][0])
    # How far a prefix-cache prefill moves the logits, against how far another image moves them
    verdict["last_logits_max_abs_diff"] = {
        name: {k: v for k, v in last_logits_diff(results["plain"]["rows"], results[name]["rows"]).items()
               if v} for name in fc_names}
    verdict["last_logits_max_abs_diff"]["plain: long D vs long E (another image)"] = last_logits_diff(
        [plain_rows["long D"]], [dict(plain_rows["long E (same text)"], label="long D")])["long D"]
    verdict["partial_image_rows"] = {name: verdict[name]["vs_plain_prefix"]["cached_tokens"]
                                     for name in fc_names if name != "featcache"}
    # Where featcache reused more than lmdeploy can (a match inside an image it holds) there is no
    # prefill of the same split without featcache: its last-position logits against plain's (prefix
    # off) are held to the noise lmdeploy's own prefix caching makes on text alone (the control), far
    # under another image's difference (a wrong or misplaced image row would show as one)
    diffs = last_logits_diff(results["plain"]["rows"], results["featcache_prefix"]["rows"])
    partial = list(verdict["featcache_prefix"]["vs_plain_prefix"]["cached_tokens_differ"])
    noise = max([diffs.get("long text again", 0.0), diffs.get("long text", 0.0)])
    another = verdict["last_logits_max_abs_diff"]["plain: long D vs long E (another image)"]
    worst = max([diffs.get(label, 0.0) for label in partial], default=0.0)
    verdict["partial_rows_logits"] = dict(rows=partial, max_abs_diff_vs_plain=worst,
                                          text_prefix_noise=noise, another_image=another,
                                          within_noise=worst <= max(2 * noise, 1e-4) and worst < another / 4)
    text = [r for r in results["featcache_prefix"]["rows"] if r["label"] == "long text again"][0]
    verdict["text_only_control"] = dict(
        cached_tokens=text["cached_tokens"][0],
        token_identical=text["token_ids"] == plain_rows["long text again"]["token_ids"])
    for name in results:
        for r in results[name].get("rows", []) if isinstance(results[name], dict) else []:
            r.pop("_last", None)
    results["verdict"] = verdict
    print("[e2e] VERDICT", json.dumps(verdict), flush=True)
    return results


# -- bench ---------------------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(walls: list[float]) -> dict[str, float]:
    return dict(n=len(walls), median_ms=round(statistics.median(walls), 2),
                p90_ms=round(percentile(walls, 0.9), 2))


def spread(xs: list[float], limit: float = 2.0) -> dict[str, Any]:
    """Median and spread of one series (all reps pooled); ``noisy`` when p90 > ``limit`` x median:
    such a series makes no ratio."""
    if not xs:
        return dict(n=0, noisy=True)
    med = statistics.median(xs)
    p90 = percentile(xs, 0.9)
    return dict(n=len(xs), median_ms=round(med, 2), p10_ms=round(percentile(xs, 0.1), 2),
                p90_ms=round(p90, 2), min_ms=round(min(xs), 2), max_ms=round(max(xs), 2),
                noisy=bool(p90 > limit * med))


def timed(prompts: list[Any], pipe: Any, gen: Any) -> list[float]:
    walls = []
    for p in prompts:
        t = time.perf_counter()
        pipe(p, gen_config=gen)
        walls.append((time.perf_counter() - t) * 1e3)
    return walls


def first_token(pipe: Any, prompt: Any, gen: Any) -> tuple[float, Any]:
    """Time to the first streamed output (ms), and the whole response (the stream is drained)."""
    t = time.perf_counter()
    ttft, out = None, None
    for chunk in pipe.stream_infer([prompt], gen_config=gen):
        if ttft is None:
            ttft = (time.perf_counter() - t) * 1e3
        out = chunk if out is None else out.extend(chunk)
    assert ttft is not None and out is not None
    return ttft, out


def chat_turn(chat: int, turn: int, im: Any) -> dict[str, Any]:
    """The user message of ``turn`` in chat ``chat``: the image comes with the first one."""
    if turn == 0:
        return dict(role="user", content=[dict(type="text", text=f"chat {chat}: describe this"),
                                          dict(type="image_data", image_data=dict(data=im))])
    return dict(role="user", content=f"and what about detail {turn}?")


class ChatSeries(NamedTuple):
    """Per turn (4 lists): time to first token (ms), cached and input prompt tokens; the last
    response; with ``twins``, the same for each chat's text-only twin."""

    walls: list[list[float]]
    cached: list[list[int]]
    input_tokens: list[list[int]]
    out: Any
    twin_walls: list[list[float]]
    twin_cached: list[list[int]]
    twin_input_tokens: list[list[int]]


def _ask(pipe: Any, hist: list[dict[str, Any]], gen: Any) -> tuple[float, Any]:
    """Time to first token (ms; the wall time when one token is asked for) and the response."""
    if gen.max_new_tokens == 1:
        t = time.perf_counter()
        out = pipe([hist], gen_config=gen)[0]
        return (time.perf_counter() - t) * 1e3, out
    return first_token(pipe, hist, gen)


def prompt_tokens(pipe: Any, hist: list[dict[str, Any]]) -> int:
    """Tokens of a text-only conversation's prompt, as lmdeploy renders and tokenises it."""
    eng = pipe.async_engine
    return len(eng.tokenizer.encode(eng.chat_template.messages2prompt(hist)))


def twin_first_message(pipe: Any, chat: int, tokens: int) -> dict[str, Any]:
    """A text-only first user message whose prompt is ``tokens`` long (or just under), made of
    words no other prompt uses: the image turn's length, without an image."""
    def msg(n: int) -> dict[str, Any]:
        return dict(role="user", content=f"chat {chat}: describe this "
                    + " ".join(f"t{chat}w{i}" for i in range(n)))

    lo, hi = 0, tokens
    while lo < hi:  # the longest message not over ``tokens``
        mid = (lo + hi + 1) // 2
        if prompt_tokens(pipe, [msg(mid)]) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return msg(lo)


def chats(pipe: Any, gen: Any, size: tuple[int, int], count: int, seed: int = 100,
          twins: bool = False, observe: Any = None) -> ChatSeries:
    """``count`` 4-turn chats, each resending its image (in its first user message) every turn:
    time to first token (ms), cached and input prompt tokens per turn. With one new token the
    time is the request's wall time; with more, the first token's, by streaming.

    ``twins``: after each chat, its text-only twin through the same engine: a first message as
    many tokens long as the image turn's prompt (no image), then the same user turns and the same
    answers, so that every turn has the chat's cached and new token counts (both recorded): what
    lmdeploy itself spends on such a prompt (issue 15's reference).

    ``observe(kind, turn, ms, response)``, kind "chat" or "twin": called after every request
    (``breakdown`` reads its stage timers there)."""
    walls: list[list[float]] = [[] for _ in range(4)]
    cached: list[list[int]] = [[] for _ in range(4)]
    lens: list[list[int]] = [[] for _ in range(4)]
    t_walls: list[list[float]] = [[] for _ in range(4)]
    t_cached: list[list[int]] = [[] for _ in range(4)]
    t_lens: list[list[int]] = [[] for _ in range(4)]
    out = None
    for c in range(count):
        im = image(seed + c, size)
        hist: list[dict[str, Any]] = []
        answers = []
        for turn in range(4):
            hist.append(chat_turn(seed + c, turn, im))
            ms, out = _ask(pipe, hist, gen)
            if observe is not None:
                observe("chat", turn, ms, out)
            walls[turn].append(ms)
            cached[turn].append(out.cached_tokens)
            lens[turn].append(out.input_token_len)
            answers.append(out.text or "x")
            hist.append(dict(role="assistant", content=answers[-1]))
        if not twins:
            continue
        hist = [twin_first_message(pipe, seed + c, lens[0][-1])]
        for turn in range(4):
            if turn:
                hist.append(chat_turn(seed + c, turn, None))
            ms, t_out = _ask(pipe, hist, gen)
            if observe is not None:
                observe("twin", turn, ms, t_out)
            t_walls[turn].append(ms)
            t_cached[turn].append(t_out.cached_tokens)
            t_lens[turn].append(t_out.input_token_len)
            hist.append(dict(role="assistant", content=answers[turn]))
    return ChatSeries(walls, cached, lens, out, t_walls, t_cached, t_lens)


ENGINES = {"plain": ("plain", True), "featcache": ("fc", True), "featcache_noprefix": ("fc", False)}


def make_cache(args: argparse.Namespace, tmp: str) -> Any:
    from featcache import FeatureCache

    return FeatureCache(device=args.cache_device, device_bytes="2GiB", host_bytes="4GiB",
                        disk_path=tmp, disk_bytes="8GiB")


def real_builder(args: argparse.Namespace) -> Any:
    """``build(engine, cache) -> pipeline``; CUDA graphs unless ``--eager`` (as deployed)."""
    def b(engine: str, cache: Any) -> Any:
        kind, prefix = ENGINES[engine]
        return build(kind, args.model, prefix, cache, eager=args.eager, kv_fraction=args.kv_fraction,
                     session_len=args.session_len, tp=args.tp, mp_engine=args.mp_engine)
    return b


def warm(pipe: Any, gen: Any, size: tuple[int, int], clients: int = 4) -> None:
    """Every path the series take, once, before anything is timed: misses, a hit in a fresh
    context, a 2-turn chat, a short concurrent burst."""
    ims = [image(900 + i, size) for i in range(3)]
    timed([(f"warm {i}", im) for i, im in enumerate(ims + ims[:1])], pipe, gen)
    hist = [chat_turn(900, 0, ims[1])]
    pipe([hist], gen_config=gen)
    pipe([hist + [dict(role="assistant", content="ok"), chat_turn(900, 1, ims[1])]], gen_config=gen)
    _concurrent(pipe, [(f"warm client {i}", ims[i % 3]) for i in range(2 * clients)], gen,
                clients=clients, session_base=90_000)


def bench_engine(pipe: Any, args: argparse.Namespace, size: tuple[int, int], deadline: float,
                 save: Any = None) -> dict[str, Any]:
    """Warm, then (a) (b) (c) (d) ``--reps`` times, interleaved (a b c d, a b c d, ...)."""
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    chat_gen = gen if args.answer_tokens == 1 else GenerationConfig(
        max_new_tokens=args.answer_tokens, do_sample=False, ignore_eos=True)
    t = time.time()
    warm(pipe, gen, size)
    res: dict[str, Any] = dict(warm_s=round(time.time() - t, 1))
    pool = [image(300 + i, size) for i in range(8)]
    for i, p in enumerate(pool):  # the pool seen once, as a server would have by then
        pipe((f"pool picture {i}: what is this?", p), gen_config=gen)
    raw: dict[str, list[Any]] = dict(a=[], b=[], c=[], d=[])
    res["raw"] = raw
    for rep in range(args.reps):
        if rep and time.time() > deadline - args.rep_reserve_s:
            res["reps_skipped"] = f"stopped after {rep} reps: {deadline - time.time():.0f} s left"
            print(f"[e2e] {res['reps_skipped']}", flush=True)
            break
        same = image(10_000 + rep, size)
        first = timed([(f"rep {rep}: prime the cache with this picture", same)], pipe, gen)[0]
        rows = timed([(f"rep {rep} question {i}: what is in the picture?", same)
                      for i in range(args.n)], pipe, gen)
        raw["a"].append(dict(first_ms=first, ms=rows))
        b = chats(pipe, chat_gen, size, args.chats, seed=20_000 + 100 * rep, twins=args.text_twins)
        raw["b"].append(dict(ms=b.walls, cached=b.cached, input_tokens=b.input_tokens,
                             input_tokens_turn_4=b.out.input_token_len))
        if args.text_twins:
            raw["b"][-1].update(twin_ms=b.twin_walls, twin_cached=b.twin_cached,
                                twin_input_tokens=b.twin_input_tokens)
        raw["c"].append(timed([(f"rep {rep} question {i}: what is in the picture?",
                                image(30_000 + 100 * rep + i, size)) for i in range(args.n)], pipe, gen))
        prompts = [(f"rep {rep} client {i}: what is this?", pool[i % 8]) for i in range(args.d_requests)]
        raw["d"].append(_concurrent(pipe, prompts, gen, clients=args.clients,
                                    session_base=100_000 * (rep + 1)))
        print(f"[e2e] rep {rep}: a {statistics.median(rows):.1f} ms, c "
              f"{statistics.median(raw['c'][-1]):.1f} ms, b "
              + " / ".join(f"{statistics.median(w):.1f}" for w in b.walls)
              + (" (text twins " + " / ".join(f"{statistics.median(w):.1f}" for w in b.twin_walls) + ")"
                 if args.text_twins else "")
              + f" ms, d {raw['d'][-1]['requests_per_s']} req/s", flush=True)
        if save is not None:
            save()
    res["reps"] = len(raw["a"])
    res.update(summarise(raw, args.spread_limit))
    return res


def summarise(raw: dict[str, list[Any]], limit: float) -> dict[str, Any]:
    """Per series: all reps pooled (median, p10/p90, min/max, ``noisy``) and each rep's median."""
    def rep_medians(reps: list[list[float]]) -> list[float]:
        return [round(statistics.median(r), 2) for r in reps if r]

    out: dict[str, Any] = {}
    out["a_same_image_fresh_context"] = dict(
        **spread([x for r in raw["a"] for x in r["ms"]], limit),
        per_rep_median_ms=rep_medians([r["ms"] for r in raw["a"]]),
        first_ms=[round(r["first_ms"], 2) for r in raw["a"]])
    out["b_multi_turn"] = {
        f"turn_{t + 1}": dict(**spread([x for r in raw["b"] for x in r["ms"][t]], limit),
                              per_rep_median_ms=rep_medians([r["ms"][t] for r in raw["b"]]))
        for t in range(4)} if raw["b"] else {}
    out["b_cached_tokens_by_turn"] = [[x for r in raw["b"] for x in r["cached"][t]] for t in range(4)]
    out["b_input_tokens_turn_4"] = raw["b"][-1]["input_tokens_turn_4"] if raw["b"] else None
    if raw["b"] and "input_tokens" in raw["b"][0]:
        out["b_input_tokens_by_turn"] = [[x for r in raw["b"] for x in r["input_tokens"][t]]
                                         for t in range(4)]
    if raw["b"] and "twin_ms" in raw["b"][0]:  # the text-only twins (--text-twins)
        out["b_text_twin"] = {
            f"turn_{t + 1}": dict(**spread([x for r in raw["b"] for x in r["twin_ms"][t]], limit),
                                  cached_tokens=[x for r in raw["b"] for x in r["twin_cached"][t]],
                                  input_tokens=[x for r in raw["b"] for x in r["twin_input_tokens"][t]])
            for t in range(4)}
        # the chat turn's time over its twin's, medians (issue 15's target: <= 1.1 from turn 2)
        out["b_turn_over_text_twin"] = {
            f"turn_{t + 1}": round(out["b_multi_turn"][f"turn_{t + 1}"]["median_ms"]
                                   / out["b_text_twin"][f"turn_{t + 1}"]["median_ms"], 3)
            for t in range(4)}
    out["c_distinct_images"] = dict(**spread([x for r in raw["c"] for x in r], limit),
                                    per_rep_median_ms=rep_medians(raw["c"]))
    if raw["d"]:
        rps = [d["requests_per_s"] for d in raw["d"]]
        ttft = spread([x for d in raw["d"] for x in d["ttft_ms"]], limit)
        out["d_concurrent_32_clients_pool_8"] = dict(
            requests_per_s=round(statistics.median(rps), 2), requests_per_s_min=min(rps),
            requests_per_s_max=max(rps), requests_per_s_by_rep=rps,
            # throughput is the ratio here: noisy when the reps disagree by more than the limit
            noisy=bool(max(rps) > limit * min(rps)),
            ttft=ttft, clients=raw["d"][0]["clients"], requests=sum(d["n"] for d in raw["d"]))
    return out


SERIES = [("a_same_image_speedup", "a_same_image_fresh_context", "plain/fc"),
          *[(f"b_turn_{t}_speedup", f"b_multi_turn.turn_{t}", "plain/fc") for t in range(1, 5)],
          ("c_distinct_slowdown", "c_distinct_images", "fc/plain")]


def _get(d: dict[str, Any], path: str) -> Any:
    for k in path.split("."):
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d


def ratios(plain: dict[str, Any], fc: dict[str, Any], limit: float = 2.0) -> dict[str, Any]:
    """Plain vs featcache from the medians over all reps; a ratio whose either series is noisy
    (p90 > limit x median; for (d), requests/s of the reps apart by more than the limit) is None,
    and named in ``flagged`` with the numbers."""
    out: dict[str, Any] = {}
    flagged: dict[str, str] = {}
    for name, path, how in SERIES:
        p, f = _get(plain, path), _get(fc, path)
        if not p.get("n") or not f.get("n"):
            out[name] = None
            continue
        bad = [f"{who} p90 {s['p90_ms']} > {limit} x median {s['median_ms']}"
               for who, s in (("plain", p), ("featcache", f)) if s.get("noisy")]
        if bad:
            out[name] = None
            flagged[name] = "; ".join(bad)
            continue
        a, b = (p["median_ms"], f["median_ms"]) if how == "plain/fc" else (f["median_ms"], p["median_ms"])
        out[name] = round(a / b, 2)
    pd, fd = plain.get("d_concurrent_32_clients_pool_8"), fc.get("d_concurrent_32_clients_pool_8")
    if pd and fd:
        bad = [f"{who} requests/s by rep {d['requests_per_s_by_rep']} apart by > {limit}x"
               for who, d in (("plain", pd), ("featcache", fd)) if d.get("noisy")]
        if bad:
            out["d_requests_per_s_gain"] = None
            flagged["d_requests_per_s_gain"] = "; ".join(bad)
        else:
            out["d_requests_per_s_gain"] = round(fd["requests_per_s"] / pd["requests_per_s"], 2)
        if pd["ttft"].get("n") and fd["ttft"].get("n"):
            out["d_ttft_median_ratio"] = round(fd["ttft"]["median_ms"] / pd["ttft"]["median_ms"], 2)
    out["flagged"] = flagged
    return out


def bench_meta(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    from runmeta import run_meta

    return run_meta(mode=mode, model=args.model, label=args.label or _label(args.model),
                    args={k: v for k, v in vars(args).items() if k != "builder"})


def _label(model: str) -> str:
    import os

    return os.path.basename(os.path.normpath(model)) or model


def run_engines(args: argparse.Namespace, builder: Any, mode: str,
                per_engine: Any) -> dict[str, Any]:
    """Build each engine of ``--engines`` in turn (one at a time, GPU memory freed between), run
    ``per_engine(pipe, engine, cache, save)`` on it; the JSON is rewritten after each engine and
    rep, so a run cut short still leaves what it measured."""
    results: dict[str, Any] = {"meta": bench_meta(args, mode), "model": args.model, "engines": []}
    deadline = time.time() + args.budget

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)

    for engine in args.engines.split(","):
        if engine not in ENGINES:
            raise SystemExit(f"unknown engine {engine!r}: one of {sorted(ENGINES)}")
        with tempfile.TemporaryDirectory() as tmp:
            cache = make_cache(args, tmp) if ENGINES[engine][0] == "fc" else None
            t = time.time()
            pipe = builder(engine, cache)
            build_s = round(time.time() - t, 1)
            print(f"[e2e] {engine}: built in {build_s} s", flush=True)
            try:
                res = per_engine(pipe, engine, cache, deadline, save)
                res["build_s"] = build_s
                if cache is not None:
                    res["stats"] = cache.stats()
                if cache is not None and (args.tp > 1 or args.mp_engine):
                    from featcache.lmdeploy import model_stats

                    res["model_stats"] = model_stats(pipe)  # each model process's cache
                results[engine] = res
                results["engines"].append(engine)
            finally:
                close_pipeline(pipe)
                if cache is not None:
                    cache.close()
        del pipe
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        save()
    return results


def bench(args: argparse.Namespace, builder: Any) -> dict[str, Any]:
    """The (a)-(d) series per engine, then the ratios (when both plain and featcache ran)."""
    w, h = (int(x) for x in args.size.split("x"))

    def per_engine(pipe: Any, engine: str, cache: Any, deadline: float, save: Any) -> dict[str, Any]:
        res = bench_engine(pipe, args, (w, h), deadline, save)
        print(f"[e2e] {engine}: " + json.dumps({k: v for k, v in res.items() if k not in ("raw", "stats")}),
              flush=True)
        return res

    results = run_engines(args, builder, "bench", per_engine)
    add_ratios(results, args.spread_limit)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    report(results)
    return results


def add_ratios(results: dict[str, Any], limit: float) -> None:
    fc = next((e for e in ("featcache", "featcache_noprefix") if e in results), None)
    if "plain" in results and fc:
        results["ratios"] = ratios(results["plain"], results[fc], limit)
        results["ratios"]["featcache_engine"] = fc


def report(results: dict[str, Any]) -> None:
    """The table in the log: median [p10, p90] ms per series and engine, then the ratios."""
    def cell(s: dict[str, Any]) -> str:
        if not s.get("n"):
            return "-"
        return f"{s['median_ms']} [{s['p10_ms']}, {s['p90_ms']}]" + (" NOISY" if s.get("noisy") else "")

    rows = [("a same image", "a_same_image_fresh_context")] + [
        (f"b turn {t}", f"b_multi_turn.turn_{t}") for t in range(1, 5)] + [
        ("c distinct", "c_distinct_images"), ("d TTFT", "d_concurrent_32_clients_pool_8.ttft")]
    engines = [e for e in results.get("engines", []) if e in results]
    print(f"[e2e] TABLE {results['meta']['label']}: TTFT median [p10, p90] ms, reps "
          + ", ".join(f"{e} {results[e].get('reps')}" for e in engines))
    print("  " + f"{'series':14s}" + "".join(f"{e:>34s}" for e in engines))
    for label, path in rows:
        print("  " + f"{label:14s}" + "".join(f"{cell(_get(results[e], path)):>34s}" for e in engines))
    line = "  " + f"{'d req/s':14s}"
    for e in engines:
        d = results[e].get("d_concurrent_32_clients_pool_8")
        line += f"{(str(d['requests_per_s']) + ' ' + str(d['requests_per_s_by_rep'])) if d else '-':>34s}"
    print(line)
    if "ratios" in results:
        print("[e2e] RATIOS " + json.dumps(results["ratios"]), flush=True)


def merge(paths: list[str], out: str | None, limit: float) -> dict[str, Any]:
    """Engines of one model run in separate calls (the 26B: one engine load per 600 s call), merged
    into one result with the ratios."""
    merged: dict[str, Any] = {}
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        if not merged:
            merged = {"meta": r["meta"], "model": r["model"], "engines": [], "merged_from": []}
        elif r["model"] != merged["model"]:
            raise SystemExit(f"{p}: model {r['model']} is not {merged['model']}")
        merged["merged_from"].append(p)
        for e in r["engines"]:
            merged[e] = r[e]
            if e not in merged["engines"]:
                merged["engines"].append(e)
    add_ratios(merged, limit)
    if out:
        with open(out, "w") as f:
            json.dump(merged, f, indent=1, default=str)
    report(merged)
    return merged


def _concurrent(pipe: Any, prompts: list[Any], gen: Any, clients: int,
                session_base: int = 10_000) -> dict[str, Any]:
    """``clients`` concurrent sessions through the engine's async API; TTFT per request."""
    engine = pipe.async_engine
    ttfts: list[float] = []

    async def one(i: int, prompt: Any) -> None:
        t = time.perf_counter()
        messages = [dict(role="user", content=[
            dict(type="text", text=prompt[0]), dict(type="image_data", image_data=dict(data=prompt[1]))])]
        request = await engine.preprocess(messages, session_id=session_base + i, gen_config=gen)
        first = True
        async for _ in engine.generate(request, stream_response=True):
            if first:
                ttfts.append((time.perf_counter() - t) * 1e3)
                first = False

    async def main() -> float:
        sem = asyncio.Semaphore(clients)

        async def gated(i: int, p: Any) -> None:
            async with sem:
                await one(i, p)

        t = time.perf_counter()
        await asyncio.gather(*(gated(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - t

    wall = pipe._run(coro=main()).result()  # on the pipeline's own event-loop thread
    return {**summary(ttfts), "requests_per_s": round(len(prompts) / wall, 2), "wall_s": round(wall, 2),
            "clients": clients, "ttft_ms": [round(x, 2) for x in ttfts]}


# -- breakdown -----------------------------------------------------------------------------------

class Spans:
    """Named spans summed per request: host time (perf_counter) and, where CUDA runs, GPU time by
    CUDA events recorded on the current stream (resolved after the request, never during it). A
    span opened while a CUDA graph is being captured is not timed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: list[tuple[str, float, float, Any, Any]] = []
        self.enabled = True

    def span(self, name: str, fn: Any, *a: Any, **k: Any) -> Any:
        if not self.enabled:
            return fn(*a, **k)
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda and torch.cuda.is_current_stream_capturing():
            return fn(*a, **k)
        start = end = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            host = (time.perf_counter() - t) * 1e3
            if end is not None:
                end.record()
            with self.lock:
                self.open.append((name, host, t, start, end))

    def add(self, name: str, host_ms: float) -> None:
        with self.lock:
            self.open.append((name, host_ms, time.perf_counter(), None, None))

    def take(self) -> dict[str, Any]:
        """``{name: ms}`` (GPU time where there is one, else host), ``{name}_host`` and counts."""
        with self.lock:
            spans, self.open = self.open, []
        out: dict[str, Any] = {}
        calls: dict[str, int] = {}
        for name, host, _, start, end in spans:
            ms = host
            if end is not None:
                end.synchronize()
                ms = start.elapsed_time(end)
            out[name] = out.get(name, 0.0) + ms
            out[f"{name}_host"] = out.get(f"{name}_host", 0.0) + host
            calls[name] = calls.get(name, 0) + 1
        out["calls"] = calls
        return out


SPANS = Spans()
_PATCHED: dict[Any, Any] = {}


def _patch(owner: Any, attr: str, make: Any) -> None:
    """Replace ``owner.attr`` by ``make(original)``, once per (owner, attr)."""
    if (owner, attr) in _PATCHED:
        return
    original = getattr(owner, attr)
    _PATCHED[(owner, attr)] = original
    setattr(owner, attr, make(original))


def _is_decoding(a: tuple[Any, ...], k: dict[str, Any]) -> bool:
    meta = k.get("attn_metadata", a[3] if len(a) > 3 else None)
    return bool(getattr(meta, "is_decoding", False))


def install_stage_timers(models: list[tuple[Any, str | None, Any]] | None = None) -> list[str]:
    """Class-level timers on what the live model runs (as ``VisionCounter``: featcache's per-instance
    vision wrapper then wraps these, so ``vision`` times only real vision-model runs): each model
    class's ``forward`` (``forward_prefill`` / ``forward_decode`` by ``attn_metadata.is_decoding``),
    its vision call (``vision``), and featcache's ``_serve`` (``fc_serve``: the vision call of a step
    with featcache, hits' leases, puts and the concatenation). ``models``: (class, vision method or
    None, vision submodule class or None); default: the four architectures featcache supports."""
    import featcache.lmdeploy.models as fcm

    if models is None:
        import importlib

        import lmdeploy.pytorch.models.qwen2_5_vl as q25
        import lmdeploy.pytorch.models.qwen2_vl as q2

        models = []
        for spec in fcm.SPECS.values():
            cls = getattr(importlib.import_module(f"lmdeploy.pytorch.models.{spec.module}"), spec.cls)
            models.append((getattr(cls, "__wrapped__", cls), None if spec.submodule else spec.vision, None))
        for vt in (q2.Qwen2VisionTransformerPretrainedModel, q25.Qwen2_5_VisionTransformerPretrainedModel):
            models.append((None, None, getattr(vt, "__wrapped__", vt)))
    done = []
    for cls, vision, tower in models:
        if cls is not None:
            def fwd(orig: Any) -> Any:
                def forward(self_: Any, *a: Any, **k: Any) -> Any:
                    name = "forward_decode" if _is_decoding(a, k) else "forward_prefill"
                    return SPANS.span(name, orig, self_, *a, **k)
                return forward
            _patch(cls, "forward", fwd)
            done.append(f"{cls.__name__}.forward")
        if cls is not None and vision is not None:
            def vis(orig: Any) -> Any:
                def call(self_: Any, *a: Any, **k: Any) -> Any:
                    return SPANS.span("vision", orig, self_, *a, **k)
                return call
            _patch(cls, vision, vis)
            done.append(f"{cls.__name__}.{vision}")
        if tower is not None:
            def tow(orig: Any) -> Any:
                def forward(self_: Any, *a: Any, **k: Any) -> Any:
                    return SPANS.span("vision", orig, self_, *a, **k)
                return forward
            _patch(tower, "forward", tow)
            done.append(f"{tower.__name__}.forward")

    def serve(orig: Any) -> Any:
        def _serve(*a: Any, **k: Any) -> Any:
            return SPANS.span("fc_serve", orig, *a, **k)
        return _serve
    _patch(fcm, "_serve", serve)  # looked up by name in featcache's vision wrapper, per call
    done.append("featcache.lmdeploy.models._serve")
    return done


class D2HCounter:
    """Counts device-to-host copies made from Python while active: ``Tensor.cpu()``,
    ``Tensor.to(<cpu>)`` and ``cpu_tensor.copy_(device_tensor)`` (calls, bytes, host ms; those of
    >= 1 MiB apart: feature-sized). Patches ``torch.Tensor`` while open: use it for a few requests,
    not timed ones."""

    LARGE = 1 << 20

    def __init__(self, on_device: Any = None) -> None:
        self.on_device = on_device or (lambda t: t.is_cuda)
        self.rows: list[tuple[str, int, float]] = []
        self.lock = threading.Lock()
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> D2HCounter:
        counter = self

        def record(what: str, nbytes: int, fn: Any, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            r = fn(*a, **k)
            with counter.lock:
                counter.rows.append((what, nbytes, (time.perf_counter() - t) * 1e3))
            return r

        cpu, to, copy_ = torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.copy_
        self.saved = dict(cpu=cpu, to=to, copy_=copy_)

        def p_cpu(self_: Any, *a: Any, **k: Any) -> Any:
            if counter.on_device(self_):
                return record("cpu", self_.nbytes, cpu, self_, *a, **k)
            return cpu(self_, *a, **k)

        def p_to(self_: Any, *a: Any, **k: Any) -> Any:
            dev = k.get("device", a[0] if a else None)
            to_host = isinstance(dev, (str, torch.device)) and str(dev).startswith("cpu")
            if to_host and counter.on_device(self_):
                return record("to_cpu", self_.nbytes, to, self_, *a, **k)
            return to(self_, *a, **k)

        def p_copy(self_: Any, src: Any, *a: Any, **k: Any) -> Any:
            if (isinstance(src, torch.Tensor) and self_.device.type == "cpu"
                    and not counter.on_device(self_) and counter.on_device(src)):
                return record("copy_to_cpu", src.nbytes, copy_, self_, src, *a, **k)
            return copy_(self_, src, *a, **k)

        torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.copy_ = p_cpu, p_to, p_copy  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for k, v in self.saved.items():
            setattr(torch.Tensor, k, v)

    def take(self) -> dict[str, Any]:
        with self.lock:
            rows, self.rows = self.rows, []
        large = [r for r in rows if r[1] >= self.LARGE]
        return dict(calls=len(rows), mbytes=round(sum(r[1] for r in rows) / 2**20, 3),
                    ms=round(sum(r[2] for r in rows), 3), large_calls=len(large),
                    large_mbytes=round(sum(r[1] for r in large) / 2**20, 3),
                    large_ms=round(sum(r[2] for r in large), 3),
                    by_kind={k: sum(1 for r in rows if r[0] == k) for k in {r[0] for r in rows}})


def instrument_preprocess(pipe: Any) -> None:
    """Host-time wrappers on the live pipeline (instance attributes): lmdeploy's request
    preprocessing (template, tokenizer, image preprocessing), its image preprocessing, and
    featcache's frontend hook around it (keying, lookup, tagging)."""
    engine = pipe.async_engine
    original_pre = engine.preprocess

    async def request_preprocess(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return await original_pre(*a, **k)
        finally:
            SPANS.add("request_preprocess", (time.perf_counter() - t) * 1e3)

    engine.preprocess = request_preprocess
    vm = engine.vl_encoder.model
    hook = vm.preprocess

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                SPANS.add(name, (time.perf_counter() - t) * 1e3)
        return wrapper

    frontend = getattr(hook, "frontend", None)
    if frontend is None:
        vm.preprocess = timed("image_preprocess", hook)
    else:
        vm.preprocess = timed("fc_frontend", hook)
        frontend.original = timed("image_preprocess", frontend.original)


STAGES = ("wall", "request_preprocess", "image_preprocess", "fc_frontend_own", "vision", "fc_serve_own",
          "prefill", "decode", "engine_overhead", "forward_prefill_host", "vision_calls", "forward_calls")


def derive(spans: dict[str, Any], wall: float) -> dict[str, float]:
    """One request's stages (ms). ``prefill`` = the prefill forwards minus the vision model and
    featcache's own serving inside them; ``engine_overhead`` = wall - request preprocessing - every
    model forward (scheduling, the engine loop, input/output copies, detokenizing, the response)."""
    g = spans.get
    calls = spans.get("calls", {})
    vision = g("vision", 0.0)
    serve_own = max(0.0, g("fc_serve", 0.0) - vision) if calls.get("fc_serve") else 0.0
    fwd = g("forward_prefill", 0.0)
    d = dict(wall=wall, request_preprocess=g("request_preprocess", 0.0),
             image_preprocess=g("image_preprocess", 0.0),
             fc_frontend_own=max(0.0, g("fc_frontend", 0.0) - g("image_preprocess", 0.0))
             if calls.get("fc_frontend") else 0.0,
             vision=vision, fc_serve_own=serve_own, prefill=fwd - vision - serve_own,
             decode=g("forward_decode", 0.0),
             engine_overhead=wall - g("request_preprocess", 0.0) - fwd - g("forward_decode", 0.0),
             forward_prefill_host=g("forward_prefill_host", 0.0),
             vision_calls=float(calls.get("vision", 0)),
             forward_calls=float(calls.get("forward_prefill", 0) + calls.get("forward_decode", 0)))
    return {k: round(v, 3) for k, v in d.items()}


def breakdown_message(i: int, im: Any, tag: str) -> list[dict[str, Any]]:
    """Text *before* the image differs per request: the prefix cache cannot cover the image span,
    so a repeated image is served by featcache (or, plain, by the vision model), not by KV reuse."""
    return [dict(role="user", content=[
        dict(type="text", text=f"{tag} request {i}: look at this picture"),
        dict(type="image_data", image_data=dict(data=im)), dict(type="text", text="what is in it?")])]


def breakdown_engine(pipe: Any, args: argparse.Namespace, size: tuple[int, int],
                     on_device: Any = None) -> dict[str, Any]:
    """Per-request stages of ``--n`` misses (distinct images) and ``--n`` repeats of one image in
    fresh contexts (featcache: hits), one new token each; then a few requests with the D2H counter."""
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    instrument_preprocess(pipe)

    def request(msgs: list[dict[str, Any]]) -> dict[str, Any]:
        SPANS.take()
        t = time.perf_counter()
        out = pipe([msgs], gen_config=gen)[0]
        wall = (time.perf_counter() - t) * 1e3
        row = derive(SPANS.take(), wall)
        row["input_tokens"] = out.input_token_len
        row["cached_tokens"] = out.cached_tokens
        return row

    for i in range(3):  # warm: two misses, a repeat
        request(breakdown_message(i, image(800 + min(i, 1), size), "warm"))
    res: dict[str, Any] = {}
    res["miss"] = [request(breakdown_message(i, image(50_000 + i, size), "miss")) for i in range(args.n)]
    same = image(60_000, size)
    res["repeat_first"] = request(breakdown_message(0, same, "prime"))
    res["repeat"] = [request(breakdown_message(i, same, "repeat")) for i in range(args.n)]
    counter = D2HCounter(on_device)
    d2h: dict[str, Any] = {}
    with counter:
        for name, im in (("miss", image(70_000, size)), ("repeat", same)):
            SPANS.enabled = False  # not timed: the counter's own wrappers cost host time
            try:
                pipe([breakdown_message(99, im, f"d2h {name}")], gen_config=gen)
            finally:
                SPANS.enabled = True
            SPANS.take()
            d2h[name] = counter.take()
    res["d2h"] = d2h
    res["chat"] = chat_stages(pipe, gen, size, args.chats)
    res["medians"] = {series: {k: round(statistics.median(r[k] for r in res[series]), 3) for k in STAGES}
                      for series in ("miss", "repeat")}
    res["spread"] = {series: {k: [round(percentile([r[k] for r in res[series]], q), 3) for q in (0.1, 0.9)]
                              for k in ("wall", "vision", "prefill", "engine_overhead")}
                     for series in ("miss", "repeat")}
    return res


CHAT_COLUMNS = (*STAGES, "input_tokens", "cached_tokens")  # per chat turn: its stages and tokens


def chat_stages(pipe: Any, gen: Any, size: tuple[int, int], count: int) -> dict[str, Any]:
    """The stages of each turn of ``count`` 4-turn chats resending their image, and of each chat's
    text-only twin (same cached and new tokens): where a chat turn spends what its twin does not.
    Per kind ("chat", "twin") and turn: the rows, and each stage's median."""
    rows: dict[str, list[list[dict[str, Any]]]] = {k: [[] for _ in range(4)] for k in ("chat", "twin")}

    def observe(kind: str, turn: int, ms: float, out: Any) -> None:
        row = derive(SPANS.take(), ms)
        row["input_tokens"] = out.input_token_len
        row["cached_tokens"] = out.cached_tokens
        rows[kind][turn].append(row)

    SPANS.take()
    chats(pipe, gen, size, count, seed=300, twins=True, observe=observe)
    medians = {kind: [{k: round(statistics.median(r[k] for r in turn), 3) for k in CHAT_COLUMNS}
                      for turn in by_turn]
               for kind, by_turn in rows.items()}
    return dict(rows=rows, medians=medians)


def chat_stages_table(label: str, engine: str, chat: dict[str, Any]) -> None:
    m = chat["medians"]
    print(f"[e2e] CHAT STAGES {label} {engine}: per-turn medians, ms, chat / text-only twin")
    print("  " + f"{'stage':22s}" + "".join(f"{'turn ' + str(t + 1):>20s}" for t in range(4)))
    for k in CHAT_COLUMNS:
        print("  " + f"{k:22s}" + "".join(f"{m['chat'][t][k]:>9.2f} /{m['twin'][t][k]:>9.2f}"
                                          for t in range(4)))


# What shared/notes/gpu.md measured on the H200 for the features of one 13-tile image (bf16):
# what the 0.5/0.6 `.cpu()` of the features would cost today.
CPU_COPY_BASELINE = {"internvl2_2b": dict(features="13 x 256 x 2048 bf16 (13.6 MB)", pageable_ms=0.97,
                                          pinned_side_stream_ms=0.26),
                     "internvl2_26b": dict(features="13 x 256 x 6144 bf16 (40.9 MB)", pageable_ms=25.8,
                                           pinned_side_stream_ms=0.75)}


def breakdown(args: argparse.Namespace, builder: Any, on_device: Any = None,
              timers: list[tuple[Any, str | None, Any]] | None = None) -> dict[str, Any]:
    """Where a request's time goes, plain vs featcache: per engine, the medians of each stage over
    ``--n`` misses and ``--n`` repeats of one image (featcache: hits), and the D2H copies."""
    w, h = (int(x) for x in args.size.split("x"))
    patched = install_stage_timers(timers)
    print(f"[e2e] breakdown timers on: {patched}", flush=True)

    def per_engine(pipe: Any, engine: str, cache: Any, deadline: float, save: Any) -> dict[str, Any]:
        res = breakdown_engine(pipe, args, (w, h), on_device)
        print(f"[e2e] BREAKDOWN {engine}: {json.dumps(res['medians'])} d2h {json.dumps(res['d2h'])}",
              flush=True)
        chat_stages_table(args.label or _label(args.model), engine, res["chat"])
        return res

    results = run_engines(args, builder, "breakdown", per_engine)
    results["timers"] = patched
    results["answer"] = breakdown_answer(results)
    results["cpu_copy_baseline_h200"] = CPU_COPY_BASELINE
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    breakdown_table(results)
    return results


def breakdown_answer(results: dict[str, Any]) -> dict[str, Any]:
    """The seed's two questions, from the medians."""
    out: dict[str, Any] = {}
    plain = results.get("plain")
    if plain:
        d = plain["d2h"]
        out["plain_d2h_feature_sized_copies_per_request"] = {k: v["large_calls"] for k, v in d.items()}
        out["plain_d2h_feature_sized_ms_per_request"] = {k: v["large_ms"] for k, v in d.items()}
        out["plain_d2h_all_copies_per_request"] = {k: v["calls"] for k, v in d.items()}
        m = plain["medians"]["miss"]
        out["plain_miss_ms"] = {k: m[k] for k in ("wall", "image_preprocess", "vision", "prefill",
                                                  "engine_overhead")}
    fc = next((results[e] for e in ("featcache", "featcache_noprefix") if e in results), None)
    if fc:
        hit = fc["medians"]["repeat"]
        out["featcache_hit_ms"] = {k: hit[k] for k in ("wall", "request_preprocess", "image_preprocess",
                                                       "fc_frontend_own", "vision", "fc_serve_own",
                                                       "prefill", "engine_overhead")}
        out["featcache_hit_own_cost_ms"] = round(hit["fc_frontend_own"] + hit["fc_serve_own"], 3)
        out["featcache_hit_vision_calls"] = hit["vision_calls"]
        out["featcache_d2h_feature_sized_copies_per_request"] = {k: v["large_calls"]
                                                                 for k, v in fc["d2h"].items()}
        if plain:
            out["hit_saves_ms_vs_plain_repeat"] = round(plain["medians"]["repeat"]["wall"] - hit["wall"], 3)
    return out


def breakdown_table(results: dict[str, Any]) -> None:
    cols = [(e, s) for e in results.get("engines", []) if e in results for s in ("miss", "repeat")]
    print(f"[e2e] BREAKDOWN TABLE {results['meta']['label']}: per-request medians, ms "
          "(GPU time by CUDA events for vision/fc_serve_own/prefill/decode; host time otherwise)")
    print("  " + f"{'stage':22s}" + "".join(f"{e + ' ' + s:>24s}" for e, s in cols))
    for k in STAGES:
        print("  " + f"{k:22s}" + "".join(f"{results[e]['medians'][s][k]:24.3f}" for e, s in cols))
    for k in ("calls", "large_calls", "large_mbytes", "large_ms"):
        print("  " + f"{'d2h ' + k:22s}" + "".join(f"{results[e]['d2h'][s][k]:>24}" for e, s in cols))
    print("[e2e] ANSWER " + json.dumps(results.get("answer", {})), flush=True)


def profile(model: str, size: tuple[int, int], n: int) -> dict[str, Any]:
    """Where the time of a request goes, per configuration: plain, plain with prefix caching forced
    on, featcache with prefix caching off and on. Wall time, lmdeploy's request preprocessing
    (template, tokenizer, image preprocessing) and cached prompt tokens, for (a) and (b)."""
    import lmdeploy
    from lmdeploy import GenerationConfig

    from featcache import FeatureCache
    from featcache.lmdeploy.engine import keep_prefix_caching
    from featcache.lmdeploy.models import SPECS

    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    out: dict[str, Any] = {}
    for name in ("plain", "plain_prefix", "featcache_noprefix", "featcache_prefix"):
        cfg = lmdeploy.PytorchEngineConfig(session_len=8192, cache_max_entry_count=0.05,
                                           eager_mode=True, enable_prefix_caching=True)
        tmp = tempfile.mkdtemp()
        cache = None
        if name.startswith("featcache"):
            from featcache.lmdeploy import pipeline as fc_pipeline

            cfg.enable_prefix_caching = name.endswith("_prefix")
            cache = FeatureCache(device="cuda", device_bytes="2GiB", host_bytes="4GiB",
                                 disk_path=tmp, disk_bytes="8GiB")
            pipe = fc_pipeline(model, backend_config=cfg, cache=cache, log_level="ERROR",
                               trust_remote_code=remote_code(model))
        else:
            with keep_prefix_caching(name == "plain_prefix", set(SPECS)):
                pipe = lmdeploy.pipeline(model, backend_config=cfg, log_level="ERROR",
                                         trust_remote_code=remote_code(model))
        engine = pipe.async_engine
        spent: dict[str, list[float]] = {"request_preprocess_ms": [], "vision_preprocess_ms": []}
        original_pre = engine.preprocess

        async def timed_pre(*a: Any, _f: Any = original_pre, _s: Any = spent, **k: Any) -> Any:
            t = time.perf_counter()
            r = await _f(*a, **k)
            _s["request_preprocess_ms"].append((time.perf_counter() - t) * 1e3)
            return r

        engine.preprocess = timed_pre
        vm = engine.vl_encoder.model
        original_vm = vm.preprocess

        def timed_vm(messages: Any, _f: Any = original_vm, _s: Any = spent) -> Any:
            t = time.perf_counter()
            r = _f(messages)
            _s["vision_preprocess_ms"].append((time.perf_counter() - t) * 1e3)
            return r

        vm.preprocess = timed_vm
        timed([(f"warm {i}", image(900 + i, size)) for i in range(2)], pipe, gen)
        for v in spent.values():
            v.clear()
        same = image(1, size)
        walls, cached = [], []
        for i in range(n):
            t = time.perf_counter()
            o = pipe((f"question {i}: what is in the picture?", same), gen_config=gen)
            walls.append((time.perf_counter() - t) * 1e3)
            cached.append(o.cached_tokens)
        res: dict[str, Any] = {"a_wall": summary(walls), "a_cached_tokens": cached,
                               **{f"a_{k}": round(statistics.median(v), 2) for k, v in spent.items()}}
        for v in spent.values():
            v.clear()
        b = chats(pipe, gen, size, 3)
        res["b_wall_median_by_turn"] = [round(statistics.median(w), 2) for w in b.walls]
        res["b_cached_tokens_by_turn"] = b.cached
        res["b_input_tokens_last"] = b.out.input_token_len
        res.update({f"b_{k}": round(statistics.median(v), 2) for k, v in spent.items() if v})
        if cache is not None:
            res["lmdeploy_stats"] = cache.stats().get("lmdeploy")
        close_pipeline(pipe)
        if cache is not None:
            cache.close()
        del pipe
        gc.collect()
        torch.cuda.empty_cache()
        out[name] = res
        print(f"[e2e] PROFILE {name}: {json.dumps(res)}", flush=True)
    return out


def floor(model: str, size: tuple[int, int], n: int) -> dict[str, Any]:
    """lmdeploy's own per-request floor, and why a chat's turn 2 misses the prefix cache.

    One featcache pipeline (prefix caching on, CUDA graphs), one new token per request. Text-only
    series: a fresh ~3.4k-token prompt, the same long prompt with a new last line (a prefix-cache
    hit), a short prompt. Image series: 4-turn chats resending their image, with the token ids of
    each turn compared with the previous turn's, and turn 1 asked twice. For each request: wall
    time, lmdeploy's request preprocessing and cached prompt tokens."""
    from lmdeploy import GenerationConfig

    from featcache import FeatureCache

    gen = GenerationConfig(max_new_tokens=1, do_sample=False)
    tmp = tempfile.mkdtemp()
    cache = FeatureCache(device="cuda", device_bytes="2GiB", host_bytes="4GiB",
                         disk_path=tmp, disk_bytes="8GiB")
    pipe = build("fc", model, True, cache, eager=False)
    engine = pipe.async_engine
    seen: list[Any] = []
    original_pre = engine.preprocess

    async def recorded(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        r = await original_pre(*a, **k)
        seen.append(((time.perf_counter() - t) * 1e3, list(r.inputs.get("input_ids") or [])))
        return r

    engine.preprocess = recorded

    def run(prompt: Any) -> dict[str, Any]:
        seen.clear()
        t = time.perf_counter()
        o = pipe(prompt, gen_config=gen)
        wall = (time.perf_counter() - t) * 1e3
        o = o[0] if isinstance(o, list) else o
        if not seen:
            raise RuntimeError(f"request was not preprocessed: {o!r}"[:2000])
        pre, ids = seen[-1]
        return dict(wall_ms=wall, preprocess_ms=pre, cached=o.cached_tokens, ids=ids, out=o)

    def series(prompts: list[Any]) -> dict[str, Any]:
        rows = [run(p) for p in prompts]
        return dict(wall=summary([r["wall_ms"] for r in rows]),
                    preprocess_ms=round(statistics.median(r["preprocess_ms"] for r in rows), 2),
                    input_tokens=[len(r["ids"]) for r in rows], cached=[r["cached"] for r in rows])

    body = " ".join(f"fact {j}: the value is {j * 7 % 101}." for j in range(280))
    run(f"warm: {body}")
    timed([(f"warm {i}", image(900 + i, size)) for i in range(3)], pipe, gen)
    out: dict[str, Any] = {"model": model}
    out["text_long_fresh"] = series([f"document {i}. {body}" for i in range(n)])
    out["text_long_cached"] = series([f"document 0. {body}\nquestion {i}: which fact is last?"
                                      for i in range(n)])
    out["text_short"] = series([f"question {i}: name a colour." for i in range(n)])
    out["image_short_text_hit"] = series([(f"question {i}: what is in the picture?", image(1, size))
                                          for i in range(n)])

    def common(a: list[int], b: list[int]) -> int:
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k

    chats_out = []
    for c in range(3):
        im = image(100 + c, size)
        hist: list[dict[str, Any]] = []
        turns, prev = [], None
        for turn in range(4):
            hist.append(chat_turn(c, turn, im))
            r = run([hist])
            row = dict(wall_ms=round(r["wall_ms"], 2), preprocess_ms=round(r["preprocess_ms"], 2),
                       input_tokens=len(r["ids"]), cached=r["cached"],
                       common_prefix_with_previous=None if prev is None else common(prev, r["ids"]))
            if turn == 0:
                again = run([hist])
                row["turn1_again"] = dict(wall_ms=round(again["wall_ms"], 2), cached=again["cached"],
                                          same_ids=again["ids"] == r["ids"])
                row["generated"] = list(r["out"].token_ids)
            if prev is not None:  # where the previous turn's prompt ended, to see what differs
                row["ids_near_previous_end"] = r["ids"][len(prev) - 6:len(prev) + 6]
                row["previous_ids_end"] = prev[-6:]
            prev = r["ids"]
            turns.append(row)
            hist.append(dict(role="assistant", content=r["out"].text or "x"))
        chats_out.append(turns)
        print(f"[e2e] FLOOR chat {c}: {json.dumps(turns)}", flush=True)
    out["chats"] = chats_out
    out["lmdeploy_stats"] = cache.stats().get("lmdeploy")
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, prompts in [("text_short", [f"q {i}: name a colour." for i in range(3)]),
                          ("image_hit", [(f"q {i}: what is it?", image(1, size)) for i in range(3)])]:
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for p in prompts:
                run(p)
        out[f"profile_{name}"] = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
        print(f"[e2e] FLOOR profile {name}:\n" + out[f"profile_{name}"], flush=True)
    for k, v in out.items():
        if k.startswith(("text", "image")):
            print(f"[e2e] FLOOR {k}: {json.dumps(v)}", flush=True)
    close_pipeline(pipe)
    cache.close()
    return out



# -- dry run: a stand-in pipeline on the CPU -----------------------------------------------------

class _Meta:
    def __init__(self, is_decoding: bool) -> None:
        self.is_decoding = is_decoding


def standin() -> tuple[Any, list[tuple[Any, str | None, Any]], Any]:
    """(builder, timer targets, on_device) for a stand-in of lmdeploy's PyTorch pipeline: lmdeploy's
    own request shapes and ``Response``, featcache's real frontend (keys, lookups, hits that skip
    preprocessing) and real model hook (its per-instance vision wrapper and ``_serve``: misses run
    the vision model and are put, hits come from their leases), over a stand-in vision model
    (tiles of 28 px, a 3 ms ViT, 2 ms of image preprocessing) and engine (one prefill forward of
    ~4 ms, ~2 ms of loop overhead, the next token copied to the host). Tensors the stand-in marks
    ``_standin_device`` count as device tensors for the D2H counter; its plain engine also copies
    each step's features to the host, as lmdeploy 0.5/0.6 did (0.18 does not), so that the counter
    is seen to catch a feature-sized copy."""
    from lmdeploy.messages import Response

    import featcache.lmdeploy.models as fcm
    from featcache.lmdeploy.frontend import install_frontend
    from featcache.lmdeploy.refs import REF_KEY

    tiles, per_tile, hidden, token_id = 2, 4, 64, 7

    class Vision:
        def preprocess(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
            out = []
            for m in messages:
                for x in m["content"] if isinstance(m.get("content"), list) else []:
                    if isinstance(x, dict) and x.get("type") == "image":
                        a = np.asarray(x["data"].convert("RGB").resize((28, 28)), dtype=np.float32)
                        px = torch.from_numpy(a).permute(2, 0, 1)[None].repeat(tiles, 1, 1, 1) / 255
                        time.sleep(0.002)
                        out.append(dict(pixel_values=px, image_tokens=tiles * per_tile,
                                        image_token_id=token_id))
            messages.append(dict(role="preprocess", content=out))
            return messages

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(3 * 28 * 28 // per_tile, hidden)
            self.lm = torch.nn.Linear(hidden, hidden)

        def extract_feature(self, pixel_values: torch.Tensor) -> torch.Tensor:
            time.sleep(0.003)
            return self.proj(pixel_values.reshape(pixel_values.shape[0], per_tile, -1))

        def forward(self, input_ids: torch.Tensor, position_ids: Any = None, past_key_values: Any = None,
                    attn_metadata: Any = None, pixel_values: Any = None, image_mask: Any = None,
                    legacy_copy: bool = False) -> torch.Tensor:
            embeds = torch.zeros(input_ids.shape[0], hidden)
            if pixel_values is not None:
                feats = self.extract_feature(pixel_values)
                if legacy_copy:
                    feats._standin_device = True
                    feats = feats.to("cpu")
                embeds[image_mask] = feats.reshape(-1, hidden).to(embeds)
            time.sleep(0.004)
            return self.lm(embeds)

    spec = fcm.ArchSpec("standin", "Model", "extract_feature", False, {})

    class Engine:
        def __init__(self, legacy_copy: bool) -> None:
            self.vl_encoder = type("Encoder", (), {})()
            self.vl_encoder.model = Vision()
            self.model = Model().eval()
            self.legacy_copy = legacy_copy
            # what the text-only twins count prompts with: this stand-in's 8 characters a token
            self.tokenizer = types.SimpleNamespace(encode=lambda text: [1] * (len(text) // 8))
            self.chat_template = types.SimpleNamespace(
                messages2prompt=lambda msgs: "".join(str(m.get("content")) for m in msgs))

        def _prepare(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
            msgs = [dict(m, content=[dict(type="image", data=x["image_data"]["data"])
                                     if isinstance(x, dict) and x.get("type") == "image_data" else x
                                     for x in m["content"]]) if isinstance(m.get("content"), list) else m
                    for m in messages]
            msgs = self.vl_encoder.model.preprocess(msgs)
            items = [m for m in msgs if m.get("role") == "preprocess"][0]["content"]
            text = sum(len(str(m.get("content"))) // 8 for m in messages)
            ids = [1] * text + [token_id] * sum(int(x["image_tokens"]) for x in items)
            return dict(items=items, input_ids=torch.tensor(ids))

        async def preprocess(self, messages: Any, session_id: int, gen_config: Any) -> dict[str, Any]:
            return await asyncio.to_thread(self._prepare, messages)

        def _step(self, request: dict[str, Any]) -> torch.Tensor:
            items, ids = request["items"], request["input_ids"]
            refs = [x.get(REF_KEY) for x in items]
            pixels = [x["pixel_values"] for x, r in zip(items, refs, strict=True) if r is None or not r.hit]
            if any(r is not None for r in refs):  # featcache's model hook, as in its prepare
                fcm._ensure_vision_wrapper(self.model, spec)
                fcm._step.plan = fcm._Plan(refs, [int(x["image_tokens"]) for x in items])
            pv = torch.cat(pixels) if pixels else (torch.empty(0) if items else None)
            with torch.inference_mode():
                logits = self.model(input_ids=ids, position_ids=None, past_key_values=None,
                                    attn_metadata=_Meta(False), pixel_values=pv,
                                    image_mask=ids == token_id, legacy_copy=self.legacy_copy)
            nxt = logits[-1:].argmax(-1)
            nxt._standin_device = True
            return nxt.cpu()  # the engine's output copy (a few bytes)

        async def generate(self, request: dict[str, Any], stream_response: bool = True) -> Any:
            await asyncio.sleep(0.001)
            token = self._step(request)
            await asyncio.sleep(0.001)
            yield Response(text="x", generate_token_len=1, input_token_len=len(request["input_ids"]),
                           token_ids=[int(token)], cached_tokens=0)

    class Pipe:
        def __init__(self, legacy_copy: bool) -> None:
            self.async_engine = Engine(legacy_copy)
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.thread.start()
            self.ids = iter(range(1, 1 << 30))

        def _run(self, coro: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, self.loop)

        def __call__(self, prompts: Any, gen_config: Any) -> Any:
            async def one(p: Any) -> Any:
                if isinstance(p, tuple):
                    p = [dict(role="user", content=[dict(type="text", text=p[0]),
                                                    dict(type="image_data", image_data=dict(data=p[1]))])]
                req = await self.async_engine.preprocess(p, next(self.ids), gen_config)
                async for out in self.async_engine.generate(req):
                    return out
            if isinstance(prompts, tuple):
                return self._run(one(prompts)).result()
            return [self._run(one(p)).result() for p in prompts]

        def close(self) -> None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)

    def build(engine: str, cache: Any) -> Any:
        pipe = Pipe(legacy_copy=engine == "plain")
        if cache is not None:
            install_frontend(pipe.async_engine.vl_encoder.model, cache, "dry-run")
        return pipe

    def on_device(t: torch.Tensor) -> bool:
        return t.is_cuda or bool(getattr(t, "_standin_device", False))

    return build, [(Model, "extract_feature", None)], on_device


def dry_run(args: argparse.Namespace) -> int:
    """bench and breakdown over the stand-in, on the CPU; checks what each must produce."""
    build, timers, on_device = standin()
    base = args.json or tempfile.mktemp(prefix="e2e-dry-")
    args.cache_device = "cpu"
    args.json = base + "-bench.json"
    args.text_twins = True
    b = bench(args, build)
    for e in ("plain", "featcache"):
        r = b[e]
        assert r["reps"] == args.reps, (e, r["reps"])
        assert r["a_same_image_fresh_context"]["n"] == args.reps * args.n
        assert r["c_distinct_images"]["n"] == args.reps * args.n
        assert all(r["b_multi_turn"][f"turn_{t}"]["n"] == args.reps * args.chats for t in range(1, 5))
        twins = r["b_text_twin"]
        assert all(twins[f"turn_{t}"]["n"] == args.reps * args.chats for t in range(1, 5)), twins
        assert set(r["b_turn_over_text_twin"]) == {f"turn_{t}" for t in range(1, 5)}
        first = r["b_input_tokens_by_turn"][0]  # a twin's first turn is its chat's length or under
        assert all(0 < x <= y for x, y in zip(twins["turn_1"]["input_tokens"], first, strict=True))
        d = r["d_concurrent_32_clients_pool_8"]
        assert d["requests"] == args.reps * args.d_requests and len(d["requests_per_s_by_rep"]) == args.reps
        for s in ("a_same_image_fresh_context", "c_distinct_images"):
            x = r[s]
            assert x["p10_ms"] <= x["median_ms"] <= x["p90_ms"] and len(x["per_rep_median_ms"]) == args.reps
    st = b["featcache"]["stats"]["lmdeploy"]
    assert st.get("vision_skipped", 0) > 0 and st.get("hits", 0) > 0, st
    rat = b["ratios"]
    assert set(rat) >= {"a_same_image_speedup", "b_turn_4_speedup", "c_distinct_slowdown",
                        "d_requests_per_s_gain", "flagged"}, rat
    assert all(rat[k] is not None or k in rat["flagged"] for k, _, _ in SERIES), rat
    # a noisy series makes no ratio: plain (a) as seen once on the GPU (median 353, p90 614 -> fine;
    # a p90 above 2x median -> flagged)
    noisy = dict(b["plain"], a_same_image_fresh_context=dict(spread([60.0] * 7 + [400.0] * 3), n=10))
    flagged = ratios(noisy, b["featcache"], args.spread_limit)
    assert flagged["a_same_image_speedup"] is None and "a_same_image_speedup" in flagged["flagged"], flagged
    m = merge([args.json, args.json], base + "-merged.json", args.spread_limit)
    assert m["ratios"]["a_same_image_speedup"] == rat["a_same_image_speedup"]

    args.json = base + "-breakdown.json"
    D2HCounter.LARGE = 1024  # the stand-in's features are 2 KiB
    r = breakdown(args, build, on_device, timers)
    pm, pr = r["plain"]["medians"]["miss"], r["plain"]["medians"]["repeat"]
    fm, fh = r["featcache"]["medians"]["miss"], r["featcache"]["medians"]["repeat"]
    for row in (pm, pr, fm):
        assert row["vision_calls"] == 1 and row["vision"] >= 3 and row["image_preprocess"] >= 2, row
    assert fh["vision_calls"] == 0 and fh["vision"] == 0 and fh["image_preprocess"] == 0, fh
    assert fh["fc_frontend_own"] > 0 and fh["fc_serve_own"] > 0 and fm["fc_serve_own"] > 0, fh
    assert pm["fc_frontend_own"] == 0 and pm["fc_serve_own"] == 0, pm
    for row in (pm, fm, fh):
        assert row["prefill"] >= 4 and row["engine_overhead"] > 0 and row["forward_calls"] == 1, row
    for row in [x for e in ("plain", "featcache") for s in ("miss", "repeat") for x in r[e][s]]:
        assert abs(row["wall"] - row["request_preprocess"] - row["vision"] - row["fc_serve_own"]
                   - row["prefill"] - row["decode"] - row["engine_overhead"]) < 0.01, row
    assert r["plain"]["d2h"]["miss"]["large_calls"] == 1, r["plain"]["d2h"]
    fd = r["featcache"]["d2h"]["repeat"]
    assert fd["large_calls"] == 0 and fd["calls"] >= 1, fd
    assert r["answer"]["featcache_hit_vision_calls"] == 0
    for e in ("plain", "featcache"):
        cm = r[e]["chat"]["medians"]
        assert all(len(r[e]["chat"]["rows"][k][t]) == args.chats for k in ("chat", "twin") for t in range(4))
        assert cm["chat"][0]["vision_calls"] == 1 and all(t["vision_calls"] == 0 for t in cm["twin"]), cm
        assert all(t["input_tokens"] > 0 and t["wall"] > 0 for k in cm for t in cm[k]), cm
    # the real targets resolve (lmdeploy imports here; nothing of them runs)
    real = install_stage_timers(None)
    assert "InternVLChatModel.extract_feature" in real and "InternVLChatModel.forward" in real, real
    print(f"DRY-RUN OK: bench {args.reps} reps x 2 engines ({args.json.replace('-breakdown', '-bench')}), "
          f"breakdown ({args.json}); ratios {json.dumps(rat)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["check", "bench", "breakdown", "merge", "profile", "floor",
                                         "dry-run"])
    parser.add_argument("inputs", nargs="*", help="merge: the bench JSONs of one model")
    parser.add_argument("--model")
    parser.add_argument("--json")
    parser.add_argument("--label", help="the model's name in tables and charts (default: the dir name)")
    parser.add_argument("--n", type=int, default=None,
                        help="requests per series and rep (default 10; dry-run 3)")
    parser.add_argument("--reps", type=int, default=None,
                        help="bench: repetitions of each series, interleaved (default 3; dry-run 2)")
    parser.add_argument("--chats", type=int, default=None,
                        help="bench: 4-turn chats per rep in (b) (default 3)")
    parser.add_argument("--clients", type=int, default=None,
                        help="bench: concurrent clients in (d) (default 32)")
    parser.add_argument("--d-requests", type=int, default=None,
                        help="bench: requests per rep in (d) (default 64)")
    parser.add_argument("--engines", default="plain,featcache",
                        help="bench/breakdown: engines in order, of " + ",".join(ENGINES)
                        + " (one per call for the 26B, then merge)")
    parser.add_argument("--spread-limit", type=float, default=2.0,
                        help="a series whose p90 exceeds this x its median makes no ratio")
    parser.add_argument("--kv-fraction", type=float, default=0.05,
                        help="cache_max_entry_count (0.05; ~0.3 for the 26B's 32 clients)")
    parser.add_argument("--session-len", type=int, default=8192)
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor parallel, every engine (on CUDA set LMDEPLOY_EXECUTOR_BACKEND=mp: "
                        "lmdeploy's default executor for tp > 1 is ray)")
    parser.add_argument("--mp-engine", action="store_true",
                        help="lmdeploy's engine in a second process (enable_mp_engine), every engine")
    parser.add_argument("--eager", action="store_true", help="bench/breakdown: no CUDA graphs")
    parser.add_argument("--budget", type=float, default=540,
                        help="bench: s for the run; reps that would not fit are skipped, and named")
    parser.add_argument("--rep-reserve-s", type=float, default=60, help="bench: s a further rep needs")
    parser.add_argument("--size", default=None,
                        help="image size, WxH (default 1344x1008: 12 tiles + thumbnail)")
    parser.add_argument("--configs", default=",".join(CHECK_CONFIGS),
                        help="check: the configurations to run (plain, plain_prefix and "
                             "featcache_prefix always run)")
    parser.add_argument("--tier-bytes", type=int, default=12 << 10,
                        help="check: device and host tier bytes, about one image's features")
    parser.add_argument("--text-twins", action="store_true",
                        help="bench (b): after each chat, its text-only twin (same cached and new "
                             "tokens per turn, no image) through the same engine")
    parser.add_argument("--answer-tokens", type=int, default=1,
                        help="tokens per chat answer in (b) (bench; >1: first token streamed)")
    args = parser.parse_args(argv)
    dry = args.mode == "dry-run"
    for k, v in dict(size="112x84" if dry else "1344x1008", n=3 if dry else 10, reps=2 if dry else 3,
                     chats=1 if dry else 3, clients=4 if dry else 32, d_requests=12 if dry else 64).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.cache_device = "cuda"
    if dry:
        args.model = args.model or "<stand-in>"
        return dry_run(args)
    if args.mode == "merge":
        merge(args.inputs, args.json, args.spread_limit)
        return 0
    if not args.model:
        parser.error(f"{args.mode} needs --model")
    if args.mode == "check":
        results = check(args.model, args.tier_bytes, tuple(args.configs.split(",")))
        v = results["verdict"]
        # prefix off: identical to plain lmdeploy; prefix on: identical to lmdeploy with the same
        # prefix caching (against plain, a prefill over cached KV may move near-ties: reported)
        on = [k for k in ("featcache_prefix", "featcache_restart") if k in v]
        off = v.get("featcache", dict(token_identical=True, prompt_logits=dict(differ=[])))
        ok = (off["token_identical"] and not off["prompt_logits"]["differ"]
              and all(v[k]["vs_plain_prefix"]["token_identical"] for k in on)
              and all(v[k]["vs_plain_prefix"]["more_cached_tokens_vs_plain"]["token_identical"] for k in on)
              and not any(v[k]["vs_plain_prefix"]["prompt_logits"]["differ"] for k in on)
              and not any(v[k]["prompt_logits"]["differ"] for k in on)
              and v.get("featcache_restart", {}).get("vision_images") in (None, 0)
              and v["prefix"]["safe"] and v["prefix"]["reused"])
    elif args.mode in ("bench", "breakdown"):
        run = bench if args.mode == "bench" else breakdown
        run(args, real_builder(args))  # writes --json itself, after each engine
        return 0
    else:
        w, h = (int(x) for x in args.size.split("x"))
        if args.mode == "floor":
            results = floor(args.model, (w, h), args.n)
        else:
            results = profile(args.model, (w, h), args.n)
        ok = True
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    exit_after_close(main())
