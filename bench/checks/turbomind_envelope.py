"""TurboMind's own envelope, and whether the features path stays inside it.

    python3 bench/checks/turbomind_envelope.py run --model /tmp/models/internvl2_2b_shape --n 16 --out R.json
    python3 bench/checks/turbomind_envelope.py dry-run        # CPU: stand-in pipelines, every comparison

Two implementations of one ViT cannot round alike (TurboMind's C++ InternViT and featcache's Python
tower), so the features path's answers cannot be bit-identical to plain TurboMind's. The standard
it is held to: its deviation from plain TurboMind is at most TurboMind's own between settings a
user changes without thinking of their answers. Over N distinct images, one request each ("describe
the image"), greedy, ``--new-tokens`` tokens, ignore_eos, the generated steps' logits:

- ``reference``: plain TurboMind, prefix caching off, one request at a time;
- ``repeat``: the same requests again on the same engine (run-to-run: nothing, if TurboMind is
  deterministic);
- ``batch``: the same engine, the requests in batches of ``--batch`` at once (other kernels'
  shapes, another batch composition);
- ``prefix``: plain TurboMind with prefix caching on, each request sent twice: the second, whose
  prompt up to its last block TurboMind takes from its prefix cache, is compared;
- ``features``: ``featcache.lmdeploy.pipeline(..., turbomind="features")``, one at a time.

Each of the last three against the reference (``turbomind_features_diff.greedy_diff``): the
first generated step's logits' largest difference (they depend on the whole prompt, image
included), the requests whose token ids differ, where, and plain's top-2 margin there. The
verdict ``features_within_envelope``: the features path's step-0 difference and its fraction of
differing requests are each at most the largest of ``repeat``'s, ``batch``'s and ``prefix``'s. A
model gets the features path by default only where it holds (docs/turbomind.md). Device use: after
the ferry,
``bash bench/device/run_turbomind.sh exec python3 bench/checks/turbomind_envelope.py run ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the checkout

from bench.checks.turbomind_features_diff import PROMPT, FakePipe, ask_each, build, close, greedy_diff  # noqa: E402
from bench.lib.engines import ask, greedy  # noqa: E402
from bench.lib.images import image  # noqa: E402
from bench.lib.results import emit  # noqa: E402

MODE = "generation"  # the generated steps' logits (a real vocabulary's prompt logits are GBs)


def ask_batched(pipe: Any, imgs: list[Any], gen: Any, batch: int) -> list[dict[str, Any]]:
    """The requests in batches of ``batch`` at once, in order."""
    rows: list[dict[str, Any]] = []
    for i in range(0, len(imgs), batch):
        t = time.perf_counter()
        outs = ask(pipe, [(PROMPT, img) for img in imgs[i:i + batch]], gen)
        ms = (time.perf_counter() - t) * 1e3 / len(outs)
        rows += [dict(token_ids=list(o.token_ids), input_len=o.input_token_len, ms=ms,
                      logits=None if o.logits is None else o.logits.float().cpu().clone())
                 for o in outs]
    return rows


def verdict(envelope: dict[str, dict[str, Any]], features: dict[str, Any]) -> dict[str, Any]:
    """Is ``features`` (a ``greedy_diff``) inside the largest of ``envelope``'s deviations?"""
    step0 = max((d["step0_logits_max_abs_diff"] or 0.0) for d in envelope.values())
    frac = max(d["differing_fraction"] for d in envelope.values())
    f_step0 = features["step0_logits_max_abs_diff"]
    inside_step0 = f_step0 is not None and f_step0 <= step0
    inside_frac = features["differing_fraction"] <= frac
    return dict(envelope_step0_logits_max_abs_diff=step0, envelope_differing_fraction=frac,
                features_step0_logits_max_abs_diff=f_step0,
                features_differing_fraction=features["differing_fraction"],
                step0_inside=inside_step0, differing_inside=inside_frac,
                features_within_envelope=inside_step0 and inside_frac)


def run(args: argparse.Namespace, builder: Any = build) -> dict[str, Any]:
    w, h = (int(v) for v in args.size.split("x"))
    imgs = [image(200 + i, (w, h)) for i in range(args.n)]
    gen = greedy(args.new_tokens, ignore_eos=True, logits=MODE)
    res: dict[str, Any] = dict(model=args.model, n=args.n, new_tokens=args.new_tokens,
                               image_size=args.size, batch=args.batch)
    t0 = time.perf_counter()
    pipe, cache = builder(args.model, "plain", False)
    reference = ask_each(pipe, imgs, gen)
    repeated = ask_each(pipe, imgs, gen)
    batched = ask_batched(pipe, imgs, gen, args.batch)
    close(pipe, cache)
    pipe, cache = builder(args.model, "plain", True)
    ask_each(pipe, imgs, gen)  # fills TurboMind's prefix cache
    prefixed = ask_each(pipe, imgs, gen)
    close(pipe, cache)
    pipe, cache = builder(args.model, "features", False)
    features = ask_each(pipe, imgs, gen)
    stats = close(pipe, cache)
    envelope = dict(repeat=greedy_diff(reference, repeated, MODE),
                    batch=greedy_diff(reference, batched, MODE),
                    prefix=greedy_diff(reference, prefixed, MODE))
    res.update(envelope=envelope, features=greedy_diff(reference, features, MODE),
               features_stats=stats)
    res["verdict"] = verdict(envelope, res["features"])
    res["ms_median"] = {name: sorted(r["ms"] for r in rows)[len(rows) // 2]
                        for name, rows in (("reference", reference), ("batch", batched),
                                           ("prefix_second", prefixed), ("features", features))}
    res["total_s"] = round(time.perf_counter() - t0, 1)
    return res


# -- the CPU dry-run --------------------------------------------------------------------------------

class _BatchingFake(FakePipe):
    """``turbomind_features_diff.FakePipe`` taking batches too (a list of requests)."""

    def __call__(self, prompt: Any, gen_config: Any) -> Any:
        if isinstance(prompt, list):
            return [super(_BatchingFake, self).__call__(p, gen_config) for p in prompt]
        return super().__call__(prompt, gen_config)


def fake_builder(model: str, path: str, prefix: bool) -> tuple[Any, Any]:
    pipe = _BatchingFake(model, path)
    cache = types.SimpleNamespace(stats=lambda: {"lmdeploy": dict(pipe.stats)}, close=lambda: None)
    return pipe, (cache if path != "plain" else None)


def dry_run() -> int:
    """The request loops on stand-ins (plain's settings deviate by nothing there, the features
    stand-in by a little: not inside), and the verdict on hand-made figures."""
    args = argparse.Namespace(model="stand-in", n=6, new_tokens=4, size="120x90", batch=4)
    res = run(args, builder=fake_builder)
    assert all(d["differing"] == 0 for d in res["envelope"].values()), res["envelope"]
    assert res["envelope"]["batch"]["step0_logits_max_abs_diff"] == 0.0, res["envelope"]
    assert res["features"]["requests"] == 6 and res["features"]["step0_logits_max_abs_diff"] > 0
    assert res["verdict"]["features_within_envelope"] is False, res["verdict"]
    diff = dict(step0_logits_max_abs_diff=0.05, differing_fraction=0.25)
    wide = dict(batch=dict(step0_logits_max_abs_diff=0.06, differing_fraction=0.1),
                prefix=dict(step0_logits_max_abs_diff=0.01, differing_fraction=0.3))
    assert verdict(wide, diff)["features_within_envelope"] is True
    narrow = dict(batch=dict(step0_logits_max_abs_diff=0.06, differing_fraction=0.2))
    v = verdict(narrow, diff)
    assert v["step0_inside"] and not v["differing_inside"] and not v["features_within_envelope"]
    json.dumps(res)
    print("DRY-RUN OK:", json.dumps(res["verdict"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dry-run")
    r = sub.add_parser("run")
    r.add_argument("--model", required=True, help="an InternVL or InternVL-HF checkpoint directory")
    r.add_argument("--n", type=int, default=16, help="distinct images, one request each")
    r.add_argument("--new-tokens", type=int, default=16)
    r.add_argument("--batch", type=int, default=8, help="requests at once in the batch setting")
    r.add_argument("--size", default="1344x1008", help="image WxH (1344x1008: 13 tiles)")
    r.add_argument("--out")
    args = ap.parse_args(argv)
    if args.cmd == "dry-run":
        return dry_run()
    return emit(run(args), args.out)


if __name__ == "__main__":
    sys.exit(main())
