"""The user's surface, third pass, item 1 (issue 41): every model-loading failure of ``warm`` and
``serve`` is one line naming the path and what is wrong (no traceback, exit code 1, no store left
behind), ``warm --backend turbomind`` prints no transformers note about torchvision, and
examples/chat.py with no server running says so in one line. Each runs the real program in a
subprocess, as a user would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import _lmdeploy_stack
import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
# warm and serve check the GPU first; on a CPU machine the model checks come after it only with
# the check passed (as tests/test_cli_surface.py does)
PAST_THE_GPU = "import featcache.cli.serving as s\ns.cuda_problem = lambda: None"


def featcache(tmp_path: Path, *argv: str, prelude: str = "",
              timeout: int = 180) -> subprocess.CompletedProcess:
    code = f"import sys\n{prelude}\nfrom featcache.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), HF_HUB_OFFLINE="1",
               FEATCACHE_DIR=str(tmp_path / "default-store"))
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=timeout)


def one_error_line(out: subprocess.CompletedProcess, prefix: str) -> str:
    """The last line of stderr, after checking it is the command's error, with no traceback."""
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(prefix), out.stderr
    return last


def photo(tmp_path: Path) -> str:
    from PIL import Image

    path = tmp_path / "photo.png"
    Image.new("RGB", (64, 48), (10, 20, 30)).save(path)
    return str(path)


def models(tmp_path: Path) -> dict[str, Path]:
    """Directories a user may mistake for a model: empty, a language model's config, a config
    that names no architecture, a config that is not JSON."""
    out = {name: tmp_path / name for name in ("empty", "llm", "noarch", "notjson")}
    for path in out.values():
        path.mkdir()
    (out["llm"] / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 128,
        "vocab_size": 100}))
    (out["noarch"] / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out["notjson"] / "config.json").write_text('{"model_type": "llama"\n')
    return out


WARM_SAYS = {
    "empty": "'{path}' is not a model directory: it has no config.json",
    "llm": "cannot load the model '{path}': it is not a vision-language model lmdeploy 0.18 runs "
           "(architecture LlamaForCausalLM)",
    "noarch": "cannot load the model '{path}': its config.json names no model architecture",
    "notjson": "'{path}/config.json' is not valid JSON",
}


@pytest.mark.parametrize("name", sorted(WARM_SAYS))
def test_warm_turbomind_with_a_model_it_cannot_load_is_one_line(tmp_path, name):
    """`featcache warm DIR photo.png --backend turbomind` (no GPU needed): before issue 41 an
    empty DIR was a ValueError traceback from transformers, a language model's config a
    RuntimeError or ValueError traceback from lmdeploy; and the store was created all the same."""
    _lmdeploy_stack.need("lmdeploy.archs")
    model = models(tmp_path)[name]
    store = tmp_path / "store"
    out = featcache(tmp_path, "warm", str(model), photo(tmp_path), "--backend", "turbomind",
                    "--cache-dir", str(store))
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr  # one line
    said = WARM_SAYS[name].format(path=model)
    assert out.stderr.startswith(f"featcache warm: error: {said}"), out.stderr
    assert not store.exists(), "a store was created for a model that cannot be loaded"


@pytest.mark.parametrize("name", ["empty", "noarch", "notjson"])
def test_serve_with_a_model_it_cannot_load_is_one_line(tmp_path, name):
    """The same for `featcache serve DIR` (past the GPU check): before, lmdeploy's
    RuntimeError/ValueError traceback from inside its api_server."""
    _lmdeploy_stack.need("lmdeploy.archs")
    model = models(tmp_path)[name]
    out = featcache(tmp_path, "serve", str(model), "--backend", "pytorch",
                    "--cache-dir", str(tmp_path / "store"), prelude=PAST_THE_GPU)
    assert out.returncode == 1, out.stderr
    line = one_error_line(out, "featcache serve: error: ")
    assert repr(str(model)) in line or repr(str(model / "config.json")) in line, line
    assert {"empty": "it has no config.json", "noarch": "names no model architecture",
            "notjson": "is not valid JSON"}[name] in line
    assert not (tmp_path / "store").exists()


def test_serve_when_lmdeploy_cannot_build_the_engine_is_one_line(tmp_path):
    """A config lmdeploy reads, but whose engine it cannot build (no tokenizer): the failure comes
    from lmdeploy's api_server building its engine, and is one line naming the model."""
    _lmdeploy_stack.need("lmdeploy.serve.openai.api_server")
    model = models(tmp_path)["llm"]
    # --max-batch-size: lmdeploy would ask the (absent) GPU's name for its default
    out = featcache(tmp_path, "serve", str(model), "--backend", "pytorch", "--max-batch-size", "1",
                    "--cache-dir", str(tmp_path / "store"), prelude=PAST_THE_GPU)
    assert out.returncode == 1, out.stderr
    line = one_error_line(out, f"featcache serve: error: cannot load the model {str(model)!r}: ")
    assert "tokenizer" in line, line


WARM_TINY = """
import sys
import torch
import lmdeploy_tiny as tiny
import turbomind_binding
torch.cuda.mem_get_info = lambda *a: (0, 0)
with turbomind_binding.installed():
    tiny.register_processors()
    model = tiny.build(sys.argv[1], tiny.INTERNVL)
    from featcache.cli import main
    sys.exit(main(["warm", model, sys.argv[2], "--cache-dir", sys.argv[3], "--dtype", "float16",
                   "--backend", "turbomind"]))
"""


def test_warm_turbomind_prints_no_torchvision_note(tmp_path):
    """Every `warm --backend turbomind` printed transformers' "`CLIPImageProcessor` requires
    torchvision (not installed); falling back ..." (lmdeploy's InternVL module imports it,
    whatever the model): noise to a user whose server preprocesses the same way. And lmdeploy's
    INFO lines went to stdout, before the report (with --json, before the JSON object)."""
    _lmdeploy_stack.need("shortuuid")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", WARM_TINY, str(tmp_path / "model"),
                          photo(tmp_path), str(tmp_path / "store")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "torchvision" not in out.stderr, out.stderr
    # stdout is the report alone (lmdeploy logs its INFO lines on stdout: "matching vision model")
    assert len(out.stdout.splitlines()) == 1 and out.stdout.startswith("warmed 1 of 1 images"), \
        out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_chat_example_without_a_server_is_one_line(tmp_path):
    """examples/chat.py with nothing listening: before, openai.APIConnectionError's 85-line
    traceback."""
    _lmdeploy_stack.need("openai", stack=False)  # examples/chat.py needs the openai client
    url = f"http://127.0.0.1:{free_port()}/v1"
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "chat.py"), "--base-url", url,
                          "--turns", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith(f"chat.py: error: cannot reach {url} ("), out.stderr
    assert "--base-url" in out.stderr


def test_chat_example_with_a_missing_image_is_bad_usage(tmp_path):
    pytest.importorskip("PIL", reason="examples/chat.py makes its images with PIL")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "chat.py"), "--image",
                          str(tmp_path / "nope.png")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"chat.py: error: argument --image: cannot read {str(tmp_path / 'nope.png')!r}: "
        "No such file or directory")
