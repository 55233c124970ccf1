"""bench/serve_stages.py on the CPU: its middleware marks a request's body and first byte, its
timers see the work lmdeploy and featcache do on executor threads (charged to the right request),
and bench/lib/stages.py's ``summarize`` splits a request into stages owned by featcache or
lmdeploy."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import json
import os
import sys

import _lmdeploy_stack
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.lib import stages  # noqa: E402


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_middleware_records_body_first_byte_and_spans(tmp_path):
    st = load("serve_stages")
    sink = st.Sink(str(tmp_path / "stages.jsonl"))

    async def app(scope, receive, send):  # reads the body in two chunks, streams two chunks
        while (await receive()).get("more_body"):
            pass
        with st.span("prepare"), st.span("tokenize"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in (b"data: 1\n\n", b"data: [DONE]\n\n"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    chunks: list[dict] = []

    async def receive():
        return chunks.pop(0)

    async def send(message):
        pass

    mw = st.StageMiddleware(app, sink)
    for path in ("/v1/chat/completions", "/v1/models"):  # the second one not recorded
        chunks[:] = [{"type": "http.request", "body": b"x" * 10, "more_body": True},
                     {"type": "http.request", "body": b"y" * 5, "more_body": False}]
        asyncio.run(mw({"type": "http", "path": path}, receive, send))
    rows = stages.read(sink.path)
    assert len(rows) == 1 and rows[0]["body_bytes"] == 15
    marks = rows[0]["marks_ms"]
    assert 0 <= marks["body_read"] <= marks["first_byte"] <= marks["end"]
    assert set(rows[0]["spans_ms"]) == {"prepare", "prepare>tokenize"}


def record(spans, marks, engine=None):
    return {"marks_ms": marks, "spans_ms": {k: [v, 1] for k, v in spans.items()}, "engine": engine}


def test_summarize_splits_featcache_from_lmdeploy():
    marks = {"body_read": 5.0, "endpoint": 17.0, "prepared": 40.0, "generate_start": 41.0,
             "first_output": 90.0, "first_byte": 91.0}
    spans = {"json_parse": 10.0, "prepare": 23.0, "prepare>engine_preprocess": 22.0,
             "prepare>engine_preprocess>parse_items": 6.0,
             "prepare>engine_preprocess>parse_items>fc_resolve": 4.0,
             "prepare>engine_preprocess>parse_items>fc_resolve>fc_source_bytes": 1.5,
             "prepare>engine_preprocess>parse_items>fc_resolve>fc_key": 0.5,
             "prepare>engine_preprocess>template": 9.0,
             "prepare>engine_preprocess>template>tokenize": 7.0}
    plain = stages.summarize(record(spans, marks))
    labels = {label: (owner, ms) for label, owner, ms in plain["rows"]}
    assert labels["featcache resolve (rest)"] == ("featcache", 2.0)  # its children taken out
    assert labels["featcache keying"] == ("featcache", 0.5)
    assert labels["tokenization"] == ("lmdeploy", 7.0)
    assert labels["chat template (+ multimodal wrap)"] == ("lmdeploy", 2.0)
    assert labels["validate (pydantic, deps) + hops"] == ("lmdeploy", 2.0)
    assert labels["submit -> first output (engine process)"] == ("lmdeploy", 49.0)
    assert plain["totals"]["featcache"] == 4.0
    # the timeline's pieces add up to the first byte
    assert sum(ms for _, _, ms in plain["rows"]) == pytest.approx(marks["first_byte"])

    engine = {"add_at_ms": 45.0, "add_ms": 2.0, "add_spans_ms": {"fc_input_processor": 0.5},
              "steps": [[47.0, 30.0, False, 1], [80.0, 5.0, True, 1]]}
    inproc = stages.summarize(record(spans, marks, engine))
    labels = {label: (owner, ms) for label, owner, ms in inproc["rows"]}
    assert labels["engine: prefill step(s)"] == ("lmdeploy", 30.0)
    assert labels["engine: queue to add"] == ("lmdeploy", 4.0)
    assert labels["engine: featcache input processor"] == ("featcache", 0.5)
    assert sum(ms for _, _, ms in inproc["rows"]) == pytest.approx(marks["first_byte"])


def test_without_a_command_it_prints_its_usage(capsys):
    assert load("serve_stages").main(["--stages-out", "x"]) == 2
    assert "serve_stages.py" in capsys.readouterr().out


# -- the timers on lmdeploy's real prompt path ----------------------------------------------------------
def test_timers_charge_executor_work_to_its_request(tmp_path_factory):
    """A miss then a hit of one data URL through lmdeploy's prompt path with featcache's frontend:
    the hit is keyed and looked up, never decoded nor preprocessed; the work on the executors
    lands in the request's record."""
    _lmdeploy_stack.need("lmdeploy.vl.engine")
    import lmdeploy_tiny as tiny
    import numpy as np
    import torch
    from PIL import Image

    from featcache import FeatureCache
    from featcache.lmdeploy.request.frontend import install_frontend
    from featcache.lmdeploy.request.refs import REF_KEY

    st = load("serve_stages")
    st.install(st.Sink(str(tmp_path_factory.mktemp("s") / "x.jsonl")))
    try:
        path = tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)
        prompt_path = tiny.PromptPath(path)
        cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        install_frontend(prompt_path.model, cache, "test:stages", prompt_path.processor)
        buf = io.BytesIO()
        pixels = np.random.default_rng(0).integers(0, 256, (64, 80, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]

        async def request():
            asyncio.get_running_loop().set_default_executor(st.ContextExecutor(max_workers=4))
            rec = st.Record()
            token = st.REC.set(rec)
            try:
                with st.span("prepare"):
                    out = await prompt_path.processor.get_prompt_input(msgs, do_preprocess=True)
            finally:
                st.REC.reset(token)
            return rec, out

        miss, out = asyncio.run(request())
        for item in out["multimodal"]:  # what the model does with a miss's features
            cache.put(item[REF_KEY].key, torch.zeros(int(item["image_tokens"]), 8), meta=item[REF_KEY].meta)
        hit, _ = asyncio.run(request())
        prompt_path.close()
        cache.close()
    finally:
        st.uninstall()
    miss_own, hit_own = stages.exclusive(miss.spans), stages.exclusive(hit.spans)
    assert {"fc_resolve", "fc_source_bytes", "fc_key", "fc_acquire", "image_decode",
            "fc_preprocess", "vl_preprocess", "template", "tokenize"} <= set(miss_own)
    assert "model_preprocess" not in miss_own  # InternVL-HF: featcache's own preprocessing
    assert {"fc_resolve", "fc_key", "fc_acquire", "fc_frontend", "template", "tokenize"} <= set(hit_own)
    assert "image_decode" not in hit_own and not {"fc_preprocess", "model_preprocess"} & set(hit_own)
    assert "fc_source_bytes" not in hit_own  # a data URL seen before is keyed by its text
    assert any(p.endswith("parse_items>fc_resolve>fc_key") or p.endswith("fc_resolve>fc_key")
               for p in hit.spans)  # nested under its caller: the executor carried the context
    json.dumps(hit.as_json(None))


def test_the_generate_wrapper_closes_the_engine_generator_with_it():
    """lmdeploy's cleanup closes the result generator; the engine's must close then, not at GC."""
    st = load("serve_stages")
    closed = []

    class Out:
        token_ids = [1]

    async def generate(self, request):
        try:
            for _ in range(3):
                yield Out()
        finally:
            closed.append(True)

    async def run():
        rec = st.Record()
        token = st.REC.set(rec)
        try:
            gen = st.timed_generate(generate)(None, None)
            await gen.__anext__()
            await gen.aclose()
            assert closed == [True]  # at once (asyncio.run would close it at the end anyway)
        finally:
            st.REC.reset(token)
        return rec

    rec = asyncio.run(run())
    assert "first_output" in rec.marks and "generate_start" in rec.marks
