"""What travels with an image when the model runs in another process: its key and metadata only.

In the multi-process mode (lmdeploy's mp engine, tp > 1: docs/design.md "Several processes") the
per-image dicts are pickled from the process that preprocesses to the process that schedules (the
mp-engine child) and, inside ``MultiModalData.meta``, to every rank. A ``FeatRef`` cannot go
there: it holds the cache and a lease. A ``FeatTag`` holds two byte strings, and for an image the
frontend did not preprocess (it sent this process's model processes that image before: see
``frontend``) the encoded image, so that a model process that lost its features can rebuild its
pixels (``rebuild``).

Invariant: unpickling a tag never raises (an exception while unpickling stops lmdeploy's RPC server
or a rank, and with it every request). A pickled tag whose fields are not what a tag holds comes
back as a ``FeatTag`` with ``valid`` False, which the model hook treats as an image featcache does
not know: its features are computed from its pixels and not stored. Unpickling depends only on the
pickled bytes, so every rank reads the same tag the same way.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, NamedTuple

import torch

from ...core.chain import MAX_KEY_BYTES
from .entry_meta import PIXEL_FIELDS, decode_item

# ``restore_pixels`` views the unpickled bytes, which are read-only to torch: nothing writes them
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__.replace(".", r"\."))


class Source(NamedTuple):
    """What rebuilds an image where the frontend did not preprocess it, and the item's per-image
    parameters (JSON text). ``raw`` and ``decode`` (JSON text) are either the encoded image as
    the client sent it with lmdeploy's decode options (``{"io": ImageMediaIO kwargs}``) or the
    decoded image's pixel bytes with their layout (``{"pil": {"mode": ..., "size": [w, h]}}``,
    ``PIL.Image.tobytes``; an in-memory image given to a pipeline). ``rebuild.image`` reads it."""

    raw: bytes
    decode: str
    params: str


class FeatTag:
    """An image's featcache key and entry metadata (``entry_meta``'s bytes), and for an image sent
    without its pixels (the frontend skipped its preprocessing) the ``Source`` that rebuilds them;
    picklable."""

    __slots__ = ("key", "meta", "source", "valid")

    def __init__(self, key: bytes, meta: bytes, source: Source | None = None) -> None:
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise TypeError(f"a FeatTag key is 1-{MAX_KEY_BYTES} bytes, not {key!r:.40}")
        if not isinstance(meta, bytes):
            raise TypeError(f"a FeatTag meta is bytes, not {type(meta).__name__}")
        if source is not None:
            if not (isinstance(source, tuple) and len(source) == 3 and isinstance(source[0], bytes)
                    and isinstance(source[1], str) and isinstance(source[2], str)):
                raise TypeError("a FeatTag source is (bytes, str, str)")
            source = Source(*source)
        self.key = key
        self.meta = meta
        self.source = source
        self.valid = True

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.source is None:
            return (_restore, (self.key, self.meta))
        return (_restore, (self.key, self.meta, tuple(self.source)))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, FeatTag) and self.valid == other.valid
                and self.key == other.key and self.meta == other.meta
                and self.source == other.source)

    def __hash__(self) -> int:
        return hash((self.key, self.meta, self.valid))

    def __repr__(self) -> str:
        if not self.valid:
            return "FeatTag(invalid)"
        return f"FeatTag({self.key.hex()}{', source' if self.source else ''})"


def sourced(key: bytes, meta: bytes, raw: bytes, decode: dict[str, Any] | str | None,
            params: dict[str, Any]) -> FeatTag | None:
    """The tag of an image sent before (``meta``, remembered) carrying ``raw`` and how to read
    it (``decode``: a dict, or its JSON text made and checked once per request,
    ``ImageOptions.decode_text``); None where the options or parameters are not plain JSON (the
    model process could not rebuild the same pixels) or ``meta`` cannot be read."""
    if decode is None:
        return None
    try:
        how = decode if isinstance(decode, str) else json.dumps(decode, sort_keys=True)
        values = json.dumps(params, sort_keys=True)
        if (not isinstance(decode, str) and json.loads(how) != decode
                or json.loads(values) != params):
            return None
        decode_item(meta)
    except Exception:
        return None
    return FeatTag(key, meta, Source(raw, how, values))


def _invalid() -> FeatTag:
    tag = FeatTag.__new__(FeatTag)
    tag.key = b""
    tag.meta = b""
    tag.source = None
    tag.valid = False
    return tag


def _restore(key: Any = None, meta: Any = None, source: Any = None, *_: Any) -> FeatTag:
    """The unpickler's constructor: a tag, or an invalid one; never raises."""
    try:
        return FeatTag(key, meta, source)
    except Exception:
        return _invalid()


class Pixels:
    """A preprocessed image's pixels on their way to lmdeploy's mp-engine process (the frontend's
    ``pack_pixels``): pickled as their raw bytes, unpickled as the tensor again (``restore_pixels``).
    A tensor pickles through torch's legacy ``torch.save`` format, whose load, several copies and
    a Python read loop, runs on the engine process's event loop, beside its scheduling and its
    forwards; here it is one copy each way (the bytes are made on the frontend's thread)."""

    __slots__ = ("raw", "dtype", "shape")

    def __init__(self, tensor: torch.Tensor) -> None:
        flat = tensor.detach().contiguous().reshape(-1)
        self.raw = flat.view(torch.uint8).numpy().tobytes()
        self.dtype = str(tensor.dtype).removeprefix("torch.")
        self.shape = tuple(int(n) for n in tensor.shape)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (restore_pixels, (self.raw, self.dtype, self.shape))


def restore_pixels(raw: Any = None, dtype: Any = None, shape: Any = None, *_: Any) -> torch.Tensor:
    """The unpickler's constructor of ``Pixels``: the tensor (a view of ``raw``), or, for fields
    that do not make one, an empty tensor (the engine then refuses the request: ``unservable``);
    never raises."""
    try:
        kind = getattr(torch, dtype)
        if not (isinstance(kind, torch.dtype) and isinstance(raw, bytes) and isinstance(shape, tuple)
                and all(type(n) is int and n >= 0 for n in shape)):
            raise TypeError
        numel = 1
        for n in shape:
            numel *= n
        if numel * kind.itemsize != len(raw) or numel == 0:
            raise ValueError
        return torch.frombuffer(raw, dtype=torch.uint8).view(kind).view(shape)
    except Exception:
        return torch.empty(0)


def pack_pixels(items: list[Any]) -> None:
    """Each per-image dict's pixels (``PIXEL_FIELDS``: a CPU tensor, not empty) as ``Pixels``:
    for a model process that receives them pickled, never for one that reads them in place."""
    for item in items:
        if not isinstance(item, dict):
            continue
        for name in PIXEL_FIELDS:
            value = item.get(name)
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() > 0:
                item[name] = Pixels(value)
