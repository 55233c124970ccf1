"""The checkpoints benchmarks run on: where they are built, what each is called, what a run calls
a checkpoint. The builders are device-side scripts (bench/device/, run where the GPU is: a
real-shape checkpoint is never carried); each writes ``MODELS_DIR/<name>`` and skips a build that
is already there.
"""

from __future__ import annotations

import json
import os

MODELS_DIR = "/tmp/models"  # where the device runs build them (docs/benchmarks.md's commands)

# checkpoint name -> the command that builds it under MODELS_DIR (random weights, no download)
CHECKPOINTS = {
    "internvl_hf_tiny": "bench/device/make_tiny_vlm.py /tmp/models --arch all",
    "qwen2vl_tiny": "bench/device/make_tiny_vlm.py /tmp/models --arch all",
    "internvl_chat_tiny": "bench/device/make_tiny_vlm.py /tmp/models --arch all",
    "qwen25vl_tiny": "bench/make_tiny_qwen25vl.py /tmp/models",
    **{f"{arch}_tiny": f"bench/device/make_tiny_vlm.py /tmp/models --arch {arch}"
       for arch in ("qwen3vl", "qwen3_5", "qwen3vl_moe", "qwen3_5_moe", "glm4v", "gemma3", "llava",
                    "llama4", "glm4v_9b", "cogvlm")},
    "internvl3_2b_shape": "bench/device/make_real_shape.py /tmp/models",
    "qwen3vl_2b_shape": "bench/device/make_real_shape.py /tmp/models --shape qwen3vl_2b",
    "internvl2_2b_shape": "bench/device/make_seed_models.py /tmp/models --which 2b",
    "internvl2_26b_shape": "bench/device/make_seed_models.py /tmp/models --which 26b",
    "internvl2_2b_tiny": "bench/device/make_seed_models.py /tmp/models --which tiny",
    "internvl2_26b_tiny": "bench/device/make_seed_models.py /tmp/models --which tiny",
}


def label(model: str) -> str:
    """A checkpoint's name in tables, charts and output folders: its directory's name."""
    return os.path.basename(os.path.normpath(model)) or model


def config(model: str) -> dict:
    """The checkpoint's config.json."""
    with open(os.path.join(model, "config.json")) as f:
        out: dict = json.load(f)
    return out


def architecture(model: str) -> str:
    """The checkpoint's model class (its config's first ``architectures`` entry)."""
    name: str = config(model)["architectures"][0]
    return name


def remote_code(model: str) -> bool:
    """Whether the checkpoint brings its own config classes (``auto_map``: legacy InternVL2)."""
    return "auto_map" in config(model)
