"""``featcache serve --turbomind native|features|combined``: the flag's parsing, its refusals
(exit 2, at start: on the PyTorch engine, and for an architecture the features path cannot
serve, before any engine is built), and that the choice reaches ``wrap`` on a TurboMind engine.
On the CPU: the GPU check is faked past and the server itself (``run_server``) is recorded, not
run; ``wrap`` is recorded as ``tests/test_threads.py`` does for ``featcache_engine``."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import featcache.cli.serving as serving
import featcache.server.serve as serve
from featcache.cli import main

INTERNVL = {"architectures": ["InternVLForConditionalGeneration"], "model_type": "internvl"}
QWEN2VL = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl"}


def model_dir(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture
def started(monkeypatch, tmp_path):
    """``featcache serve`` past the GPU check on ``backend``; ``run_server``'s arguments recorded."""
    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(serving, "cuda_problem", lambda: None)
    monkeypatch.setattr(serve, "run_server", lambda *a, **k: calls.append((a, k)))

    def start(capsys, config: dict, *argv: str, backend: str = "turbomind") -> tuple[int, str]:
        monkeypatch.setattr(serve, "backend_of", lambda args: backend)
        model = model_dir(tmp_path, config)
        rc = main(["serve", model, "--cache-dir", str(tmp_path / "store"), "--disk-bytes", "16MiB",
                   *argv, "--backend", backend])
        return rc, capsys.readouterr().err

    start.calls = calls  # type: ignore[attr-defined]
    return start


def test_the_flag_defaults_to_native_and_takes_the_three_paths():
    parser = serving.featcache_parser()
    assert parser.parse_known_args(["m"])[0].turbomind == "native"
    for path in ("native", "features", "combined"):
        args, rest = parser.parse_known_args(["m", "--turbomind", path, "--backend", "turbomind"])
        assert args.turbomind == path and rest == ["m", "--backend", "turbomind"]
    assert serve.TURBOMIND_PATHS == serving.TURBOMIND_PATHS


def test_an_unknown_path_is_bad_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "m", "--turbomind", "pixels"])
    assert e.value.code == 2
    assert "invalid choice: 'pixels'" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["features", "combined"])
def test_features_and_combined_are_refused_on_the_pytorch_engine(started, capsys, path):
    rc, err = started(capsys, INTERNVL, "--turbomind", path, backend="pytorch")
    assert rc == 2 and not started.calls
    assert err.strip() == (
        f"featcache serve: error: --turbomind {path} picks a path of the TurboMind backend, and "
        "this model is served on pytorch (--backend pytorch, or lmdeploy's choice when TurboMind "
        "cannot run it here); give --backend turbomind, or leave --turbomind out")


@pytest.mark.parametrize("path", ["features", "combined"])
def test_an_architecture_the_features_path_cannot_serve_is_refused_at_start(started, capsys, path):
    rc, err = started(capsys, QWEN2VL, "--turbomind", path)
    assert rc == 2 and not started.calls  # no server, no engine: refused before either
    assert err.strip().splitlines() == [
        f"featcache serve: error: --turbomind {path}: featcache: the TurboMind features path cannot "
        "serve Qwen2VLForConditionalGeneration: its LLM positions (M-RoPE) depend on each image's "
        "grid, which input_embeddings do not carry. Use --turbomind native (cached pixels, "
        "TurboMind's own vision model)."]


def test_native_serves_any_architecture_on_either_engine(started, capsys):
    rc, err = started(capsys, QWEN2VL)  # the default
    assert rc == 0, err
    assert started.calls[-1][1]["turbomind"] == "native" and "vision tower" not in err
    assert serve.turbomind_refusal("native", "pytorch", types.SimpleNamespace()) is None


@pytest.mark.parametrize("path", ["features", "combined"])
def test_the_chosen_path_reaches_the_server(started, capsys, path):
    rc, err = started(capsys, INTERNVL, "--turbomind", path)
    assert rc == 0, err
    assert f"featcache serve: TurboMind {path} path: featcache's vision tower runs in Python on " \
           "the GPU" in err
    (_, kwargs), = started.calls
    assert kwargs["turbomind"] == path


@pytest.mark.parametrize("path", ["native", "features", "combined"])
def test_the_server_hands_the_path_to_wrap_for_a_turbomind_engine(monkeypatch, path):
    from lmdeploy import TurbomindEngineConfig
    from lmdeploy.serve.openai import api_server

    seen: list[dict] = []
    monkeypatch.setattr(serve, "wrap", lambda *a, **k: seen.append(k))
    monkeypatch.setattr(api_server, "get_task", lambda *a, **k: ("task", types.SimpleNamespace))
    with serve.featcache_engine(types.SimpleNamespace(), None, turbomind=path):
        _, build = api_server.get_task()
        build(backend_config=TurbomindEngineConfig())
    assert [k["turbomind"] for k in seen] == [path]


def test_the_server_refuses_an_unknown_path_before_hooking_lmdeploy():
    with pytest.raises(ValueError, match="turbomind is one of"):
        with serve.featcache_engine(types.SimpleNamespace(), None, turbomind="pixels"):
            pass
