"""``featcache demo``: the main job on an embedded default (``featcache.demo``)."""

from __future__ import annotations

import argparse
import os

from ..config import DEMO_MAX_TURNS, DEMO_TURNS, DEMO_WINDOW
from ..errors import FeatCacheError, StoreOpenError
from ..store.files import check_path_encoding
from .command import EXIT_OK, Command, UsageError, at_least_one, json_argument


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=at_least_one, default=DEMO_TURNS,
                   help=f"chat turns, at most {DEMO_MAX_TURNS} (default {DEMO_TURNS})")
    p.add_argument("--cache-dir", help="store directory (default: a temporary one)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="cuda or cpu (default: cuda when available)")
    json_argument(p, "one JSON object: per run and turn, what was encoded and what each tier served")


def _demo(args: argparse.Namespace) -> int:
    if args.turns > DEMO_MAX_TURNS:  # before torch is imported: refused at once
        raise UsageError(f"--turns {args.turns}: the demo runs at most {DEMO_MAX_TURNS} turns "
                         f"(each encodes a new image and resends up to {DEMO_WINDOW - 1})")
    if args.cache_dir is not None and not args.cache_dir.strip():  # ('': not "no directory")
        raise UsageError("--cache-dir '' names no directory: give one, or leave the option out "
                         "for a temporary store")
    if args.cache_dir and os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        raise UsageError(f"--cache-dir {args.cache_dir!r} is a file, not a directory")
    if args.cache_dir:
        try:
            check_path_encoding(args.cache_dir)  # before the demo makes anything there
        except StoreOpenError as e:
            raise UsageError(f"--cache-dir: {e}") from None
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise FeatCacheError(f"--device cuda: no CUDA device here (torch {torch.__version__}); "
                                 "use --device cpu")
    from .. import demo  # torch: only when the demo runs

    if demo.run(turns=args.turns, cache_dir=args.cache_dir, device=args.device, as_json=args.json):
        raise FeatCacheError("the check did not pass (see above)")
    return EXIT_OK


DEMO = Command(
    "demo", help="run the main job on an embedded default (no GPU or download needed)",
    description="A built-in vision encoder over generated images in a multi-turn chat that "
    "resends its images; shows what hit which tier, before and after a restart.",
    add_arguments=_demo_arguments, run=_demo,
)
