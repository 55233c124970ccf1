"""The images benchmarks send: random noise, seeded, so every run and every engine sees the same
pixels (a seed names an image; a different seed is a different image, never a cache hit); and the
user message that carries them to lmdeploy's pipeline (``user_message``).
"""

from __future__ import annotations

import base64
import io
from typing import Any

CHAT_SIZE = (1344, 1008)  # (width, height): 12 InternVL tiles + a thumbnail (3328 image tokens)


def image(seed: int, size: tuple[int, int]) -> Any:
    """A ``size`` (width, height) RGB PIL image of uniform noise from ``seed``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def clip(seed: int, frames: int = 12, size: tuple[int, int] = (96, 64), fps: float = 4.0) -> bytes:
    """An MP4 (mp4v, encoded by OpenCV) of ``frames`` frames of noise from ``seed`` scrolling
    sideways, ``size`` (width, height)."""
    import os
    import tempfile

    import cv2
    import numpy as np

    base = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "clip.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
        for i in range(frames):
            writer.write(np.roll(base, 3 * i, axis=1))
        writer.release()
        with open(path, "rb") as f:
            return f.read()


def clip_data_url(seed: int, frames: int = 12, size: tuple[int, int] = (96, 64), fps: float = 4.0) -> str:
    """``clip(...)`` as a data URL."""
    import base64

    return "data:video/mp4;base64," + base64.b64encode(clip(seed, frames, size, fps)).decode()


def user_message(*parts: Any) -> dict[str, Any]:
    """A user message as lmdeploy's pipeline takes it: ``parts`` in order, a ``str`` as a text item,
    anything else (a PIL image) as an ``image_data`` item; a None part is left out."""
    content = [dict(type="text", text=p) if isinstance(p, str) else
               dict(type="image_data", image_data=dict(data=p)) for p in parts if p is not None]
    return dict(role="user", content=content)


def png(seed: int, size: tuple[int, int] = CHAT_SIZE) -> bytes:
    """``image(seed, size)`` encoded as PNG (the same bytes as examples/chat.py's for a seed)."""
    buf = io.BytesIO()
    image(seed, size).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, kind: str = "png") -> str:
    """Encoded image bytes as a base64 data URL, as an OpenAI client sends them."""
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()


def chat_url(seed: int) -> str:
    """The served benches' image: a 1344x1008 noise PNG as a data URL."""
    return data_url(png(seed))


def url_bytes(url: str) -> bytes:
    """The encoded bytes of a data URL (to write the same image to a file)."""
    return base64.b64decode(url.split(",", 1)[1])


def photo(width: int, height: int, seed: int = 0) -> Any:
    """A photo-like uint8 RGB array (``[height, width, 3]``): smooth fields, a few hard-edged
    discs, sensor noise; JPEG compresses it as it does photos (1344x1008 at quality 90: ~0.4 MB,
    the size of issue 38's documents), unlike ``image``'s noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / (7 + 0.05 * width) + c) * np.cos(y / (9 + 0.05 * height) - c)
                     for c in (0.0, 1.3, 2.6)], axis=-1)
    for _ in range(6):
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(2, max(3, width / 4))
        base[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    base += rng.normal(0, 6, base.shape)
    return np.clip(base, 0, 255).astype(np.uint8)


def photo_jpeg(seed: int, size: tuple[int, int] = CHAT_SIZE, quality: int = 90) -> bytes:
    """``photo`` of ``size`` (width, height) as a 4:2:0 JPEG: a new document for each seed."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(photo(size[0], size[1], seed)).save(buf, "JPEG", quality=quality, subsampling=2)
    return buf.getvalue()
