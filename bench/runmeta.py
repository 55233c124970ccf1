"""What every bench records about the run it measured: versions, GPU, commit, start time."""

from __future__ import annotations

import subprocess
import time
from typing import Any


def run_meta(**fields: Any) -> dict[str, Any]:
    """``fields`` plus torch's and lmdeploy's versions (None if absent), the GPU's name when CUDA
    is available, the checkout's short commit (None where there is no .git: the device's copy)
    and the start time."""
    import torch

    try:
        import lmdeploy

        lmdeploy_version: str | None = lmdeploy.__version__
    except ImportError:
        lmdeploy_version = None
    m: dict[str, Any] = dict(fields, torch=torch.__version__, lmdeploy=lmdeploy_version,
                             started=time.strftime("%Y-%m-%d %H:%M:%S"))
    if torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name()
    try:
        m["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001 - the device copy may have no .git
        m["commit"] = None
    return m
