"""The shape of a ``featcache`` command, its exit codes, and the arguments several commands share.

Every command is a ``Command``: ``add_arguments(parser)`` declares its arguments (parsing only)
and ``run(args)`` does the work, prints its output and returns the exit code. The table of
commands is ``featcache.cli.COMMANDS``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ..config import STORE_DIR_HELP, default_store_dir

EXIT_OK, EXIT_ERROR, EXIT_BAD, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Bad usage found while running a command (a value argparse cannot check): one line on
    stderr and exit code 2."""


class Parser(argparse.ArgumentParser):
    """featcache's parsers (the top level's and each command's, ``add_subparsers`` makes them of
    this class): an error is said by the parser of the command it concerns, with that command's
    usage line, and names the argument.

    - ``unknown="rest"`` (``Command.takes_rest``): the arguments this parser does not know are
      kept, in order, as ``args.rest`` (serve: lmdeploy's options), and returned as argparse's
      ``parse_known_args`` returns them (``featcache.cli.main`` tells them from the top level's);
    - ``unknown="error"`` (a command's, the default): an argument it does not know is its own
      error (``featcache stats: error: unrecognized arguments: --bogus``), not the top level's
      with the top level's usage; ``"return"`` (the top level's): returned, as argparse does;
    - an option whose value starts with '-' (``--older-than -5d``), which argparse takes for an
      option and answers "expected one argument", is answered with what is wrong with the value
      (its type's message), or how to pass it (``--older-than=-5d``).
    """

    def __init__(self, *args: Any, unknown: str = "error", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if unknown not in ("error", "rest", "return"):
            raise ValueError(f"unknown is 'error', 'rest' or 'return', not {unknown!r}")
        self.unknown = unknown
        self._argv: list[str] = []

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._argv = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        if self.unknown == "rest":
            parsed.rest = list(extras)
            return parsed, extras
        if extras and self.unknown == "error":
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        super().error(self._dash_value(message) or message)

    def _dash_value(self, message: str) -> str | None:
        """A better message for "argument --X: expected one argument" where the token after
        ``--X`` starts with '-' and names no option of this parser: the value's own problem."""
        match = re.fullmatch(r"argument (\S+?)(?:/\S+)?: expected one argument", message)
        if match is None:
            return None
        action = next((a for a in self._actions if match.group(1) in a.option_strings), None)
        if action is None:
            return None
        for i, token in enumerate(self._argv[:-1]):
            value = self._argv[i + 1]
            if token not in action.option_strings or not value.startswith("-") \
                    or any(value in a.option_strings for a in self._actions):
                continue
            if callable(action.type):
                try:
                    action.type(value)
                except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
                    return f"argument {token}: {e}"
            return (f"argument {token}: expected one argument, and {value!r} starts with '-': "
                    f"pass it as {token}={value}")
        return None


@dataclass(frozen=True)
class Command:
    name: str
    help: str  # one line, for `featcache --help`
    description: str  # for `featcache NAME --help`
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    # True: the arguments its parser does not know reach ``run`` as ``args.rest``, in order, and
    # its parser has no -h (serve: lmdeploy's own options, parsed by lmdeploy's parser)
    takes_rest: bool = False
    usage: str | None = None  # the usage line, where argparse's own would mislead

    def parser_options(self) -> dict[str, Any]:
        """How its parser is built (``featcache.cli.build_parser``; alone, for its help text)."""
        # allow_abbrev=False where the rest goes on: another parser's flags (e.g. lmdeploy's
        # --device) must not pass for prefixes of ours (--device-bytes)
        return dict(description=self.description, usage=self.usage,
                    add_help=not self.takes_rest, allow_abbrev=not self.takes_rest,
                    unknown="rest" if self.takes_rest else "error")


# -- arguments several commands share --------------------------------------------------------------
def store_dir_argument(p: argparse.ArgumentParser, optional: bool = True) -> None:
    """The store directory ``DIR``: every store command's first positional argument."""
    if optional:
        p.add_argument("dir", nargs="?", metavar="DIR",
                       help=f"the store directory (default: {STORE_DIR_HELP})")
    else:
        p.add_argument("dir", metavar="DIR", help="the store directory")


def json_argument(p: argparse.ArgumentParser, help: str = "print JSON (for scripts)") -> None:
    """``--json``: the command's result as JSON on stdout (progress and questions stay on stderr)."""
    p.add_argument("--json", action="store_true", help=help)


def no_lock_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-lock", action="store_true",
                   help="read without registering in lock.mdb (for a store no process has "
                   "open, whose lock file you cannot write; refused while it is in use)")


def store_dir(args: argparse.Namespace) -> str:
    """The store directory a command works on: ``DIR``, else the default."""
    return str(args.dir) if args.dir else default_store_dir()


# -- argument types ----------------------------------------------------------------------------------
_AGE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhdw])\s*$")
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """Seconds from an age like ``7d``, ``12h``, ``30m``, ``90s``, ``2w``."""
    if re.match(r"\s*-\s*\d", text):
        raise argparse.ArgumentTypeError(f"invalid age {text!r}: an age is not negative (e.g. 7d: "
                                         "last used more than 7 days ago)")
    match = _AGE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid age {text!r}: use a number and s, m, h, d or w (e.g. 7d)")
    seconds = float(match.group(1)) * _AGE_UNITS[match.group(2)]
    if not math.isfinite(seconds):  # (a finite age beyond the epoch is fine: it matches nothing)
        raise argparse.ArgumentTypeError(f"invalid age {text!r}: too large")
    return seconds


def hex_key(text: str) -> str:
    cleaned = text.strip().lower()
    if not cleaned or any(c not in "0123456789abcdef" for c in cleaned):
        raise argparse.ArgumentTypeError(f"{text!r} is not a hex key (as `featcache ls` prints them)")
    return cleaned


def _int_at_least(text: str, low: int) -> int | None:
    """``text`` as an int if it is one >= ``low``, else None."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= low else None


def limit(text: str) -> int:
    """A count of entries, >= 0; one past any store's size (``sys.maxsize``) means all of them."""
    value = _int_at_least(text, 0)
    if value is None:
        raise argparse.ArgumentTypeError(f"invalid limit {text!r}: a number >= 0 (0: no limit)")
    return min(value, sys.maxsize)


def at_least_one(text: str) -> int:
    value = _int_at_least(text, 1)
    if value is None:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: a number >= 1")
    return value
