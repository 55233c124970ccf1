"""Each request knows what it got (issue 30, item 4): the ``X-Featcache`` header and
``usage.featcache`` of `featcache serve`, and ``Response.featcache`` of the pipeline.

Three levels (the ASGI middleware over a toy app: tests/test_serve_report.py): the report's
format and the tiers a lookup names (``Lease.tier``); `featcache serve` end to end, served by a
real uvicorn on a local port and asked with ``http.client``: lmdeploy's real CLI, api_server,
FastAPI app, chat completion handler and ``AsyncEngine.preprocess`` over the tiny checkpoint's
real prompt path with featcache's frontend, the engine's generation a stand-in that runs
featcache's real model hook (``models._serve``: misses computed by a fake vision call and put
with their measured cost, hits served from their leases); and lmdeploy's real ``Pipeline`` over
the same stand-in.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import http.client
import importlib
import io
import json
import threading
import time

import _lmdeploy_stack
import pytest
import torch

_lmdeploy_stack.require("fastapi", "uvicorn", "prometheus_client")  # CI fails instead of skipping

import lmdeploy_tiny as tiny  # noqa: E402
import test_media_sources  # noqa: E402
from lmdeploy import PytorchEngineConfig  # noqa: E402
from lmdeploy.serve.core.async_engine import GenOut  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.entrymeta import cost_of  # noqa: E402
from featcache.lmdeploy.pytorch import models  # noqa: E402
from featcache.lmdeploy.pytorch.visioncost import VisionClock  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY, FeatRef  # noqa: E402
from featcache.lmdeploy.request.report import RequestReport, merged, report_of  # noqa: E402
from featcache.lmdeploy.request.tags import FeatTag, Source  # noqa: E402

VISION_S = 0.02  # the stand-in vision call's time


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    tiny.noise_image(64, 48, seed=seed).save(buf, format="PNG")
    return buf.getvalue()


def image(seed: int) -> dict:
    return {"type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(seed)).decode()}}


def header(fields: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in fields.split("; "))


# -- the report and where a lookup found its entry -------------------------------------------------
def test_a_lease_names_the_tier_its_entry_was_found_in(tmp_path):
    store = str(tmp_path / "store")
    with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes="4MiB", disk_path=store,
                      disk_bytes="8MiB") as cache:
        cache.put(b"a" * 16, torch.ones(64), block=True)
        cache.flush()
        lease = cache.acquire(b"a" * 16)
        assert lease.tier == "device"
        lease.release()
        cache.put(b"b" * 16, torch.ones((1 << 20) // 4 - 32), block=True)  # a pushed out of the device
        cache.flush()
        lease = cache.acquire(b"a" * 16)
        assert lease is not None and lease.tier == "host"
        lease.release()
    with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes="4MiB", disk_path=store,
                      disk_bytes="8MiB") as cache:  # a restart: only the disk holds it
        lease = cache.acquire(b"a" * 16)
        assert lease is not None and lease.tier == "disk"
        lease.release()


def test_the_report_says_hits_tiers_and_savings_in_a_fixed_vocabulary():
    report = RequestReport("in", images=3, hits=2, tiers={"disk": 1, "device": 1},
                           vision_saved_s=0.2714)
    assert report.header() == "mode=in; images=3; hits=2; tiers=device:1,disk:1; vision_saved_ms=271"
    assert report.usage() == {"mode": "in", "images": 3, "hits": 2, "tiers": {"device": 1, "disk": 1},
                              "vision_saved_ms": 271.4, "unknown_cost": 0,
                              "vision_computed_ms": 0.0}
    assert RequestReport("in", vision_saved_s=0.0, tiers={}).header() == (
        "mode=in; images=0; hits=0; tiers=-; vision_saved_ms=0")
    partly = RequestReport("in", 2, 2, {"host": 2}, 0.05, unknown_cost=1)
    assert partly.header().endswith("vision_saved_ms=50; unknown_cost=1")
    none_known = RequestReport("in", 1, 1, {"device": 1}, None, unknown_cost=1)
    assert "vision_saved_ms=unknown; unknown_cost=1" in none_known.header()
    mp = RequestReport("mp", 2, 1)
    assert mp.header() == "mode=mp; images=2; hits=1; tiers=unknown; vision_saved_ms=unknown"
    assert mp.usage()["tiers"] is None and mp.usage()["vision_computed_ms"] is None
    both = merged([report, RequestReport("in", 1, 1, {"device": 1}, 0.1)])
    assert (both.images, both.hits, dict(both.tiers)) == (4, 3, {"device": 2, "disk": 1})
    assert both.vision_saved_s == pytest.approx(0.3714)


def test_the_report_reads_the_refs_lmdeploy_hands_the_engine():
    with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes=0) as cache:
        cache.put(b"h" * 16, torch.ones(8), meta=b'{"ns":"x"}', cost_s=0.125)
        cache.put(b"u" * 16, torch.ones(8))  # no cost recorded
        hit, unknown = (cache.acquire(k * 16) for k in (b"h", b"u"))
        miss = FeatRef(cache, b"m" * 16, b"{}", None)
        items = [{REF_KEY: FeatRef(cache, b"h" * 16, hit.meta, hit)}, {REF_KEY: miss},
                 {REF_KEY: FeatRef(cache, b"u" * 16, unknown.meta, unknown)}, {"pixel_values": 0}]
        report = report_of({"multimodal": items}, "in")
        assert (report.images, report.hits, dict(report.tiers)) == (4, 2, {"device": 2})
        assert (report.vision_saved_s, report.unknown_cost) == (0.125, 1)
        assert report.vision_computed_s is None  # the miss not run yet
        miss.cost_s = 0.03
        assert report.vision_computed_s == 0.03
        assert report_of({"prompt": "text only"}, "in").header().startswith("mode=in; images=0")
    resent = FeatTag(b"k" * 16, b"{}", Source(b"png", "{}", "{}"))
    tags = {"multimodal": [{REF_KEY: resent}, {REF_KEY: FeatTag(b"j" * 16, b"{}")}]}
    assert report_of(tags, "mp") == RequestReport("mp", 2, 1)


# -- featcache serve, end to end -----------------------------------------------------------------
class Engine(test_media_sources.StandInEngine):
    """lmdeploy's prompt path and ``AsyncEngine.preprocess``; generation runs featcache's model
    hook over the request's refs (one process) with a vision call of ``VISION_S``, and waits
    until ``together`` requests are generating at once."""

    together = 1

    def __init__(self, model_path, backend_config, **kwargs):
        super().__init__(model_path, backend_config, **kwargs)
        self.clock = VisionClock()
        self.generating = 0
        self.gate: asyncio.Event | None = None

    async def generate(self, request, stream_response=True):
        items = request.inputs.get("multimodal") or []
        refs = [item.get(REF_KEY) for item in items]
        if refs and all(isinstance(r, FeatRef) for r in refs):  # the model hook, as in a forward
            tokens = [int(item["image_tokens"]) for item in items]
            rows = sum(n for n, r in zip(tokens, refs, strict=True) if not r.hit)

            def vision():
                time.sleep(VISION_S)
                return torch.ones(rows, 8)

            models._serve(models._Plan(refs, tokens), vision, self.clock)
        self.gate = self.gate or asyncio.Event()
        self.generating += 1
        if self.generating >= self.together:
            self.gate.set()
        await asyncio.wait_for(self.gate.wait(), 30)
        self.session_mgr.remove(request.session)
        for word in ("o", "k"):
            yield GenOut(response=word, input_token_len=request.input_token_len, generate_token_len=1,
                         finish_reason="stop" if word == "k" else None, token_ids=[1])

    def start_loop(self, loop, use_async_api=False):
        self.session_mgr.attach_event_loop(loop)
        return True


class Client:
    def __init__(self, port: int, model: str) -> None:
        self.port, self.model = port, model

    def chat(self, *items: dict, stream: bool = False) -> tuple[int, dict[str, str], str]:
        body = {"model": self.model, "max_completion_tokens": 4, "stream": stream,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *items]}]}
        if stream:
            body["stream_options"] = {"include_usage": True}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"content-type": "application/json"})
            response = conn.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, \
                response.read().decode()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)


@pytest.fixture
def serve(monkeypatch, model, tmp_path):
    """``serve(flags, drive)``: `featcache serve MODEL ... flags` with its app served by a real
    uvicorn on a free local port while ``drive(client)`` runs; returns the exit code."""
    import uvicorn
    from lmdeploy.serve.openai import api_server

    import featcache.cli.serving as serving
    from featcache.cli import main as cli

    Engine.built.clear()
    monkeypatch.setattr(importlib.import_module("lmdeploy.serve.core"), "VLAsyncEngine", Engine)
    monkeypatch.setattr(serving, "cuda_problem", lambda: None)  # the engine is a stand-in

    def run(flags, drive):
        def uvicorn_run(app, host, port, **kwargs):
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off",
                                                   log_level="warning"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            deadline = time.monotonic() + 30
            while not server.started:  # (uvicorn says when it listens by this flag only)
                assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
                time.sleep(0.01)
            try:
                drive(Client(server.servers[0].sockets[0].getsockname()[1], model))
            finally:
                server.should_exit = True
                thread.join(30)

        monkeypatch.setattr(api_server.uvicorn, "run", uvicorn_run)
        return cli(["serve", model, "--cache-dir", str(tmp_path / "store"), "--disk-bytes", "64MiB",
                    "--host-bytes", "32MiB", "--backend", "pytorch", "--max-batch-size", "4",
                    *flags])

    yield run
    for engine in Engine.built:
        if not engine.closed:
            engine.close()
    Engine.together = 1
    gc.collect()


def test_serve_in_process_headers_say_hits_tiers_and_the_recorded_saving(serve):
    seen = {}

    def drive(client):
        seen["first"] = client.chat(image(1))
        cache = Engine.built[0].featcache
        cache.flush()
        [key] = cache.keys()
        seen["meta"] = cache.acquire(key).meta  # (its lease released when collected)
        seen["again"] = client.chat(image(1))
        seen["text"] = client.chat()
        seen["stream"] = client.chat(image(1), image(2), stream=True)

    assert serve(["--engine-process", "in", "--device-bytes", "16MiB"], drive) == 0
    recorded = cost_of(seen.pop("meta"))
    assert recorded is not None and recorded >= VISION_S  # the hook's measure of the vision call
    for name in seen:
        assert seen[name][0] == 200, seen[name]
    assert header(seen["first"][1]["x-featcache"]) == {
        "mode": "in", "images": "1", "hits": "0", "tiers": "-", "vision_saved_ms": "0"}
    assert header(seen["again"][1]["x-featcache"]) == {
        "mode": "in", "images": "1", "hits": "1", "tiers": "device:1",
        "vision_saved_ms": str(round(recorded * 1e3))}
    assert seen["text"][1]["x-featcache"] == "mode=in; images=0; hits=0; tiers=-; vision_saved_ms=0"
    fields = header(seen["stream"][1]["x-featcache"])  # streamed: the same, before the first byte
    assert (fields["images"], fields["hits"], fields["tiers"]) == ("2", "1", "device:1")
    assert "featcache" not in seen["again"][2]  # the default: the header only, bodies as lmdeploy's


def test_serve_usage_option_puts_the_report_in_usage_streamed_or_not(serve):
    seen = {}

    def drive(client):
        client.chat(image(3))
        seen["json"] = client.chat(image(3), image(4))
        seen["stream"] = client.chat(image(3), image(5), stream=True)

    assert serve(["--engine-process", "in", "--featcache-report", "usage"], drive) == 0
    usage = json.loads(seen["json"][2])["usage"]
    assert usage["prompt_tokens"] > 0  # lmdeploy's own fields kept
    ours = usage["featcache"]
    assert (ours["images"], ours["hits"], ours["tiers"]) == (2, 1, {"host": 1})  # no device tier here
    assert ours["vision_computed_ms"] >= VISION_S * 1e3  # the miss, run once the body is known
    assert header(seen["json"][1]["x-featcache"])["hits"] == "1"
    events = [json.loads(e[6:]) for e in seen["stream"][2].split("\n\n") if e.startswith("data: {")]
    final = [e for e in events if isinstance(e.get("usage"), dict)]
    assert len(final) == 1 and final[0]["choices"] == []
    assert final[0]["usage"]["featcache"]["hits"] == 1
    assert final[0]["usage"]["featcache"]["vision_computed_ms"] >= VISION_S * 1e3
    assert all("featcache" not in e for e in events)


def test_serve_two_concurrent_requests_get_their_own_reports(serve):
    seen = {}

    def drive(client):
        client.chat(image(6))  # cached before
        Engine.together = 2  # each answer waits until both requests are generating
        threads = [threading.Thread(target=lambda k=k, items=items: seen.__setitem__(k, client.chat(*items)),
                                    daemon=True)
                   for k, items in (("hit", (image(6),)), ("misses", (image(7), image(8))))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    assert serve(["--engine-process", "in"], drive) == 0
    assert header(seen["hit"][1]["x-featcache"])["hits"] == "1"
    assert header(seen["hit"][1]["x-featcache"])["images"] == "1"
    assert header(seen["misses"][1]["x-featcache"])["hits"] == "0"
    assert header(seen["misses"][1]["x-featcache"])["images"] == "2"


def test_serve_multi_process_mode_reports_what_this_process_knows(serve):
    seen = {}

    def drive(client):
        seen["first"] = client.chat(image(9))
        seen["again"] = client.chat(image(9), image(10))

    assert serve(["--engine-process", "mp"], drive) == 0
    assert seen["first"][1]["x-featcache"] == (
        "mode=mp; images=1; hits=0; tiers=unknown; vision_saved_ms=unknown")
    assert seen["again"][1]["x-featcache"] == (
        "mode=mp; images=2; hits=1; tiers=unknown; vision_saved_ms=unknown")


def test_serve_report_off_sends_nothing_and_bad_requests_get_no_header(serve):
    seen = {}

    def drive(client):
        seen["off"] = client.chat(image(11))

    assert serve(["--engine-process", "in", "--featcache-report", "off"], drive) == 0
    assert seen["off"][0] == 200 and "x-featcache" not in seen["off"][1]

    def bad(client):
        seen["bad"] = client.chat({"type": "image_url", "image_url": {"url": "data:image/png;base64,eA=="}})

    assert serve(["--engine-process", "in"], bad) == 0
    assert seen["bad"][0] == 400 and "x-featcache" not in seen["bad"][1]


# -- the pipeline --------------------------------------------------------------------------------------
def test_each_pipeline_response_carries_its_report(model, monkeypatch, tmp_path):
    from featcache.lmdeploy import pipeline

    pipeline_module = importlib.import_module("lmdeploy.pipeline")
    monkeypatch.setattr(pipeline_module, "get_task", lambda *a, **k: ("vlm", Engine))
    Engine.built.clear()
    cache = FeatureCache(device="cpu", device_bytes="16MiB", host_bytes=0)
    pipe = pipeline(model, cache=cache, backend_config=PytorchEngineConfig(dtype="float16", max_batch_size=4))
    try:
        picture = tiny.noise_image(64, 48, seed=12)
        first = pipe(("describe", picture))
        again, other = pipe([("describe", picture), ("describe", tiny.noise_image(64, 48, seed=13))])
        text = pipe("no image")
        assert (first.featcache.images, first.featcache.hits) == (1, 0)
        assert first.featcache.vision_computed_s >= VISION_S
        assert (again.featcache.hits, dict(again.featcache.tiers)) == (1, {"device": 1})
        assert again.featcache.vision_saved_s == pytest.approx(first.featcache.vision_computed_s,
                                                               abs=1e-6)
        assert (other.featcache.images, other.featcache.hits) == (1, 0)
        assert text.featcache.header() == "mode=in; images=0; hits=0; tiers=-; vision_saved_ms=0"
        streamed = list(pipe.stream_infer(("describe", picture)))
        assert all(r.featcache.hits == 1 for r in streamed) and len(streamed) == 2
    finally:
        pipe.close()
        gc.collect()
        cache.close()


# -- the GPU check's client side, against the CPU server ------------------------------------------
@pytest.fixture(scope="module")
def gpu_check():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "bench", "checks"))
    import request_report_check

    return request_report_check


@pytest.mark.parametrize("mode", ["in", "mp"])
def test_the_gpu_checks_requests_and_verdict_hold_on_the_cpu_server(serve, gpu_check, mode):
    """bench/checks/request_report_check.py's requests (13-tile PNGs as data URLs, a stream, two at
    once) and expectations, against `featcache serve` here; only its server start is the GPU's."""
    seen = {}

    def drive(client):
        seen["served"] = gpu_check.run_requests(client.port, f"http://127.0.0.1:{client.port}", mode)

    flags = ["--engine-process", mode, "--featcache-report", "usage", "--device-bytes", "64MiB"]
    assert serve(flags, drive) == 0
    checks = gpu_check.checks(mode, seen["served"], cuda=False)
    assert len(checks) > 15 and all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]


def test_the_gpu_check_dry_runs_with_command_lines_featcache_takes(gpu_check, capsys):
    from bench.lib.servers import parse_command

    assert gpu_check.main(["--model", "/m/x", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for mode, cmd in plan["servers"].items():
        ours, theirs = parse_command(cmd)
        assert (ours.engine_process, ours.featcache_report) == (mode, "usage")
        assert theirs.enable_prefix_caching and theirs.model_path == "/m/x"
    with pytest.raises(SystemExit):
        gpu_check.main(["--model", "/m/x", "--servers", "tm"])
