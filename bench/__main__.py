"""``python -m bench``: every runnable file under bench/ by name, from the checkout's root.

    python -m bench                  # the benchmarks, tools and checkpoint builders, one line each
    python -m bench NAME --help      # NAME's own help
    python -m bench NAME ARGS...     # runs python3 bench/NAME.py ARGS... (bench/checks/NAME.py for
                                     # a check, bench/device/NAME.py for a builder): the same
                                     # process, the same exit code

A file is runnable when it has a ``__main__`` block; its line in the list is its docstring's first
line. Running one replaces this process by ``python3 bench/NAME.py ARGS...`` with the checkout's
root on PYTHONPATH (as bench/device's scripts run them on the GPU machine), so both forms behave
the same: the file form stays what docs/benchmarks.md and bench/device/*.sh call.
"""

from __future__ import annotations

import ast
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# What a user asks, and the files that answer it (every benchmark measures against plain lmdeploy
# in the same run where plain lmdeploy does the same work). Every runnable file is in one group or
# is a checkpoint builder: tests/test_bench_entry.py fails on a new file placed nowhere.
QUESTIONS: dict[str, tuple[str, ...]] = {
    "the store: a hit's latency and bandwidth per tier": ("tiers",),
    "a pipeline (PyTorch engine): repeated and new images, chat turns, clients at once; token identity":
        ("e2e_lmdeploy",),
    "a stream of new images (preprocessing, a pipeline, a server)": ("distinct",),
    "TurboMind: speed and fidelity": ("turbomind_bench", "turbomind_check"),
    "a server: chats, latency under load, hostile clients, stopping": (
        "serve_chat", "serve_latency", "hostile_serve", "shutdown_serve"),
    "eviction policies against LRU": ("eviction",),
    "a fleet's shared tier": ("fleet", "remote"),
    "the command line's start-up": ("cli_start",),
}
# Checks of one mechanism (bench/checks/: each answered once; rerun when what it checks changes)
CHECKS = ("mp_engine_check", "request_report_check", "auto_budgets_check", "turbomind_features",
          "turbomind_features_diff", "turbomind_envelope", "hit_path_costs", "lmdbcheck")
TOOLS = ("plot_bench", "runmeta", "serve_stages")  # they read, chart or time runs; they compare nothing


def runnable() -> dict[str, str]:
    """Name -> path of every file with a ``__main__`` block in bench/, bench/checks/ and bench/device/."""
    found: dict[str, str] = {}
    for folder in (HERE, os.path.join(HERE, "checks"), os.path.join(HERE, "device")):
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if name.endswith(".py") and not name.startswith("_") and _has_main(path):
                found.setdefault(name[:-3], path)
    return found


def _has_main(path: str) -> bool:
    with open(path, errors="replace") as f:
        text = f.read()
    return "if __name__ == '__main__':" in text or 'if __name__ == "__main__":' in text


def summary(path: str, width: int = 96) -> str:
    """The first sentence of the file's docstring (what it measures or does), cut at ``width``."""
    try:
        with open(path) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
    except (OSError, SyntaxError, ValueError) as e:
        return f"(unreadable: {type(e).__name__})"
    first = " ".join(doc.strip().split("\n\n", 1)[0].split()) or "(no docstring)"
    first = first.split(". ", 1)[0].removesuffix(".")
    return first if len(first) <= width else first[:width - 3].rsplit(" ", 1)[0] + " ..."


def builders() -> set[str]:
    """The checkpoint builders: bench/device's scripts and every file bench/lib/models.py names."""
    from bench.lib.models import CHECKPOINTS

    named = {os.path.basename(cmd.split()[0])[:-3] for cmd in CHECKPOINTS.values()}
    return named | {n[:-3] for n in os.listdir(os.path.join(HERE, "device")) if n.endswith(".py")}


def groups() -> dict[str, list[str]]:
    """The listing's groups: each question's benchmarks, then the checks, the tools, the builders."""
    files = runnable()
    made = builders()
    out = {f"{q}:": [n for n in names if n in files] for q, names in QUESTIONS.items()}
    out["checks of one mechanism (on a GPU unless said):"] = [n for n in CHECKS if n in files]
    out["tools:"] = [n for n in TOOLS if n in files]
    out["checkpoint builders (bench/lib/models.py: which builds what):"] = [n for n in files if n in made]
    placed = {n for names in out.values() for n in names}
    out["not yet placed (bench/__main__.py's QUESTIONS):"] = [n for n in files if n not in placed]
    return {title: names for title, names in out.items() if names}


def listing() -> str:
    files = runnable()
    width = max(len(n) for n in files)
    lines = ["usage: python -m bench NAME [ARGS...]   (python -m bench NAME --help: its own help)"]
    for title, names in groups().items():
        lines += ["", title] + [f"  {n:<{width}}  {summary(files[n])}" for n in names]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    files = runnable()
    name = argv[0].removesuffix(".py").rsplit("/", 1)[-1]
    if name not in files:
        print(f"python -m bench: no runnable bench file {argv[0]!r}\n\n{listing()}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, ROOT])
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, files[name], *argv[1:]], env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
