"""Videos for the CPU tests: short clips encoded here (OpenCV, as lmdeploy decodes them) and a
tiny Qwen3-VL checkpoint whose processor has its real video processor.

transformers' video processors need torchvision, and no PyPI build of it loads beside the CPU
torch these tests run on (``lmdeploy_tiny``'s docstring). What a video processor calls of it is
pure Python (``torchvision.transforms.v2.functional``: resize, normalize over tensors), so
``torchvision_for_transformers`` registers torchvision's own package from the wheel installed aside
for the tests (``bench/lib/torchvision_ref.py``: ``.cache/torchvision-ref``) without running its
``__init__`` (which loads the compiled ops), with an import spec so that transformers finds it:
transformers' real ``Qwen3VLVideoProcessor`` then runs, unchanged."""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import sys
import types
from typing import Any

import lmdeploy_tiny as tiny

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.lib import images  # noqa: E402
from bench.lib.torchvision_ref import REF_DIR  # noqa: E402

_video_checkpoints: dict[str, str] = {}


def torchvision_for_transformers() -> str | None:
    """Make torchvision's pure-Python transforms importable and visible to transformers
    (idempotent); None, or why it cannot be (the wheel is not installed aside)."""
    try:
        import torchvision.transforms.v2.functional  # noqa: F401  (a torchvision that loads)
        return None
    except Exception:
        pass
    root = os.path.join(REF_DIR, "torchvision")
    if not os.path.isfile(os.path.join(root, "transforms", "v2", "functional", "__init__.py")):
        return f"torchvision is not at {REF_DIR}"
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    package = types.ModuleType("torchvision")
    package.__path__ = [root]  # type: ignore[attr-defined]
    package.__spec__ = importlib.machinery.ModuleSpec("torchvision", None, is_package=True)
    package.__spec__.submodule_search_locations = package.__path__
    package.__version__ = "0.29.1"  # (the wheel's)
    sys.modules["torchvision"] = package
    from transformers.utils import import_utils

    for name in dir(import_utils):
        clear = getattr(getattr(import_utils, name), "cache_clear", None)
        if clear is not None and "torchvision" in name:
            clear()
    # transformers was imported without it (by the suite's other modules): its lazy modules named
    # every video processor a placeholder, and its video base module imported no transforms. Those
    # names only are made importable again; image processors keep their PIL fallbacks.
    sys.modules.pop("transformers.video_processing_utils", None)
    for module in [m for n, m in list(sys.modules.items())
                   if n == "transformers" or n.startswith("transformers.models.")]:
        missing = getattr(module, "_object_missing_backend", None)
        if not isinstance(missing, dict):
            continue
        where = getattr(module, "_class_to_module", {})
        for name in [n for n in missing if n.endswith("VideoProcessor")
                     or "video_processing" in str(where.get(n, ""))]:
            del missing[name]
            module.__dict__.pop(name, None)
    return None


def checkpoint(tmp_path_factory: Any, arch: str = tiny.QWEN3VL) -> str:
    """The tiny checkpoint of ``arch`` (a Qwen3-VL lineage one) with its processor's real video
    processor (patch 16, merge 2, as the public checkpoints), built once a session."""
    if arch not in _video_checkpoints:
        from transformers import Qwen3VLVideoProcessor

        out = str(tmp_path_factory.mktemp("video_tiny"))
        out = shutil.copytree(tiny.checkpoint(arch, tmp_path_factory), os.path.join(out, "ckpt"))
        Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                              image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                              size={"shortest_edge": tiny.QWEN3_MIN_PIXELS,
                                    "longest_edge": 4 * tiny.QWEN3_MAX_PIXELS}).save_pretrained(out)
        path = os.path.join(out, "processor_config.json")
        with open(path) as f:
            config = json.load(f)
        config["processor_class"] = "Qwen3VLProcessor"
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
        _video_checkpoints[arch] = out
    return _video_checkpoints[arch]


def clip(frames: int = 12, width: int = 96, height: int = 64, fps: float = 4.0, seed: int = 0) -> bytes:
    """An MP4 (mp4v) of ``frames`` frames, encoded by OpenCV (the GPU check's clips)."""
    return images.clip(seed, frames, (width, height), fps)


def data_url(raw: bytes, mime: str = "video/mp4") -> str:
    import base64

    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def jpeg_frames(frames: int = 6, width: int = 96, height: int = 64, seed: int = 0) -> str:
    """A ``data:video/jpeg`` URL of ``frames`` random JPEG frames, base64, comma-separated (the form
    lmdeploy reads for frames a client sampled itself)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(frames):
        buf = io.BytesIO()
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        parts.append(base64.b64encode(buf.getvalue()).decode())
    return "data:video/jpeg;base64," + ",".join(parts)


def video_item(source: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": source}}


def lying_avi(stated: int, frames: int = 12) -> bytes:
    """An MJPG AVI of ``frames`` frames whose headers state ``stated`` (the main header's total
    and the stream header's length: what OpenCV's FFmpeg backend reports as its frame count)."""
    import struct
    import tempfile

    import cv2
    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "clip.avi")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 4.0, (64, 48))
        for i in range(frames):
            writer.write(np.full((48, 64, 3), 20 * i, np.uint8))
        writer.release()
        with open(path, "rb") as f:
            raw = bytearray(f.read())
    main, stream = raw.find(b"avih"), raw.find(b"strh")
    struct.pack_into("<I", raw, main + 8 + 16, stated)  # avih.dwTotalFrames
    struct.pack_into("<I", raw, stream + 8 + 32, stated)  # strh.dwLength
    return bytes(raw)
