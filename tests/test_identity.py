"""``model_identity``: the namespace of every key the lmdeploy integration makes. Two checkpoints of
one architecture and dtype must not share it (their features would serve each other), and a
checkpoint rewritten in place must get a new one (issue 32 item 3)."""

from __future__ import annotations

import json
import os
import shutil

import torch

from featcache.lmdeploy.request.identity import model_identity

ARCH = "InternVLChatModel"


def checkpoint(path, config: dict | None = None, weights: bytes = b"w" * 64,
               preprocessor: dict | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config or {"architectures": [ARCH], "hidden_size": 64}, f)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(preprocessor or {"image_size": 448}, f)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(weights)
    stamp(os.path.join(path, "model.safetensors"), 1_700_000_000)
    return str(path)


def stamp(path: str, seconds: int) -> None:
    os.utime(path, ns=(seconds * 10**9, seconds * 10**9))


def ident(path: str, dtype=torch.bfloat16, extra: dict | None = None) -> str:
    return model_identity(path, ARCH, dtype, extra or {})


def test_the_same_checkpoint_has_one_identity(tmp_path):
    a = checkpoint(tmp_path / "a")
    assert ident(a) == ident(a)
    assert ident(a).startswith(ARCH + ":")
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)  # copy2: times kept, so the identity is kept (the documented rule)
    assert ident(str(copy)) == ident(a)


def test_two_checkpoints_of_one_architecture_and_dtype_differ_by_config(tmp_path):
    a = checkpoint(tmp_path / "a", config={"architectures": [ARCH], "hidden_size": 64})
    b = checkpoint(tmp_path / "b", config={"architectures": [ARCH], "hidden_size": 128})
    assert ident(a) != ident(b)


def test_two_checkpoints_differ_by_their_preprocessor(tmp_path):
    a = checkpoint(tmp_path / "a", preprocessor={"image_size": 448})
    b = checkpoint(tmp_path / "b", preprocessor={"image_size": 336})
    assert ident(a) != ident(b)


def test_two_checkpoints_differ_by_their_weights(tmp_path):
    """Same configs, other weights (a fine-tune): other weight files (sizes, or names, or times)."""
    a = checkpoint(tmp_path / "a", weights=b"w" * 64)
    b = checkpoint(tmp_path / "b", weights=b"w" * 128)
    assert ident(a) != ident(b)
    c = checkpoint(tmp_path / "c", weights=b"w" * 64)
    os.rename(os.path.join(c, "model.safetensors"), os.path.join(c, "model-00001.safetensors"))
    assert ident(c) != ident(a)


def test_a_checkpoint_rewritten_in_place_gets_a_new_identity(tmp_path):
    path = checkpoint(tmp_path / "m", weights=b"a" * 64)
    before = ident(path)
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "wb") as f:  # same name, same size, new bytes: written later
        f.write(b"b" * 64)
    stamp(weights, 1_700_000_060)
    assert ident(path) != before
    after_weights = ident(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": [ARCH], "hidden_size": 64, "vision_select_layer": -2}, f)
    assert ident(path) != after_weights


def test_hub_ids_name_the_model(tmp_path):
    assert ident("OpenGVLab/InternVL2-2B") != ident("OpenGVLab/InternVL2-4B")
    assert ident("OpenGVLab/InternVL2-2B") == ident("OpenGVLab/InternVL2-2B")


def test_dtype_and_engine_settings_are_part_of_it(tmp_path):
    a = checkpoint(tmp_path / "a")
    assert ident(a, torch.bfloat16) != ident(a, torch.float16)
    assert ident(a, extra={"max_dynamic_patch": 12}) != ident(a, extra={"max_dynamic_patch": 6})
