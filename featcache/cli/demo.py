"""``featcache demo``: the main job on an embedded default (``featcache.demo``)."""

from __future__ import annotations

import argparse

from .. import demo
from .command import Command, at_least_one


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=at_least_one, default=demo.TURNS,
                   help=f"chat turns (default {demo.TURNS})")
    p.add_argument("--cache-dir", help="store directory (default: a temporary one)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")


def _demo(args: argparse.Namespace) -> int:
    return demo.run(turns=args.turns, cache_dir=args.cache_dir, device=args.device)


DEMO = Command(
    "demo", help="run the main job on an embedded default (no GPU or download needed)",
    description="A built-in vision encoder over generated images in a multi-turn chat that "
    "resends its images; shows what hit which tier, before and after a restart.",
    add_arguments=_demo_arguments, run=_demo,
)
