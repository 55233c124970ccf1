"""The model identity that namespaces every key: features of one model never serve another."""

from __future__ import annotations

import json
import os
from typing import Any

import xxhash

_CONFIGS = ("config.json", "preprocessor_config.json", "processor_config.json",
            "generation_config.json")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")


def model_identity(model_path: str, arch: str, feature_dtype: Any, extra: dict[str, Any]) -> str:
    """``arch:digest`` over what decides an image's features: the architecture, the feature dtype,
    the model's config and preprocessor files, its weight files (name, size, modification time),
    and ``extra`` (engine settings that change features).

    A checkpoint changed in place gets a new identity (its files' times change); the same files
    copied elsewhere keep theirs only if their times are kept. Deployments that want one identity
    across machines pass ``namespace=`` (e.g. "org/model@revision") instead.
    """
    h = xxhash.xxh3_128()
    record: dict[str, Any] = {"arch": arch, "dtype": str(feature_dtype), "extra": extra, "files": []}
    if os.path.isdir(model_path):
        for name in sorted(os.listdir(model_path)):
            path = os.path.join(model_path, name)
            if name in _CONFIGS:
                with open(path, "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
            elif name.endswith(_WEIGHTS):
                st = os.stat(path)
                record["files"].append([name, st.st_size, st.st_mtime_ns])
    else:  # a hub id: its revision is what identifies it
        record["hub_id"] = model_path
    h.update(json.dumps(record, sort_keys=True, default=str).encode())
    return f"{arch}:{h.hexdigest()}"
