"""`featcache demo`: the main job on an embedded default, with no model download.

A small built-in vision encoder (a random-weight ViT of the InternVL shape: 448 px tiles, patch 14,
pixel-shuffle to 256 tokens, an MLP projector) encodes generated images in a simulated multi-turn
chat: each turn adds one image and resends the earlier ones still in its context (the last
``WINDOW``), as chat clients do. Every image goes through the real store: content key -> get -> on
a miss, preprocess + encode + put. Then the process "restarts" (the cache is closed and reopened
on the same directory) and replays the chat from the disk tier. Each feature served after the
restart is checked against a fresh encoding of its image: hits must be bit-identical.

The cost is linear in the turns (at most ``WINDOW`` lookups, one new image and one encoding a
turn; images are made as the chat reaches them), each turn's row is printed as it completes, and
more than ``MAX_TURNS`` turns are refused. Each row accounts for every image the turn sent: the
encoder (a miss), or the device, host or disk tier, or an entry still on its way down (in flight).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .config import DEMO_MAX_TURNS, DEMO_TURNS, DEMO_WINDOW
from .core.cache import FeatureCache
from .sizes import format_bytes

TILE = 448
PATCH = 14
TURNS = DEMO_TURNS
WINDOW = DEMO_WINDOW
MAX_TURNS = DEMO_MAX_TURNS
SOURCES = ("encoded", "device", "host", "disk", "in_flight")  # every way a turn's image is served


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
    sources: dict[str, int] = field(default_factory=dict)  # SOURCES -> images; they sum to images
    ms: float = 0.0


def _key(cache: FeatureCache, image: np.ndarray, identity: str) -> bytes:
    return cache.image_key(image, namespace=identity, params={"tile": TILE})


def _encode(model: nn.Module, image: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode():
        return model(preprocess(image, device, dtype))


def run_chat(cache: FeatureCache, model: nn.Module, turns: int, dtype: torch.dtype, identity: str,
             on_turn: Callable[[int, Turn], None] | None = None,
             bad: set[int] | None = None) -> list[Turn]:
    """Turn k sends image k and the ``WINDOW - 1`` images before it (all of them in a chat of
    ``WINDOW`` turns or fewer). Returns what served each turn; ``on_turn(k, turn)`` after each.
    With ``bad``, every feature served is compared with a fresh encoding of its image (outside
    the timed part) and the index of each image served otherwise is added to it."""
    window: deque[np.ndarray] = deque(maxlen=WINDOW)
    fresh: deque[torch.Tensor] = deque(maxlen=WINDOW)  # with ``bad``: window's fresh encodings
    result = []
    for k in range(turns):
        window.append(make_image(k))
        turn = Turn(images=len(window))
        before = cache.stats()
        served = []
        t0 = time.perf_counter()
        for image in window:
            key = _key(cache, image, identity)
            feats = cache.get(key)
            if feats is None:
                feats = _encode(model, image, cache.device, dtype)
                cache.put(key, feats, namespace=identity)  # `featcache ls` shows it
            served.append(feats)
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)
        turn.ms = (time.perf_counter() - t0) * 1e3
        after = cache.stats()
        for tier in ("device", "host", "disk"):
            turn.sources[tier] = after[tier]["hits"] - before[tier]["hits"]
        turn.sources["in_flight"] = after["cache"]["inflight_hits"] - before["cache"]["inflight_hits"]
        turn.sources["encoded"] = after["cache"]["misses"] - before["cache"]["misses"]
        if bad is not None:
            fresh.append(_encode(model, window[-1], cache.device, dtype))
            first = k + 1 - len(window)  # the index of the window's oldest image
            bad.update(first + i for i, (got, want) in enumerate(zip(served, fresh, strict=True))
                       if not torch.equal(got, want))
        result.append(turn)
        if on_turn is not None:
            on_turn(k + 1, turn)
    return result


_COLUMNS = (("turn", 4), ("images", 6), ("encoded", 8), ("device", 7), ("host", 5), ("disk", 5),
            ("in-flight", 9), ("ms", 8))


def _table(title: str, say: Callable[[str], None]) -> Callable[[int, Turn], None]:
    """Print ``title`` and the table's header; returns the function that prints one row (each
    row as its turn completes: the progress of a long chat)."""
    say(f"\n{title}")
    say("  " + " ".join(f"{name:>{width}}" for name, width in _COLUMNS))

    def row(i: int, t: Turn) -> None:
        cells = [i, t.images, *(t.sources[s] for s in SOURCES)]
        say("  " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS[:-1], strict=True))
            + f" {t.ms:>{_COLUMNS[-1][1]}.1f}")

    return row


def check_turns(turns: int) -> None:
    """Refuse a chat the demo does not run (``ValueError``, one line: the CLI's usage error)."""
    if not 1 <= turns <= MAX_TURNS:
        raise ValueError(f"--turns {turns}: the demo runs 1 to {MAX_TURNS} turns (each encodes a "
                         f"new image and resends up to {WINDOW - 1}; {MAX_TURNS} take about a "
                         "minute on a CPU)")


def run(turns: int = TURNS, cache_dir: str | None = None, device: str | None = None,
        as_json: bool = False) -> int:
    """Run the demo, printing what it does, each turn's row as it completes (``as_json``: one
    JSON object at the end instead); 0 if every feature served after the restart was
    bit-identical to a fresh encoding and each image not already in the store was encoded
    once, else 1. ``ValueError`` for turns outside 1 to ``MAX_TURNS``."""
    check_turns(turns)
    say: Callable[[str], None] = (lambda text: None) if as_json else print
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = TinyVisionEncoder().to(dev, dtype).eval()
    per_image = 256 * 1024 * torch.empty((), dtype=dtype).element_size()
    budgets: dict[str, int] = dict(device_bytes=3 * per_image, host_bytes=4 * per_image,
                                   disk_bytes=max(256 << 20, turns * (per_image + (64 << 10))))
    tmp = None if cache_dir else tempfile.TemporaryDirectory(prefix="featcache-demo-")
    path = cache_dir or tmp.name  # type: ignore[union-attr]
    say(f"featcache demo on {dev}: {turns}-turn chat, each turn a new image and up to "
        f"{WINDOW - 1} earlier ones resent; encoder "
        f"{model.identity} -> [1, 256, 1024] {str(dtype).removeprefix('torch.')} per image "
        f"({format_bytes(per_image)}); device tier {format_bytes(budgets['device_bytes'])}, "
        f"host tier {format_bytes(budgets['host_bytes'])}, disk tier "
        + (f"at {path}" if tmp is None else "in a temporary directory, deleted at the end "
           "(--cache-dir DIR keeps it)"))
    identity = model.identity
    bad: set[int] = set()  # images served otherwise than a fresh encoding after the restart
    try:
        with FeatureCache(device=dev, disk_path=path, **budgets) as cache:
            stored = 0 if not len(cache) else sum(  # from an earlier run on the same --cache-dir
                _key(cache, make_image(k), identity) in cache for k in range(turns))
            row = _table("First run (a cold cache):" if not stored else
                         f"First run ({stored} of {turns} images already in the store):", say)
            first = run_chat(cache, model, turns, dtype, identity, row)
            cache.flush()
        with FeatureCache(device=dev, disk_path=path, **budgets) as cache:
            row = _table("After a restart (same directory):", say)
            second = run_chat(cache, model, turns, dtype, identity, row, bad)
            stats = cache.stats()
    finally:
        if tmp is not None:
            tmp.cleanup()
    encoded = sum(t.sources["encoded"] for t in first + second)
    asked = sum(t.images for t in first + second)
    cold = sum(t.ms for t in first) / max(1, sum(t.images for t in first))
    say(f"\n{asked} image requests, {encoded} encoder runs ({turns} distinct images); "
        f"mean per image {cold:.1f} ms on the first run, "
        f"{sum(t.ms for t in second) / max(1, sum(t.images for t in second)):.1f} ms after restart")
    say(f"bit-identical to a fresh encoding: {turns - len(bad)}/{turns}")
    tiers = ("device", "host", "disk")
    say("store: " + ", ".join(
        f"{tier} {stats[tier]['entries']} entries {format_bytes(stats[tier]['bytes'])}" for tier in tiers))
    ok = not bad and encoded == turns - stored
    if as_json:
        print(json.dumps(dict(
            ok=ok, device=str(dev), turns=turns, images=turns, window=WINDOW, already_stored=stored,
            image_requests=asked, encoder_runs=encoded, bit_identical=turns - len(bad),
            store=cache_dir, runs={name: [dict(images=t.images, ms=round(t.ms, 2), **t.sources)
                                          for t in run_turns]
                                   for name, run_turns in (("first", first), ("after_restart", second))},
            tiers={tier: dict(entries=stats[tier]["entries"], bytes=stats[tier]["bytes"])
                   for tier in tiers}), indent=2))
    return 0 if ok else 1
