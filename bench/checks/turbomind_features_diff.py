"""The features path against plain TurboMind, on TurboMind itself: how far featcache's Python tower
is from TurboMind's C++ ViT, how often greedy outputs differ, and hit == miss within featcache.

    python3 bench/checks/turbomind_features_diff.py run --model /tmp/models/internvl_hf_tiny --out R.json
    python3 bench/checks/turbomind_features_diff.py run --model /tmp/models/internvl3_2b_shape \\
        --n 24 --vit-n 4 --size 896x448 --out R2B.json
    python3 bench/checks/turbomind_features_diff.py dry-run          # CPU: no engine, stand-in pipelines

(a) ``vit``: TurboMind does not expose its ViT's features, so they are read through a
*pass-through* copy of the checkpoint (``make_passthrough``: every LLM layer's ``o_proj`` and
``down_proj`` zeroed, the final norm's weight set to 1). Its residual stream carries the input
embeddings unchanged, so TurboMind's ``last_hidden_state`` at an image position is exactly
RMSNorm(that image token's features) (``unified_decoder.cc``: the output norm is fused into the
last layer). Plain TurboMind (its C++ ViT) and the features path (featcache's tower) run the same
prompts on that copy: the difference at image positions is the two feature sets' difference after
RMS normalisation, per token; times the token's RMS it estimates the absolute difference. Checks
that come with it: text positions bit-identical between the two, and the features path's hidden
states equal to RMSNorm(featcache's own features) computed here (the pass-through is exact).
(b) ``greedy``: N distinct images, greedy, ``--new-tokens`` each, ignore_eos, one request at a time
(same batch composition on both sides), plain TurboMind vs ``featcache.lmdeploy.pipeline(...,
turbomind="features")`` on the real checkpoint: requests whose token ids differ, the first
differing position, the logit margin between plain's top two tokens there (divergence at a
near-tie is rounding, not a bug), and the largest difference of the first step's logits (which
depend on the whole prompt). A plain-vs-plain repeat is the control.
(c) ``hit_miss``: the same N requests again on the same features pipeline (all hits): token ids and
logits must be bit-identical to the misses; the vision tower must run N times in all.

Prefix caching is off throughout (lmdeploy refuses ``output_logits='all'`` and full hidden states
with it). Writes one JSON object to ``--out`` (and prints it). Device use: bench/device/
run_turbomind.sh exec (docs/turbomind.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import types
from typing import Any

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the checkout

from bench.lib import models  # noqa: E402
from bench.lib.engines import ask, build_turbomind, free_gpu, greedy, host_cache, turbomind_config  # noqa: E402
from bench.lib.images import image  # noqa: E402
from bench.lib.results import emit  # noqa: E402

PROMPT = "describe the image"
SUFFIX = "_passthrough"


# -- the pass-through checkpoint ------------------------------------------------------------------

def make_passthrough(src: str, dst: str | None = None) -> str:
    """A copy of ``src`` whose LLM passes its input embeddings through to the final norm:
    ``o_proj`` and ``down_proj`` weights (and biases) zero in every layer, final norm weight 1.
    Vision tower, projector, embeddings, tokenizer untouched. Skips the work when done before."""
    from safetensors.torch import load_file, save_file

    dst = dst or src.rstrip("/") + SUFFIX
    done = os.path.join(dst, ".passthrough_done")
    if os.path.exists(done):
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    changed = {"zeroed": 0, "norm": 0}
    for name in sorted(os.listdir(src)):
        if not name.endswith(".safetensors"):
            continue
        state = load_file(os.path.join(src, name))
        for key, value in state.items():
            if "language_model" not in key:
                continue
            if ".self_attn.o_proj." in key or ".mlp.down_proj." in key:
                state[key] = torch.zeros_like(value)
                changed["zeroed"] += 1
            elif re.fullmatch(r"(model\.)?language_model\.(model\.)?norm\.weight", key):
                state[key] = torch.ones_like(value)
                changed["norm"] += 1
        save_file(state, os.path.join(dst, name), metadata={"format": "pt"})
    if not changed["zeroed"] or changed["norm"] != 1:
        raise RuntimeError(f"{src}: not the expected LLM keys ({changed})")
    with open(done, "w") as f:
        json.dump(changed, f)
    return dst


def rms_eps(model: str) -> float:
    """The language model's RMSNorm epsilon (its config's, 1e-6 where it names none)."""
    cfg = models.config(model)
    return float((cfg.get("text_config") or cfg.get("llm_config") or cfg).get("rms_norm_eps", 1e-6))


# -- requests and pipelines -----------------------------------------------------------------------

def build(model: str, path: str, prefix: bool = False) -> tuple[Any, Any]:
    """(pipeline, featcache cache or None): plain TurboMind or the features path, prefix caching
    off unless ``prefix`` (lmdeploy refuses every position's logits and hidden states, which this
    script reads, with it on; bench/checks/turbomind_envelope.py reads the generated steps' only)."""
    cache = None if path == "plain" else host_cache(2 << 30, tempfile.mkdtemp(prefix="fc-tmdiff-"), 4 << 30)
    return build_turbomind(path, model, turbomind_config(prefix, session_len=16384), cache), cache


class Capture:
    """Records what the features path hands TurboMind (``to_turbomind``'s result) per request."""

    def __init__(self, pipe: Any) -> None:
        self.vision_model = pipe.async_engine.vl_encoder.model
        self.inner = self.vision_model.to_turbomind
        self.last: dict[str, Any] | None = None
        self.vision_model.to_turbomind = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self.inner(*args, **kwargs)
        return self.last


def ask_each(pipe: Any, imgs: list[Any], gen: Any, capture: Capture | None = None) -> list[dict[str, Any]]:
    """One request per image, one at a time."""
    rows = []
    for img in imgs:
        t = time.perf_counter()
        out = ask(pipe, (PROMPT, img), gen)[0]
        row: dict[str, Any] = dict(token_ids=list(out.token_ids), input_len=out.input_token_len,
                                   ms=(time.perf_counter() - t) * 1e3)
        row["logits"] = None if out.logits is None else out.logits.float().cpu().clone()
        row["hidden"] = (None if out.last_hidden_state is None
                         else out.last_hidden_state.cpu().clone())
        if capture is not None and capture.last is not None:
            row["ranges"] = [list(r) for r in capture.last["input_embedding_ranges"]]
            row["features"] = [f.cpu().clone() for f in capture.last["input_embeddings"]]
        rows.append(row)
    return rows


def close(pipe: Any, cache: Any) -> dict[str, Any]:
    stats = cache.stats().get("lmdeploy", {}) if cache is not None else {}
    pipe.close()
    if cache is not None:
        cache.close()
    free_gpu()
    return dict(stats)


# -- the comparisons (pure: the dry-run checks them) ------------------------------------------------

def rms_normalise(x: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def vit_diff(plain: list[dict[str, Any]], feat: list[dict[str, Any]], eps: float) -> dict[str, Any]:
    """TurboMind's C++ ViT vs featcache's tower, read through the pass-through LLM (see above)."""
    d_norm, d_est, fvals, bit_equal, total = [], [], [], 0, 0
    text_identical, passthrough_err, cos_min = True, 0.0, 1.0
    for a, b in zip(plain, feat, strict=True):
        ha, hb = a["hidden"], b["hidden"]
        n = b["input_len"]
        if a["input_len"] != n:
            raise RuntimeError(f"prompt lengths differ: {a['input_len']} vs {n}")
        ha, hb = ha[:n], hb[:n]
        idx = torch.cat([torch.arange(s, e) for s, e in b["ranges"]])
        text = torch.ones(n, dtype=torch.bool)
        text[idx] = False
        text_identical &= bool(torch.equal(ha[text], hb[text]))
        x = torch.cat(b["features"]).float()
        own = rms_normalise(x, eps, hb.dtype)
        passthrough_err = max(passthrough_err, (own.float() - hb[idx].float()).abs().max().item())
        na, nb = ha[idx].float(), hb[idx].float()
        diff = (na - nb).abs()
        rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        d_norm.append(diff.flatten())
        d_est.append((diff * rms).flatten())
        fvals.append(x.abs().flatten())
        bit_equal += int((ha[idx] == hb[idx]).sum())
        total += diff.numel()
        cos_min = min(cos_min, torch.nn.functional.cosine_similarity(na, nb, dim=-1).min().item())
    dn, de, fv = torch.cat(d_norm), torch.cat(d_est), torch.cat(fvals)
    return dict(
        images=len(plain), image_tokens=total // max(1, plain[0]["hidden"].shape[-1]),
        normalised_max_abs_diff=dn.max().item(), normalised_mean_abs_diff=dn.mean().item(),
        elements_bit_identical=bit_equal / max(1, total),
        est_feature_max_abs_diff=de.max().item(), est_feature_mean_abs_diff=de.mean().item(),
        feature_max_abs=fv.max().item(), feature_mean_abs=fv.mean().item(),
        cosine_min=cos_min, text_positions_identical=text_identical,
        passthrough_max_err=passthrough_err)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _step(row: dict[str, Any], k: int, mode: str) -> torch.Tensor | None:
    """Logits of generated step ``k`` (``'all'`` starts at the prompt's first position)."""
    logits = row["logits"]
    if logits is None:
        return None
    i = k + (row["input_len"] - 1 if mode == "all" else 0)
    return logits[i] if i < logits.shape[0] else None


def greedy_diff(plain: list[dict[str, Any]], feat: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Requests whose greedy token ids differ, where, and how close to a tie plain was there."""
    firsts, margins, step0 = [], [], []
    for a, b in zip(plain, feat, strict=True):
        s0a, s0b = _step(a, 0, mode), _step(b, 0, mode)
        if s0a is not None and s0b is not None:
            step0.append((s0a - s0b).abs().max().item())
        k = _first_diff(a["token_ids"], b["token_ids"])
        if k is None:
            continue
        firsts.append(k)
        la = _step(a, k, mode)
        if la is not None:
            top = la.topk(2).values
            margins.append((top[0] - top[1]).item())
    return dict(requests=len(plain), differing=len(firsts),
                differing_fraction=len(firsts) / max(1, len(plain)), first_diff_positions=firsts,
                plain_top2_margin_at_divergence=margins,
                step0_logits_max_abs_diff=max(step0) if step0 else None,
                step0_logits_mean_of_max_abs_diff=sum(step0) / len(step0) if step0 else None)


def identical(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Bit-identity of token ids and logits, request by request."""
    tok = [x["token_ids"] == y["token_ids"] for x, y in zip(a, b, strict=True)]
    lg = [x["logits"] is not None and y["logits"] is not None and torch.equal(x["logits"], y["logits"])
          for x, y in zip(a, b, strict=True)]
    return dict(requests=len(a), tokens_identical=sum(tok), logits_identical=sum(lg),
                all_identical=all(tok) and all(lg))


def strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [dict(token_ids=r["token_ids"], input_len=r["input_len"], ms=round(r["ms"], 2))
            for r in rows]


# -- the run ----------------------------------------------------------------------------------------

def run(args: argparse.Namespace, builder: Any = build) -> dict[str, Any]:
    w, h = (int(v) for v in args.size.split("x"))
    imgs = [image(100 + i, (w, h)) for i in range(args.n)]
    res: dict[str, Any] = dict(model=args.model, n=args.n, new_tokens=args.new_tokens,
                               image_size=args.size, logits=args.logits,
                               device=torch.cuda.get_device_name() if torch.cuda.is_available()
                               else "cpu")
    t0 = time.perf_counter()

    # (a) the features themselves, through the pass-through copy
    try:
        if args.vit_n > 0:
            vit_part(args, imgs, res, builder)
    except Exception as e:  # (b) and (c) still run
        import traceback

        res["vit"] = dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
    greedy_part(args, imgs, res, builder)
    res["total_s"] = round(time.perf_counter() - t0, 1)
    return res


def vit_part(args: argparse.Namespace, imgs: list[Any], res: dict[str, Any], builder: Any) -> None:
    """(a): plain TurboMind and the features path on the pass-through copy."""
    t = time.perf_counter()
    through = make_passthrough(args.model, args.passthrough)
    res["passthrough_s"] = round(time.perf_counter() - t, 1)
    gen = greedy(1, ignore_eos=True, hidden=True)
    pipe, cache = builder(through, "plain")
    plain = ask_each(pipe, imgs[:args.vit_n], gen)
    close(pipe, cache)
    pipe, cache = builder(through, "features")
    feat = ask_each(pipe, imgs[:args.vit_n], gen, Capture(pipe))
    close(pipe, cache)
    if any(r["hidden"] is None for r in plain + feat):
        raise RuntimeError("TurboMind returned no last_hidden_state")
    res["vit"] = vit_diff(plain, feat, rms_eps(args.model))
    del plain, feat
    res["vit_s"] = round(time.perf_counter() - t, 1)


def greedy_part(args: argparse.Namespace, imgs: list[Any], res: dict[str, Any], builder: Any) -> None:
    """(b) greedy outputs, plain vs features; (c) hits vs misses."""
    vocab_small = args.logits == "all"
    gen = greedy(args.new_tokens, ignore_eos=True, logits=args.logits)
    t = time.perf_counter()
    pipe, cache = builder(args.model, "plain")
    plain = ask_each(pipe, imgs, gen)
    k = min(args.control, len(imgs))
    again = ask_each(pipe, imgs[:k], gen)
    close(pipe, cache)
    res["plain_repeat_control"] = identical(plain[:k], again)
    pipe, cache = builder(args.model, "features")
    misses = ask_each(pipe, imgs, gen)
    hits = ask_each(pipe, imgs, gen)
    stats = close(pipe, cache)
    res["greedy"] = greedy_diff(plain, misses, args.logits)
    res["hit_miss"] = dict(identical(misses, hits), vision_images=stats.get("vision_images"),
                           tm_features_served=stats.get("tm_features_served"),
                           hits=stats.get("hits"), misses=stats.get("misses"),
                           vision_ran_once_per_image=stats.get("vision_images") == len(imgs))
    res["ms_median"] = {name: sorted(r["ms"] for r in rows)[len(rows) // 2]
                        for name, rows in (("plain", plain), ("features_miss", misses),
                                           ("features_hit", hits))}
    res["greedy_s"] = round(time.perf_counter() - t, 1)
    if args.rows:
        res["rows"] = dict(plain=strip(plain), features=strip(misses))
    res["logits_note"] = ("prompt + generated logits" if vocab_small else
                          "generated steps' logits (the first depends on the whole prompt)")


# -- the CPU dry-run --------------------------------------------------------------------------------

class FakePipe:
    """A stand-in pipeline: deterministic outputs from the image; ``features`` perturbs them a
    little, as a second vision model would. Its ``to_turbomind`` is called like lmdeploy's."""

    def __init__(self, model: str, path: str, hidden: int = 16, vocab: int = 32) -> None:
        self.path, self.hidden, self.vocab = path, hidden, vocab
        self.passthrough = model.endswith(SUFFIX)
        self.stats: dict[str, int] = {"vision_images": 0, "tm_features_served": 0}
        self.seen: set[int] = set()
        model_ns = types.SimpleNamespace(to_turbomind=self._to_turbomind)
        self.async_engine = types.SimpleNamespace(vl_encoder=types.SimpleNamespace(model=model_ns))

    def _to_turbomind(self, feats: torch.Tensor) -> dict[str, Any]:
        return dict(input_embeddings=[feats], input_embedding_ranges=[[3, 3 + feats.shape[0]]])

    def __call__(self, prompt: Any, gen_config: Any) -> Any:
        from lmdeploy.messages import Response

        img = prompt[1]
        seed = int(sum(img.getpixel((0, 0))) + img.size[0])
        g = torch.Generator().manual_seed(seed)
        feats = torch.randn(4, self.hidden, generator=g)
        if self.path == "features":
            feats = feats + 1e-2 * torch.randn(4, self.hidden, generator=g)
            self.stats["tm_features_served" if seed in self.seen else "vision_images"] += 1
            self.seen.add(seed)
        feats = feats.to(torch.bfloat16)  # features in the engine dtype, as the path hands them
        if self.path == "features":
            feats = self.async_engine.vl_encoder.model.to_turbomind(feats)["input_embeddings"][0]
        text = torch.randn(3, self.hidden, generator=torch.Generator().manual_seed(0))
        emb = torch.cat([text.to(torch.bfloat16), feats, text[:2].to(torch.bfloat16)])
        n, steps = emb.shape[0], gen_config.max_new_tokens
        hidden = rms_normalise(emb, 1e-6, torch.bfloat16) if self.passthrough else emb
        head = torch.randn(self.hidden, self.vocab, generator=torch.Generator().manual_seed(1))
        shift = torch.randn(steps, self.vocab, generator=torch.Generator().manual_seed(2))
        logits = emb.float().mean(0, keepdim=True) @ head + shift  # steps depend on the image
        ids = logits.argmax(-1).tolist()
        if gen_config.output_logits == "all":  # prompt positions, then the generated steps
            logits = torch.cat([hidden[:-1].float() @ head, logits])
        return Response(text="", generate_token_len=steps, input_token_len=n, token_ids=ids,
                        logits=logits if gen_config.output_logits else None,
                        last_hidden_state=hidden if gen_config.output_last_hidden_state else None)

    def close(self) -> None:
        pass


def fake_builder(model: str, path: str) -> tuple[Any, Any]:
    pipe = FakePipe(model, path)
    cache = types.SimpleNamespace(stats=lambda: {"lmdeploy": dict(pipe.stats)}, close=lambda: None)
    return pipe, (cache if path != "plain" else None)


def dry_run() -> int:
    """The pass-through on a real tiny checkpoint (checked with transformers on the CPU), the
    request loops and every comparison on stand-in pipelines."""
    from transformers import InternVLForConditionalGeneration

    from bench.checks.turbomind_features import build_checkpoint  # random InternVL-HF (no torchvision needed)

    with tempfile.TemporaryDirectory() as d:
        src = build_checkpoint(os.path.join(d, "internvl_hf_tiny"), "tiny")
        through = make_passthrough(src)
        assert make_passthrough(src) == through  # done once
        model = InternVLForConditionalGeneration.from_pretrained(through).eval()
        x = torch.randn(1, 7, model.config.text_config.hidden_size)
        with torch.no_grad():
            h = model.model.language_model(inputs_embeds=x).last_hidden_state
        err = (h - rms_normalise(x, rms_eps(through), torch.float32)).abs().max().item()
        assert err < 1e-5, err
        original = InternVLForConditionalGeneration.from_pretrained(src).eval()
        with torch.no_grad():
            h0 = original.model.language_model(inputs_embeds=x).last_hidden_state
        assert (h0 - h).abs().max().item() > 1e-3  # the original LLM does not pass through
        for k, v in model.model.vision_tower.state_dict().items():
            assert torch.equal(v, original.model.vision_tower.state_dict()[k])

        args = argparse.Namespace(model=src, passthrough=None, n=6, vit_n=3, new_tokens=4,
                                  size="120x90", logits="all", control=2, rows=True)
        res = run(args, builder=fake_builder)
    vit = res["vit"]
    assert vit["text_positions_identical"] and vit["passthrough_max_err"] == 0.0, vit
    assert 0 < vit["normalised_max_abs_diff"] < 0.1 and vit["images"] == 3, vit
    assert res["plain_repeat_control"]["all_identical"]
    assert res["hit_miss"]["all_identical"] and res["hit_miss"]["vision_ran_once_per_image"]
    assert res["greedy"]["requests"] == 6 and res["greedy"]["step0_logits_max_abs_diff"] > 0
    g = greedy_diff([dict(token_ids=[1, 2, 3], input_len=2, logits=torch.eye(4)[[0, 1, 2, 3]])],
                    [dict(token_ids=[1, 2, 0], input_len=2, logits=torch.eye(4)[[0, 1, 2, 0]])],
                    "all")
    assert g["differing"] == 1 and g["first_diff_positions"] == [2], g
    assert g["plain_top2_margin_at_divergence"] == [1.0], g
    json.dumps(res)
    print("DRY-RUN OK:", json.dumps({k: res[k] for k in ("vit", "greedy", "hit_miss")})[:600])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dry-run")
    r = sub.add_parser("run")
    r.add_argument("--model", required=True, help="an InternVL-HF checkpoint directory")
    r.add_argument("--passthrough", help="where its pass-through copy goes (default: MODEL"
                   f"{SUFFIX})")
    r.add_argument("--n", type=int, default=40, help="distinct images for (b) and (c)")
    r.add_argument("--vit-n", type=int, default=8, help="images for (a); 0 skips it")
    r.add_argument("--new-tokens", type=int, default=32)
    r.add_argument("--size", default="120x90", help="image WxH (tiny: 120x90 is 4 tiles + thumbnail)")
    r.add_argument("--logits", choices=["all", "generation"], default="all",
                   help="'all' (tiny vocab) or 'generation' (real vocab: prompt logits are GBs)")
    r.add_argument("--control", type=int, default=8, help="plain requests repeated as a control")
    r.add_argument("--rows", action="store_true", help="keep per-request token ids in the JSON")
    r.add_argument("--out")
    args = ap.parse_args(argv)
    if args.cmd == "dry-run":
        return dry_run()
    return emit(run(args), args.out)


if __name__ == "__main__":
    sys.exit(main())
