"""featcache on lmdeploy 0.18's real TurboMind engine: fidelity against plain TurboMind, by logits.

    python3 bench/turbomind_check.py import                                  # load the binary
    python3 bench/turbomind_check.py run --model DIR --path plain|native|features --out R.jsonl
    python3 bench/turbomind_check.py compare R.jsonl [--out SUMMARY.json]
    python3 bench/turbomind_check.py dry-run                                 # CPU: no engine
    python3 bench/turbomind_check.py paths DIR                               # paths DIR gets

``run`` builds one pipeline per pass (TurboMind prefix caching off, then on), sends the same
requests (repeated image, distinct image with the same text, other text on a seen image, two
two-image requests, a 3-turn chat resending its image), greedy, and writes one JSON line per pass:
the run's metadata (``run``: commit, dirty flag, GPU, start time, the sources' digest), token ids,
the sha256 of the float32 logits, the prompt length and cached tokens per request, the
times; for featcache its counters (``stats()['lmdeploy']``, hits by tier) and how often lmdeploy
computed sha256 over pixels (``_resolve_fingerprint`` without a fingerprint). Random tiny models
often emit the same tokens for different images, so the logits decide. lmdeploy refuses
``output_logits='all'`` with prefix caching on, so that pass hashes the logits of the generated
steps (``'generation'``: from the last prompt position on, which depends on every prompt token);
the prefix-off pass hashes the whole prompt's logits. Tensors are also saved (``--save``) so that
``compare`` can give the largest difference where hashes differ (the features path runs the
vision tower in PyTorch, not TurboMind's C++ ViT: close, not necessarily bit-identical); its
summary names the runs it compared (``runs``: their metadata).

``dry-run`` runs everything that needs no GPU: imports, the requests, the configs, ``compare`` on
synthetic records. Device use: bench/device/run_turbomind.sh (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.lib

from bench.lib import models  # noqa: E402
from bench.lib.engines import ask, build_turbomind, free_gpu, greedy, host_cache, turbomind_config  # noqa: E402
from bench.lib.images import image, user_message  # noqa: E402
from bench.lib.results import run_meta, write_report  # noqa: E402
from bench.lib.standin import turbomind_binding  # noqa: E402

NEW_TOKENS = 8
FEATURES_ARCHS = ("InternVLForConditionalGeneration", "InternVLChatModel")


def requests() -> list[tuple[str, Any]]:
    """(label, prompt): a (text, image(s)) tuple or OpenAI-style messages (sent as one)."""
    a, b, c, d = (image(s, size) for s, size in [(1, (120, 90)), (2, (64, 64)), (3, (200, 60)),
                                                   (4, (90, 130))])
    chat = [user_message("look at this", d)]
    turn2 = chat + [dict(role="assistant", content="ok"), dict(role="user", content="and now?")]
    turn3 = turn2 + [dict(role="assistant", content="fine"), dict(role="user", content="last one")]
    return [
        ("A", ("describe the image", a)),
        ("A again", ("describe the image", a)),
        ("A third", ("describe the image", a)),
        ("B (same text)", ("describe the image", b)),
        ("A other text", ("what colour dominates?", a)),
        ("A+B (hit+hit)", ("compare these", [a, b])),
        ("C+A (miss+hit)", ("compare these", [c, a])),
        ("chat turn 1", chat), ("chat turn 2", turn2), ("chat turn 3", turn3),
    ]


def paths_for(model: str) -> list[str]:
    """The paths a checkpoint gets: plain and native always, features where featcache has a
    tower for its architecture."""
    return ["plain", "native"] + (["features"] if models.architecture(model) in FEATURES_ARCHS else [])


def logits_kind(prefix: bool) -> str:
    """The logits a pass hashes: the whole prompt's ("all") with prefix caching off; lmdeploy
    refuses that with it on, so then the generated steps' ("generation")."""
    return "generation" if prefix else "all"


class Sha256Count:
    """Counts lmdeploy's per-image fingerprint resolutions, and those that hashed the pixels."""

    def __init__(self) -> None:
        import importlib

        self.calls = self.computed = 0
        for name in ("internvl", "qwen2_vl"):
            mod = importlib.import_module(f"lmdeploy.turbomind.models.{name}")
            original = getattr(mod, "_resolve_fingerprint", None)
            if original is not None:
                setattr(mod, "_resolve_fingerprint", self._wrap(original))  # noqa: B010 - a private name

    def _wrap(self, original: Any) -> Any:
        def counted(input_mm: dict[str, Any], *args: Any) -> bytes:  # qwen2_vl: + grid_thw
            self.calls += 1
            self.computed += input_mm.get("fingerprint") is None
            out: bytes = original(input_mm, *args)
            return out
        return counted

    def take(self) -> dict[str, int]:
        out = dict(fingerprints=self.calls, sha256_over_pixels=self.computed)
        self.calls = self.computed = 0
        return out


def digest(logits: Any) -> tuple[list[int], str, Any]:
    t = logits.float().cpu().contiguous().clone()
    return list(t.shape), hashlib.sha256(t.numpy().tobytes()).hexdigest(), t


def one_pass(model: str, path: str, prefix: bool, counter: Sha256Count,
             save: str | None) -> dict[str, Any]:
    import torch

    res: dict[str, Any] = dict(model=models.label(model), arch=models.architecture(model), path=path,
                               prefix_caching=prefix, logits=logits_kind(prefix))
    t = time.time()
    cache = None
    store = tempfile.mkdtemp(prefix="fc-tm-")
    if path != "plain":
        cache = host_cache(256 << 20, store, 1 << 30)
    pipe = build_turbomind(path, model, turbomind_config(prefix), cache)
    if cache is not None:
        res["featcache_installed"] = getattr(pipe, "featcache", None) is cache
    res["build_s"] = round(time.time() - t, 2)
    counter.take()
    gen, rows = greedy(NEW_TOKENS, ignore_eos=True, logits=logits_kind(prefix)), []
    for i, (label, prompt) in enumerate(requests()):
        t = time.time()
        out = ask(pipe, prompt, gen)[0]  # a conversation or a (text, image(s)) tuple: one response
        row = dict(label=label, token_ids=list(out.token_ids), input_tokens=out.input_token_len,
                   cached_tokens=getattr(out, "cached_tokens", None), ms=round((time.time() - t) * 1e3, 2))
        if out.logits is not None:
            row["logits_shape"], row["logits_sha256"], tensor = digest(out.logits)
            if save:
                d = os.path.join(save, res["model"], path, "prefix" if prefix else "noprefix")
                os.makedirs(d, exist_ok=True)
                torch.save(tensor, os.path.join(d, f"{i:02d}.pt"))
        rows.append(row)
    res["rows"] = rows
    res["lmdeploy_fingerprints"] = counter.take()
    if cache is not None:
        stats = cache.stats()
        res["featcache"] = stats.get("lmdeploy", {})
        res["tier_hits"] = {k: v["hits"] for k, v in stats.items() if k in ("device", "host", "disk")}
    pipe.close()
    if cache is not None:
        cache.close()
    shutil.rmtree(store, ignore_errors=True)
    return res


def run(args: argparse.Namespace) -> int:
    """Both passes (prefix caching off, then on), a JSON line each with the run's metadata
    (``run``: commit, dirty flag, GPU, start time, the sources' digest; the same for both)."""
    counter = Sha256Count()
    meta = run_meta(mode="turbomind_check", model=args.model, path=args.path, new_tokens=NEW_TOKENS)
    ok = True
    for prefix in (False, True):
        t = time.time()
        try:
            res = one_pass(args.model, args.path, prefix, counter, args.save)
            res["ok"] = True
        except BaseException as e:  # noqa: BLE001 - lmdeploy raises SystemExit too; report all
            res = dict(model=models.label(args.model), path=args.path,
                       prefix_caching=prefix, ok=False, error=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc()[-3000:])
            ok = False
        res["total_s"] = round(time.time() - t, 2)
        res["run"] = meta
        emit(res, args.out)
        free_gpu()
    return 0 if ok else 1


def emit(res: dict[str, Any], out: str | None) -> None:
    line = json.dumps(res, default=str)
    print("RESULT", line[:2000], flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def compare(records: list[dict[str, Any]], save: str | None = None) -> dict[str, Any]:
    """Per model and prefix setting: every path against plain TurboMind, label by label; the
    records' run metadata under ``runs`` (each distinct one once)."""
    by = {(r["model"], r["prefix_caching"], r["path"]): r for r in records if r.get("ok")}
    summary: dict[str, Any] = {"failed": [f'{r["model"]}/{r["path"]}/prefix={r["prefix_caching"]}: '
                                          f'{r.get("error")}' for r in records if not r.get("ok")]}
    runs = {json.dumps(r["run"], sort_keys=True): r["run"] for r in records if r.get("run")}
    summary["runs"] = list(runs.values())
    for (model, prefix, path), r in sorted(by.items()):
        base = by.get((model, prefix, "plain"))
        key = f"{model}/{'prefix' if prefix else 'noprefix'}"
        entry = summary.setdefault(key, {})
        if path == "plain":
            rows = {x["label"]: x for x in r["rows"]}
            entry["images_reach_logits"] = (rows["A"].get("logits_sha256")
                                            != rows["B (same text)"].get("logits_sha256"))
            entry["same_tokens_for_A_and_B"] = rows["A"]["token_ids"] == rows["B (same text)"]["token_ids"]
            entry["plain_cached_tokens"] = [x["cached_tokens"] for x in r["rows"]]
            entry["plain_sha256_over_pixels"] = r["lmdeploy_fingerprints"]["sha256_over_pixels"]
            continue
        if base is None:
            entry[path] = "no plain run to compare with"
            continue
        pairs = list(zip(base["rows"], r["rows"], strict=True))
        v: dict[str, Any] = dict(
            tokens_identical=all(a["token_ids"] == b["token_ids"] for a, b in pairs),
            logits_identical=all(a.get("logits_sha256") == b.get("logits_sha256") for a, b in pairs),
            token_mismatch=[a["label"] for a, b in pairs if a["token_ids"] != b["token_ids"]],
            logits_mismatch=[a["label"] for a, b in pairs
                             if a.get("logits_sha256") != b.get("logits_sha256")],
            cached_tokens=[b["cached_tokens"] for b in r["rows"]],
            sha256_over_pixels=r["lmdeploy_fingerprints"]["sha256_over_pixels"],
            featcache=r.get("featcache"), tier_hits=r.get("tier_hits"))
        if save and v["logits_mismatch"]:
            v["max_abs_diff"] = max_diffs(save, model, path, prefix, v["logits_mismatch"],
                                          [x["label"] for x in base["rows"]])
        entry[path] = v
    return summary


def max_diffs(save: str, model: str, path: str, prefix: bool, labels: list[str],
              order: list[str]) -> dict[str, Any]:
    import torch

    sub = "prefix" if prefix else "noprefix"
    out: dict[str, Any] = {}
    for label in labels:
        i = order.index(label)
        try:
            a = torch.load(os.path.join(save, model, "plain", sub, f"{i:02d}.pt"))
            b = torch.load(os.path.join(save, model, path, sub, f"{i:02d}.pt"))
            out[label] = ((a - b).abs().max().item() if a.shape == b.shape
                          else f"shapes {list(a.shape)} {list(b.shape)}")
        except FileNotFoundError as e:
            out[label] = f"not saved: {e.filename}"
    return out


def fake_pass() -> None:
    """``run`` (plain) over a stand-in pipeline: the request loop, hashing, saving, a JSON line a
    pass with the run's metadata, ``compare`` over those lines."""
    import lmdeploy
    import torch
    from lmdeploy.messages import Response

    class FakePipe:
        def __call__(self, prompt: Any, gen_config: Any) -> Any:
            r = Response(text="", generate_token_len=2, input_token_len=5, token_ids=[1, 2],
                         logits=torch.randn(6 if gen_config.output_logits == "all" else 2, 7))
            return [r] if isinstance(prompt, list) else r

        def close(self) -> None:
            pass

    real = lmdeploy.pipeline
    lmdeploy.pipeline = lambda *a, **k: FakePipe()
    try:
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(dict(architectures=["Qwen2VLForConditionalGeneration"]), f)
            out = os.path.join(d, "r.jsonl")
            args = argparse.Namespace(model=d, path="plain", out=out, save=os.path.join(d, "save"))
            assert run(args) == 0
            with open(out) as f:
                records = [json.loads(line) for line in f]
    finally:
        lmdeploy.pipeline = real
    for prefix, res in zip((False, True), records, strict=True):
        assert res["ok"] and res["prefix_caching"] is prefix and len(res["rows"]) == len(requests())
        assert res["rows"][0]["logits_shape"] == ([6, 7] if not prefix else [2, 7])
        assert res["run"]["source_digest"] and "commit" in res["run"] and res["run"]["path"] == "plain"
    assert len(compare(records)["runs"]) == 1


def dry_run() -> int:
    """What can go wrong before the GPU: imports, requests, configs, compare on fake records."""
    import featcache.lmdeploy  # noqa: F401
    import featcache.lmdeploy.turbomind  # noqa: F401
    import featcache.lmdeploy.turbomind.features  # noqa: F401

    reqs = requests()
    assert len({label for label, _ in reqs}) == len(reqs)
    for prefix in (False, True):
        assert turbomind_config(prefix).enable_prefix_caching is prefix
        gen = greedy(NEW_TOKENS, ignore_eos=True, logits=logits_kind(prefix))
        assert gen.output_logits == ("generation" if prefix else "all") and gen.ignore_eos
    import lmdeploy  # the rule the prefix-on pass works around:

    with open(os.path.join(os.path.dirname(lmdeploy.__file__), "serve/core/async_engine.py")) as f:
        assert "output_logits == 'all'" in f.read()
    with turbomind_binding():  # the recording stand-in for the compiled module (CPU tests)
        counter = Sha256Count()
        import lmdeploy.turbomind.models.internvl as ivl
        import lmdeploy.turbomind.models.qwen2_vl as q2

        assert ivl._resolve_fingerprint(dict(fingerprint=b"x" * 32)) == b"x" * 32
        assert q2._resolve_fingerprint(dict(fingerprint=b"y" * 32), (1, 2, 2)) == b"y" * 32
        assert counter.take() == dict(fingerprints=2, sha256_over_pixels=0)
        fake_pass()

    def fake(path: str, prefix: bool, sha: str) -> dict[str, Any]:
        rows = [dict(label=label, token_ids=[1, 2], cached_tokens=0, logits_sha256=f"{sha}{i}")
                for i, (label, _) in enumerate(reqs)]
        return dict(ok=True, model="m", path=path, prefix_caching=prefix, rows=rows,
                    lmdeploy_fingerprints=dict(fingerprints=11, sha256_over_pixels=0))
    s = compare([fake("plain", False, "x"), fake("native", False, "x"), fake("features", False, "y"),
                 dict(ok=False, model="m", path="native", prefix_caching=True, error="E")])
    assert s["m/noprefix"]["native"]["logits_identical"] and s["m/noprefix"]["images_reach_logits"]
    assert not s["m/noprefix"]["features"]["logits_identical"] and s["failed"]
    for arch, remote, features in (("InternVLForConditionalGeneration", False, True),
                                   ("InternVLChatModel", True, True),  # legacy: its own tower since f35213d
                                   ("Qwen2VLForConditionalGeneration", False, False)):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(dict(architectures=[arch], **(dict(auto_map={}) if remote else {})), f)
            assert paths_for(d) == ["plain", "native"] + (["features"] if features else [])
            assert models.remote_code(d) is remote
    print("DRY-RUN OK:", len(reqs), "requests;", json.dumps(s["m/noprefix"]["native"])[:200])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("import")
    sub.add_parser("dry-run")
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--path", choices=["plain", "native", "features"], required=True)
    r.add_argument("--out")
    r.add_argument("--save", help="directory for the logits tensors (for compare)")
    c = sub.add_parser("compare")
    c.add_argument("results")
    c.add_argument("--save")
    c.add_argument("--out")
    sub.add_parser("paths").add_argument("model")
    args = ap.parse_args(argv)
    if args.cmd == "dry-run":
        return dry_run()
    if args.cmd == "import":
        t = time.time()
        import lmdeploy.turbomind._turbomind as tm

        print("TURBOMIND_IMPORT_OK", tm.__file__, f"{time.time() - t:.1f} s", flush=True)
        return 0
    if args.cmd == "run":
        return run(args)
    if args.cmd == "paths":  # for the device script: which paths this checkpoint gets
        print(" ".join(paths_for(args.model)))
        return 0
    with open(args.results) as f:
        summary = compare([json.loads(line) for line in f if line.strip()], args.save)
    print(json.dumps(summary, indent=1))
    if args.out:
        write_report(args.out, summary)  # the GPU runs' metadata under "runs", this one's under "run"
    return 0


if __name__ == "__main__":
    sys.exit(main())
