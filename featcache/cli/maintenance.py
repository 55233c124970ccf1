"""The commands that check and change a store: ``verify``, ``purge``, ``compact``.

Invariant: only ``verify --fix`` and ``purge`` delete entries, by the disk tier's own rules
(``store.deletes``: books kept exact, no torch); ``compact`` writes only into DEST; plain
``verify`` only reads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..entrymeta import namespace_of
from ..sizes import format_bytes
from ..store.layout import OtherFormatError
from ..storetools.maintenance import compact, discard_keys, purge_foreign_store
from ..storetools.view import StoreView
from .command import (
    EXIT_BAD,
    EXIT_ERROR,
    EXIT_OK,
    Command,
    json_argument,
    no_lock_argument,
    parse_age,
    store_dir,
    store_dir_argument,
)
from .progress import ProgressBar
from .render import compact_advice, when


# -- verify ------------------------------------------------------------------------------------------
def _verify_arguments(p: argparse.ArgumentParser) -> None:
    store_dir_argument(p)
    p.add_argument("--fix", action="store_true",
                   help="delete the bad entries (one transaction per batch, books kept exact)")
    json_argument(p)
    no_lock_argument(p)


def _verify(args: argparse.Namespace) -> int:
    if args.fix and args.no_lock:
        print("featcache verify: error: --fix writes to the store: it cannot be combined with "
              "--no-lock", file=sys.stderr)
        return EXIT_BAD
    path = store_dir(args)
    started = time.monotonic()
    with StoreView(path, lock=not args.no_lock) as view:
        bar = ProgressBar(view.summary().entries, "verify")
        report = view.verify(progress=bar.update)
        bar.close(report.checked, report.checked_bytes)
    elapsed = time.monotonic() - started
    if args.json:
        deleted = (discard_keys(path, [e.key for e in report.bad], only_bad=True)
                   if args.fix and report.bad else None)
        print(json.dumps(dict(
            path=path, checked=report.checked, checked_bytes=report.checked_bytes,
            seconds=round(elapsed, 3), notes=list(report.notes), deleted=deleted,
            bad=[dict(key=e.key.hex(), size=e.size, problem=e.problem) for e in report.bad]),
            indent=2))
        return EXIT_BAD if report.bad else EXIT_OK
    verdict = f"{len(report.bad)} bad" if report.bad else "all good"
    print(f"verified {report.checked} entries ({format_bytes(report.checked_bytes)}) in "
          f"{elapsed:.2f} s: {verdict}")
    for e in report.bad:
        print(f"bad   {e.key.hex()}  {format_bytes(e.size):>10}  {e.problem}")
    for note in report.notes:
        print(f"note  {note}")
    if not report.bad:
        return EXIT_OK
    if args.fix:
        # Only entries still bad when deleted: a live writer may have replaced one since.
        deleted = discard_keys(path, [e.key for e in report.bad], only_bad=True)
        freed = sum(e.size for e in report.bad)
        kept = len(report.bad) - deleted
        print(f"deleted {deleted} bad entr{'y' if deleted == 1 else 'ies'}"
              + (f" ({format_bytes(freed)})" if not kept else
                 f"; {kept} rewritten with a good value meanwhile, kept"))
    else:
        print(f"run `featcache verify --fix {path}` to delete them (they are already served as "
              "misses: the cache checks every value it reads)")
    return EXIT_BAD


VERIFY = Command(
    "verify", help="checksum every entry; exit code 2 if any is bad",
    description="Check the header and checksum of every value and the books that account for "
    "them, with a progress bar on stderr (when it is a terminal). Exit code 2 if bad entries "
    "were found, also with --fix (which then deleted them).",
    add_arguments=_verify_arguments, run=_verify,
)


# -- purge -------------------------------------------------------------------------------------------
def _purge_arguments(p: argparse.ArgumentParser) -> None:
    store_dir_argument(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--older-than", type=parse_age, metavar="AGE",
                       help="entries last used more than AGE ago (e.g. 7d, 12h, 30m, 90s, 2w)")
    which.add_argument("--all", action="store_true", help="every entry")
    which.add_argument("--namespace", metavar="NS",
                       help="entries whose metadata records namespace NS (as `featcache ls` "
                       "shows it; featcache.lmdeploy records the model identity)")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    p.add_argument("-y", "--yes", action="store_true",
                   help="--all: do not ask on a terminal (without a terminal it never asks)")
    json_argument(p)


def _confirmed(args: argparse.Namespace, question: str) -> bool:
    """Whether ``purge --all`` may go on: asked on a terminal unless ``--yes``; a script (stdin not
    a terminal) is not asked. Declining is one line on stderr, nothing deleted."""
    if not args.all or args.yes or not sys.stdin.isatty():
        return True
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)  # stdout stays the result's
    answer = sys.stdin.readline()
    if answer.strip().lower() in ("y", "yes"):
        return True
    print("featcache purge: nothing deleted (not confirmed; --yes skips the question)", file=sys.stderr)
    return False


def _purge(args: argparse.Namespace) -> int:
    path = store_dir(args)
    try:
        view = StoreView(path)
    except OtherFormatError as e:
        if not args.all:
            raise
        fmt = e.tag.decode("ascii", "replace")
        if args.dry_run:
            _say(args, f"would delete the store files (format {fmt}) in {path}",
                 path=path, dry_run=True, foreign_format=fmt)
            return EXIT_OK
        if not _confirmed(args, f"delete the store files of format {fmt} in {path}?"):
            return EXIT_ERROR
        tag = purge_foreign_store(path)
        _say(args, f"deleted the store files of format {tag} in {path} (the directory stays)",
             path=path, dry_run=False, foreign_format=tag)
        return EXIT_OK
    with view:
        total = view.summary().entries
        if args.all:
            victims, what = view.all_keys(), "entries"
        elif args.namespace is not None:
            ns = args.namespace
            victims = view.keys_where(lambda meta: namespace_of(meta) == ns)
            what = f"entries of namespace {ns}"
        else:
            # no stamp is older than the epoch: an age beyond it matches nothing, said as 1970
            cutoff = max(0, time.time_ns() - int(args.older_than * 1e9))
            victims = view.keys_used_before(cutoff)
            what = f"entries last used before {when(cutoff)}"
    freed = sum(size for _, size in victims)
    doc = dict(path=path, what=what, matched=len(victims), matched_bytes=freed, entries=total)
    if args.dry_run:
        _say(args, f"would delete {len(victims)} of {total} {what} ({format_bytes(freed)})",
             **doc, dry_run=True)
        return EXIT_OK
    if not _confirmed(args, f"delete all {len(victims)} entries ({format_bytes(freed)}) in {path}?"):
        return EXIT_ERROR
    if victims:
        discard_keys(path, [key for key, _ in victims])
    with StoreView(path) as view:
        left = view.summary()
    left_bytes = format_bytes(left.used_bytes) if left.used_bytes is not None else "?"
    advice = compact_advice(left, path)
    _say(args, f"deleted {len(victims)} {what} ({format_bytes(freed)}); {left.entries} entries "
         f"({left_bytes}) remain" + (f"\n{advice}" if advice else ""),
         **doc, dry_run=False, deleted=len(victims), remaining_entries=left.entries,
         remaining_bytes=left.used_bytes, data_file_bytes=left.data_file_bytes,
         reclaimable_bytes=left.reclaimable_bytes)
    return EXIT_OK


def _say(args: argparse.Namespace, text: str, **doc: Any) -> None:
    """The result: ``text`` for people, or ``doc`` as JSON with ``--json``."""
    print(json.dumps(doc, indent=2) if args.json else text)


PURGE = Command(
    "purge", help="delete entries: all, or those unused for a while",
    description="Delete entries from the store at DIR (processes serving from it keep what "
    "their device and host tiers hold). --all also removes a store of another format version.",
    add_arguments=_purge_arguments, run=_purge,
)


# -- compact -----------------------------------------------------------------------------------------
def _compact_arguments(p: argparse.ArgumentParser) -> None:
    store_dir_argument(p, optional=False)
    p.add_argument("dest", metavar="DEST")
    json_argument(p)


def _compact(args: argparse.Namespace) -> int:
    with StoreView(args.dir) as view:
        before = view.summary()
        skipped = compact(view, args.dest)
    with StoreView(args.dest) as copy:
        after = copy.summary()
    code = EXIT_BAD if skipped else EXIT_OK  # as verify's: bad entries found
    if args.json:
        print(json.dumps(dict(source=before.path, dest=after.path, entries=after.entries,
                              source_data_file_bytes=before.data_file_bytes,
                              dest_data_file_bytes=after.data_file_bytes,
                              source_in_use_by=before.in_use_by,
                              skipped=[dict(key=e.key.hex(), size=e.size, problem=e.problem)
                                       for e in skipped]), indent=2))
        return code
    print(f"compacted {before.path} (data file {format_bytes(before.data_file_bytes)}) into "
          f"{after.path} (data file {format_bytes(after.data_file_bytes)}, {after.entries} entries)")
    if skipped:
        n = len(skipped)
        print(f"skipped {n} bad entr{'y' if n == 1 else 'ies'} "
              f"({format_bytes(sum(e.size for e in skipped))}): the copy holds only entries whose "
              f"checksum holds; `featcache verify --fix {before.path}` deletes them from the store")
        for e in skipped:
            print(f"bad   {e.key.hex()}  {format_bytes(e.size):>10}  {e.problem}")
    if before.in_use_by:
        print(f"note: process {before.in_use_by} has {args.dir} open: what it wrote after the copy "
              "began is not in the copy")
    print("swap the copy in while no process uses the store (e.g. stop the server, move DIR away, "
          "move DEST to DIR)")
    return code


COMPACT = Command(
    "compact", help="write a compacted copy of a store",
    description="Copy the store at DIR into DEST (empty or missing), leaving free pages out, "
    "and bad entries (a checksum that does not hold: exit code 2, as verify's). The copy is "
    "consistent as of its start; swap it in while no process uses DIR.",
    add_arguments=_compact_arguments, run=_compact,
)
