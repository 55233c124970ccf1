"""What travels with an image from the frontend to the model: its key, its metadata, its lease.

A ``FeatRef`` rides in the per-image dict the frontend builds, and from there in the engine's
``MultiModalData.meta``, for the whole life of the sequence (lmdeploy keeps every image of a
sequence in its history: preemption and chunked prefill may send it to the model again).

Invariant: a hit's lease is held as long as its ``FeatRef`` lives, so its features cannot be evicted
while any request that was promised them is in flight; the lease is released when the last
reference to the ``FeatRef`` goes (the request finished, failed or was aborted).
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import torch

from ..cache import FeatureCache, Lease

REF_KEY = "featcache"  # the per-image dict / MultiModalData.meta key holding the FeatRef
_MAX_META_TENSOR = 64  # metadata tensors (image_grid_thw, image_tokens) are tiny


class FeatRef:
    __slots__ = ("__weakref__", "cache", "key", "lease", "meta")

    def __init__(self, cache: FeatureCache, key: bytes, meta: bytes, lease: Lease | None) -> None:
        self.cache = cache
        self.key = key
        self.meta = meta
        self.lease = lease
        if lease is not None:
            weakref.finalize(self, lease.release)

    @property
    def hit(self) -> bool:
        return self.lease is not None

    def __repr__(self) -> str:
        return f"FeatRef({self.key.hex()}, {'hit' if self.hit else 'miss'})"


# -- the per-image dict, minus pixels, as JSON bytes (stored as the entry's metadata) -----------

def encode_item(item: dict[str, Any], namespace: str | None = None) -> bytes:
    """What the engine needs of a preprocessed image besides its pixels, as JSON bytes.

    Records every field but the pixels (token counts, token id, grids, sizes) plus the trailing
    shape and dtype of ``pixel_values``, so a hit can be rebuilt exactly without preprocessing,
    and the key's ``namespace`` (the model identity; for ``featcache ls`` and
    ``purge --namespace``: keys are digests, so it cannot be read back from them).
    Raises ``TypeError`` for fields it cannot encode (the image is then not cached).
    """
    pixels = item["pixel_values"]
    if not isinstance(pixels, torch.Tensor):
        raise TypeError("pixel_values is not a tensor")
    fields = {k: _encode(v) for k, v in item.items() if k not in ("pixel_values", REF_KEY)}
    record: dict[str, Any] = {
        "pixels": [list(pixels.shape[1:]), str(pixels.dtype).removeprefix("torch.")],
        "fields": fields}
    if namespace is not None:
        record["ns"] = namespace
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def decode_item(meta: bytes) -> dict[str, Any]:
    """The per-image dict of a hit: the recorded fields and a 0-row ``pixel_values`` placeholder."""
    record = json.loads(meta)
    tail, dtype = record["pixels"]
    item = {k: _decode(v) for k, v in record["fields"].items()}
    item["pixel_values"] = torch.empty((0, *tail), dtype=getattr(torch, dtype))
    return item


def _encode(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.Tensor):
        if v.numel() > _MAX_META_TENSOR:
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
