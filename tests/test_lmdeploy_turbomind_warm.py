"""`featcache warm --backend turbomind` on the CPU: what it stores is what a TurboMind server's path
looks up and serves.

Warm runs lmdeploy's real TurboMind prompt path (``ImageEncoder`` + ``MultimodalProcessor``) with
featcache's path installed, no engine (``featcache.lmdeploy.turbomind.warm``). The "server" here is the same
prompt path built as the other TurboMind tests build it, with lmdeploy's real TurboMind source model
bound in the engine dtype (tests/test_lmdeploy_turbomind.py, ``source_model``): its namespaces come
from the engine, warm's from ``resolved_dtypes``; a hit proves they agree.
"""

from __future__ import annotations

import base64
import gc
import json
import types

import _lmdeploy_stack
import pytest
import torch

_lmdeploy_stack.require("shortuuid")

import lmdeploy_tiny as tiny  # noqa: E402
import turbomind_binding  # noqa: E402
from test_lmdeploy_turbomind import ENGINE_DTYPE, source_model, weighted_checkpoint  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.cli import main as cli  # noqa: E402
from featcache.lmdeploy import wrap  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402
from featcache.lmdeploy.turbomind.native import fingerprint  # noqa: E402
from featcache.lmdeploy.turbomind.warm import resolve_dtype, resolved_dtypes  # noqa: E402
from featcache.warm import TURBOMIND_PATHS, warm_images  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")


@pytest.fixture(scope="module")
def binding():
    with turbomind_binding.installed() as b:
        yield b


@pytest.fixture(autouse=True)
def no_cuda_query(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))


def store(path) -> FeatureCache:
    return FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0, disk_path=str(path),
                        disk_bytes="256MiB")


def pictures(tmp_path, *seeds: int) -> list[str]:
    out = []
    for s in seeds:
        p = tmp_path / f"pic{s}.png"
        tiny.noise_image(120, 90, seed=s).save(p)
        out.append(str(p))
    return out


def as_data_url(path: str) -> dict:
    """The image as a client sends it to a server: a base64 data URL."""
    with open(path, "rb") as f:
        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


class Server:
    """A TurboMind server's prompt path with featcache's ``path`` over a store, its engine's dtypes
    what TurboMind resolves for ``dtype='float16'`` (the source model bound in float16)."""

    def __init__(self, model: str, cache: FeatureCache, path: str) -> None:
        from lmdeploy.messages import TurbomindEngineConfig

        self.prompt = tiny.PromptPath(model, ENGINE_DTYPE, backend="turbomind")
        self.tm = source_model(tiny.INTERNVL, model)
        engine = types.SimpleNamespace(vl_encoder=self.prompt.encoder,
                                       prompt_processor=self.prompt.processor,
                                       backend_config=TurbomindEngineConfig(dtype=ENGINE_DTYPE),
                                       engine=self.tm)
        wrap(types.SimpleNamespace(async_engine=engine), cache, turbomind=path)

    def close(self) -> None:
        self.prompt.close()
        gc.collect()


def test_warm_native_fills_the_pixels_a_native_server_serves(tmp_path, tmp_path_factory, binding):
    model = tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)
    files = pictures(tmp_path, 1, 2)
    with store(tmp_path / "s") as cache:
        report = warm_images(model, cache, files, params={}, dtype=ENGINE_DTYPE,
                             backend="turbomind", turbomind="native")
        assert (report.images, report.computed, report.cached, report.failed) == (2, 2, 0, [])
        assert report.entries == 2 and report.vision_images == 0
        again = warm_images(model, cache, files, params={}, dtype=ENGINE_DTYPE,
                            backend="turbomind", turbomind="native")
        assert again.computed == 2 and again.cached == 2  # (counters add up: 2 hits the second time)
    with store(tmp_path / "s") as cache:  # a server started on the warmed store
        server = Server(model, cache, "native")
        try:
            msgs = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                 as_data_url(files[1])]}]
            out = server.prompt.prompt(msgs)
            assert server.prompt.calls == []  # served from the disk: no preprocessing
            item = out["multimodal"][0]
            assert item[REF_KEY].hit and item["fingerprint"] == fingerprint(item[REF_KEY].key)
            assert item["pixel_values"].dtype == torch.float16 and item["pixel_values"].shape[0] > 0
            items = list(server.tm.mm_input_converter(out["multimodal"]).args[0])
            assert items[0].kwargs["data"].args[0].shape == item["pixel_values"].shape
            counts = cache.stats()[SECTION]
            assert counts["hits"] == 1 and counts["tm_pixels_served"] == 1
            del out, item, items
        finally:
            server.close()


def test_warm_combined_fills_pixels_and_features(tmp_path, tmp_path_factory, binding):
    """Combined: both forms; a server's fresh context then goes the features way with no vision
    model run at all, and a chat turn natively with the warmed pixels."""
    model = weighted_checkpoint(tmp_path_factory)
    files = pictures(tmp_path, 3, 4)
    with store(tmp_path / "s") as cache:
        report = warm_images(model, cache, files, params={}, dtype=ENGINE_DTYPE,
                             backend="turbomind", turbomind="combined", batch=2)
        assert report.failed == [] and report.entries == 4 and report.vision_images == 2
    with store(tmp_path / "s") as cache:
        server = Server(model, cache, "combined")
        try:
            first = {"role": "user", "content": [{"type": "text", "text": "a fresh context"},
                                                 as_data_url(files[0])]}
            out = server.prompt.prompt([first])
            assert "input_embeddings" in out and "multimodal" not in out  # the features route
            turn = server.prompt.prompt([first, {"role": "assistant", "content": "ok."},
                                         {"role": "user", "content": "and?"}])
            assert turn["multimodal"][0]["pixel_values"].shape[0] > 0  # native, the warmed pixels
            assert server.prompt.calls == []  # nothing preprocessed
            counts = cache.stats()[SECTION]
            assert counts.get("vision_images", 0) == 0 and counts["tm_features_served"] == 1
            assert counts["tm_route_repeat"] == 1 and counts["tm_route_indexed"] == 1
            del out, turn
        finally:
            server.close()


def test_warm_cli_turbomind_native_runs_on_a_cpu(tmp_path, tmp_path_factory, binding, capsys):
    model = tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)
    files = pictures(tmp_path, 5)
    argv = ["warm", model, *files, "--cache-dir", str(tmp_path / "s"), "--dtype", ENGINE_DTYPE,
            "--backend", "turbomind", "--json"]
    assert cli(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["images"], report["computed"], report["entries"]) == (1, 1, 1)
    if not torch.cuda.is_available():  # the PyTorch engine's warm still needs the GPU
        assert cli(["warm", model, *files, "--cache-dir", str(tmp_path / "t")]) == 1
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_turbomind_paths_and_dtypes_are_lmdeploys(tmp_path_factory, binding):
    """warm's path names are wrap's; its dtype rule is lmdeploy's converter's (importable over the
    stand-in binding), on the tiny checkpoint's config and a legacy-shaped one."""
    from lmdeploy.turbomind.converter import _resolve_dtype
    from transformers import AutoConfig

    from featcache.lmdeploy.turbomind import PATHS

    assert set(TURBOMIND_PATHS) == set(PATHS)
    model = tiny.checkpoint(tiny.INTERNVL, tmp_path_factory)
    hf = AutoConfig.from_pretrained(model)
    legacy = types.SimpleNamespace(llm_config=types.SimpleNamespace(torch_dtype=torch.bfloat16),
                                   vision_config=types.SimpleNamespace(torch_dtype=torch.float16))
    for config in (hf, hf.vision_config, legacy, legacy.vision_config):
        for requested in ("auto", "float16", "bfloat16"):
            for executable in ({"bfloat16", "float16"}, {"float16"}):
                assert resolve_dtype(requested, config, executable) == _resolve_dtype(
                    requested, config, executable), (config, requested, executable)
    assert resolved_dtypes(model, "float16") == ("float16", torch.float16)
