"""`featcache demo`: the main job on an embedded default, with no model download.

A small built-in vision encoder (a random-weight ViT of the InternVL shape: 448 px tiles, patch 14,
pixel-shuffle to 256 tokens, an MLP projector) encodes generated images in a simulated multi-turn
chat that resends every earlier image each turn, as chat clients do. Every image goes through the
real store: content key -> get -> on a miss, preprocess + encode + put. Then the process "restarts"
(the cache is closed and reopened on the same directory) and replays the chat from the disk tier.
Each served feature is checked against a fresh encoding: hits must be bit-identical.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .cache import FeatureCache
from .config import DEMO_TURNS
from .sizes import format_bytes

TILE = 448
PATCH = 14
TURNS = DEMO_TURNS


class TinyVisionEncoder(nn.Module):
    """InternVL-shaped, small: [tiles, 3, 448, 448] -> [tiles, 256, out_dim]."""

    def __init__(self, width: int = 192, depth: int = 2, out_dim: int = 1024, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Conv2d(3, width, PATCH, PATCH)
        self.pos = nn.Parameter(torch.randn(1, (TILE // PATCH) ** 2, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.project = nn.Sequential(
            nn.LayerNorm(4 * width), nn.Linear(4 * width, out_dim), nn.GELU(), nn.Linear(out_dim, out_dim)
        )

    @property
    def identity(self) -> str:
        return f"featcache-demo-vit/{self.embed.out_channels}x{len(self.blocks.layers)}"

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embed(pixels).flatten(2).transpose(1, 2) + self.pos  # [t, 1024, w]
        x = self.blocks(x)
        t, n, w = x.shape
        side = int(n**0.5)
        x = x.reshape(t, side // 2, 2, side // 2, 2, w).permute(0, 1, 3, 2, 4, 5)  # pixel shuffle
        return self.project(x.reshape(t, (side // 2) ** 2, 4 * w))  # [t, 256, out_dim]


def make_image(seed: int) -> np.ndarray:
    """A generated 'photo': smooth colour fields plus noise, 448 x 448 RGB."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:TILE, 0:TILE] / TILE
    channels = [np.sin(xx * rng.uniform(1, 9) + yy * rng.uniform(1, 9) + rng.uniform(0, 6)) for _ in range(3)]
    img = (np.stack(channels, -1) * 100 + 128 + rng.normal(0, 10, (TILE, TILE, 3))).clip(0, 255)
    return img.astype(np.uint8)


def preprocess(image: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    x = torch.from_numpy(image).to(device).permute(2, 0, 1).unsqueeze(0).float() / 255
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)
    return ((x - mean) / std).to(dtype)


@dataclass
class Turn:
    images: int
    sources: dict[str, int] = field(default_factory=dict)
    ms: float = 0.0


def run_chat(cache: FeatureCache, model: nn.Module, images: list[np.ndarray], dtype: torch.dtype,
             identity: str) -> list[Turn]:
    """Turn k shows images 0..k (every earlier image resent). Returns what served each turn."""
    turns = []
    for k in range(len(images)):
        turn = Turn(images=k + 1)
        before = cache.stats()
        t0 = time.perf_counter()
        for image in images[: k + 1]:
            key = cache.image_key(image, namespace=identity, params={"tile": TILE})
            feats = cache.get(key)
            if feats is None:
                with torch.inference_mode():
                    feats = model(preprocess(image, cache.device, dtype))
                cache.put(key, feats, namespace=identity)  # `featcache ls` shows it
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)
        turn.ms = (time.perf_counter() - t0) * 1e3
        after = cache.stats()
        for tier in ("device", "host", "disk"):
            turn.sources[tier] = after[tier]["hits"] - before[tier]["hits"]
        turn.sources["encoded"] = after["cache"]["misses"] - before["cache"]["misses"]
        turns.append(turn)
    return turns


def check_bit_identical(cache: FeatureCache, model: nn.Module, images: list[np.ndarray],
                        dtype: torch.dtype, identity: str) -> int:
    """Re-encode every image and compare with what the cache serves; returns mismatches."""
    bad = 0
    for image in images:
        served = cache.get(cache.image_key(image, namespace=identity, params={"tile": TILE}))
        with torch.inference_mode():
            fresh = model(preprocess(image, cache.device, dtype))
        bad += served is None or not torch.equal(served, fresh)
    return bad


def _print_turns(title: str, turns: list[Turn], say: Callable[[str], None] = print) -> None:
    say(f"\n{title}")
    say(f"  {'turn':>4} {'images':>6} {'encoded':>8} {'device':>7} {'host':>5} {'disk':>5} {'ms':>8}")
    for i, t in enumerate(turns, 1):
        s = t.sources
        say(f"  {i:>4} {t.images:>6} {s['encoded']:>8} {s['device']:>7} {s['host']:>5} {s['disk']:>5} "
              f"{t.ms:>8.1f}")


def run(turns: int = TURNS, cache_dir: str | None = None, device: str | None = None,
        as_json: bool = False) -> int:
    """Run the demo, printing what it does (``as_json``: one JSON object at the end instead); 0 if
    every feature served was bit-identical to a fresh encoding and each image not already in the
    store was encoded once, else 1."""
    say: Callable[[str], None] = (lambda text: None) if as_json else print
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = TinyVisionEncoder().to(dev, dtype).eval()
    images = [make_image(seed) for seed in range(turns)]
    per_image = 256 * 1024 * torch.empty((), dtype=dtype).element_size()
    budgets: dict[str, int] = dict(device_bytes=3 * per_image, host_bytes=4 * per_image,
                                   disk_bytes=256 << 20)
    tmp = None if cache_dir else tempfile.TemporaryDirectory(prefix="featcache-demo-")
    path = cache_dir or tmp.name  # type: ignore[union-attr]
    say(f"featcache demo on {dev}: {turns}-turn chat resending its images; encoder "
          f"{model.identity} -> [1, 256, 1024] {str(dtype).removeprefix('torch.')} per image "
          f"({format_bytes(per_image)}); device tier {format_bytes(budgets['device_bytes'])}, "
          f"host tier {format_bytes(budgets['host_bytes'])}, disk tier "
          + (f"at {path}" if tmp is None else "in a temporary directory, deleted at the end "
             "(--cache-dir DIR keeps it)"))
    identity = model.identity
    try:
        with FeatureCache(device=dev, disk_path=path, **budgets) as cache:
            stored = sum(cache.image_key(image, namespace=identity, params={"tile": TILE}) in cache
                         for image in images)  # from an earlier run on the same --cache-dir
            first = run_chat(cache, model, images, dtype, identity)
            cache.flush()
        _print_turns("First run (a cold cache):" if not stored else
                     f"First run ({stored} of {len(images)} images already in the store):", first, say)
        with FeatureCache(device=dev, disk_path=path, **budgets) as cache:
            second = run_chat(cache, model, images, dtype, identity)
            mismatches = check_bit_identical(cache, model, images, dtype, identity)
            stats = cache.stats()
        _print_turns("After a restart (same directory):", second, say)
    finally:
        if tmp is not None:
            tmp.cleanup()
    encoded = sum(t.sources["encoded"] for t in first + second)
    asked = sum(t.images for t in first + second)
    cold = sum(t.ms for t in first) / max(1, sum(t.images for t in first))
    say(f"\n{asked} image requests, {encoded} encoder runs ({len(images)} distinct images); "
          f"mean per image {cold:.1f} ms on the first run, "
          f"{sum(t.ms for t in second) / max(1, sum(t.images for t in second)):.1f} ms after restart")
    say(f"bit-identical to a fresh encoding: {len(images) - mismatches}/{len(images)}")
    tiers = ("device", "host", "disk")
    say("store: " + ", ".join(
        f"{tier} {stats[tier]['entries']} entries {format_bytes(stats[tier]['bytes'])}" for tier in tiers))
    ok = mismatches == 0 and encoded == len(images) - stored
    if as_json:
        print(json.dumps(dict(
            ok=ok, device=str(dev), turns=turns, images=len(images), already_stored=stored,
            image_requests=asked, encoder_runs=encoded, bit_identical=len(images) - mismatches,
            store=cache_dir, runs={name: [dict(images=t.images, ms=round(t.ms, 2), **t.sources)
                                          for t in run_turns]
                                   for name, run_turns in (("first", first), ("after_restart", second))},
            tiers={tier: dict(entries=stats[tier]["entries"], bytes=stats[tier]["bytes"])
                   for tier in tiers}), indent=2))
    return 0 if ok else 1
