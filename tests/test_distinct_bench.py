"""bench/distinct.py's ``stages`` on the CPU (issue 38): a real run over lmdeploy's InternVL
preprocessing of the seed InternVL2-2B checkpoint (config only), in a subprocess, as
docs/benchmarks.md runs it on the GPU machine; what its report says a user reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _lmdeploy_stack
import pytest

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


# -- issue 53: the serve bench that decides -----------------------------------------------------------
def test_serve_runs_every_server_at_once_in_a_rotating_order_and_reports_each_reps_ratios(
        tmp_path, monkeypatch, capsys):
    """Three servers up at once; rep 0 runs plain, featcache, featcache_in; rep 1 featcache,
    featcache_in, plain; rep 2 featcache_in, plain, featcache. Each repetition's ratios against
    plain's same repetition are printed and kept, with their spread and the answers' identity;
    ``--bound`` reports each server's rate as a fraction of the compute bound."""
    import contextlib

    from bench import distinct
    from bench.lib import bound, client, servers

    started, ran = [], []
    rates = {"plain": [10.0, 12.0, 11.0], "featcache": [20.0, 18.0, 33.0],
             "featcache_in": [22.0, 24.0, 22.0]}

    @contextlib.contextmanager
    def running(name, cmd, port, log, timeout, res):
        started.append((name, cmd))
        yield f"http://server/{name}"

    def side(name, base, model, args, rep, profile=None):
        ran.append((rep, name))
        tokens = [[1, 2, 3]] * args.n if name != "featcache_in" or rep else [[9]] * args.n
        return dict(sequential_ms=[100.0 if name == "plain" else 50.0] * args.n, tokens=tokens,
                    prompt_tokens=[1900] * args.n, requests_per_s=rates[name][rep], ttft_p50_ms=1.0,
                    ttft_max_ms=2.0)

    monkeypatch.setattr(servers, "running", running)
    monkeypatch.setattr(client, "connect", lambda base: base)
    monkeypatch.setattr(client, "served_model", lambda c: "m")
    monkeypatch.setattr(client, "counters", lambda base: {})
    monkeypatch.setattr(distinct, "_ask", lambda c, model, url, max_tokens=1: dict(prompt_tokens=100))
    monkeypatch.setattr(distinct, "_side", side)
    monkeypatch.setattr(bound, "matrix_rate", lambda: 1e15)
    monkeypatch.setattr(bound, "param_split",
                        lambda model: dict(vision=300_000_000, llm=1_300_000_000, other=0))
    monkeypatch.setattr(bound, "merge_factor", lambda model: 4)
    import argparse

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["InternVLChatModel"]}))
    args = argparse.Namespace(model=str(tmp_path), engine="pytorch", eager=False, logs=str(tmp_path),
                              n=2, batch=4, clients=2, reps=3, stages=False, ready_timeout=1,
                              engine_process=None, servers="plain,featcache,featcache_in",
                              answer_tokens=4, bound=True, profile="")
    report = distinct.serve(args)
    assert [n for n, _ in started] == ["plain", "featcache", "featcache_in"]
    assert "--engine-process" not in started[1][1]  # (featcache serve's own default: mp)
    assert started[2][1][started[2][1].index("--engine-process") + 1] == "in"
    assert ran == [(0, "plain"), (0, "featcache"), (0, "featcache_in"), (1, "featcache"),
                   (1, "featcache_in"), (1, "plain"), (2, "featcache_in"), (2, "plain"), (2, "featcache")]
    vs = report["results"]["featcache"]["vs_plain"]
    assert vs["requests_per_s_per_rep"] == [2.0, 1.5, 3.0] and vs["requests_per_s_spread"] == [1.5, 3.0]
    assert vs["sequential_speedup_per_rep"] == [2.0, 2.0, 2.0]
    assert vs["token_identical"] == vs["compared"] == 6
    vin = report["results"]["featcache_in"]["vs_plain"]
    assert vin["token_identical"] == 4 and vin["compared"] == 6  # (rep 0's answers differed)
    assert report["results"]["featcache"]["vs_featcache_in"]["requests_per_s_per_rep"] == [0.909, 0.75, 1.5]
    b = report["bound"]
    assert b["image_tokens"] == 1800 and b["prompt_tokens"] == 1900
    flops = 2 * 300e6 * 4 * 1800 + 2 * 1.3e9 * 1900
    assert b["tflop_per_request"] == round(flops / 1e12, 3)
    assert b["fraction_of_bound"]["plain"] == round(11.0 * flops / 1e15, 4)
    out = capsys.readouterr().out
    assert "serve rep 1 (order featcache featcache_in plain)" in out
    assert "(1.50x req/s, 2.00x sequential)" in out


def test_the_bound_counts_the_towers_and_the_llms_weights_from_the_checkpoint(tmp_path):
    import torch
    from safetensors.torch import save_file

    from bench.lib import bound

    save_file({"vision_model.encoder.layers.0.w": torch.zeros(10, 20),
               "mlp1.0.weight": torch.zeros(5, 5),
               "language_model.model.layers.0.w": torch.zeros(30, 40),
               "language_model.model.embed_tokens.weight": torch.zeros(100, 8),
               "language_model.lm_head.weight": torch.zeros(100, 8)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"downsample_ratio": 0.5}))
    assert bound.param_split(str(tmp_path)) == {"vision": 225, "llm": 1200, "other": 1600}
    assert bound.merge_factor(str(tmp_path)) == 4
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"spatial_merge_size": 2}}))
    assert bound.merge_factor(str(tmp_path)) == 4
    assert bound.request_flops({"vision": 225, "llm": 1200}, 4, 10, 30) == 2 * 225 * 40 + 2 * 1200 * 30
    if not torch.cuda.is_available():
        assert bound.matrix_rate() is None


def test_serve_profile_records_each_phase_of_the_named_servers_in_the_first_repetition(
        tmp_path, monkeypatch):
    """``--profile featcache``: repetition 0's sequential phase and concurrent phase of that server
    each run under py-spy (started before the phase's first request, stopped after its last), the
    two summaries in its result; the other servers and repetitions run without it; a server not
    in --servers is refused."""
    import argparse
    import contextlib

    from bench import distinct, pyspy
    from bench.lib import client, servers

    events = []

    class Recording:
        def __init__(self, pid, seconds, out_path):
            events.append(("start", pid, os.path.basename(out_path)))

        def stop(self):
            events.append(("stop",))
            return {"samples": len(events)}

    @contextlib.contextmanager
    def running(name, cmd, port, log, timeout, res):
        res["pid"] = {"plain": 11, "featcache": 22}[name]
        yield f"http://server/{name}"

    def ask(c, model, url, max_tokens=1):
        events.append(("ask", c))
        return dict(prompt_tokens=100, ttft_ms=5.0, output_ids=[1])

    def concurrent(base, model, urls, clients):
        events.append(("batch", base))
        return 2.0, [1.0, 2.0]

    monkeypatch.setattr(pyspy, "Profile", Recording)
    monkeypatch.setattr(servers, "running", running)
    monkeypatch.setattr(client, "connect", lambda base: base)
    monkeypatch.setattr(client, "served_model", lambda c: "m")
    monkeypatch.setattr(client, "counters", lambda base: {})
    monkeypatch.setattr(distinct, "_ask", ask)
    monkeypatch.setattr(distinct, "_concurrent", concurrent)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["InternVLChatModel"]}))
    args = argparse.Namespace(model=str(tmp_path), engine="pytorch", eager=False, logs=str(tmp_path),
                              n=2, batch=3, clients=2, reps=2, stages=False, ready_timeout=1,
                              engine_process=None, servers="plain,featcache", answer_tokens=1,
                              bound=False, profile="featcache")
    report = distinct.serve(args)
    assert "profile" in report["results"]["featcache"] and "profile" not in report["results"]["plain"]
    assert set(report["results"]["featcache"]["profile"]) == {"sequential", "concurrent"}
    assert [e for e in events if e[0] == "start"] == [("start", 22, "pyspy-featcache-sequential.txt"),
                                                    ("start", 22, "pyspy-featcache-concurrent.txt")]
    first = events.index(("start", 22, "pyspy-featcache-sequential.txt"))
    mine = events[first:first + 7]  # its two sequential asks and its batch, each phase inside a recording
    assert [e[0] for e in mine] == ["start", "ask", "ask", "stop", "start", "batch", "stop"]
    assert all(e[1] == "http://server/featcache" for e in mine if e[0] in ("ask", "batch"))
    args.profile = "featcache_in"
    with pytest.raises(SystemExit, match="--profile"):
        distinct.serve(args)
