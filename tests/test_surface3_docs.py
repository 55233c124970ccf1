"""The user's surface, third pass, item 5 (issue 41): docs that agree with the code.

Every `$ featcache ...` example of docs/cli.md whose output can be compared against a real store is
run here, as written, on a store built in tmp_path to look like the example's, and its output is
compared with the page's, line by line, after what differs from run to run is normalised (dates,
paths, numbers, sizes; a hex string keeps its length, so a key of 32 hex digits where real keys
have 64 does not pass; a line `...` stands for any lines). The other examples are listed in
NOT_COMPARED with where they are checked; a new example must be added to one or the other. Before
issue 41 the `ls`, `inspect` and `verify` examples showed 32-hex-digit keys, and `featcache ls`
showed 2 of 4 entries (its default limit is 50).

Also: requirements/lmdeploy-cpu.txt's list of what it leaves out on purpose pins none of it (it
said anyio and click were left out, and pinned both).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lmdb
import pytest
import torch

from featcache import FeatureCache
from featcache.cli import main

ROOT = Path(__file__).resolve().parent.parent
CLI_DOC = ROOT / "docs" / "cli.md"
NS = "InternVLForConditionalGeneration:5d0b1f3c9a7e4e21b8c6d2f0a1e3b4c5"  # as identity.py makes them


@dataclass
class Example:
    command: str  # as the page writes it, without "$ "
    expected: list[str]  # the lines the page shows after it
    line: int  # where it is on the page


def examples(text: str) -> list[Example]:
    """The `$ featcache ...` examples of the page's fenced blocks, each with the lines after it."""
    out: list[Example] = []
    in_block = False
    current: Example | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_block, current = not in_block, None
            continue
        if not in_block:
            continue
        if line.startswith("$ featcache"):
            current = Example(line[2:], [], number)
            out.append(current)
        elif current is not None:
            current.expected.append(line)
    return out


# -- normalising what changes from run to run ---------------------------------------------------------
def _hex(match: re.Match[str]) -> str:
    return f"<hex{len(match.group())}>"


def normal(line: str) -> str:
    line = re.sub(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}", "<date>", line)
    line = re.sub(r"(?<![\w.~])/[^\s'`\"),]*", "<path>", line)
    line = re.sub(r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{16,}\b", _hex, line)
    line = re.sub(r"(?<![\w<-])\d+(?:\.\d+)?", "<n>", line)
    line = re.sub(r"<n> (?:B|KiB|MiB|GiB|TiB)\b", "<size>", line)
    return " ".join(line.split())


def assert_matches(expected: list[str], real: str, where: str) -> None:
    """``real`` (the command's stdout) has the page's lines, normalised; `...` is any lines."""
    pattern = "".join(r"(?:.*\n)*?" if normal(e) == "..." else re.escape(normal(e)) + r"\n"
                      for e in expected if e.strip())
    got = "".join(normal(line) + "\n" for line in real.splitlines() if line.strip())
    if re.fullmatch(pattern, got) is None:
        want = "\n".join(normal(e) for e in expected if e.strip())
        pytest.fail(f"{where}: the page shows (normalised)\n{want}\n\nthe command prints "
                    f"(normalised)\n{got}", pytrace=False)


# -- stores that look like the page's ----------------------------------------------------------------
def lmdeploy_meta() -> bytes:
    """An entry's metadata as featcache.lmdeploy writes it (InternVL-HF: 256 image tokens)."""
    return json.dumps({"fields": {"image_token_id": 151655, "image_tokens": 256}, "ns": NS,
                       "pixels": [[3, 448, 448], "bfloat16"]},
                      sort_keys=True, separators=(",", ":")).encode()


def put_entries(path: Path, n: int, first: int = 0, namespaced_last: bool = True) -> list[bytes]:
    """``n`` entries of bfloat16 [1,256,1536] features (768 KiB each), keyed as the cache keys
    images; the last one carries lmdeploy's metadata and namespace (the page's first `ls` row)."""
    keys = []
    with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=path,
                      disk_bytes="1GiB") as cache:
        for i in range(first, first + n):
            key = bytes(cache.image_key(b"image-%d" % i, namespace="ns"))  # the digest alone
            last = namespaced_last and i == first + n - 1
            cache.put(key, torch.full((1, 256, 1536), float(i), dtype=torch.bfloat16),
                      meta=lmdeploy_meta() if last else None, block=True)
            keys.append(key)
    return keys


def flip_payload_byte(path: Path, key: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30)
    try:
        data = env.open_db(b"data")
        with env.begin(write=True) as txn:
            value = bytearray(txn.get(key, db=data))
            value[-1] ^= 0x40
            txn.put(key, bytes(value), db=data)
    finally:
        env.close()


HOLD = """
import sys
from featcache import FeatureCache
with FeatureCache(device="cpu", device_bytes=0, host_bytes=0, disk_path=sys.argv[1],
                  disk_bytes="1GiB"):
    print("open", flush=True)
    sys.stdin.read()
"""


class Held:
    """The store open in another process (a server), as the page's `in use yes (process N)`."""

    def __init__(self, path: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "open"

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# Each compared example: how to build its store (into ``store``), run before the command; it
# returns the substitutions that turn the page's command into one for this store.
Setup = Callable[[Path, pytest.MonkeyPatch], dict[str, str]]


def four_entries(store: Path, _: pytest.MonkeyPatch) -> dict[str, str]:
    keys = put_entries(store, 4)
    return {"36fb51b3": keys[-1].hex()[:8]}  # inspect: the newest entry's prefix


def one_bad(store: Path, _: pytest.MonkeyPatch) -> dict[str, str]:
    keys = put_entries(store, 4)
    flip_payload_byte(store, keys[1])
    return {}


def old_and_new(store: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Entries last used ten days ago (over 8 MiB, most of the file) and three used now."""
    real = time.time_ns
    with monkeypatch.context() as m:
        m.setattr(time, "time_ns", lambda: real() - 10 * 86400 * 10**9)
        put_entries(store, 14, namespaced_last=False)
    put_entries(store, 3, first=100)
    return {}


def purged(store: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    old_and_new(store, monkeypatch)
    assert main(["purge", str(store), "--older-than", "7d"]) == 0
    return {}


COMPARED: dict[str, tuple[Setup, bool]] = {  # command -> (its store, held open by a server)
    "featcache stats /var/cache/featcache": (four_entries, True),
    "featcache ls --limit 2": (four_entries, False),
    "featcache inspect 36fb51b3": (four_entries, False),
    "featcache verify": (one_bad, False),
    "featcache verify --fix": (one_bad, False),  # after `featcache verify`, in the same block
    "featcache purge --older-than 7d": (old_and_new, False),
    "featcache compact /var/cache/featcache /var/cache/featcache.new": (purged, False),
}
NOT_COMPARED = {  # command -> why not here, and where it is checked
    "featcache doctor": "what this machine has: tests/test_cli_doctor.py",
    "featcache stats --remote-url redis://:secret@cache-1:6379/0 --remote-prefix internvl2-2b":
        "a Redis server's entries: tests/test_remote.py",
    "featcache stats --url http://localhost:23333": "a running server: tests/test_cli_server_stats.py",
    "featcache warm /models/InternVL3-2B --from-dir ./photos --cache-dir /var/cache/featcache":
        "a model and a GPU: tests/test_serve_warm.py",
}
PAGE_PATHS = ("/var/cache/featcache.new", "/var/cache/featcache")  # the page's store (and copy)


def test_every_example_of_the_page_is_compared_or_says_where_it_is_checked():
    on_page = [e.command for e in examples(CLI_DOC.read_text())]
    assert on_page, "no `$ featcache` examples found in docs/cli.md"
    unknown = [c for c in on_page if c not in COMPARED and c not in NOT_COMPARED]
    assert not unknown, f"docs/cli.md examples neither compared nor listed in NOT_COMPARED: {unknown}"
    stale = [c for c in (*COMPARED, *NOT_COMPARED) if c not in on_page]
    assert not stale, f"examples listed here that docs/cli.md no longer shows: {stale}"


def run_page_command(command: str, store: Path, subs: dict[str, str], capsys) -> tuple[int, str]:
    argv = command.split()[1:]
    for old, new in subs.items():
        argv = [a.replace(old, new) for a in argv]
    argv = [str(store) + "-copy" if a == PAGE_PATHS[0] else str(store) if a == PAGE_PATHS[1] else a
            for a in argv]
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out


@pytest.mark.parametrize("command", [c for c in COMPARED if c != "featcache verify --fix"])
def test_the_pages_example_is_what_the_command_prints(command, tmp_path, capsys, monkeypatch):
    page = examples(CLI_DOC.read_text())
    block = [e for e in page if e.command == command]
    assert block, f"docs/cli.md shows no `$ {command}`"
    store = tmp_path / "featcache"
    monkeypatch.setenv("FEATCACHE_DIR", str(store))  # `featcache ls` etc. read the default store
    setup, held = COMPARED[command]
    subs = setup(store, monkeypatch)
    runs = [block[0]]
    if command == "featcache verify":  # the page's next example runs on the same store
        runs += [e for e in page if e.command == "featcache verify --fix"]
    holder = Held(store) if held else None
    try:
        for example in runs:
            rc, out = run_page_command(example.command, store, subs, capsys)
            assert rc in (0, 2), out
            assert_matches(example.expected, out, f"docs/cli.md line {example.line}")
    finally:
        if holder is not None:
            holder.close()


def shape(doc: object, real: object, where: str) -> None:
    """``real`` has ``doc``'s keys (recursively) and kinds of values; a string of the page that
    ends in `...` is a prefix of the real one."""
    if isinstance(doc, dict):
        assert isinstance(real, dict) and set(doc) == set(real), (where, doc, real)
        for key in doc:
            shape(doc[key], real[key], f"{where}.{key}")
    elif isinstance(doc, str) and doc.endswith("..."):
        assert isinstance(real, str) and real.startswith(doc[:-3]), (where, doc, real)
    else:
        assert type(doc) is type(real), (where, doc, real)


def test_the_pages_stats_json_is_what_stats_json_prints(tmp_path, capsys, monkeypatch):
    text = CLI_DOC.read_text()
    section = text[text.index("### `featcache stats [DIR]"):]
    block = section[section.index("```json\n") + 8:]
    doc = json.loads(block[:block.index("```")])
    store = tmp_path / "featcache"
    four_entries(store, monkeypatch)
    holder = Held(store)
    try:
        assert main(["stats", str(store), "--json"]) == 0
    finally:
        holder.close()
    shape(doc, json.loads(capsys.readouterr().out), "stats --json")


def test_the_lmdeploy_requirements_pin_nothing_they_say_they_leave_out():
    text = (ROOT / "requirements" / "lmdeploy-cpu.txt").read_text()
    comment = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    said = re.search(r"Left out on purpose \([^)]*\): ([^()]*?) \(", comment)
    assert said is not None, "requirements/lmdeploy-cpu.txt no longer says what it leaves out"
    left_out = {name.strip().lower() for name in said.group(1).split(",")}
    pinned = {line.split("==")[0].strip().lower() for line in text.splitlines()
              if "==" in line and not line.startswith("#")}
    assert left_out and not left_out & pinned, f"said to be left out, yet pinned: {left_out & pinned}"
