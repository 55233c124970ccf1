"""A stand-in for Llama 4's image processor, written into tests/lmdeploy_tiny.py's tiny Llama 4
checkpoint as remote code (its ``preprocessor_config.json`` names it).

transformers' ``Llama4ImageProcessor`` is torchvision-backed only, and no torchvision build loads
beside the CPU torch these tests run on. This one has its output's layout, the one lmdeploy 0.18's
Llama 4 frontend reads (``pixel_values`` [tiles, 3, 56, 56] of one image, ``aspect_ratios``
[[rows, columns]] of its tile canvas, a global tile after the others when there are several),
with a simpler canvas choice: up to 2x2 tiles of 56 px by the image's size, resized to fill it,
mean and std 0.5. What it computes matters only as far as each image's pixels and token layout
depend on the image alone: featcache runs lmdeploy's own preprocessing for a miss of this family.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor

TILE, MAX_SIDE_TILES = 56, 2


class Llama4ImageProcessorStandIn(BaseImageProcessor):
    model_input_names = ["pixel_values"]

    def __call__(self, images: list[Any], **kwargs: Any) -> BatchFeature:
        return self.preprocess(images, **kwargs)

    def preprocess(self, images: list[Any], **kwargs: Any) -> BatchFeature:
        from PIL import Image

        pixels, ratios = [], []
        for image in images:
            image = image.convert("RGB")
            w, h = image.size
            rows, cols = (min(MAX_SIDE_TILES, max(1, math.ceil(x / TILE))) for x in (h, w))
            canvas = _normalized(image.resize((cols * TILE, rows * TILE), Image.BILINEAR))
            tiles = canvas.reshape(3, rows, TILE, cols, TILE).permute(1, 3, 0, 2, 4)
            tiles = tiles.reshape(-1, 3, TILE, TILE)
            if rows * cols > 1:  # the global tile: the whole image at one tile's size
                tiles = torch.cat([tiles, _normalized(image.resize((TILE, TILE), Image.BILINEAR))[None]])
            pixels.append(tiles)
            ratios.append([rows, cols])
        return BatchFeature({"pixel_values": torch.cat(pixels), "aspect_ratios": torch.tensor(ratios)})


def _normalized(image: Any) -> torch.Tensor:
    array = np.asarray(image, dtype=np.float32) / 255.0
    return ((torch.from_numpy(array) - 0.5) / 0.5).permute(2, 0, 1).contiguous()
