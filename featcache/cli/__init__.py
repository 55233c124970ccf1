"""The ``featcache`` command line: one table of commands, one parser, one way to run a command.

Each command is a ``Command`` (``command.py``): ``add_arguments(parser)`` declares its arguments,
``run(args)`` does the work and prints. They live one module per group: ``reading`` (stats, ls,
inspect), ``maintenance`` (verify, purge, compact), ``serving`` (serve, warm), ``demo``, ``doctor``; what the
store commands print is built in ``render``; progress bars are ``progress``'s.

Invariants: a command that reads a store never writes to it and never blocks a process serving
from it (the store tools); only ``verify --fix``, ``purge`` and ``compact`` write (the first two
by the disk tier's own rules, ``store.deletes``; ``compact`` only into DEST). Every error a user
can act on is one line on stderr and exit code 1; exit code 2 is bad usage (argparse) or bad
entries found; stdout carries only the command's output (tables, JSON).
"""

from __future__ import annotations

import argparse
import os
import sys

import lmdb

from .._version import __version__
from ..config import ENV_DIR, STORE_DIR_HELP
from ..errors import FeatCacheError
from ..store.files import NO_LOCK_HINT
from .command import EXIT_BAD, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, Command, Parser, UsageError
from .demo import DEMO
from .doctor import DOCTOR
from .maintenance import COMPACT, PURGE, VERIFY
from .reading import INSPECT, LS, STATS
from .serving import SERVE, WARM

# The commands, in the order `featcache --help` lists them.
COMMANDS: tuple[Command, ...] = (STATS, LS, INSPECT, VERIFY, PURGE, COMPACT, SERVE, WARM, DEMO, DOCTOR)

EPILOG = f"""\
Store commands take the store directory DIR (default: {STORE_DIR_HELP},
where featcache.lmdeploy keeps its store). They read a live store safely: read-only, and without
blocking the processes that serve from it. See docs/cli.md.

exit codes:
  0    success
  1    the command failed: one line on stderr says why (missing directory, not a featcache
       store, a store of another format version, permission denied, no such key, or the
       demo's check did not pass)
  2    bad entries found (verify, inspect; compact leaves them out of its copy), or bad
       usage
  130  interrupted"""


def build_parser() -> Parser:
    parser = Parser(
        prog="featcache", unknown="return",  # main names what it does not know
        description="A content-hashed, tiered image-feature cache for vision-language models "
        "served with lmdeploy.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"featcache {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_arguments(subparsers.add_parser(command.name, help=command.help,
                                                    **command.parser_options()))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); the exit code."""
    parser = build_parser()
    # each command's parser says its own errors (``Parser``); serve's keeps lmdeploy's options
    # as ``args.rest``, after what the top level did not know (argparse's order)
    args, extras = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    own = extras[:len(extras) - len(getattr(args, "rest", []))]
    if own:  # e.g. `featcache --bogus`: named, with the top level's usage
        parser.error(f"unrecognized arguments: {' '.join(own)}")
    if args.command is None:
        parser.print_help()
        return EXIT_BAD
    command = next(c for c in COMMANDS if c.name == args.command)
    return run(command, args)


# The optional dependencies a command may need: the module, and the extra that installs it.
# huggingface_hub comes with lmdeploy (through transformers): serve and warm look models up with it.
EXTRAS = {"lmdeploy": "lmdeploy", "huggingface_hub": "lmdeploy", "redis": "remote",
          "prometheus_client": "metrics", "PIL": "image"}


def run(command: Command, args: argparse.Namespace) -> int:
    """Run ``command``; errors a user can act on become one line on stderr and exit code 1 (2 for
    bad usage)."""
    def fail(message: str, code: int = EXIT_ERROR) -> int:
        print(f"featcache {command.name}: error: {message}", file=sys.stderr)
        return code

    try:
        return command.run(args)
    except BrokenPipeError:  # `featcache ls | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except UsageError as e:
        return fail(str(e), EXIT_BAD)
    except ModuleNotFoundError as e:  # an optional dependency: say which extra installs it
        module = (e.name or "").partition(".")[0]
        if module not in EXTRAS:
            raise
        return fail(f"this command needs {module}, which is not installed: "
                    f"pip install 'featcache[{EXTRAS[module]}]'")
    except (FeatCacheError, lmdb.Error, OSError) as e:
        message = str(e) if not isinstance(e, lmdb.Error) else f"LMDB error: {e}"
        if getattr(args, "dir", "set") is None and "no such directory" in message:
            message += (f" (the default store, from {ENV_DIR}: pass DIR, or set {ENV_DIR} to a "
                        "store's directory)" if os.environ.get(ENV_DIR) else
                        f" (the default store: pass DIR or set {ENV_DIR})")
        if not hasattr(args, "no_lock"):  # advice this command cannot follow
            message = message.replace(NO_LOCK_HINT, "")
        return fail(message)
    except KeyboardInterrupt:
        print(f"featcache {command.name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
