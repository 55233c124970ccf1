"""The commands that read a store: ``stats``, ``ls``, ``inspect``.

Invariant: they open the store read-only and never block a process serving from it (the store
tools' ``StoreView``); ``--no-lock`` reads without registering in ``lock.mdb`` and is refused
for a store in use.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

from ..config import DEFAULTS, CacheConfig
from ..entrymeta import namespace_of
from ..storetools.view import KeyNotFoundError, StoreView
from . import render, scrape
from .command import (
    EXIT_BAD,
    EXIT_OK,
    Command,
    UsageError,
    hex_key,
    json_argument,
    limit,
    no_lock_argument,
    store_dir,
    store_dir_argument,
)


# -- stats -------------------------------------------------------------------------------------------
def _stats_arguments(p: argparse.ArgumentParser) -> None:
    store_dir_argument(p)
    json_argument(p)
    p.add_argument("--remote-url", metavar="URL",
                   help="also the shared remote tier on this Redis/Valkey server (entries under "
                   "--remote-prefix, memory, eviction policy); without DIR, only it")
    prefix = DEFAULTS["remote_prefix"]
    p.add_argument("--remote-prefix", default=prefix, metavar="P",
                   help=f"the caches' remote_prefix (default {prefix})")
    p.add_argument("--url", metavar="URL",
                   help="a running featcache serve's hit ratios and tiers, from its /metrics "
                   "(http://HOST:PORT); not with DIR or --remote-url")
    no_lock_argument(p)


def _stats(args: argparse.Namespace) -> int:
    if args.url is not None:
        if args.dir is not None or args.remote_url:
            raise UsageError("--url reads a running server: give it without DIR and --remote-url")
        doc = scrape.server_stats(args.url)
        print(json.dumps(doc, indent=2) if args.json else "\n".join(scrape.lines(doc)))
        return EXIT_OK
    remote = _remote_summary(args) if args.remote_url else None
    if remote is not None and args.dir is None:  # the remote tier alone
        if args.json:
            print(json.dumps({"remote": remote}, indent=2))
        else:
            print("\n".join(render.remote_lines(remote)))
        return EXIT_OK
    with StoreView(store_dir(args), lock=not args.no_lock) as view:
        summary = view.summary()
    if args.json:
        print(json.dumps(render.stats_doc(summary, remote), indent=2))
    else:
        print("\n".join(render.stats_lines(summary, remote)))
    return EXIT_OK


def _remote_summary(args: argparse.Namespace) -> dict[str, Any]:
    try:
        config = CacheConfig.create(device="cpu", remote_url=args.remote_url,
                                    remote_prefix=args.remote_prefix)
    except ValueError as e:  # e.g. a URL of another scheme
        raise UsageError(f"--remote-url: {e}") from None
    from ..tiers.remote import server_summary  # torch: only for --remote-url

    return server_summary(config)


STATS = Command(
    "stats", help="entries, bytes and settings of a store",
    description="Entries, bytes and settings of the store at DIR. Hits, misses, evictions, "
    "drops and corrupt-entry counts are counted in each process's memory "
    "(FeatureCache.stats(), featcache.metrics), not in the store.",
    add_arguments=_stats_arguments, run=_stats,
)


# -- ls ----------------------------------------------------------------------------------------------
def _ls_arguments(p: argparse.ArgumentParser) -> None:
    store_dir_argument(p)
    p.add_argument("--limit", type=limit, default=50, metavar="N",
                   help="at most N entries (default 50; 0: all)")
    p.add_argument("--namespace", metavar="NS",
                   help="only entries whose metadata records namespace NS (the NAMESPACE column)")
    json_argument(p, "print JSON lines (for scripts)")
    no_lock_argument(p)


def _ls(args: argparse.Namespace) -> int:
    with StoreView(store_dir(args), lock=not args.no_lock) as view:
        total = view.summary().entries
        entries = view.entries(newest_first=True, limit=None if args.namespace else args.limit or None)
        if args.namespace is not None:
            entries = (e for e in entries if namespace_of(e.meta) == args.namespace)
        listed = list(itertools.islice(entries, args.limit or None))
    if args.json:
        for e in listed:
            print(json.dumps(render.entry_doc(e)))
    elif not listed:
        ns = f" of namespace {args.namespace}" if args.namespace is not None else ""
        print(f"no entries{ns} in {view.path}")
    else:
        print("\n".join(render.entry_table(listed, total)))
    return EXIT_OK


LS = Command(
    "ls", help="list entries, most recently used first",
    description="Entries of the store at DIR, most recently used first: key, size, dtype, "
    "shape, last use, the namespace (model identity) its metadata records, and a summary of "
    "the metadata. Keys are digests: an entry whose metadata records no namespace (one "
    "put through the FeatureCache API without it) shows '-'.",
    add_arguments=_ls_arguments, run=_ls,
)


# -- inspect -----------------------------------------------------------------------------------------
def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    store_dir_argument(p)
    p.add_argument("key", type=hex_key, metavar="KEY")
    json_argument(p)
    no_lock_argument(p)


def _inspect(args: argparse.Namespace) -> int:
    with StoreView(store_dir(args), lock=not args.no_lock) as view:
        key = view.find(args.key)
        entry = view.entry(key)
    if entry is None:
        raise KeyNotFoundError(f"the entry {key.hex()} was deleted meanwhile")
    if args.json:
        print(json.dumps(render.entry_doc(entry, full_meta=True), indent=2))
    else:
        print("\n".join(render.entry_lines(entry)))
    return EXIT_OK if entry.problem is None else EXIT_BAD


INSPECT = Command(
    "inspect", help="one entry: header, metadata, checksum",
    description="Header fields, metadata and checksum of the entry with key KEY (hex, as "
    "`featcache ls` prints it; a unique prefix is enough) in the store at DIR. Exit code 2 if "
    "its checksum fails.",
    add_arguments=_inspect_arguments, run=_inspect,
)
