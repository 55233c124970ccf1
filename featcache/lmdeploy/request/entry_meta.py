"""The entry metadata featcache.lmdeploy stores with each image's features: its format, written
and read here only.

An entry's metadata is what the engine needs of a preprocessed image besides its pixels, so a hit
is rebuilt exactly without preprocessing. It is one JSON object (keys sorted, no spaces)::

    {"cost_s": SECONDS,                     the vision model's time of the miss, when measured
     "fields": {NAME: VALUE, ...},         every field of lmdeploy's per-image dict but the pixels
     "ns": NAMESPACE,                       the key's namespace (model identity), when known
     "pixels": [[TRAILING SHAPE], DTYPE],   of ``pixel_values``, for the 0-row placeholder of a hit
     "pixel_field": NAME}                  where the pixels are not ``pixel_values`` (a video's
                                            items: ``pixel_values_videos``)

A VALUE is None, a bool, int, float or str as is; a list of VALUEs; ``{"tuple": [VALUE, ...]}``;
or ``{"tensor": [DTYPE, SHAPE, FLAT VALUES]}`` for a tensor of at most 64 elements (token counts,
grids). Keys are digests, so ``ns`` is the only way to tell which model an entry belongs to
(``featcache ls``, ``purge --namespace``). ``cost_s`` is added by ``FeatureCache.put(...,
cost_s=...)`` (the model hook's measure, ``visioncost``) and read by ``featcache.entrymeta.cost_of``
for value eviction (``featcache.eviction.value``).

Writers: the frontend (``encode_item``) and the TurboMind native path; readers: the frontend
(``decode_item``) and the store commands (``featcache ls``, ``inspect``, ``purge --namespace``),
through ``featcache.entrymeta``'s ``read`` and ``namespace_of`` (re-exported here; torch-free, so
the store tools start fast), which also take metadata of any other shape (a ``FeatureCache``
user's own bytes) without raising. Nothing else decodes it.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ...entrymeta import EntryMeta, namespace_of, read
from .refs import REF_KEY

__all__ = ["EntryMeta", "decode_item", "encode_item", "namespace_of", "processor_item_meta", "read"]

MAX_TENSOR_ELEMENTS = 64  # metadata tensors (image_grid_thw, image_tokens) are tiny
PIXEL_FIELDS = ("pixel_values", "pixel_values_videos")  # an image's pixels; a video item's


def encode_item(item: dict[str, Any], namespace: str | None = None) -> bytes:
    """The metadata of a preprocessed image (lmdeploy's per-image dict): every field but the
    pixels, the trailing shape and dtype of ``pixel_values``, and ``namespace`` when given.

    Raises ``TypeError`` for fields it cannot encode (the image is then not cached).
    """
    name = next((n for n in PIXEL_FIELDS if n in item), PIXEL_FIELDS[0])
    pixels = item[name]
    if not isinstance(pixels, torch.Tensor):
        raise TypeError(f"{name} is not a tensor")
    fields = {k: _encode(v) for k, v in item.items() if k not in (name, REF_KEY)}
    record: dict[str, Any] = {
        "pixels": [list(pixels.shape[1:]), str(pixels.dtype).removeprefix("torch.")],
        "fields": fields}
    if name != PIXEL_FIELDS[0]:
        record["pixel_field"] = name
    if namespace is not None:
        record["ns"] = namespace
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def decode_item(meta: bytes) -> dict[str, Any]:
    """The per-image dict of a hit: the recorded fields and a 0-row ``pixel_values`` placeholder.
    Raises (``ValueError``, ``KeyError``, ``TypeError``, ...) for metadata not of this format."""
    record = json.loads(meta)
    tail, dtype = record["pixels"]
    item = {k: _decode(v) for k, v in record["fields"].items()}
    name = record.get("pixel_field", PIXEL_FIELDS[0])
    if name not in PIXEL_FIELDS:
        raise ValueError(f"unknown pixel field {name!r:.40}")
    item[name] = torch.empty((0, *tail), dtype=getattr(torch, dtype))
    return item


def _encode(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.Tensor):
        if v.numel() > MAX_TENSOR_ELEMENTS:
            raise TypeError(f"tensor field of {v.numel()} elements is too large for metadata")
        return {"tensor": [str(v.dtype).removeprefix("torch."), list(v.shape), v.flatten().tolist()]}
    if isinstance(v, tuple):
        return {"tuple": [_encode(x) for x in v]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    raise TypeError(f"cannot record a field of type {type(v).__name__}")


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        if "tensor" in v:
            dtype, shape, data = v["tensor"]
            return torch.tensor(data, dtype=getattr(torch, dtype)).reshape(shape)
        return tuple(_decode(x) for x in v["tuple"])
    return v


def processor_item_meta(item: dict[str, Any], namespace: str) -> bytes:
    """An image's entry metadata from the processor-level API's per-image dict: the dict without
    what is the request's (its offset) or a constant (its modality), with its token count
    (``image_tokens``: what ``featcache ls`` shows; not a field of lmdeploy's dict, never put in
    one)."""
    start, end = item["offset"]
    fields = {k: v for k, v in item.items() if k not in ("offset", "modality", REF_KEY)}
    return encode_item({**fields, "image_tokens": int(end) - int(start)}, namespace)
