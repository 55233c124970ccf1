"""The `featcache` command line."""

from __future__ import annotations

import argparse
import sys

from ._version import __version__

EPILOG = """exit codes: 0 success, 1 the command failed (a check did not pass), 2 bad usage"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="featcache",
        description="A content-hashed, tiered image-feature cache for vision-language models "
        "served with lmdeploy.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"featcache {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="run the main job on an embedded default (no GPU or download needed)",
        description="A built-in vision encoder over generated images in a multi-turn chat that "
        "resends its images; shows what hit which tier, before and after a restart.",
    )
    demo.add_argument("--turns", type=int, default=6, help="chat turns (default 6)")
    demo.add_argument("--cache-dir", help="store directory (default: a temporary one)")
    demo.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.turns < 1:
            parser.error("--turns must be at least 1")
        from .demo import main as demo

        return demo(turns=args.turns, cache_dir=args.cache_dir, device=args.device)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
