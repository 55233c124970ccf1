"""Generated images, as encoded files, for the preprocessing exactness tests (issue 38).

Each ``CASES`` entry is a name and a function returning the encoded bytes: JPEG (4:2:0, 4:4:4,
progressive, grey, CMYK, with an EXIF orientation), PNG (RGB, RGBA, palette, 16-bit grey, grey
with alpha), WebP, GIF, BMP; sizes from 1x1 to 8000x6000, aspect ratios up to 1:50 both ways,
and sides just around the 448-pixel tile. Content is photo-like (smooth fields, edges, noise),
so that JPEG behaves as on photos and every resize weight matters.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.lib.images import photo  # noqa: E402  (photo-like content, shared with bench/distinct.py)


def _save(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


def _rgb(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(photo(w, h, seed))


def _exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW to display
    return _save(_rgb(640, 480, 3), "JPEG", exif=exif.tobytes())


def _grey16() -> bytes:
    a = (photo(300, 200, 4)[..., 0].astype(np.uint16) * 257)
    return _save(Image.fromarray(a), "PNG")  # (mode I;16)


CASES: dict[str, Callable[[], bytes]] = {
    "jpeg-420-photo-1344x1008": lambda: _save(_rgb(1344, 1008), "JPEG", quality=90, subsampling=2),
    "jpeg-444-1000x700": lambda: _save(_rgb(1000, 700, 1), "JPEG", quality=95, subsampling=0),
    "jpeg-progressive-800x600": lambda: _save(_rgb(800, 600, 2), "JPEG", progressive=True),
    "jpeg-grey-500x375": lambda: _save(_rgb(500, 375, 5).convert("L"), "JPEG"),
    "jpeg-cmyk-400x300": lambda: _save(_rgb(400, 300, 6).convert("CMYK"), "JPEG"),
    "jpeg-exif-rotated-640x480": _exif_rotated,
    "png-rgb-1x1": lambda: _save(_rgb(1, 1, 7), "PNG"),
    "png-rgb-tiny-3x5": lambda: _save(_rgb(3, 5, 8), "PNG"),
    "png-rgba-600x400": lambda: _save(Image.fromarray(
        np.dstack([photo(600, 400, 9), photo(600, 400, 10)[..., :1]])), "PNG"),
    "png-palette-320x240": lambda: _save(
        _rgb(320, 240, 11).convert("P", palette=Image.Palette.ADAPTIVE), "PNG"),
    "png-grey16-300x200": _grey16,
    "png-grey-alpha-256x256": lambda: _save(_rgb(256, 256, 12).convert("LA"), "PNG"),
    "webp-720x540": lambda: _save(_rgb(720, 540, 13), "WEBP", quality=80),
    "gif-300x300": lambda: _save(_rgb(300, 300, 14).convert("P"), "GIF"),
    "bmp-333x222": lambda: _save(_rgb(333, 222, 15), "BMP"),
    "png-1-to-50-40x2000": lambda: _save(_rgb(40, 2000, 16), "PNG"),
    "png-50-to-1-2000x40": lambda: _save(_rgb(2000, 40, 17), "PNG"),
    "png-447x448": lambda: _save(_rgb(447, 448, 18), "PNG"),
    "png-448x448": lambda: _save(_rgb(448, 448, 19), "PNG"),
    "png-449x448": lambda: _save(_rgb(449, 448, 20), "PNG"),
    "png-895x449": lambda: _save(_rgb(895, 449, 21), "PNG"),
    "png-1345x1343": lambda: _save(_rgb(1345, 1343, 22), "PNG"),
    "png-noise-1344x1008": lambda: _save(Image.fromarray(
        np.random.default_rng(23).integers(0, 256, (1008, 1344, 3), dtype=np.uint8)), "PNG"),
}
LARGE = {"jpeg-8000x6000": lambda: _save(_rgb(8000, 6000, 24), "JPEG", quality=85)}
