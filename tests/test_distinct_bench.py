"""bench/distinct.py's ``stages`` on the CPU (issue 38): a real run over lmdeploy's InternVL
preprocessing of the seed InternVL2-2B checkpoint (config only), in a subprocess, as
docs/benchmarks.md runs it on the GPU machine; what its report says a user reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _lmdeploy_stack

_lmdeploy_stack.require()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench", "device"))
import make_seed_models as seed  # noqa: E402


def test_stages_compares_every_image_and_reports_ratios_per_repetition(tmp_path):
    _lmdeploy_stack.need_transforms()
    model = seed.build("2b", str(tmp_path), dry_run=True)["path"]
    out = tmp_path / "stages.json"
    r = subprocess.run([sys.executable, "-m", "bench", "distinct", "stages", "--model", model,
                        "--n", "2", "--batch", "3", "--reps", "2", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["pixel_values_differ"] == 0 and report["compared"] == 4
    assert report["where"].startswith("on cpu")
    assert len(report["sequential"]["speedup_per_rep"]) == 2
    assert len(report["batch"]["speedup_per_rep"]) == 2
    # every image featcache preprocessed went its fast way: 2 warm-ups, 2 x 2 compared, 2 x 3 batched
    assert report["counters"] == {"preprocess_fast": 12}
    assert "run" in report  # the run's metadata (bench.lib.results)
