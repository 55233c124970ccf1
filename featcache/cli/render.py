"""What the store commands print: tables and JSON documents built from what the store tools
return. Pure functions (no I/O, no argument parsing): the commands print what these return.

Entry metadata is read through its format's owner (``featcache.lmdeploy.request.entry_meta``), never
decoded here.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from .. import codec
from ..entrymeta import namespace_of, read
from ..sizes import format_bytes

if TYPE_CHECKING:
    from ..store.report import EntryInfo, Summary

PER_PROCESS_NOTE = (
    "hits, misses, evictions, drops and corrupt entries are counted in the memory of each process "
    "that uses the store (FeatureCache.stats(), featcache.metrics), not in the store; the device "
    "and host tiers are per process too"
)


# -- values ----------------------------------------------------------------------------------------
def when(ns: int | None) -> str:
    """A stamp in ns as local time, to the second; ``-`` for none."""
    if ns is None:
        return "-"
    try:
        return datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")
    except (ValueError, OverflowError, OSError):  # past what datetime can show
        return f"stamp {ns}"


def iso(ns: int | None) -> str | None:
    if ns is None:
        return None
    try:
        return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds")
    except (ValueError, OverflowError, OSError):  # past what datetime can show
        return None


def exact_bytes(n: int) -> str:
    text = format_bytes(n)
    return text if text.endswith(" B") else f"{text} ({n} B)"


def dtype_text(e: EntryInfo) -> str:
    return e.header.dtype_name if e.header is not None else "?"


def shape_text(e: EntryInfo) -> str:
    return "[" + ",".join(str(d) for d in e.header.shape) + "]" if e.header is not None else "?"


def meta_summary(meta: bytes) -> str:
    """A short, one-line description of an entry's metadata for ``ls``."""
    m = read(meta)
    if not m.size:
        return "-"
    if not m.is_json:
        return f"{m.size} B, not JSON"
    if not isinstance(m.record, dict):
        return f"JSON {type(m.record).__name__}, {m.size} B"
    if m.video is not None:
        return _video_summary(m.video, m.image_tokens)
    if m.image_tokens is not None:
        return f"image_tokens={m.image_tokens}"
    names = sorted(m.record)
    return "JSON {" + ", ".join(names[:4]) + (", ..." if len(names) > 4 else "") + "}"


def _video_summary(video: dict[str, Any], tokens: int | None) -> str:
    """A video's engine item: its video's grid, frames sampled (of how many, at what rate), the
    container's frame size (where its entries recorded it) and the request's decode options."""
    meta = video.get("metadata") if isinstance(video.get("metadata"), dict) else {}
    sampled = meta.get("frames_indices")
    frames = f"{len(sampled)} of {meta.get('total_num_frames')} frames" if isinstance(sampled, list) else "?"
    grid = "x".join(str(x) for x in video.get("grid") or ()) or "?"
    options = json.dumps(video.get("options") or {}, sort_keys=True)
    stated = video.get("stated") if isinstance(video.get("stated"), dict) else {}
    size = f"{stated.get('width')}x{stated.get('height')} px; " if stated else ""
    return (f"video item of {video.get('items')} (grid {grid}; {frames} at {meta.get('fps')} fps; "
            f"{size}options {options}), image_tokens={tokens}")


def meta_text(meta: bytes) -> str:
    """An entry's metadata in full, for ``inspect``."""
    m = read(meta)
    if not m.size:
        return "none"
    if not m.is_json:
        shown = meta[:64].hex() + ("..." if len(meta) > 64 else "")
        return f"{m.size} B, not JSON: {shown}"
    body = json.dumps(m.record, indent=2, sort_keys=True)
    return f"{m.size} B, JSON:\n" + "\n".join("  " + line for line in body.splitlines())


# -- entries (ls, inspect) ---------------------------------------------------------------------------
def entry_doc(e: EntryInfo, full_meta: bool = False) -> dict[str, Any]:
    """One entry as JSON (``ls --json``; ``inspect --json`` with ``full_meta``)."""
    h = e.header
    doc: dict[str, Any] = {
        "key": e.key.hex(),
        "size": e.size,
        "dtype": h.dtype_name if h is not None else None,
        "shape": list(h.shape) if h is not None else None,
        "payload_bytes": h.nbytes if h is not None else None,
        "meta_bytes": len(e.meta),
        "meta": meta_summary(e.meta),
        "namespace": namespace_of(e.meta),
        "last_use_ns": e.last_use_ns,
        "last_use": iso(e.last_use_ns),
        "checksum_ok": e.checksum_ok,
        "problem": e.problem,
    }
    if full_meta:
        m = read(e.meta)
        doc["meta"] = m.record if m.is_json else ({"hex": e.meta.hex()} if m.size else None)
        doc["checksum"] = h.checksum.hex() if h is not None else None
    return doc


def entry_table(listed: list[EntryInfo], total: int) -> list[str]:
    """``ls``'s table of ``listed`` (of ``total`` entries) and its closing line."""
    rows = [
        (e.key.hex(), format_bytes(e.size), dtype_text(e), shape_text(e), when(e.last_use_ns),
         namespace_of(e.meta) or "-", meta_summary(e.meta) if e.problem is None else f"BAD: {e.problem}")
        for e in listed
    ]
    header = ("KEY", "SIZE", "DTYPE", "SHAPE", "LAST USE", "NAMESPACE", "META")
    widths = [max([len(header[i])] + [len(r[i]) for r in rows]) for i in range(6)]
    lines = []
    for row in [header, *rows]:
        cells = [row[i].rjust(widths[i]) if i == 1 else row[i].ljust(widths[i]) for i in range(6)]
        lines.append("  ".join(cells) + "  " + row[6])
    more = f" (--limit 0 for all {total})" if len(listed) < total else ""
    lines.append(f"{len(listed)} of {total} entries, most recently used first{more}.")
    return lines


def entry_lines(entry: EntryInfo) -> list[str]:
    """``inspect``'s description of one entry."""
    h = entry.header
    rows: list[tuple[str, str]] = [("key", entry.key.hex()), ("size", exact_bytes(entry.size))]
    if h is not None:
        rows += [
            ("dtype", h.dtype_name),
            ("shape", shape_text(entry)),
            ("layout", f"header {codec.HEADER.size} B (codec v{codec.FORMAT_VERSION}) + metadata "
                       f"{h.meta_len} B + payload {h.nbytes} B"),
            ("checksum", ("OK" if entry.checksum_ok else f"BAD: {entry.problem}")
                         + f" (xxh3-128 {h.checksum.hex()})"),
        ]
    else:
        rows.append(("header", f"BAD: {entry.problem}"))
    rows.append(("last use", f"{when(entry.last_use_ns)} (stamp {entry.last_use_ns})"))
    rows.append(("metadata", meta_text(entry.meta)))
    return [f"{name:<9} {value}" for name, value in rows]


# -- stats -------------------------------------------------------------------------------------------
def stats_doc(s: Summary, remote: dict[str, Any] | None) -> dict[str, Any]:
    """``stats --json``: the store's summary (and the remote tier's, when asked for)."""
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
                 "live_bytes": s.live_bytes, "reclaimable_bytes": s.reclaimable_bytes,
                 "pages_bytes": s.pages_bytes, "page_size": s.page_size},
        "info": s.info,
        "process_counters": None,
        "note": PER_PROCESS_NOTE,
    }
    if remote is not None:
        doc["remote"] = remote
    return doc


def stats_lines(s: Summary, remote: dict[str, Any] | None) -> list[str]:
    """``stats``' tables: the store, its tiers, the remote tier when asked for, the note."""
    used = format_bytes(s.used_bytes) if s.used_bytes is not None else "unreadable"
    capacity = (format_bytes(s.capacity_bytes) if s.capacity_bytes is not None
                else "not recorded (each process sets its own disk_bytes)")
    in_use = {None: "unknown", 0: "no"}.get(s.in_use_by, f"yes (process {s.in_use_by})")
    rows = [
        ("store", s.path),
        ("format", f"{s.format_tag} (values: codec v{s.value_format_version})"),
        ("in use", in_use),
        ("last use", f"oldest {when(s.oldest_use_ns)}, newest {when(s.newest_use_ns)}"),
        ("map size", f"{format_bytes(s.map_size)} (address space only)"),
        ("data file", f"{format_bytes(s.data_file_bytes)}, page {s.page_size} B"),
        ("pages", f"{format_bytes(s.live_bytes)} live, {format_bytes(s.reclaimable_bytes)} free "
                  "(later writes reuse free pages; `featcache compact` gives them back)"),
    ]
    lines = [f"{name:<10} {value}" for name, value in rows]
    lines += [
        "",
        f"{'tier':<8} {'entries':>9} {'bytes':>11}  capacity",
        f"{'device':<8} {'-':>9} {'-':>11}  - (per process)",
        f"{'host':<8} {'-':>9} {'-':>11}  - (per process)",
        f"{'disk':<8} {s.entries:>9} {used:>11}  {capacity}",
    ]
    if remote is not None:
        lines += ["", *remote_lines(remote)]
    lines += ["", f"note: {PER_PROCESS_NOTE}."]
    return lines


# A compacted copy is worth a stop of the store's processes when it gives back this much of the
# data file, and at least COMPACT_WORTH_BYTES (`purge` says so).
COMPACT_WORTH_FRACTION = 0.25
COMPACT_WORTH_BYTES = 8 << 20


def compact_advice(s: Summary, path: str) -> str | None:
    """What ``featcache compact`` would give back of the store ``s`` describes, when that is
    worth saying (``COMPACT_WORTH_*``); None otherwise."""
    free = s.reclaimable_bytes
    if free < COMPACT_WORTH_BYTES or free < COMPACT_WORTH_FRACTION * s.data_file_bytes:
        return None
    return (f"the data file stays {format_bytes(s.data_file_bytes)} (LMDB reuses free pages but "
            f"never shrinks its file): `featcache compact {path} DEST` would give back "
            f"{format_bytes(free)}")


def remote_lines(r: dict[str, Any]) -> list[str]:
    """The remote tier's server summary (``tiers.remote.server_summary``) as ``stats`` shows it."""
    entries = f"{r['entries']}{'+' if r['entries_capped'] else ''}"
    used = r["used_memory_bytes"]
    cap = r["maxmemory_bytes"]
    return [
        f"remote     {r['url']} (keys {r['prefix']}:*)",
        f"  entries  {entries}",
        f"  memory   {format_bytes(used) if used is not None else '?'} used by the server, maxmemory "
        f"{format_bytes(cap) if cap else 'none'}, policy {r['maxmemory_policy']}",
    ]
