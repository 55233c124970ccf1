"""`featcache serve` and `featcache warm` on the CPU.

serve: lmdeploy's real CLI parser, its real `api_server` handler and FastAPI app, and featcache's
real frontend on a tiny checkpoint's real lmdeploy prompt path; only the engine (which needs CUDA)
is a stand-in, and uvicorn does not listen: the app is driven in process. The real server on the
GPU is in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import types

import _lmdeploy_stack
import pytest

_lmdeploy_stack.require("fastapi", "prometheus_client")  # a skip naming the missing module; CI fails

import lmdeploy_tiny as tiny  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.lib
from bench.lib import servers  # noqa: E402
from featcache.cli import main as cli  # noqa: E402
from featcache.errors import FeatCacheError  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)


class StandInEngine:
    """What the server instantiates in place of `VLAsyncEngine` (whose engine needs CUDA): lmdeploy's
    real encoder and prompt processor for the checkpoint, and the config the server passed."""

    built: list[StandInEngine] = []

    def __init__(self, model_path, backend_config, **kwargs):
        self.kwargs = kwargs
        self.backend_config = backend_config
        backend = kwargs.get("backend", "pytorch")
        self.path = (tiny.PromptPath(model_path, "float16", backend="turbomind") if backend == "turbomind"
                     else tiny.PromptPath(model_path))
        self.vl_encoder = self.path.encoder
        self.prompt_processor = self.path.processor
        self.inner = object()
        # lmdeploy's mp engine (a ZMQ client here) has no input processor in this process
        mp = bool(getattr(backend_config, "enable_mp_engine", False))
        self.engine = (types.SimpleNamespace(_collective_rpc=self.model_process_stats) if mp
                       else types.SimpleNamespace(input_processor=self.inner))
        from lmdeploy.tokenizer import Tokenizer

        self.arch = tiny.INTERNVL
        self.model_name = "tiny"  # what /v1/models lists
        self.tokenizer = Tokenizer(model_path)
        self.chat_template = self.prompt_processor.chat_template
        self.is_sleeping = False
        self.closed = False
        StandInEngine.built.append(self)

    @staticmethod
    def model_process_stats(method):  # lmdeploy's RPC to its engine process (featcache's method)
        assert method == "featcache_stats"
        return [{"rank": 0, "pid": 1, "stats": {"lmdeploy": {"vision_images": 4}}}]

    def close(self):
        self.path.close()
        self.closed = True

    # what a listening server's lifespan calls (lmdeploy's api_server: start, health, metrics)
    def start_loop(self, loop, use_async_api=True):
        pass

    async def health_probe(self, **kwargs):
        return {"status": "healthy", "message": "a stand-in"}

    async def get_schedule_metrics(self):
        return None

    async def do_log_stats(self):
        pass


@pytest.fixture
def served(monkeypatch, model, tmp_path):
    """Run `featcache serve` until uvicorn would listen; returns what the server was built with."""
    import importlib

    from lmdeploy.serve.openai import api_server

    core = importlib.import_module("lmdeploy.serve.core")  # `lmdeploy.serve` is also a function
    StandInEngine.built.clear()
    monkeypatch.setattr(core, "VLAsyncEngine", StandInEngine)
    seen = {}

    def run(app, host, port, **kwargs):  # in place of uvicorn.run: drive the app in process
        from fastapi.testclient import TestClient

        seen.update(app=app, host=host, port=port, metrics=TestClient(app).get("/metrics").text)

    monkeypatch.setattr(api_server.uvicorn, "run", run)
    import featcache.cli.serving as serving

    monkeypatch.setattr(serving, "cuda_problem", lambda: None)  # the engine is a stand-in

    def serve(*extra):
        argv = ["serve", model, "--cache-dir", str(tmp_path / "store"), "--disk-bytes", "64MiB",
                "--host-bytes", "32MiB", "--backend", "pytorch", "--max-batch-size", "4",
                "--server-port", "23999", *extra]
        seen["rc"] = cli(argv)
        return seen

    yield serve
    for engine in StandInEngine.built:
        if not engine.closed:
            engine.close()


def test_serve_builds_lmdeploys_server_with_featcache_in_process(served, tmp_path):
    from featcache.lmdeploy.pytorch.engine import KeyedInputProcessor

    seen = served("--enable-prefix-caching", "--engine-process", "in")

    assert seen["rc"] == 0 and seen["port"] == 23999
    [engine] = StandInEngine.built
    config = engine.backend_config
    assert config.enable_mp_engine is False  # lmdeploy sets it True; featcache keeps it in process
    assert config.enable_prefix_caching is True
    assert isinstance(engine.engine.input_processor, KeyedInputProcessor)
    assert engine.engine.input_processor.inner is engine.inner
    cache = engine.featcache
    assert cache.config.disk_path == str(tmp_path / "store")
    assert cache.stats()["disk"]["capacity_bytes"] == 64 << 20
    assert cache.stats()["host"]["capacity_bytes"] == 32 << 20
    # featcache's counters are on lmdeploy's /metrics while the server runs
    assert "featcache_" in seen["metrics"], seen["metrics"][:500]
    with pytest.raises(FeatCacheError, match="closed"):  # closed when the server stopped
        cache.put(b"k" * 16, torch.zeros(1))


@pytest.mark.parametrize("flag, trusted", [((), False), (("--trust-client-image-ids",), True),
                                           (("--trust-client-image-ids", "verify"), "verify")])
def test_serve_honours_client_image_ids_only_when_told(served, flag, trusted):
    seen = served("--enable-prefix-caching", *flag)
    assert seen["rc"] == 0
    [engine] = StandInEngine.built
    frontend = engine.prompt_processor.async_parse_multimodal_item.frontend
    assert frontend.trust_image_ids is trusted


def test_serve_keys_with_the_secret_file_it_is_given(served, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(bytes(range(32)).hex())
    seen = served("--enable-prefix-caching", "--engine-process", "in", "--key-secret-file", str(secret))
    assert seen["rc"] == 0
    [engine] = StandInEngine.built
    frontend = engine.prompt_processor.async_parse_multimodal_item.frontend
    assert frontend.hasher.secret == bytes(range(32)) and frontend.hasher.algorithm == "blake3"
    assert engine.featcache.config.key_secret_file == str(secret)


def test_serve_turbomind_installs_the_native_path_on_a_host_cache(served, monkeypatch, capsys):
    """`featcache serve MODEL --backend turbomind`: lmdeploy's handler builds a TurbomindEngineConfig
    (TurboMind itself needs CUDA: the backend choice is answered "turbomind", the engine is the
    stand-in over lmdeploy's real TurboMind prompt path); featcache's native path goes on it with a
    host-only cache."""
    import lmdeploy.archs
    from lmdeploy.messages import TurbomindEngineConfig

    monkeypatch.setattr(lmdeploy.archs, "autoget_backend", lambda *a, **k: "turbomind")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))  # load_vl_model asks
    seen = served("--enable-prefix-caching", "--backend", "turbomind", "--tp", "2")

    assert seen["rc"] == 0  # tp > 1 served (TurboMind's tensor parallelism stays in its process)
    assert "not verified yet" in capsys.readouterr().err  # said at start
    [engine] = StandInEngine.built
    assert engine.backend_config.tp == 2
    assert engine.kwargs["backend"] == "turbomind"
    assert isinstance(engine.backend_config, TurbomindEngineConfig)
    assert engine.backend_config.enable_prefix_caching is True
    assert not hasattr(engine.backend_config, "enable_mp_engine")
    cache = engine.featcache
    assert cache.config.device == "cpu"  # TurboMind takes host tensors: no GPU tier
    assert getattr(engine.path.model.preprocess, "_featcache", False)  # the native path's hook
    assert "featcache_" in seen["metrics"]
    with pytest.raises(FeatCacheError, match="closed"):  # closed when the server stopped
        cache.put(b"k" * 16, torch.zeros(1))


def test_serve_turbomind_hits_through_the_prompt_path(model, tmp_path, monkeypatch):
    """The same wiring as `featcache serve --backend turbomind` (wrap on a TurboMind engine), a
    request sent twice: the second is a hit with no preprocessing."""
    from lmdeploy.messages import TurbomindEngineConfig

    from featcache import FeatureCache
    from featcache.lmdeploy import wrap
    from featcache.lmdeploy.request.frontend import SECTION
    from featcache.lmdeploy.request.refs import REF_KEY

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))
    engine = StandInEngine(model, TurbomindEngineConfig(dtype="float16", enable_prefix_caching=True),
                           backend="turbomind")
    cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
    try:
        wrap(types.SimpleNamespace(async_engine=engine), cache)
        engine.path.record_featcache()  # calls: featcache's preprocessing too (InternVL-HF's)
        msgs = tiny.messages(tiny.image_item(tiny.noise_image(120, 90, seed=5)))
        first = engine.path.prompt(msgs)
        second = engine.path.prompt(msgs)
        refs = [out["multimodal"][0][REF_KEY] for out in (first, second)]
        assert not refs[0].hit and refs[1].hit and refs[0].key == refs[1].key
        assert len(engine.path.calls) == 1  # lmdeploy preprocessed once
        assert torch.equal(first["multimodal"][0]["pixel_values"], second["multimodal"][0]["pixel_values"])
        assert cache.stats()[SECTION]["hits"] == 1
        del refs, first, second
    finally:
        engine.close()
        import gc

        gc.collect()
        cache.close()


def test_serve_metrics_off_and_refusals(served, capsys):
    seen = served("--disable-metrics")
    assert seen["rc"] == 0 and "featcache_" not in seen["metrics"]

    for flags, words in [(["--dp", "2"], "one `featcache serve` per GPU")]:
        StandInEngine.built.clear()
        assert served(*flags)["rc"] == 2
        assert words in capsys.readouterr().err
        assert StandInEngine.built == []


def test_serve_runs_lmdeploys_process_model_unless_clients_name_images(served):
    """The default is lmdeploy's own (the engine in a second process); with client image ids it
    is the server's process (an id alone carries no bytes for an engine process to rebuild)."""
    from featcache.lmdeploy.pytorch.processes import FeatcacheEngineConfig

    assert served()["rc"] == 0
    [engine] = StandInEngine.built
    assert isinstance(engine.backend_config, FeatcacheEngineConfig)
    assert engine.backend_config.enable_mp_engine is True
    StandInEngine.built.clear()
    assert served("--trust-client-image-ids")["rc"] == 0
    [engine] = StandInEngine.built
    assert not isinstance(engine.backend_config, FeatcacheEngineConfig)
    assert engine.backend_config.enable_mp_engine is False


@pytest.mark.parametrize("flags, mp", [(("--engine-process", "mp"), True), ((), True),
                                       (("--tp", "2", "--engine-process", "in"), False),
                                       (("--engine-process", "mp", "--tp", "2"), True),
                                       (("--engine-process", "in", "--distributed-executor-backend",
                                         "mp"), False)])
def test_serve_multi_process_mode_tags_images_for_the_model_processes(served, tmp_path, flags, mp):
    """`featcache serve --engine-process mp` keeps lmdeploy's engine process; --tp 2 (or an mp
    executor, at tp=1 too) puts the model in rank processes: the engine config carries the model
    processes' cache settings, and the server's frontend tags every image (no cache of its
    own): preprocessed the first time, sent as its bytes after."""
    from featcache.lmdeploy.pytorch.processes import FeatcacheEngineConfig
    from featcache.lmdeploy.request.frontend import SECTION
    from featcache.lmdeploy.request.refs import REF_KEY
    from featcache.lmdeploy.request.tags import FeatTag, Pixels

    seen = served("--enable-prefix-caching", *flags)

    assert seen["rc"] == 0
    [engine] = StandInEngine.built
    config = engine.backend_config
    assert isinstance(config, FeatcacheEngineConfig)
    assert config.enable_mp_engine is mp and config.enable_prefix_caching is True
    assert config.featcache_cache == {"default_cache": dict(
        path=str(tmp_path / "store"), device_bytes=None, host_bytes=32 << 20,
        disk_bytes=64 << 20, remote_url=None, key_algorithm=None, key_secret_file=None)}
    assert engine.engine.__dict__.get("input_processor") in (None, engine.inner)  # untouched here
    cache = engine.featcache  # this process only counts
    assert cache.config.device == "cpu" and cache.config.disk_path is None
    msgs = tiny.messages(tiny.image_item(tiny.noise_image(120, 90, seed=5)))
    engine.path.record_featcache()  # calls: featcache's preprocessing too (InternVL-HF's)
    first, again = (engine.path.prompt(msgs) for _ in range(2))
    assert isinstance(first["multimodal"][0][REF_KEY], FeatTag)
    assert first["multimodal"][0][REF_KEY].source is None  # the first time: its pixels travel
    # as their bytes to lmdeploy's engine process; as the tensor where the engine reads them here
    assert isinstance(first["multimodal"][0]["pixel_values"], Pixels) is mp
    assert again["multimodal"][0][REF_KEY].source is not None  # then its bytes
    assert len(engine.path.calls) == 1  # preprocessed once
    assert cache.stats()[SECTION]["tagged"] == 2
    if mp:  # /metrics carries the engine process's counters beside the frontend's
        assert 'featcache_model_lmdeploy_vision_images_total{rank="0"} 4.0' in seen["metrics"]
    assert "featcache_lookups_total" in seen["metrics"]  # the frontend's own, as before


def test_lmdeploys_flags_are_not_taken_for_prefixes_of_featcaches():
    from featcache.cli import build_parser
    from featcache.server.serve import lmdeploy_parser

    ours, rest = build_parser().parse_known_args(
        ["serve", "m", "--device", "cuda", "--disk-bytes", "1GiB"])  # as `featcache` parses it
    assert ours.device_bytes is None and ours.disk_bytes == 1 << 30
    assert rest == ["m", "--device", "cuda"]
    assert lmdeploy_parser().parse_args(rest).device == "cuda"


def test_serve_help_lists_featcache_and_lmdeploy_options(capsys):
    assert cli(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--cache-dir" in out and "--device-bytes" in out
    assert "--server-port" in out and "--enable-prefix-caching" in out
    assert cli(["serve"]) == 2


# -- warm ------------------------------------------------------------------------------------------

def test_warm_collects_files_and_refuses_bad_input(tmp_path, capsys):
    from featcache.warm import collect, parse_params, request

    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ["d/b.png", "d/a.JPG", "d/sub/c.webp", "d/notes.txt"]:
        (tmp_path / name).write_bytes(b"x")
    one = str(tmp_path / "d" / "a.JPG")
    got = collect([one], str(tmp_path / "d"))
    assert [os.path.relpath(p, tmp_path) for p in got] == ["d/a.JPG", "d/b.png", "d/sub/c.webp"]
    with pytest.raises(ValueError, match="no such file"):
        collect([str(tmp_path / "missing.png")], None)
    with pytest.raises(ValueError, match="no such directory"):
        collect([], str(tmp_path / "nope"))
    assert parse_params(["max_dynamic_patch=6", "detail=high", "x=1.5", "y=true"]) == {
        "max_dynamic_patch": 6, "detail": "high", "x": 1.5, "y": True}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_params(["oops"])
    item = request(one, {"max_dynamic_patch": 6})[0]["content"][1]
    assert item == {"type": "image_url", "image_url": {"url": one, "max_dynamic_patch": 6}}

    assert cli(["warm", "some/model"]) == 2
    assert "no images" in capsys.readouterr().err
    assert cli(["warm", "some/model", str(tmp_path / "missing.png")]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.fixture
def stand_in_warm(tmp_path, monkeypatch):
    """`featcache warm` over a stand-in pipeline (lmdeploy's engine needs CUDA) and a CPU store,
    five files of which "bad" fails to decode; what the run did is recorded in the result."""
    import featcache.cli.serving as serving
    import featcache.lmdeploy as fc_lmdeploy  # warm imports pipeline and default_cache when it runs
    from featcache import FeatureCache, image_key
    from featcache.lmdeploy import SECTION

    run = types.SimpleNamespace(files=[], calls=[], caches=[], drawn=[])
    for name in ["a", "b", "bad", "c", "d"]:
        run.files.append(tmp_path / f"{name}.png")
        run.files[-1].write_bytes(name.encode() * 10)

    class StandInPipe:
        def __init__(self, cache):
            self.cache = cache
            self.closed = False

        def __call__(self, requests, gen_config):
            paths = [r[0]["content"][1]["image_url"]["url"] for r in requests]
            run.calls.append([os.path.basename(p) for p in paths])
            if any("bad" in p for p in paths):
                raise ValueError("cannot decode")
            for p in paths:
                self.cache.count(SECTION, "misses")
                self.cache.put(image_key(p.encode()), torch.zeros(4))

        def close(self):
            self.closed = True

    def default_cache(path, disk_bytes):
        run.caches.append(FeatureCache(device="cpu", host_bytes=0, disk_path=path, disk_bytes="64MiB"))
        return run.caches[-1]

    monkeypatch.setattr(fc_lmdeploy, "pipeline", lambda model, cache, **kw: StandInPipe(cache))
    monkeypatch.setattr(fc_lmdeploy, "default_cache", default_cache)
    monkeypatch.setattr(serving, "cuda_problem", lambda: None)  # the pipeline is a stand-in
    monkeypatch.setattr(serving, "model_problem", lambda model: None)
    monkeypatch.setattr(serving, "arch_problem", lambda *a: None)  # (no config: a stand-in model)
    monkeypatch.setattr(serving.ProgressBar, "update", lambda self, done, n, force=False:
                        run.drawn.append(done))
    run.argv = ["warm", "m", *map(str, run.files), "--cache-dir", str(tmp_path / "s"), "--batch", "2"]
    return run


def test_warm_runs_batches_keeps_going_past_a_bad_file_and_reports(stand_in_warm, capsys):
    """Batches of --batch, a failing batch retried image by image, progress per batch, the store
    flushed and closed, the summary on stdout and each failed file on stderr (exit code 1)."""
    run = stand_in_warm
    assert cli(run.argv) == 1
    out, err = capsys.readouterr()
    assert run.calls == [["a.png", "b.png"], ["bad.png", "c.png"], ["bad.png"], ["c.png"], ["d.png"]]
    assert run.drawn == [2, 4, 5]
    assert out.startswith("warmed 4 of 5 images in ")
    assert "4 computed, 0 already cached; store: 4 entries" in out
    assert err.strip() == f"featcache warm: failed: {run.files[2]}: ValueError: cannot decode"
    with pytest.raises(FeatCacheError, match="closed"):  # closed when warm returned
        run.caches[0].put(b"k" * 16, torch.zeros(1))


def test_warm_json_reports_the_same_in_one_object(stand_in_warm, capsys):
    """`featcache warm --json`: the report as one JSON object on stdout, no progress bar, the
    failures in it; exit code 1 when some failed."""
    run = stand_in_warm
    assert cli([*run.argv, "--json"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert run.drawn == [] and err == ""
    assert (report["images"], report["computed"], report["cached"], report["entries"]) == (5, 4, 0, 4)
    assert report["failed"] == [f"{run.files[2]}: ValueError: cannot decode"]


def test_warm_keys_files_as_a_server_keys_the_same_bytes(model, tmp_path):
    """What `warm` stores is what a server looks up for the same file sent as a data URL: both go
    through featcache's encoded-source path (lmdeploy's real parser), which keys the bytes."""
    import base64

    import torch

    from featcache import FeatureCache
    from featcache.lmdeploy.request.frontend import SECTION, install_frontend
    from featcache.lmdeploy.request.refs import REF_KEY
    from featcache.warm import request

    path = tmp_path / "pic.png"
    tiny.noise_image(64, 48, seed=3).save(path)
    data_url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
    pp = tiny.PromptPath(model)
    try:
        install_frontend(pp.model, cache, "test:warm", pp.processor)
        pp.record_featcache()  # calls: featcache's preprocessing too (InternVL-HF's)
        warmed = pp.prompt(request(str(path), {}))
        for item in warmed["multimodal"]:  # what the engine does with a miss's features
            ref = item[REF_KEY]
            assert not ref.hit
            cache.put(ref.key, torch.randn(int(item["image_tokens"]), 256), meta=ref.meta)
        client = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                {"type": "image_url", "image_url": {"url": data_url}}]}]
        served = pp.prompt(client)
        ref = served["multimodal"][0][REF_KEY]
        assert ref.hit and ref.key == warmed["multimodal"][0][REF_KEY].key
        assert len(pp.calls) == 1  # preprocessed once: by warm, not for the client
        counts = cache.stats()[SECTION]
        assert counts["hits"] == 1 and counts["decode_skipped"] == 1
        del ref, served, warmed
    finally:
        pp.close()
        import gc

        gc.collect()
        cache.close()


def test_serve_remote_url_reaches_the_cache_and_its_password_stays_out_of_logs(served, tmp_path,
                                                                             caplog):
    import _redis

    srv = _redis.RedisServer(_redis.redis_binary(), tmp_path, None, "--requirepass", "s3cret")
    try:
        url = srv.url.replace("redis://", "redis://:s3cret@")
        seen = served("--remote-url", url, "--engine-process", "in")
        assert seen["rc"] == 0
        [engine] = StandInEngine.built
        cache = engine.featcache
        assert cache.config.remote_url == url and "remote" in cache.stats()
        assert "s3cret" not in repr(cache) and "s3cret" not in caplog.text
    finally:
        srv.kill()


SERVE_SCRIPT = """
import importlib, sys
sys.path.insert(0, {tests!r})
from test_serve_warm import StandInEngine, tiny
tiny.register_processors()
importlib.import_module("lmdeploy.serve.core").VLAsyncEngine = StandInEngine
import featcache.cli.serving as serving
serving.cuda_problem = lambda: None  # the engine is a stand-in
from featcache.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("process", ["in", "mp"])
def test_serve_closes_its_cache_and_says_so_when_signalled(model, tmp_path, sig, process):
    """A real `featcache serve` process (uvicorn listening, the engine a stand-in) signalled as a
    terminal or a process manager does: it exits in time, its last line the cache's close.
    (uvicorn re-raises the signal after its shutdown: SIGTERM's default action ended the process
    before the close ran, its queued disk writes lost, exit -15; issue 27, seen on the H200.)"""
    from _redis import free_port

    port = free_port()
    argv = ["serve", model, "--cache-dir", str(tmp_path / "store"), "--disk-bytes", "64MiB",
            "--host-bytes", "32MiB", "--backend", "pytorch", "--max-batch-size", "4",
            "--engine-process", process,
            "--server-port", str(port)]
    script = SERVE_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), argv=argv)
    log = str(tmp_path / "serve.log")  # a file, not a pipe: a full pipe would stall the server
    proc, _ = servers.start([sys.executable, "-c", script], port, log, timeout=120)  # until it serves
    try:
        signalled = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=30)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            servers.kill(proc)
    with open(log) as f:
        err = f.read()
    last = err.strip().splitlines()[-1]
    assert last.startswith("featcache serve: cache closed in "), err[-2000:]
    # SIGTERM: 143 as a shell reports a process it ended; SIGINT: 0, as plain lmdeploy's server
    expected = {signal.SIGTERM: 143, signal.SIGINT: 0}[sig]
    assert proc.returncode == expected and took < 10, (proc.returncode, took)
