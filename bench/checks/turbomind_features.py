"""The TurboMind features path, checked: featcache's Python InternVL tower against lmdeploy's own
reference computation, and what a miss and a hit cost.

    python3 bench/checks/turbomind_features.py                      # tiny random InternVL-HF, auto device
    python3 bench/checks/turbomind_features.py --shape 2b --device cuda --dtype bfloat16 --out r.json

Builds a random-weight InternVL-HF checkpoint (``--shape tiny``: 2 x 128 ViT at 56 px; ``2b``: the
InternVL2-2B / InternVL3-2B vision tower, InternViT-300M, 24 x 1024 at 448 px, projecting to an
LLM hidden size of 2048; the language model is one small layer: the vision path never uses it),
or reads ``--model DIR``. Then:

1. reference: lmdeploy's PyTorch-engine InternVL-HF modules
   (``lmdeploy.pytorch.models.internvl3_hf``: vision tower, projector, ``get_image_features``),
   weights loaded by lmdeploy's own ``load_weights`` (fused qkv);
2. featcache's ``InternVLTower`` (transformers' ``InternVLModel``, separate q/k/v, sdpa) on the
   same random tiles: bit-identical, or the largest difference;
3. ``FeatureServer.forward`` (the features path) on a miss (tower + one D2H copy into page-locked
   memory + ``put``) and on a hit (served from the host cache), timed; the hit's tensor must be
   the miss's features bit for bit, on the host, in the engine dtype.

Needs lmdeploy's Python (no TurboMind: bench/device/make_bundle.sh's bundle works), transformers,
safetensors. Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the checkout

from bench.lib.engines import host_cache  # noqa: E402
from bench.lib.results import write_report  # noqa: E402
from bench.lib.timing import median_call_ms  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY, FeatRef  # noqa: E402
from featcache.lmdeploy.turbomind.features import FeatureServer, InternVLTower  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vision=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=256, image_size=[56, 56], patch_size=[14, 14]),
                 text_hidden=256, image_seq_length=4),
    "2b": dict(vision=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                           intermediate_size=4096, image_size=[448, 448], patch_size=[14, 14]),
               text_hidden=2048, image_seq_length=256),
}


def build_checkpoint(out: str, shape: str, seed: int = 0) -> str:
    """A random InternVL-HF checkpoint (config.json + model.safetensors) in ``out``."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    s = SHAPES[shape]
    hidden = s["text_hidden"]
    cfg = InternVLConfig(
        vision_config=s["vision"],
        text_config=dict(model_type="qwen2", vocab_size=512, hidden_size=hidden,
                         intermediate_size=hidden * 2, num_hidden_layers=1,
                         num_attention_heads=hidden // 128 if hidden >= 256 else 4,
                         num_key_value_heads=2, architectures=["Qwen2ForCausalLM"]),
        image_seq_length=s["image_seq_length"], downsample_ratio=0.5, image_token_id=500)
    cfg.architectures = ["InternVLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(cfg)
    with torch.no_grad():  # transformers zero-initialises some of these; make every weight count
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return out


class _NoLanguageModel(torch.nn.Module):
    def load_weights(self, weights: Any) -> None:  # lmdeploy hands it the LLM's weights: unused
        return None


def lmdeploy_reference(path: str, dtype: torch.dtype, device: torch.device) -> Any:
    """lmdeploy's own InternVL-HF vision computation (PyTorch engine modules and weight loader)."""
    from lmdeploy.pytorch.models import internvl3_hf as lm
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    ref = torch.nn.Module()
    ref.config = cfg
    ref.vision_tower = lm.InternVLVisionModel(cfg.vision_config, dtype=dtype, device=device)
    ref.multi_modal_projector = lm.InternVLMultiModalProjector(cfg, dtype=dtype, device=device)
    ref.language_model = _NoLanguageModel()
    cls = lm.InternVLForConditionalGeneration
    weights = [(cls.rename_weight(k), v.to(dtype)) for k, v in
               load_file(os.path.join(path, "model.safetensors")).items()
               if "language_model" not in k and not k.startswith("lm_head")]
    cls.load_weights(ref, weights)
    ref.eval()

    def features(pixel_values: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = cls.get_image_features(
                ref, pixel_values.to(device, dtype), cfg.vision_feature_layer,
                cfg.vision_feature_select_strategy)
        return out

    ref.pixel_shuffle = lambda x, scale_factor=0.5: cls.pixel_shuffle(ref, x, scale_factor)  # type: ignore[assignment]
    return features


def _median_ms(fn: Any, repeat: int, device: torch.device) -> float:
    """Median ms of ``fn()`` over ``repeat`` calls, each waiting for ``device``'s work."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    return median_call_ms(fn, repeat, sync=sync)


def features_path(tower: InternVLTower, dtype: torch.dtype, pixels: torch.Tensor,
                  repeat: int) -> dict[str, Any]:
    """FeatureServer.forward on a miss and on a hit of one image of ``pixels.shape[0]`` tiles."""
    tokens = pixels.shape[0] * tower.config.image_seq_length
    result: dict[str, Any] = {}
    with host_cache(4 << 30) as cache:
        server = FeatureServer(cache, tower, dtype)

        def request(key: bytes) -> torch.Tensor:
            lease = cache.acquire(key)
            item = dict(pixel_values=pixels, image_tokens=tokens, image_token_id=500)
            item[REF_KEY] = FeatRef(cache, key, b"{}", lease)
            messages = [dict(role="preprocess", content=[item])]
            out: torch.Tensor = server.forward(messages, max_batch_size=1)[-1]["content"][0]
            return out

        counter = iter(range(10**9))
        result["miss_ms"] = _median_ms(lambda: request(b"miss%d" % next(counter)), repeat,
                                       tower.device)
        first = request(b"image")
        result["hit_ms"] = _median_ms(lambda: request(b"image"), repeat, tower.device)
        hit = request(b"image")
        result["hit_identical_to_miss"] = bool(torch.equal(hit, first))
        result["hit_same_tensor"] = hit.data_ptr() == first.data_ptr()
        result["served_device"] = str(hit.device)
        result["served_dtype"] = str(hit.dtype).removeprefix("torch.")
        result["served_pinned"] = bool(hit.is_pinned()) if torch.cuda.is_available() else None
        result["features_shape"] = list(hit.shape)
        result["counters"] = cache.stats().get("lmdeploy", {})
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="an InternVL-HF checkpoint dir (default: build a random one)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                    default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--tiles", type=int, default=13)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_checkpoint(tmp, args.shape)
        t = time.perf_counter()
        tower = InternVLTower.from_pretrained(path, dtype, device)
        reference = lmdeploy_reference(path, dtype, device)
        load_s = time.perf_counter() - t
        size = tower.config.vision_config.image_size[0]
        torch.manual_seed(1)
        pixels = torch.randn(args.tiles, 3, size, size).to(dtype)
        ours, theirs = tower(pixels), reference(pixels)
        diff = (ours.float() - theirs.float()).abs()
        result: dict[str, Any] = {
            "model": args.model or f"random InternVL-HF ({args.shape})",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": args.dtype, "tiles": args.tiles,
            "load_s": round(load_s, 2),
            "features_shape": list(ours.shape),
            "bit_identical": bool(torch.equal(ours, theirs)),
            "max_abs_diff": diff.max().item(),
            "mean_abs_diff": diff.mean().item(),
            "max_abs_value": theirs.float().abs().max().item(),
            "cosine_min": torch.nn.functional.cosine_similarity(
                ours.float().reshape(-1, ours.shape[-1]),
                theirs.float().reshape(-1, theirs.shape[-1]), dim=-1).min().item(),
        }
        result["tower_ms"] = _median_ms(lambda: tower(pixels), args.repeat, device)
        result["features_path"] = features_path(tower, dtype, pixels, args.repeat)
    print(json.dumps(result, indent=2))
    if args.out:
        write_report(args.out, dict(result))  # with the run's metadata under "run"
    return result


if __name__ == "__main__":
    main()
