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


def _record(first_output: float) -> dict:
    return dict(marks_ms=dict(body_read=1.0, endpoint=2.0, prepared=10.0, generate_start=11.0,
                              first_output=first_output, first_byte=first_output + 1.0),
                spans_ms={"json_parse": [0.5, 1], "fc_preprocess": [6.0, 1]}, engine=None)


def test_serve_stages_records_are_taken_per_phase_and_summed_up_as_medians(tmp_path):
    """``distinct serve --stages``: a phase's records are the ones after those already answered
    (each server appends one per request as it ends), and the report gets each stage's median."""
    from bench import distinct
    from bench.lib import stages

    path = tmp_path / "stages.jsonl"
    path.write_text("".join(json.dumps(_record(t)) + "\n" for t in (20.0, 30.0, 100.0, 300.0, 500.0)))
    rows = distinct._records(str(path), 2, 2)
    assert [r["marks_ms"]["first_output"] for r in rows] == [100.0, 300.0]
    assert distinct._records(None, 0, 3) == []
    assert len(distinct._records(str(path), 4, 3, wait_s=0.2)) == 1  # (a record never written)
    got = dict((label, ms) for label, _, ms in stages.medians([stages.summarize(r) for r in rows]))
    assert got["submit -> first output (engine process)"] == 189.0  # (89 and 289)
    assert got["featcache image preprocessing (fastprep; lmdeploy's where it falls back)"] == 6.0
