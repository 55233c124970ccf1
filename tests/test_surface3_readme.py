"""The user's surface, third pass, item 4 (issue 41): a README that reads in one screen.

Before: the headline packed two benchmarks, their qualifiers and two file paths into one
sentence; the API notes (26 lines), Results (one 19-line paragraph of ~20 figures and 10 file
names) and Status buried the capabilities; nothing said how long the tests take. Now: what, why,
one headline figure per engine (a table row each, recomputed here from its results file), the two
commands, the quick start, the CLI; the figures in a table that says which workload and machine
each holds for; the rest in docs/ pages the README links to, none of it lost.
(The two commands themselves: tests/test_quickstart.py and tests/test_cli.py.)"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "bench" / "results"


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a Markdown page (not code blocks, tables, lists or headings)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [p for p in re.split(r"\n\s*\n", prose)
            if p.strip() and not p.lstrip().startswith(("|", "-", "#", "<!--", "!["))]


def top() -> str:
    return README[:README.index("\n## Quick start\n")]


def test_no_paragraph_of_the_readme_runs_past_eight_lines():
    long = [p.splitlines()[0][:60] for p in paragraphs(README) if len(p.splitlines()) > 8]
    assert not long, f"README paragraphs longer than 8 lines: {long}"


def test_the_headline_is_one_figure_per_engine_each_from_its_results_file():
    rows = re.findall(r"^\| (PyTorch engine|TurboMind[^|]*) \| (\d+) ms \| (\d+) ms \| \*\*([\d.]+)x\*\* "
                      r"\| `([^`]+)` \|$", top(), re.M)
    assert [r[0].split(",")[0] for r in rows] == ["PyTorch engine", "TurboMind"], rows
    for engine, plain, cached, ratio, name in rows:
        runs = json.loads((RESULTS / name).read_text())
        if engine == "PyTorch engine":
            ms = {e: statistics.median(x for rep in runs[e]["raw"]["a"] for x in rep["ms"])
                  for e in ("plain", "featcache")}
            plain_ms, cached_ms = ms["plain"], ms["featcache"]
        else:  # turbomind_bench's result: the (a) series' medians per engine
            assert 'turbomind="combined"' in engine
            plain_ms, cached_ms = (runs["engines"][e]["a_same_image_fresh_context"]["median_ms"]
                                   for e in ("plain", "combined"))
        assert (round(plain_ms), round(cached_ms)) == (int(plain), int(cached)), name
        assert f"{plain_ms / cached_ms:.1f}" == ratio, name
    # no sentence of the first screen names a results file: they sit in the table's column
    assert not [p for p in paragraphs(top()) if "bench/results/" in p and ".json" in p]


def test_the_figures_are_a_table_saying_workload_and_machine_each_from_benchmarks():
    section = README[README.index("\n## Results\n"):README.index("\n## Documentation\n")]
    header = next(line for line in section.splitlines() if line.startswith("| "))
    assert header == "| figure | workload | engine, machine | source |"
    rows = [line for line in section.splitlines() if line.startswith("| ") and line != header
            and not line.startswith("|---")]
    assert len(rows) >= 8
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    for row in rows:
        figure, workload, machine, source = (c.strip() for c in row.strip("|").split(" | "))
        assert workload and machine and source, row
        files = re.findall(r"`([^`]+\.json)`", source)
        for name in files:  # each named file exists ({a,b} alternatives expanded)
            alternatives = re.match(r"(.*)\{(.*)\}(.*)", name)
            for one in ([alternatives.group(1) + a + alternatives.group(3)
                         for a in alternatives.group(2).split(",")] if alternatives else [name]):
                assert (RESULTS / one).is_file(), one
        assert files or "docs/benchmarks.md" in source, row
        # every figure of the row is docs/benchmarks.md's, as it writes it
        for number in re.findall(r"\d+\.\d+", figure):
            assert number in benchmarks, f"{number} (README results table) is not in docs/benchmarks.md"


def test_the_readme_says_how_long_the_tests_take_on_a_small_machine():
    setup = top()[top().index("## Set up and run"):]
    said = re.search(r"about \d+(-\d+)? minutes on a small machine[^)]*2 cores, passed\s+\d+ and "
                     r"skipped \d+", setup)
    assert said is not None, "the README does not say how long the tests take"


def test_every_docs_page_the_readme_names_exists():
    named = set(re.findall(r"docs/[\w-]+\.md", README))
    assert {"docs/api.md", "docs/results.md", "docs/serving.md", "docs/setup.md"} <= named
    assert all((ROOT / name).is_file() for name in named), sorted(n for n in named
                                                              if not (ROOT / n).is_file())


# Facts the README stated before issue 41 that now live in docs/ (a phrase of each).
MOVED = [
    "Keys are 1 to 503 bytes",
    "`clear()` leaves the shared remote tier alone",
    "a CUDA\n  cache cannot be used in a forked child",
    "`key_algorithm=\"xxh3_128\"` is faster and unkeyed",
    "Returned tensors may share storage with the cache",
    "a hit costs featcache 2.6 ms and skips 380 ms of preprocessing and vision",
    "measured just outside TurboMind's own envelope",
    "so 2.67x is the most any feature cache can give a fresh context",
    "`--dp` > 1 is refused",
    "A request\nnaming `/dev/zero`, a FIFO, a 1 GiB file or a file outside DIR is answered 400",
    "`pack_turbomind.sh` / `run_turbomind.sh` carry TurboMind",
    "redis-cluster://node:port",
    "start in 0.14-0.22 s",
    "torchvision's wheel is",
]


def test_what_left_the_readme_is_in_the_docs_it_links():
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    lost = [m for m in MOVED if m not in docs and m not in README]
    assert not lost, f"no longer said anywhere: {lost}"
