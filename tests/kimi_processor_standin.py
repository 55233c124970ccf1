"""A stand-in for Kimi-K2.5's remote-code processor, written into tests/lmdeploy_tiny.py's tiny
Kimi checkpoint (its ``processor_config.json`` names it, as the public checkpoints name theirs).

It has the remote processor's API, the one lmdeploy 0.18's Kimi frontend calls
(``processor(medias=[{"type": "image", "image": PIL}], text=..., return_tensors="pt")`` and
``image_processor.preprocess(medias, return_tensors="pt")``: ``input_ids`` with one
``<|media_pad|>`` per image, ``pixel_values`` [patches, 3, 14, 14], ``grid_thws`` [images, 3]),
and a NaViT-like preprocessing of its own: each side resized to a multiple of 28 px (patch 14,
merge 2x2), 112 px at most, mean and std 0.5. featcache never reproduces a remote processor
(``families.reproduces_expansion``): lmdeploy runs it and featcache tags its images, so what it
computes matters only as far as every image's pixels and grid depend on the image alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

PATCH, MERGE, MAX_SIDE = 14, 2, 112


class KimiImageProcessorStandIn:
    def preprocess(self, medias: list[dict[str, Any]], return_tensors: str = "pt") -> dict[str, Any]:
        from PIL import Image

        unit = PATCH * MERGE
        pixels, grids = [], []
        for media in medias:
            image = media["image"].convert("RGB")
            w, h = image.size
            scale = min(1.0, MAX_SIDE / max(w, h))
            nw, nh = (max(unit, round(x * scale / unit) * unit) for x in (w, h))
            array = np.asarray(image.resize((nw, nh), Image.BICUBIC), dtype=np.float32) / 255.0
            t = (torch.from_numpy(array) - 0.5) / 0.5  # [h, w, 3]
            gh, gw = nh // PATCH, nw // PATCH
            patches = t.reshape(gh, PATCH, gw, PATCH, 3).permute(0, 2, 4, 1, 3)
            pixels.append(patches.reshape(-1, 3, PATCH, PATCH))
            grids.append([1, gh, gw])
        return {"pixel_values": torch.cat(pixels), "grid_thws": torch.tensor(grids, dtype=torch.long)}


class KimiK25ProcessorStandIn:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.image_processor = KimiImageProcessorStandIn()

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoProcessor") -> None:
        """(transformers calls it on a remote-code class it loads)"""

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> KimiK25ProcessorStandIn:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def __call__(self, medias: list[dict[str, Any]], text: str, return_tensors: str = "pt") -> dict[str, Any]:
        out = self.image_processor.preprocess(medias, return_tensors=return_tensors)
        return {"input_ids": self.tokenizer(text, return_tensors="pt")["input_ids"], **out}
