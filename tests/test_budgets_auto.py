"""``budgets="auto"`` (issue 30 item 3): each tier sized from what the machine has free, the device
tier from what lmdeploy's KV cache left, each choice with its reason, in the API, the pipeline's
and the model processes' caches, ``featcache serve`` and ``featcache doctor``.

The machine is faked: ``featcache.autosize``'s probes (the GPU's free memory, the available RAM,
the free disk and the store's file, the GPUs of the machine) are replaced, and a "GPU" machine
keeps its caches on the CPU (torch here has no CUDA). A recorded list of events shows when each
probe ran, so that a test can tell the device tier was decided after the engine was built.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import _lmdeploy_stack
import pytest

from featcache import FeatureCache, autosize
from featcache.autosize import EngineMemory, decide
from featcache.cli import build_parser
from featcache.cli import main as cli
from featcache.config import AUTO_BUDGETS
from featcache.sizes import format_bytes

G = 1 << 30
ROOT = Path(__file__).resolve().parent.parent


class Machine:
    """What the fake machine has free; ``events`` records each probe as it runs."""

    def __init__(self) -> None:
        self.cuda = True
        self.gpu_free, self.gpu_total = 15 * G, 80 * G
        self.available, self.ram_total = 100 * G, 128 * G
        self.disk_free, self.disk_size, self.store = 20 * G, 100 * G, 0
        self.gpus = 4
        self.events: list[object] = []

    def gpu_memory(self, device: str) -> tuple[int, int]:
        self.events.append(("gpu", device))
        return self.gpu_free, self.gpu_total

    def ram(self) -> tuple[int, int]:
        self.events.append("ram")
        return self.available, self.ram_total

    def disk(self, path: str) -> tuple[int, int, int]:
        self.events.append(("disk", path))
        return self.disk_free, self.disk_size, self.store


@pytest.fixture
def machine(monkeypatch) -> Machine:
    m = Machine()
    monkeypatch.setattr(autosize, "gpu_memory", m.gpu_memory)
    monkeypatch.setattr(autosize, "ram", m.ram)
    monkeypatch.setattr(autosize, "disk", m.disk)
    monkeypatch.setattr(autosize, "gpus_on_machine", lambda: m.gpus if m.cuda else 0)
    monkeypatch.setattr(autosize, "cuda_available", lambda: m.cuda)
    monkeypatch.setattr(autosize, "current_gpu", lambda: "cuda:0")
    return m


def device_line(free: int, margin: int = G, engine: str = "cache_max_entry_count 0.8") -> str:
    budget = (free - margin) * 25 // 100
    return (f"device {format_bytes(budget)}: 25% of the {format_bytes(free)} free on cuda:0 after "
            f"lmdeploy's KV cache ({engine}), less a {format_bytes(margin)} margin")


# -- the rules ---------------------------------------------------------------------------------
def test_each_tier_is_a_share_of_what_is_free_less_a_margin_with_its_reason(machine, tmp_path):
    machine.store = 5 * G  # the store already holds 5 GiB: space it may reuse
    chosen = decide(device="cuda:0", disk_path=str(tmp_path), engine=EngineMemory(0.8))

    ram_margin = 128 * G * 5 // 100  # 5% of the RAM: more than the 2 GiB floor
    disk_margin = 5 * G  # 5% of the filesystem
    assert chosen.sizes() == {"device_bytes": (15 * G - G) * 25 // 100,
                              "host_bytes": (100 * G - ram_margin) * 25 // 100 // 4,
                              "disk_bytes": (20 * G + 5 * G - disk_margin) * 50 // 100}
    device, host, disk = (str(c) for c in chosen.choices)
    assert device == device_line(15 * G) == (
        "device 3.5 GiB: 25% of the 15.0 GiB free on cuda:0 after lmdeploy's KV cache "
        "(cache_max_entry_count 0.8), less a 1.0 GiB margin")
    assert host == ("host 5.8 GiB: 25% of the 100.0 GiB of available RAM (of 128.0 GiB), less a "
                    "6.4 GiB margin, split among the machine's 4 GPUs")
    assert disk == (f"disk 10.0 GiB: 50% of the 25.0 GiB free at {tmp_path}, 5.0 GiB of it the "
                    "store's own files, less a 5.0 GiB margin (5% of the filesystem)")
    assert chosen.line() == f"budgets auto (cuda:0): {device}; {host}; {disk}"


def test_a_store_that_fills_its_disk_keeps_its_budget_across_restarts(machine, tmp_path):
    first = decide(device="cuda:0", disk_path=str(tmp_path)).sizes()["disk_bytes"]
    machine.disk_free -= 6 * G  # the store wrote 6 GiB; the next start sees less free space
    machine.store += 6 * G
    assert decide(device="cuda:0", disk_path=str(tmp_path)).sizes()["disk_bytes"] == first


def test_given_sizes_are_kept_and_their_probes_not_read(machine, tmp_path):
    chosen = decide(device="cuda:0", disk_path=str(tmp_path),
                    given={"device_bytes": 7, "host_bytes": None, "disk_bytes": 9})
    assert chosen.sizes() == {"device_bytes": 7, "host_bytes": chosen.sizes()["host_bytes"],
                              "disk_bytes": 9}
    assert str(chosen.choices[0]) == "device 7 B: given" and chosen.choices[2].reason == "given"
    assert machine.events == ["ram"]


def test_less_free_than_the_margin_turns_a_tier_off(machine, tmp_path):
    machine.gpu_free = G // 2
    machine.disk_free, machine.disk_size = G // 2, 8 * G
    chosen = decide(device="cuda:0", disk_path=str(tmp_path))
    assert chosen.sizes()["device_bytes"] == 0 and chosen.sizes()["disk_bytes"] == 0
    assert "device off: 25% of the 512.0 MiB free on cuda:0 now (no engine known" in chosen.line()
    assert "disk off: 50% of the 512.0 MiB free" in chosen.line()


def test_without_cuda_the_device_tier_is_ram_and_there_is_no_host_tier(machine, tmp_path):
    machine.cuda = False
    chosen = decide(device="cpu", disk_path=None)
    assert chosen.sizes() == {"device_bytes": (100 * G - 128 * G * 5 // 100) * 25 // 100,
                              "host_bytes": 0, "disk_bytes": 0}
    assert chosen.line() == (
        "budgets auto (cpu): device 23.4 GiB: in RAM (no CUDA): 25% of the 100.0 GiB of "
        "available RAM (of 128.0 GiB), less a 6.4 GiB margin; host off: the device tier is in RAM "
        "already (a host tier would hold a second copy); disk off: no store directory")


def test_the_probes_read_this_machine(tmp_path):
    available, total = autosize.ram()
    assert 0 < available <= total
    free, size, store = autosize.disk(os.path.join(os.getcwd(), "not", "made", "yet"))
    assert 0 <= free <= size and store == 0
    (tmp_path / "data.mdb").write_bytes(b"x" * 100_000)  # a store's files: what it may reuse
    assert autosize.disk(str(tmp_path))[2] >= 100_000
    assert autosize.LMDEPLOY_KV_SHARE == 0.8  # lmdeploy's own default, checked where it is at hand
    lmdeploy = _lmdeploy_stack.missing()
    if lmdeploy is None:
        from lmdeploy import PytorchEngineConfig

        assert PytorchEngineConfig().cache_max_entry_count == autosize.LMDEPLOY_KV_SHARE


# -- FeatureCache(budgets="auto"): the CPU fallback, and bad input -----------------------------------
def test_feature_cache_auto_on_the_cpu_sizes_from_ram_and_logs_why(machine, tmp_path, caplog):
    machine.cuda = False
    caplog.set_level("INFO", logger="featcache")
    with FeatureCache(device="cpu", disk_path=tmp_path / "store", budgets="auto") as cache:
        c = cache.config
        assert c.device_bytes == (100 * G - 128 * G * 5 // 100) * 25 // 100
        assert c.host_bytes == 0 and c.disk_bytes == (20 * G - 5 * G) * 50 // 100
        assert cache.stats()["device"]["capacity_bytes"] == c.device_bytes
        import torch

        cache.put(b"k", torch.ones(4))
        assert torch.equal(cache.get(b"k"), torch.ones(4))
    [line] = [r.getMessage() for r in caplog.records if "budgets auto" in r.getMessage()]
    assert line.startswith("featcache: budgets auto (cpu): device 23.4 GiB: in RAM (no CUDA): 25% ")
    assert f"disk 7.5 GiB: 50% of the 20.0 GiB free at {tmp_path / 'store'}" in line


def test_feature_cache_auto_keeps_the_sizes_given(machine, tmp_path):
    machine.cuda = False
    with FeatureCache(device="cpu", host_bytes="1MiB", disk_path=tmp_path, disk_bytes="64MiB",
                      budgets="auto") as cache:
        assert (cache.config.host_bytes, cache.config.disk_bytes) == (1 << 20, 64 << 20)
        assert cache.config.device_bytes > 0


@pytest.mark.parametrize("options, says", [
    (dict(device_bytes="auto"), "device_bytes: 'auto' is not a size; pass budgets='auto'"),
    (dict(disk_bytes=" AUTO "), "disk_bytes: 'auto' is not a size"),
    (dict(budgets="share"), "budgets must be 'auto' (each tier not given sized from"),
    (dict(budgets="auto", host_bytes="auto"), "host_bytes: 'auto' is not a size"),
])
def test_auto_where_a_size_goes_or_an_unknown_mode_is_refused(machine, options, says):
    with pytest.raises(ValueError, match="^" + says.replace("(", r"\(")):
        FeatureCache(device="cpu", **options)


# -- the CLI -----------------------------------------------------------------------------------------
def test_serve_parses_budgets_and_refuses_auto_as_a_size(capsys):
    ours, rest = build_parser().parse_known_args(["serve", "m", "--budgets", "auto", "--disk-bytes",
                                                  "1GiB", "--cache-max-entry-count", "0.5"])
    assert (ours.budgets, ours.disk_bytes, ours.device_bytes) == ("auto", 1 << 30, None)
    assert rest == ["m", "--cache-max-entry-count", "0.5"]  # lmdeploy's option, for lmdeploy
    assert build_parser().parse_known_args(["serve", "m"])[0].budgets is None  # the default: share

    for argv, says in [(["--device-bytes", "auto"], "argument --device-bytes: 'auto' is not a "
                         "size: --budgets auto sizes every tier not given from the machine"),
                        (["--budgets", "most"], "argument --budgets: invalid choice: 'most'")]:
        with pytest.raises(SystemExit) as exited:  # argparse's usage error: the line, exit code 2
            cli(["serve", "m", *argv])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"featcache serve: error: {says}" in err and "Traceback" not in err


def test_serve_help_states_the_auto_rules(capsys):
    assert cli(["serve", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--budgets {share,auto}" in out
    assert f"the device tier {AUTO_BUDGETS['device_bytes']}" in out


# -- featcache doctor --------------------------------------------------------------------------------
def test_doctor_says_what_auto_chooses_here_and_why(machine, monkeypatch, tmp_path, capsys):
    import featcache.cli.doctor as doctor

    monkeypatch.setattr(doctor, "_lmdeploy", lambda: [])  # its engine probes: seconds, not ours
    monkeypatch.setenv("FEATCACHE_DIR", str(tmp_path / "store"))
    machine.gpu_free, machine.gpu_total = 100 * G, 141 * G

    assert cli(["doctor"]) == 0
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()[:-1]}
    most = (100 * G - int(100 * G * 0.8) - G) * 25 // 100
    assert lines["budget.device"] == (
        f"ok    budget.device      at most {format_bytes(most)}: decided once lmdeploy's engine "
        "has reserved its KV cache, as 25% of what it leaves less a 1.0 GiB margin; cuda:0 has "
        "100.0 GiB free now, of which cache_max_entry_count 0.8 leaves at most 20.0 GiB (less "
        "once the model's weights are loaded)")
    assert "budget.host        5.8 GiB: 25% of the 100.0 GiB of available RAM" in lines["budget.host"]
    assert f"50% of the 20.0 GiB free at {tmp_path / 'store'}" in lines["budget.disk"]

    assert cli(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["budgets"]
    assert report["mode"] == "auto" and report["device"] == "cuda:0"
    assert report["tiers"][0] == {"tier": "device", "bytes": most, "at_most": True,
                                  "reason": lines["budget.device"].split(": ", 1)[1]}


# -- the lmdeploy integration ------------------------------------------------------------------------
@pytest.fixture
def lmdeploy_budgets():
    _lmdeploy_stack.need("featcache.lmdeploy")
    from featcache.lmdeploy.pytorch import budgets

    return budgets


def test_default_cache_auto_after_an_engine_names_its_reservation(machine, lmdeploy_budgets,
                                                                  tmp_path):
    from lmdeploy import PytorchEngineConfig

    from featcache.lmdeploy import chosen_budgets, default_cache

    cache = default_cache(path=str(tmp_path), budgets="auto",
                          engine=PytorchEngineConfig(cache_max_entry_count=0.5))
    try:
        assert cache.config.device_bytes == (15 * G - G) * 25 // 100
        chosen = chosen_budgets(cache)
        assert chosen is not None and chosen.choices[0].reason.endswith(
            "after lmdeploy's KV cache (cache_max_entry_count 0.5), less a 1.0 GiB margin")
    finally:
        cache.close()


def test_default_cache_keeps_the_share_default_and_says_so(machine, lmdeploy_budgets, tmp_path):
    from featcache.lmdeploy import chosen_budgets, default_cache

    machine.cuda = False
    cache = default_cache(path=str(tmp_path))
    try:
        line = chosen_budgets(cache).line()
        assert line.startswith("budgets share (cpu): device off: no CUDA (the host tier holds "
                               "the features); host ")
        assert "10% of RAM, at most 8GiB" in line and "50% of the free space, at most 32GiB" in line
        assert machine.events == []  # share reads the machine its own way, as before
    finally:
        cache.close()


def test_turbomind_auto_puts_the_device_tier_in_ram(machine, lmdeploy_budgets, tmp_path):
    from featcache.lmdeploy import chosen_budgets, default_cache

    cache = default_cache(path=str(tmp_path), budgets="auto", host_only=True)
    try:
        assert cache.device.type == "cpu" and cache.config.host_bytes == 0
        assert "device 5.8 GiB: in RAM (TurboMind takes host tensors): 25%" in (
            chosen_budgets(cache).line())
    finally:
        cache.close()


def test_a_cache_built_before_its_engine_is_sized_when_it_is_installed(machine, lmdeploy_budgets,
                                                                        tmp_path):
    from lmdeploy import PytorchEngineConfig

    from featcache.lmdeploy import chosen_budgets, default_cache

    said: list[str] = []
    cache = default_cache(path=str(tmp_path), budgets="auto", before_engine=True,
                          announce=said.append)
    try:
        assert isinstance(cache, lmdeploy_budgets.EngineSizedCache) and not cache.sized
        assert cache.config.device_bytes == 0 and cache.stats()["device"]["entries"] == 0
        assert said == [] and chosen_budgets(cache) is None and machine.events == []
        chosen = cache.size_after(PytorchEngineConfig(cache_max_entry_count=0.6))
        assert cache.sized and cache.config.disk_path == str(tmp_path)
        assert cache.config.device_bytes == (15 * G - G) * 25 // 100
        assert said == [chosen.line()] and chosen_budgets(cache) is chosen
        assert "(cache_max_entry_count 0.6)" in said[0]
        assert cache.size_after(None) is chosen and len(said) == 1  # once
        import torch

        cache.put(b"k", torch.ones(3))  # a working cache, the same object
        assert torch.equal(cache.get(b"k"), torch.ones(3))
    finally:
        cache.close()
    with pytest.raises(ValueError, match="remote_url must start with"):  # bad settings: at once
        default_cache(path=str(tmp_path), budgets="auto", before_engine=True, remote_url="http://x")


def test_pipeline_refuses_budgets_it_cannot_apply(lmdeploy_budgets):
    from featcache.lmdeploy import counters_cache, pipeline

    with pytest.raises(ValueError, match="budgets must be one of share, auto"):
        pipeline("some/model", budgets="most")
    cache = counters_cache()
    with pytest.raises(ValueError, match=r"a cache passed in keeps its own budgets"):
        pipeline("some/model", cache=cache, budgets="auto")
    cache.close()


def test_a_model_process_sizes_its_cache_at_first_use_and_prints_why(machine, lmdeploy_budgets,
                                                                      tmp_path, capsys):
    from featcache.lmdeploy.pytorch import processes, ranks

    settings = processes.rank_settings(
        processes.FeatcacheEngineConfig(cache_max_entry_count=0.6,
                                        featcache_cache={"default_cache": {
                                            "path": str(tmp_path), "budgets": "auto"}}),
        "some/model", False)
    assert settings["engine"] == {"cache_max_entry_count": 0.6, "num_gpu_blocks": 0}
    ranks.configure(json.dumps(settings))
    try:
        assert machine.events == []  # nothing is read until the first image
        cache = ranks.local_cache()
        assert cache is not None and cache.config.device_bytes == (15 * G - G) * 25 // 100
        err = capsys.readouterr().err
        assert (f"featcache (model process, rank 0): budgets auto (cuda:0): "
                f"{device_line(15 * G, engine='cache_max_entry_count 0.6')}; host ") in err
    finally:
        ranks.reset_for_tests()


# -- featcache serve (lmdeploy's real server, a stand-in engine: test_serve_warm's) ------------------
@pytest.fixture
def serve(machine, monkeypatch, tmp_path, tmp_path_factory):
    """Run `featcache serve MODEL ...` until uvicorn would listen, the engine a stand-in that
    records when it was built among the machine's events; returns what the server was built with."""
    _lmdeploy_stack.need("fastapi")
    _lmdeploy_stack.need("prometheus_client", stack=False)
    import importlib

    import lmdeploy_tiny as tiny
    import test_serve_warm
    from lmdeploy.serve.openai import api_server

    import featcache.cli.serving as serving

    class Engine(test_serve_warm.StandInEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            machine.events.append("engine built")

    model = tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)
    Engine.built.clear()
    monkeypatch.setattr(importlib.import_module("lmdeploy.serve.core"), "VLAsyncEngine", Engine)
    monkeypatch.setattr(serving, "cuda_problem", lambda: None)
    seen: dict[str, object] = {}

    def run(app, host, port, **kwargs):  # in place of uvicorn.run
        from fastapi.testclient import TestClient

        seen["metrics"] = TestClient(app).get("/metrics").text

    monkeypatch.setattr(api_server.uvicorn, "run", run)

    def go(*extra: str) -> dict[str, object]:
        seen["rc"] = cli(["serve", model, "--cache-dir", str(tmp_path / "store"), "--backend",
                          "pytorch", "--max-batch-size", "4", "--server-port", "23999", *extra])
        seen["engines"] = list(Engine.built)
        return seen

    yield go
    for engine in Engine.built:
        if not engine.closed:
            engine.close()


def test_serve_in_process_sizes_the_device_tier_after_the_engine_and_says_why(serve, machine,
                                                                            capsys, tmp_path):
    seen = serve("--budgets", "auto", "--engine-process", "in", "--cache-max-entry-count", "0.5")

    assert seen["rc"] == 0
    [engine] = seen["engines"]
    cache = engine.featcache
    assert cache.sized and cache.config.device_bytes == (15 * G - G) * 25 // 100
    gpu = machine.events.index(("gpu", "cuda:0"))
    assert machine.events.index("engine built") < gpu  # decided once the engine was built
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("featcache serve: budgets")]
    assert line.startswith(f"featcache serve: budgets auto (cuda:0): "
                           f"{device_line(15 * G, engine='cache_max_entry_count 0.5')}; host 5.8 GiB")
    assert f"disk 7.5 GiB: 50% of the 20.0 GiB free at {tmp_path / 'store'}" in line
    capacity = next(x for x in seen["metrics"].splitlines()
                    if x.startswith('featcache_tier_capacity_bytes{tier="device"}'))
    assert float(capacity.split()[-1]) == cache.config.device_bytes  # /metrics: the sized cache


def test_serve_with_lmdeploys_engine_process_leaves_budgets_to_it(serve, machine, capsys, tmp_path):
    seen = serve("--budgets", "auto", "--host-bytes", "32MiB")

    assert seen["rc"] == 0
    [engine] = seen["engines"]
    assert engine.backend_config.featcache_cache["default_cache"] == dict(
        path=str(tmp_path / "store"), device_bytes=None, host_bytes=32 << 20, disk_bytes=None,
        remote_url=None, key_algorithm=None, key_secret_file=None, budgets="auto")
    assert "featcache serve: budgets auto: decided by each model process once its engine has " \
           "reserved its KV cache" in capsys.readouterr().err
    assert not [e for e in machine.events if isinstance(e, tuple) and e[0] == "gpu"]


# -- the GPU check's dry run -------------------------------------------------------------------------
def test_the_gpu_check_dry_runs_on_the_cpu(machine, tmp_path, capsys):
    machine.cuda = False
    sys.path.insert(0, str(ROOT / "bench" / "checks"))
    try:
        import auto_budgets_check
    finally:
        sys.path.remove(str(ROOT / "bench" / "checks"))
    out = tmp_path / "auto.json"
    assert auto_budgets_check.main(["--model", "m", "--dry-run", "--cache-dir", str(tmp_path),
                                    "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and "budgets='auto'" in report["plan"][0]
    assert report["rules"]["device_bytes"] == str(AUTO_BUDGETS["device_bytes"])
    assert [t["tier"] for t in report["budgets_here_now"]["tiers"]] == ["device", "host", "disk"]
    assert report["budgets_here_now"]["tiers"][0]["reason"].startswith("in RAM (no CUDA)")
    assert json.loads(capsys.readouterr().out)["dry_run"] is True
