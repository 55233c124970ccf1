"""What a GPU could do for a stream of new images: the compute bound of a new-image request
(issue 53 item 4), from the checkpoint's weights and a matrix rate measured in the same run.

A new image costs the vision tower over its patches and the prefill over the prompt; both are
matrix products over (nearly) every weight: about 2 x params FLOPs per token through each. So:

    flops(request) = 2 x vision_params x vision_tokens + 2 x llm_params x prompt_tokens

where ``vision_tokens`` is the tower's tokens before they are merged into the LLM's image tokens
(``merge`` of them each: InternVL's pixel shuffle and Qwen2-VL's 2x2 merge make 4), the LLM's
parameters leave out the embedding table (a lookup) and the output head (one position in a
prefill), and attention's quadratic terms are left out: a lower bound on the work, so the fraction
of the bound reported is an upper bound on how close a server runs to its GPU's arithmetic.

``matrix_rate`` measures the bf16 rate of one large matrix product on this GPU, in the run that
reports the fraction (the machines differ and are noisy)."""

from __future__ import annotations

import json
import os
import struct
import time
from typing import Any

# substrings of a weight's name that put it in the vision tower or its projector
VISION_NAMES = ("vision", "visual", "mlp1", "multi_modal_projector", "mm_projector")
# substrings of the LLM weights that are no matrix product per prompt token
NOT_PER_TOKEN = ("embed_tokens", "lm_head", "wte", "output.weight")
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def tensor_shapes(model_dir: str) -> dict[str, list[int]]:
    """Every weight's shape, read from the checkpoint's safetensors headers (nothing loaded)."""
    shapes: dict[str, list[int]] = {}
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, name), "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for key, info in header.items():
            if key != "__metadata__":
                shapes[key] = list(info["shape"])
    if not shapes:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return shapes


def param_split(model_dir: str) -> dict[str, int]:
    """The checkpoint's parameters: ``vision`` (tower and projector), ``llm`` (per prompt token:
    no embedding table, no output head), ``other`` (those two)."""
    out = {"vision": 0, "llm": 0, "other": 0}
    for key, shape in tensor_shapes(model_dir).items():
        n = 1
        for d in shape:
            n *= d
        part = ("vision" if any(s in key for s in VISION_NAMES) else
                "other" if any(s in key for s in NOT_PER_TOKEN) else "llm")
        out[part] += n
    return out


def merge_factor(model_dir: str) -> int:
    """Vision tokens per LLM image token: InternVL's ``1 / downsample_ratio**2``, the Qwen VL
    lineage's ``spatial_merge_size**2``; 4 where the config says neither."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    vision = config.get("vision_config") or {}
    ratio = config.get("downsample_ratio")
    if isinstance(ratio, (int, float)) and 0 < ratio <= 1:
        return round(1 / ratio ** 2)
    merge = vision.get("spatial_merge_size") or config.get("spatial_merge_size")
    return int(merge) ** 2 if isinstance(merge, int) and merge > 0 else 4


def request_flops(params: dict[str, int], merge: int, image_tokens: int, prompt_tokens: int) -> float:
    """The module docstring's lower bound on one new-image request's FLOPs."""
    return 2.0 * params["vision"] * merge * image_tokens + 2.0 * params["llm"] * prompt_tokens


def matrix_rate(n: int = 8192, seconds: float = 2.0) -> float | None:
    """bf16 FLOP/s of an ``n`` x ``n`` x ``n`` matrix product on this process's CUDA device, the
    best of repeated runs for about ``seconds``; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    best = float("inf")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ b
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) / 1e3 / 10)
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n ** 3 / best


def bound_report(model_dir: str, rate: float | None, image_tokens: int, prompt_tokens: int,
                 rates: dict[str, float]) -> dict[str, Any]:
    """The bound for ``model_dir``'s new-image requests of ``image_tokens`` / ``prompt_tokens``
    tokens at ``rate`` FLOP/s, and each of ``rates`` (requests/s by server) as a fraction of it."""
    params = param_split(model_dir)
    merge = merge_factor(model_dir)
    flops = request_flops(params, merge, image_tokens, prompt_tokens)
    out: dict[str, Any] = dict(params=params, merge=merge, image_tokens=image_tokens,
                               prompt_tokens=prompt_tokens, tflop_per_request=round(flops / 1e12, 3),
                               matrix_tflops=None if rate is None else round(rate / 1e12, 1))
    if rate is not None:
        out["bound_requests_per_s"] = round(rate / flops, 2)
        out["fraction_of_bound"] = {name: round(r * flops / rate, 4) for name, r in rates.items()}
    return out
