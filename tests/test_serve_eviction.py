"""``--eviction lru|value`` (issue 30, item 1) where featcache builds a cache for lmdeploy: `featcache
serve` with the engine in its process and in lmdeploy's engine process (the settings each model
process builds its cache from), ``default_cache`` and ``featcache.lmdeploy.pipeline``. The
policies themselves are tests/test_eviction.py's."""

from __future__ import annotations

import json

import _lmdeploy_stack
import pytest

_lmdeploy_stack.require("fastapi", "prometheus_client")  # a skip naming the missing module; CI fails

from test_serve_warm import StandInEngine, model, served  # noqa: E402, F401, F811 (fixtures)

from featcache.cli import main as cli  # noqa: E402


def test_default_cache_takes_the_eviction_policy(tmp_path):
    from featcache.config import DEFAULTS
    from featcache.lmdeploy import default_cache

    for given, used in ((None, DEFAULTS["eviction"]), ("value", "value"), ("lru", "lru")):
        cache = default_cache(path=str(tmp_path), device_bytes=1 << 20, host_bytes=1 << 20,
                              disk_bytes=8 << 20, eviction=given)
        try:
            assert cache.config.eviction == used
        finally:
            cache.close()
    with pytest.raises(ValueError, match="eviction must be one of lru, value"):
        default_cache(path=str(tmp_path), host_bytes=1 << 20, disk_bytes=8 << 20, eviction="lfu")


def test_serve_in_process_builds_its_cache_with_the_policy(served):  # noqa: F811
    from featcache.config import DEFAULTS

    other = "lru" if DEFAULTS["eviction"] == "value" else "value"
    seen = served("--engine-process", "in", "--eviction", other)
    assert seen["rc"] == 0
    [engine] = StandInEngine.built
    assert engine.featcache.config.eviction == other
    StandInEngine.built.clear()
    assert served("--engine-process", "in")["rc"] == 0  # not given: the config's default
    assert StandInEngine.built[0].featcache.config.eviction == DEFAULTS["eviction"]


def test_serve_multi_process_hands_the_policy_to_each_model_process(served, tmp_path):  # noqa: F811
    from featcache.lmdeploy.pytorch import processes, ranks

    seen = served("--eviction", "value")  # lmdeploy's engine process, the default
    assert seen["rc"] == 0
    [engine] = StandInEngine.built
    config = engine.backend_config
    assert config.featcache_cache["default_cache"]["eviction"] == "value"
    # what a model process does with them: its cache, built at its first image
    ranks.configure(json.dumps(processes.rank_settings(config, "some/model", False)))
    try:
        cache = ranks.local_cache()
        assert cache is not None and cache.config.eviction == "value"
        assert cache.config.disk_path == str(tmp_path / "store")
    finally:
        ranks.reset_for_tests()


def test_serve_refuses_an_unknown_policy(capsys):
    with pytest.raises(SystemExit) as exited:  # argparse's usage error: the line, exit code 2
        cli(["serve", "some/model", "--eviction", "lfu"])
    assert exited.value.code == 2
    assert "featcache serve: error: argument --eviction: invalid choice: 'lfu'" in (
        capsys.readouterr().err)
    assert cli(["serve", "--help"]) == 0
    assert "--eviction {lru,value,admit}" in capsys.readouterr().out


def test_pipeline_takes_the_policy_for_the_cache_it_builds(monkeypatch):
    import types

    import lmdeploy
    from lmdeploy import PytorchEngineConfig

    import featcache.lmdeploy as fc
    from featcache.lmdeploy.pytorch.processes import FeatcacheEngineConfig

    with pytest.raises(ValueError, match="eviction must be one of lru, value"):
        fc.pipeline("some/model", eviction="lfu")
    cache = fc.counters_cache()
    with pytest.raises(ValueError, match="a cache passed in keeps its own budgets and eviction"):
        fc.pipeline("some/model", cache=cache, eviction="value")
    cache.close()

    built: dict[str, object] = {}

    def lmdeploy_pipeline(model_path, **kwargs):  # lmdeploy's engine needs CUDA: a stand-in
        built["backend_config"] = kwargs.get("backend_config")
        engine = types.SimpleNamespace(backend_config=kwargs.get("backend_config"), vl_encoder=None)
        return types.SimpleNamespace(async_engine=engine, close=lambda: None)

    def default_cache(**kwargs):
        built["default_cache"] = kwargs
        return fc.counters_cache()

    monkeypatch.setattr(lmdeploy, "pipeline", lmdeploy_pipeline)
    monkeypatch.setattr(fc, "default_cache", default_cache)
    pipe = fc.pipeline("some/model", eviction="value", backend_config=PytorchEngineConfig())
    pipe.close()
    assert built["default_cache"]["eviction"] == "value"  # one process: the cache built here
    fc.pipeline("some/model", eviction="value", budgets="auto",
                backend_config=PytorchEngineConfig(enable_mp_engine=True)).close()
    config = built["backend_config"]  # several processes: in each model process's settings
    assert isinstance(config, FeatcacheEngineConfig)
    assert config.featcache_cache == {"default_cache": {"budgets": "auto", "eviction": "value"}}
