"""The README's first screen (issue 29 item 10): the quick start is examples/quickstart.py, which
runs as written on a CPU with only what the main command installs; the problem, a headline number
from a results file, and the two commands come before any benchmark paragraph."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
QUICKSTART = ROOT / "examples" / "quickstart.py"
MAIN_COMMAND = "python3 -m pip install torch==2.13.0 -e . && featcache demo"

# What the main command does not install: the quick start must not need any of it.
NOT_INSTALLED = ("PIL", "lmdeploy", "redis", "prometheus_client", "transformers", "matplotlib")


def test_the_quick_start_runs_as_written_on_a_cpu_with_the_base_install():
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in NOT_INSTALLED)  # import fails
    code = f"import runpy, sys; {blocked}; runpy.run_path({str(QUICKSTART)!r}, run_name='__main__')"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the device it picks by itself: the CPU
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [
        "features (1, 256, 1024) torch.float32 on cpu",
        "9 entries on disk, 0 writes dropped",
        "after a restart: 9 entries on disk, 9 verified, the first image's features bit-identical",
    ]


def test_the_readme_quick_start_is_the_example_file():
    section = README.split("\n## Quick start\n", 1)[1]
    shown = re.search(r"```python\n(.*?)```", section, re.S)
    assert shown is not None and shown.group(1) == QUICKSTART.read_text()


def test_the_first_screen_says_what_it_is_the_problem_a_number_and_the_two_commands():
    first_benchmark = README.index("\n## Results\n")  # the figures' table (issue 41)
    top = README[:first_benchmark]
    assert top.index("tiered") < top.index("every turn") < top.index(MAIN_COMMAND)
    assert "<!-- test-command: .ci/run runs the next line verbatim -->" in top
    ci = subprocess.run(["awk", "/<!-- test-command/{found=1; next} found && /^python3 /{print; exit}",
                         "README.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert ci.stdout.strip() == (
        "python3 -m pip install torch==2.13.0 -e '.[test]' && python3 -m pip install --no-deps "
        "lmdeploy==0.18.0 -r requirements/lmdeploy-cpu.txt && python3 -m pip install --no-deps "
        "--target .cache/torchvision-ref torchvision==0.29.1 && python3 -m pytest -q")
    assert top.index(MAIN_COMMAND) < top.index(ci.stdout.strip()) < top.index("## Quick start")
    assert top.count("```bash") == 2  # the two commands, nothing else to run yet

    # the headline number, recomputed from the results file it names
    headline = re.search(r"\| PyTorch engine \| 597 ms \| 237 ms \| \*\*2\.5x\*\* \| `([^`]+)` \|", top)
    assert headline is not None
    runs = json.loads((ROOT / "bench" / "results" / headline.group(1)).read_text())
    ms = {engine: statistics.median(x for rep in runs[engine]["raw"]["a"] for x in rep["ms"])
          for engine in ("plain", "featcache")}
    assert (round(ms["plain"]), round(ms["featcache"])) == (597, 237)
    assert round(ms["plain"] / ms["featcache"], 1) == 2.5


def test_cli_md_lists_demo_once():
    usage = (ROOT / "docs" / "cli.md").read_text().split("```")[1]
    assert sum(line.startswith("featcache demo") for line in usage.splitlines()) == 1
