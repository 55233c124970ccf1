"""check: the same requests (repeated, distinct, multi-image, batched, a multi-turn chat resending
its images, identical text over different images) through plain lmdeploy and through featcache
with prefix caching off and on; greedy token ids must be identical, the vision model must run once
per distinct image, and the prefix cache must never serve one image's KV for another."""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from bench.e2e.probes import PromptLogits, VisionCounter
from bench.lib.engines import ask, build, close_pipeline, free_gpu
from bench.lib.images import clip_data_url, image, user_message

LONG_PREFIX = "".join(f"line {i:03d} of a long shared instruction. " for i in range(6))[:200]
LONG_SUFFIX = ("then answer in one word, please, and nothing else at all; thank you very much, "
               "my friend, for reading this far.")


LONG_TEXT = " ".join([LONG_PREFIX] * 10) + " " + LONG_SUFFIX
# Texts of 225-245 characters before the image and a short question after it: with the tiny
# models' ~30-token images the prompt's last whole 64-token block ends at 256, inside the image, so
# the repeat's prefix match ends inside an image featcache holds (featcache.lmdeploy.pytorch.prefix);
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


# the architectures whose videos featcache caches (docs/lmdeploy.md, "Videos"): the check adds a
# 4-turn chat over a short clip (issue 52)
VIDEO_ARCHS = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")


def video_chat() -> list[tuple[str, Any]]:
    """A 4-turn chat resending one short clip (a data URL) every turn, then another clip."""
    clip = {"type": "video_url", "video_url": {"url": clip_data_url(1, frames=12, size=(96, 64), fps=4.0)}}
    other = {"type": "video_url", "video_url": {"url": clip_data_url(2, frames=8, size=(64, 96), fps=2.0)}}
    turns: list[dict[str, Any]] = [dict(role="user", content=[dict(type="text", text="what happens?"), clip])]
    rows = [("video chat turn 1", list(turns))]
    for n, (answer, ask_next) in enumerate([("ok", "and then?"), ("fine", "why?"), ("sure", "last")], 2):
        turns += [dict(role="assistant", content=answer), dict(role="user", content=ask_next)]
        rows.append((f"video chat turn {n}", list(turns)))
    rows.append(("video: another clip", [dict(role="user", content=[dict(type="text", text="and this?"),
                                                                    other])]))
    return rows


def check_requests(videos: bool = False) -> list[tuple[str, Any]]:
    """(label, prompt) in order; a prompt is a (text, image(s)) tuple, a list of them (one batch),
    or OpenAI-style messages. ``videos``: the video chat too (``video_chat``)."""
    a, b, c, d, e = (image(s, size) for s, size in
                     [(1, (120, 90)), (2, (64, 64)), (3, (200, 60)), (4, (90, 130)), (5, (56, 56))])
    chat = [user_message("look at this", c)]
    def long(img: Any) -> list[dict[str, Any]]:
        # 200 characters of text (byte-level tokenizers: ~200 tokens, 3 full KV blocks of 64),
        # the image, then 100 more: prefix caching can reuse the text blocks before the image for
        # any image, and blocks holding the image only for the same image.
        return [user_message(LONG_PREFIX, img, LONG_SUFFIX)]

    return [
        ("long D", long(d)),
        ("long E (same text)", long(e)),
        ("long D again", long(d)),
        # control: the same long prompt without an image, twice: what the engine's prefix cache
        # does to greedy tokens by itself (a prefill of the tail over cached KV is other kernels)
        ("long text", [dict(role="user", content=LONG_TEXT)]),
        ("long text again", [dict(role="user", content=LONG_TEXT)]),
        # a repeat whose cached prefix ends inside the image (the partial-image path)
        *[(f"straddle {len(t)}{again}", [user_message(t, d, "what is it?")])
          for t in STRADDLE for again in ("", " again")],
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
        *(video_chat() if videos else []),
    ]


def rows_by(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["label"]: r for r in result["rows"]}


def run_check(pipe: Any, counter: VisionCounter, logits: PromptLogits,
              videos: bool = False) -> list[dict[str, Any]]:
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=12, do_sample=False, ignore_eos=True)
    rows = []
    for label, prompt in check_requests(videos):
        counter.take()
        logits.take()
        logits.take_last()
        outs = ask(pipe, prompt, gen)
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
    with open(os.path.join(model, "config.json")) as f:
        videos = bool(set(json.load(f).get("architectures") or ()) & set(VIDEO_ARCHS))
    dirs = [tempfile.mkdtemp(prefix="fc-check-") for _ in range(2)]
    # featcache_restart reopens featcache_prefix's store in a new pipeline: a restarted server
    # plain_prefix: lmdeploy without featcache, its prefix caching forced on (0.18 switches it off
    # for these models; its own sha256 over the pixels keys the images): the reference for the
    # prefix-on passes, whose prefills over cached KV run other kernels than a full prefill
    passes: list[tuple[str, str, bool, int | None]] = [  # name, kind, prefix, featcache's store
        ("plain", "plain", True, None), ("plain_prefix", "plain_prefix", True, None),
        ("featcache", "fc", False, 0), ("featcache_prefix", "fc", True, 1),
        ("featcache_restart", "fc", True, 1)]
    for name, kind, prefix, store in passes:
        if name not in configs:
            continue
        # memory tiers of about one image each, so requests are served from host and disk too; a
        # disk of 32 such (every image of the check: the restart must find them all)
        disk_bytes = max(64 << 20, 32 * tier_bytes)
        cache = FeatureCache(device="cuda", device_bytes=tier_bytes, host_bytes=tier_bytes,
                             disk_path=dirs[store], disk_bytes=disk_bytes) if store is not None else None
        t = time.time()
        pipe = build(kind, model, prefix, cache)
        rows = run_check(pipe, counter, logits, videos)
        stats = cache.stats() if cache is not None else None
        close_pipeline(pipe)
        if cache is not None:
            cache.close()
        results[name] = dict(rows=rows, stats=stats, seconds=round(time.time() - t, 1),
                             prefix_kept=getattr(pipe.async_engine.backend_config,
                                                 "enable_prefix_caching", None))
        del pipe
        free_gpu()
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
            # more (a match ending inside an image it holds, featcache.lmdeploy.pytorch.prefix) there is no
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
    # plain lmdeploy against itself: a request sent again, both times with no cached token, must
    # get the same tokens, or no comparison with it means anything (Gemma 3's tiny checkpoint on
    # lmdeploy 0.18, 2026-12-07: it did not)
    plain = rows_by(results["plain"])
    again = [label for label in plain if label.endswith(" again") and label[:-6] in plain
             and not any(plain[label]["cached_tokens"]) and not any(plain[label[:-6]]["cached_tokens"])]
    verdict["plain_repeatable"] = dict(
        pairs=len(again), differ=[x for x in again if plain[x]["token_ids"] != plain[x[:-6]]["token_ids"]])
    # Prefix safety by the engine's own accounting: over an identical text prefix, another image
    # may reuse at most the text blocks before the image; the same image reuses blocks holding it.
    # The image's first token in plain's "long D" prefill (no prefix cache there: the whole prompt)
    # bounds what another image may reuse; 200 (the text's characters) where it is not known.
    steps = plain_rows["long D"]["prefill_logits"]
    image_at = next((s["image_at"] for s in steps if s.get("image_at") is not None), 200)
    fc_rows = {r["label"]: r for r in results["featcache_prefix"]["rows"]}
    other = fc_rows["long E (same text)"]["cached_tokens"][0]
    same = fc_rows["long D again"]["cached_tokens"][0]
    # (featcache keeps the engine's prefix caching off for the families whose masks or positions
    # assume a full prefill, ``families.py``: nothing can be reused there, and nothing is asked to)
    kept = bool(results["featcache_prefix"].get("prefix_kept"))
    verdict["prefix"] = dict(other_image_cached_tokens=other, same_image_cached_tokens=same,
                             image_at=image_at, safe=other <= image_at, reused=same > image_at,
                             prefix_caching_kept=kept,
                             input_tokens=fc_rows["long D again"]["input_tokens"][0])
    # How far a prefix-cache prefill moves the logits, against how far another image moves them
    verdict["last_logits_max_abs_diff"] = {
        name: {k: v for k, v in last_logits_diff(results["plain"]["rows"], results[name]["rows"]).items()
               if v} for name in fc_names}
    verdict["last_logits_max_abs_diff"]["plain: long D vs long E (another image)"] = last_logits_diff(
        [plain_rows["long D"]], [dict(plain_rows["long E (same text)"], label="long D")]).get("long D")
    # (None: no logits to compare, e.g. requests that failed: the verdict's other fields say why)
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
                                          within_noise=another is not None and worst <= max(2 * noise, 1e-4)
                                          and worst < another / 4)  # (None: plain's rows failed)
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



def verdict_ok(v: dict[str, Any]) -> bool:
    """The check passes: prefix off, identical to plain lmdeploy; prefix on, identical to lmdeploy
    with the same prefix caching (against plain, a prefill over cached KV may move near-ties:
    reported, not failed); a restart computes no image again; the prefix cache safe, and reused
    wherever featcache keeps it on."""
    on = [k for k in ("featcache_prefix", "featcache_restart") if k in v]
    off = v.get("featcache", dict(token_identical=True, prompt_logits=dict(differ=[])))
    return bool(off["token_identical"] and not off["prompt_logits"]["differ"]
                and all(v[k]["vs_plain_prefix"]["token_identical"] for k in on)
                and all(v[k]["vs_plain_prefix"]["more_cached_tokens_vs_plain"]["token_identical"] for k in on)
                and not any(v[k]["vs_plain_prefix"]["prompt_logits"]["differ"] for k in on)
                and not any(v[k]["prompt_logits"]["differ"] for k in on)
                and v.get("featcache_restart", {}).get("vision_images") in (None, 0)
                and v["prefix"]["safe"]
                and (v["prefix"]["reused"] or not v["prefix"].get("prefix_caching_kept", True)))
