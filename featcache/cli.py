"""The `featcache` command line: the demo and the store commands (stats, ls, inspect, verify,
purge, compact).

Invariants: a command that reads a store never writes to it and never blocks a process serving
from it (``featcache.storetools.view``); only ``verify --fix``, ``purge`` and ``compact`` write (the
first two through the disk tier's own transactions, ``compact`` only into DEST). Every error a
user can act on is one line on stderr and exit code 1; exit code 2 is bad usage (argparse) or
bad entries found; stdout carries only the command's output (tables, JSON).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import IO, Any

from ._version import __version__

EXIT_OK, EXIT_ERROR, EXIT_BAD = 0, 1, 2

EPILOG = """\
Store commands take the store directory DIR (default: $FEATCACHE_DIR, else ~/.cache/featcache,
where featcache.lmdeploy keeps its store). They read a live store safely: read-only, and without
blocking the processes that serve from it. See docs/cli.md.

exit codes:
  0    success
  1    the command failed: one line on stderr says why (missing directory, not a featcache
       store, a store of another format version, permission denied, no such key, or the
       demo's check did not pass)
  2    bad entries found (verify, inspect), or bad usage
  130  interrupted"""

_AGE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhdw])\s*$")
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# -- argument types ------------------------------------------------------------------------------
def parse_age(text: str) -> float:
    """Seconds from an age like ``7d``, ``12h``, ``30m``, ``90s``, ``2w``."""
    match = _AGE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid age {text!r}: use a number and s, m, h, d or w (e.g. 7d)")
    return float(match.group(1)) * _AGE_UNITS[match.group(2)]


def _hex_key(text: str) -> str:
    cleaned = text.strip().lower()
    if not cleaned or any(c not in "0123456789abcdef" for c in cleaned):
        raise argparse.ArgumentTypeError(f"{text!r} is not a hex key (as `featcache ls` prints them)")
    return cleaned


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid limit {text!r}: a number >= 0 (0: no limit)")
    return value


# -- parser --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="featcache",
        description="A content-hashed, tiered image-feature cache for vision-language models "
        "served with lmdeploy.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"featcache {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def store_dir(p: argparse.ArgumentParser) -> None:
        p.add_argument("dir", nargs="?", metavar="DIR",
                       help="the store directory (default: $FEATCACHE_DIR, else ~/.cache/featcache)")

    def no_lock(p: argparse.ArgumentParser) -> None:
        p.add_argument("--no-lock", action="store_true",
                       help="read without registering in lock.mdb (for a store no process has "
                       "open, whose lock file you cannot write; refused while it is in use)")

    stats = commands.add_parser(
        "stats", help="entries, bytes and settings of a store",
        description="Entries, bytes and settings of the store at DIR. Hits, misses, evictions, "
        "drops and corrupt-entry counts are counted in each process's memory "
        "(FeatureCache.stats(), featcache.metrics), not in the store.",
    )
    store_dir(stats)
    stats.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    stats.add_argument("--remote-url", metavar="URL",
                       help="also the shared remote tier on this Redis/Valkey server (entries under "
                       "--remote-prefix, memory, eviction policy); without DIR, only it")
    stats.add_argument("--remote-prefix", default="featcache", metavar="P",
                       help="the caches' remote_prefix (default featcache)")
    no_lock(stats)

    ls = commands.add_parser(
        "ls", help="list entries, most recently used first",
        description="Entries of the store at DIR, most recently used first: key, size, dtype, "
        "shape, last use, the namespace (model identity) its metadata records, and a summary of "
        "the metadata. Keys are digests: an entry whose metadata records no namespace (one "
        "put through the FeatureCache API without it) shows '-'.",
    )
    store_dir(ls)
    ls.add_argument("--limit", type=_limit, default=50, metavar="N",
                    help="at most N entries (default 50; 0: all)")
    ls.add_argument("--json", action="store_true", help="print JSON lines (for scripts)")
    no_lock(ls)

    inspect = commands.add_parser(
        "inspect", help="one entry: header, metadata, checksum",
        description="Header fields, metadata and checksum of the entry with key KEY (hex, as "
        "`featcache ls` prints it; a unique prefix is enough). Exit code 2 if its checksum fails.",
    )
    inspect.add_argument("key", type=_hex_key, metavar="KEY")
    inspect.add_argument("--dir", metavar="DIR",
                         help="the store directory (default: $FEATCACHE_DIR, else ~/.cache/featcache)")
    inspect.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    no_lock(inspect)

    verify = commands.add_parser(
        "verify", help="checksum every entry; exit code 2 if any is bad",
        description="Check the header and checksum of every value and the books that account for "
        "them, with a progress bar on stderr (when it is a terminal). Exit code 2 if bad entries "
        "were found, also with --fix (which then deleted them).",
    )
    store_dir(verify)
    verify.add_argument("--fix", action="store_true",
                        help="delete the bad entries (one transaction per batch, books kept exact)")
    no_lock(verify)

    purge = commands.add_parser(
        "purge", help="delete entries: all, or those unused for a while",
        description="Delete entries from the store at DIR (processes serving from it keep what "
        "their device and host tiers hold). --all also removes a store of another format version.",
    )
    store_dir(purge)
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("--older-than", type=parse_age, metavar="AGE",
                       help="entries last used more than AGE ago (e.g. 7d, 12h, 30m, 90s, 2w)")
    which.add_argument("--all", action="store_true", help="every entry")
    which.add_argument("--namespace", metavar="NS",
                       help="entries whose metadata records namespace NS (as `featcache ls` "
                       "shows it; featcache.lmdeploy records the model identity)")
    purge.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")

    compact = commands.add_parser(
        "compact", help="write a compacted copy of a store",
        description="Copy the store at DIR into DEST (empty or missing), leaving free pages out. "
        "The copy is consistent as of its start; swap it in while no process uses DIR.",
    )
    compact.add_argument("dir", metavar="DIR")
    compact.add_argument("dest", metavar="DEST")

    serve = commands.add_parser(
        "serve", add_help=False, help="lmdeploy's OpenAI-compatible server with featcache wrapped in",
        description="lmdeploy's api_server (its flags, endpoints and behaviour) with featcache; "
        "`featcache serve --help` lists both sets of options. See docs/cli.md.",
    )
    serve.add_argument("args", nargs=argparse.REMAINDER)

    warm = commands.add_parser(
        "warm", help="compute features of image files into the disk tier (needs a GPU)",
        description="Run MODEL's vision model (a featcache pipeline, lmdeploy's PyTorch engine) "
        "over image files so a server over the same store starts hot. Exit code 1 if some "
        "images failed (listed on stderr).",
    )
    from .warm import add_arguments as warm_arguments

    warm_arguments(warm)

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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # lmdeploy's own parser takes the rest (argparse cannot pass it on)
        from .serve import main as serve

        return serve(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.turns < 1:
            parser.error("--turns must be at least 1")
        from .demo import main as demo

        return demo(turns=args.turns, cache_dir=args.cache_dir, device=args.device)
    if args.command == "warm":
        from .warm import main as warm

        return warm(args)
    if args.command is None:
        parser.print_help()
        return EXIT_BAD
    usage = None
    if args.command == "verify" and args.fix and args.no_lock:
        usage = "--fix writes to the store: it cannot be combined with --no-lock"
    if usage is not None:
        print(f"featcache {args.command}: error: {usage}", file=sys.stderr)
        return EXIT_BAD
    return _run(args.command, args)


def _run(command: str, args: argparse.Namespace) -> int:
    """Run a store command; errors a user can act on become one line on stderr and exit 1."""
    import lmdb

    from .errors import FeatCacheError

    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "stats": cmd_stats, "ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify,
        "purge": cmd_purge, "compact": cmd_compact,
    }
    try:
        return handlers[command](args)
    except BrokenPipeError:  # `featcache ls | head`: the reader has what it wanted
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (FeatCacheError, lmdb.Error, OSError) as e:
        message = str(e) if not isinstance(e, lmdb.Error) else f"LMDB error: {e}"
        if getattr(args, "dir", "set") is None and "no such directory" in message:
            message += " (the default store: pass DIR or set FEATCACHE_DIR)"
        print(f"featcache {command}: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"featcache {command}: interrupted", file=sys.stderr)
        return 130


def _dir(args: argparse.Namespace) -> str:
    from .config import default_store_dir

    return str(args.dir) if args.dir else default_store_dir()


# -- stats ---------------------------------------------------------------------------------------
PER_PROCESS_NOTE = (
    "hits, misses, evictions, drops and corrupt entries are counted in the memory of each process "
    "that uses the store (FeatureCache.stats(), featcache.metrics), not in the store; the device "
    "and host tiers are per process too"
)


def cmd_stats(args: argparse.Namespace) -> int:
    remote = _remote_summary(args) if args.remote_url else None
    if remote is not None and args.dir is None:  # the remote tier alone
        if args.json:
            print(json.dumps({"remote": remote}, indent=2))
        else:
            _print_remote(remote)
        return EXIT_OK
    return _stats_store(args, remote)


def _remote_summary(args: argparse.Namespace) -> dict[str, Any]:
    from .config import CacheConfig
    from .tiers.remote import server_summary

    return server_summary(CacheConfig.create(device="cpu", remote_url=args.remote_url,
                                             remote_prefix=args.remote_prefix))


def _print_remote(r: dict[str, Any]) -> None:
    from .sizes import format_bytes

    entries = f"{r['entries']}{'+' if r['entries_capped'] else ''}"
    used = r["used_memory_bytes"]
    cap = r["maxmemory_bytes"]
    print(f"remote     {r['url']} (keys {r['prefix']}:*)")
    print(f"  entries  {entries}")
    print(f"  memory   {format_bytes(used) if used is not None else '?'} used by the server, maxmemory "
          f"{format_bytes(cap) if cap else 'none'}, policy {r['maxmemory_policy']}")


def _stats_store(args: argparse.Namespace, remote: dict[str, Any] | None) -> int:
    from .sizes import format_bytes
    from .storetools.view import StoreView

    with StoreView(_dir(args), lock=not args.no_lock) as view:
        s = view.summary()
    if args.json:
        doc = {
            "path": s.path,
            "format": s.format_tag,
            "value_format_version": s.value_format_version,
            "in_use_by_pid": s.in_use_by,
            "tiers": {
                "device": None,
                "host": None,
                "disk": {"entries": s.entries, "bytes": s.used_bytes, "capacity_bytes": s.capacity_bytes},
            },
            "last_use_ns": {"oldest": s.oldest_use_ns, "newest": s.newest_use_ns},
            "lmdb": {"map_size": s.map_size, "data_file_bytes": s.data_file_bytes,
                     "pages_bytes": s.pages_bytes, "page_size": s.page_size},
            "info": s.info,
            "process_counters": None,
            "note": PER_PROCESS_NOTE,
        }
        if remote is not None:
            doc["remote"] = remote
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    used = format_bytes(s.used_bytes) if s.used_bytes is not None else "unreadable"
    capacity = (format_bytes(s.capacity_bytes) if s.capacity_bytes is not None
                else "not recorded (each process sets its own disk_bytes)")
    in_use = {None: "unknown", 0: "no"}.get(s.in_use_by, f"yes (process {s.in_use_by})")
    rows = [
        ("store", s.path),
        ("format", f"{s.format_tag} (values: codec v{s.value_format_version})"),
        ("in use", in_use),
        ("last use", f"oldest {_when(s.oldest_use_ns)}, newest {_when(s.newest_use_ns)}"),
        ("map size", f"{format_bytes(s.map_size)} (address space only)"),
        ("data file", f"{format_bytes(s.data_file_bytes)}, pages in use {format_bytes(s.pages_bytes)}, "
                      f"page {s.page_size} B"),
    ]
    print("\n".join(f"{name:<10} {value}" for name, value in rows))
    print()
    print(f"{'tier':<8} {'entries':>9} {'bytes':>11}  capacity")
    print(f"{'device':<8} {'-':>9} {'-':>11}  - (per process)")
    print(f"{'host':<8} {'-':>9} {'-':>11}  - (per process)")
    print(f"{'disk':<8} {s.entries:>9} {used:>11}  {capacity}")
    if remote is not None:
        print()
        _print_remote(remote)
    print()
    print(f"note: {PER_PROCESS_NOTE}.")
    return EXIT_OK


# -- ls and inspect ------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    from .sizes import format_bytes
    from .storetools.view import StoreView

    limit = args.limit or None
    with StoreView(_dir(args), lock=not args.no_lock) as view:
        total = view.summary().entries
        listed = list(view.entries(newest_first=True, limit=limit))
    if args.json:
        for e in listed:
            print(json.dumps(_entry_doc(e)))
        return EXIT_OK
    if not listed:
        print(f"no entries in {view.path}")
        return EXIT_OK
    rows = [
        (e.key.hex(), format_bytes(e.size), _dtype(e), _shape(e), _when(e.last_use_ns),
         namespace_of(e.meta) or "-", meta_summary(e.meta) if e.problem is None else f"BAD: {e.problem}")
        for e in listed
    ]
    header = ("KEY", "SIZE", "DTYPE", "SHAPE", "LAST USE", "NAMESPACE", "META")
    widths = [max([len(header[i])] + [len(r[i]) for r in rows]) for i in range(6)]
    for row in [header, *rows]:
        cells = [row[i].rjust(widths[i]) if i == 1 else row[i].ljust(widths[i]) for i in range(6)]
        print("  ".join(cells) + "  " + row[6])
    more = f" (--limit 0 for all {total})" if len(listed) < total else ""
    print(f"{len(listed)} of {total} entries, most recently used first{more}.")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from . import codec
    from .storetools.view import StoreView

    with StoreView(_dir(args), lock=not args.no_lock) as view:
        key = view.find(args.key)
        entry = view.entry(key)
    if entry is None:
        from .storetools.view import KeyNotFoundError

        raise KeyNotFoundError(f"the entry {key.hex()} was deleted meanwhile")
    if args.json:
        print(json.dumps(_entry_doc(entry, full_meta=True), indent=2))
        return EXIT_OK if entry.problem is None else EXIT_BAD
    h = entry.header
    rows: list[tuple[str, str]] = [
        ("key", entry.key.hex()), ("size", _exact_bytes(entry.size)),
    ]
    if h is not None:
        rows += [
            ("dtype", str(h.dtype).removeprefix("torch.")),
            ("shape", _shape(entry)),
            ("layout", f"header {codec.HEADER.size} B (codec v{codec.FORMAT_VERSION}) + metadata "
                       f"{h.meta_len} B + payload {h.nbytes} B"),
            ("checksum", ("OK" if entry.checksum_ok else f"BAD: {entry.problem}")
                         + f" (xxh3-128 {h.checksum.hex()})"),
        ]
    else:
        rows.append(("header", f"BAD: {entry.problem}"))
    rows.append(("last use", f"{_when(entry.last_use_ns)} (stamp {entry.last_use_ns})"))
    rows.append(("metadata", _meta_text(entry.meta)))
    print("\n".join(f"{name:<9} {value}" for name, value in rows))
    return EXIT_OK if entry.problem is None else EXIT_BAD


def namespace_of(meta: bytes) -> str | None:
    """The namespace an entry's metadata records (``"ns"`` of a JSON object), or None."""
    if not meta.startswith(b"{"):
        return None
    try:
        record = json.loads(meta)
    except (UnicodeDecodeError, ValueError):
        return None
    ns = record.get("ns") if isinstance(record, dict) else None
    return ns if isinstance(ns, str) else None


def meta_summary(meta: bytes) -> str:
    """A short, one-line description of an entry's metadata for ``ls``."""
    if not meta:
        return "-"
    try:
        record = json.loads(meta)
    except (UnicodeDecodeError, ValueError):
        return f"{len(meta)} B, not JSON"
    if not isinstance(record, dict):
        return f"JSON {type(record).__name__}, {len(meta)} B"
    fields = record.get("fields")
    nested = fields if isinstance(fields, dict) else {}
    tokens = record.get("image_tokens", nested.get("image_tokens"))
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        return f"image_tokens={tokens}"
    names = sorted(record)
    return "JSON {" + ", ".join(names[:4]) + (", ..." if len(names) > 4 else "") + "}"


def _meta_text(meta: bytes) -> str:
    if not meta:
        return "none"
    try:
        record = json.loads(meta)
    except (UnicodeDecodeError, ValueError):
        shown = meta[:64].hex() + ("..." if len(meta) > 64 else "")
        return f"{len(meta)} B, not JSON: {shown}"
    body = json.dumps(record, indent=2, sort_keys=True)
    return f"{len(meta)} B, JSON:\n" + "\n".join("  " + line for line in body.splitlines())


def _entry_doc(e: Any, full_meta: bool = False) -> dict[str, Any]:
    h = e.header
    doc: dict[str, Any] = {
        "key": e.key.hex(),
        "size": e.size,
        "dtype": str(h.dtype).removeprefix("torch.") if h is not None else None,
        "shape": list(h.shape) if h is not None else None,
        "payload_bytes": h.nbytes if h is not None else None,
        "meta_bytes": len(e.meta),
        "meta": meta_summary(e.meta),
        "namespace": namespace_of(e.meta),
        "last_use_ns": e.last_use_ns,
        "last_use": _iso(e.last_use_ns),
        "checksum_ok": e.checksum_ok,
        "problem": e.problem,
    }
    if full_meta:
        try:
            doc["meta"] = json.loads(e.meta) if e.meta else None
        except (UnicodeDecodeError, ValueError):
            doc["meta"] = {"hex": e.meta.hex()}
        doc["checksum"] = h.checksum.hex() if h is not None else None
    return doc


def _exact_bytes(n: int) -> str:
    from .sizes import format_bytes

    text = format_bytes(n)
    return text if text.endswith(" B") else f"{text} ({n} B)"


def _dtype(e: Any) -> str:
    return str(e.header.dtype).removeprefix("torch.") if e.header is not None else "?"


def _shape(e: Any) -> str:
    return "[" + ",".join(str(d) for d in e.header.shape) + "]" if e.header is not None else "?"


def _when(ns: int | None) -> str:
    if ns is None:
        return "-"
    return datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")


def _iso(ns: int | None) -> str | None:
    if ns is None:
        return None
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds")


# -- verify --------------------------------------------------------------------------------------
class ProgressBar:
    """A one-line progress bar on ``stream`` (stderr), redrawn at most 10 times a second.

    Draws only when ``enabled`` (default: the stream is a terminal), so logs and pipes get no
    carriage returns; ``close`` ends the line it drew.
    """

    WIDTH = 28

    def __init__(self, total: int, label: str, stream: IO[str] | None = None,
                 enabled: bool | None = None) -> None:
        self.total = max(total, 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled if enabled is not None else self.stream.isatty()
        self.started = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def update(self, done: int, nbytes: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < 0.1):
            return
        from .sizes import format_bytes

        self._last = now
        frac = min(done / self.total, 1.0) if self.total else 1.0
        filled = int(frac * self.WIDTH)
        rate = nbytes / max(now - self.started, 1e-9)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{self.total} "
            f"{format_bytes(nbytes)} {format_bytes(int(rate))}/s"
        )
        self.stream.flush()
        self._drawn = True

    def close(self, done: int, nbytes: int) -> None:
        if self.enabled:
            self.update(done, nbytes, force=True)
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()


def cmd_verify(args: argparse.Namespace) -> int:
    from .sizes import format_bytes
    from .storetools.maintenance import discard_keys
    from .storetools.view import StoreView

    path = _dir(args)
    started = time.monotonic()
    with StoreView(path, lock=not args.no_lock) as view:
        bar = ProgressBar(view.summary().entries, "verify")
        report = view.verify(progress=bar.update)
        bar.close(report.checked, report.checked_bytes)
    elapsed = time.monotonic() - started
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


# -- purge and compact ---------------------------------------------------------------------------
def cmd_purge(args: argparse.Namespace) -> int:
    from .sizes import format_bytes
    from .store.layout import OtherFormatError
    from .storetools.maintenance import discard_keys, purge_foreign_store
    from .storetools.view import StoreView

    path = _dir(args)
    try:
        view = StoreView(path)
    except OtherFormatError as e:
        if not args.all:
            raise
        if args.dry_run:
            print(f"would delete the store files (format {e.tag.decode('ascii', 'replace')}) in {path}")
            return EXIT_OK
        tag = purge_foreign_store(path)
        print(f"deleted the store files of format {tag} in {path} (the directory stays)")
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
            cutoff = time.time_ns() - int(args.older_than * 1e9)
            victims = view.keys_used_before(cutoff)
            what = f"entries last used before {_when(cutoff)}"
    freed = sum(size for _, size in victims)
    if args.dry_run:
        print(f"would delete {len(victims)} of {total} {what} ({format_bytes(freed)})")
        return EXIT_OK
    if victims:
        discard_keys(path, [key for key, _ in victims])
    with StoreView(path) as view:
        left = view.summary()
    left_bytes = format_bytes(left.used_bytes) if left.used_bytes is not None else "?"
    print(f"deleted {len(victims)} {what} ({format_bytes(freed)}); {left.entries} entries "
          f"({left_bytes}) remain")
    return EXIT_OK


def cmd_compact(args: argparse.Namespace) -> int:
    from .sizes import format_bytes
    from .storetools.maintenance import compact
    from .storetools.view import StoreView

    with StoreView(args.dir) as view:
        before = view.summary()
        compact(view, args.dest)
    with StoreView(args.dest) as copy:
        after = copy.summary()
    print(f"compacted {before.path} (data file {format_bytes(before.data_file_bytes)}) into "
          f"{after.path} (data file {format_bytes(after.data_file_bytes)}, {after.entries} entries)")
    if before.in_use_by:
        print(f"note: process {before.in_use_by} has {args.dir} open: what it wrote after the copy "
              "began is not in the copy")
    print("swap the copy in while no process uses the store (e.g. stop the server, move DIR away, "
          "move DEST to DIR)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
