"""The stored value format: a fixed header followed by the tensor's raw bytes. No pickle.

Value = header + metadata (``meta_len`` bytes) + payload (``nbytes`` bytes).
Header (little-endian, ``HEADER.size`` = 104 bytes)::

    magic      4s   b"FCv\\x00"
    version    u16  FORMAT_VERSION (2; version 1 had a 96-byte header and no metadata)
    dtype      u8   code from DTYPES
    ndim       u8   0..MAX_NDIM
    meta_len   u32  metadata length, 0..MAX_META_BYTES
    reserved   u32  0
    nbytes     u64  payload length
    shape      8 x u64 (unused dims are 0)
    checksum   16s  xxh3-128 over the header fields above, the metadata and the payload

Any change to this layout bumps FORMAT_VERSION (and the disk store's FORMAT_TAG), so that a store
written in an older layout is refused at open rather than read as corrupt entries.

``decode_header`` validates everything it can without the payload and never trusts a length it
has not checked against the real value length, so a hostile header cannot make a reader allocate
more than the value holds.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from .errors import CorruptEntryError

MAGIC = b"FCv\x00"
FORMAT_VERSION = 2
MAX_NDIM = 8
MAX_META_BYTES = 64 * 1024
_PREFIX = struct.Struct(f"<4sHBBIIQ{MAX_NDIM}Q")
HEADER = struct.Struct(f"<4sHBBIIQ{MAX_NDIM}Q16s")

if TYPE_CHECKING:
    import torch

# dtype code -> (torch's name of the dtype, bytes per element). Names, not torch.dtype objects: the
# store tools read headers without importing torch (``featcache stats``/``ls`` start fast).
DTYPES: dict[int, tuple[str, int]] = {
    1: ("float32", 4), 2: ("float16", 2), 3: ("bfloat16", 2), 4: ("float64", 8), 5: ("uint8", 1),
    6: ("int8", 1), 7: ("int16", 2), 8: ("int32", 4), 9: ("int64", 8), 10: ("bool", 1),
    11: ("float8_e4m3fn", 1), 12: ("float8_e5m2", 1),
}
NAME_CODES = {name: code for code, (name, _) in DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> int | None:
    """The code of a torch dtype, or None for a dtype the format does not store."""
    return NAME_CODES.get(str(dtype).removeprefix("torch."))


def __getattr__(name: str) -> Any:
    if name == "DTYPE_CODES":  # torch.dtype -> code, for callers that have torch anyway
        import torch

        return {getattr(torch, n): code for code, (n, _) in DTYPES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Header:
    dtype_name: str  # torch's name: "bfloat16", ...
    shape: tuple[int, ...]
    nbytes: int
    meta_len: int
    checksum: bytes

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)  # type: ignore[no-any-return]

    @property
    def payload_offset(self) -> int:
        return HEADER.size + self.meta_len


def check_storable(tensor: torch.Tensor) -> None:
    """Raise ``TypeError``/``ValueError`` if ``tensor`` cannot be stored.

    Storable: a plain dense (strided) tensor of a dtype in ``DTYPES`` with data on the CPU
    or a CUDA device. Refused: meta tensors (no data), nested, sparse and mkldnn tensors,
    quantized dtypes, tensors of other devices, tensors wrapped by functorch transforms (vmap,
    grad) and tensor subclasses that intercept dispatch (FakeTensor, DTensor, ...): their raw
    bytes are not their values, or they have none. A tensor with the negative or conjugate bit
    set is storable: the cache resolves it (``resolve_neg``) before reading its bytes.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"features must be a torch.Tensor, not {type(tensor).__name__}")
    allowed = "pass a dense tensor on the CPU or a CUDA device"
    if type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise TypeError(f"features of type {type(tensor).__name__} (a tensor subclass that "
                        f"intercepts dispatch) cannot be cached: {allowed}")
    if torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        raise TypeError("features wrapped by a functorch transform (vmap, grad) cannot be cached: "
                        "call put outside the transform")
    if tensor.is_nested:
        raise TypeError(f"nested tensors cannot be cached: {allowed} (e.g. one per image)")
    if tensor.layout != torch.strided:
        raise TypeError(f"tensors of layout {tensor.layout} cannot be cached, only dense "
                        f"(strided) ones: {allowed} (e.g. tensor.to_dense())")
    if tensor.device.type not in ("cpu", "cuda"):
        why = "meta tensors hold no data" if tensor.device.type == "meta" else "the cache copies " \
            "only from the CPU and CUDA devices"
        raise TypeError(f"features on the {tensor.device.type} device cannot be cached ({why}): "
                        f"{allowed}")
    if dtype_code(tensor.dtype) is None:
        names = ", ".join(name for name, _ in DTYPES.values())
        hint = " (dequantize() it first)" if tensor.is_quantized else ""
        raise TypeError(f"dtype {tensor.dtype} cannot be cached{hint}; supported: {names}")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"tensors of more than {MAX_NDIM} dims cannot be cached ({tensor.dim()})")


def check_meta(meta: object) -> bytes:
    """``meta`` as the bytes to store (None: b""); ``TypeError``/``ValueError`` otherwise."""
    if meta is None:
        return b""
    if not isinstance(meta, bytes):
        hint = " (encode text first: meta=text.encode())" if isinstance(meta, str) else ""
        raise TypeError(f"meta must be bytes or None, not {type(meta).__name__}{hint}")
    if len(meta) > MAX_META_BYTES:
        raise ValueError(f"meta is {len(meta)} bytes; at most {MAX_META_BYTES} are stored")
    return meta


def _prefix(dtype: torch.dtype, shape: tuple[int, ...], meta_len: int, nbytes: int) -> bytes:
    dims = list(shape) + [0] * (MAX_NDIM - len(shape))
    return _PREFIX.pack(
        MAGIC, FORMAT_VERSION, NAME_CODES[str(dtype).removeprefix("torch.")], len(shape), meta_len, 0,
        nbytes, *dims
    )


def checksum(prefix: bytes, meta: memoryview | bytes, payload: memoryview | bytes) -> bytes:
    h = xxhash.xxh3_128(prefix)
    h.update(meta)
    h.update(payload)
    return h.digest()


def encode(
    dtype: torch.dtype, shape: tuple[int, ...], payload: memoryview | bytes, meta: bytes = b""
) -> bytes:
    """Header, metadata and payload as one bytes value (one copy of the payload)."""
    return b"".join((lead(dtype, shape, payload, meta), payload))


def lead(
    dtype: torch.dtype, shape: tuple[int, ...], payload: memoryview | bytes, meta: bytes = b""
) -> bytes:
    """The value's bytes before the payload (header + metadata): ``lead + payload`` is the value
    ``encode`` returns, for writers that send the payload from where it lies (no copy)."""
    nbytes = memoryview(payload).nbytes
    prefix = _prefix(dtype, shape, len(meta), nbytes)
    return b"".join((prefix, checksum(prefix, meta, payload), meta))


def meta_len(value_head: memoryview | bytes) -> int:
    """The ``meta_len`` field of a header (no validation: ``verify`` the whole value after)."""
    if memoryview(value_head).nbytes < HEADER.size:
        raise CorruptEntryError("value shorter than a header")
    return int(HEADER.unpack_from(value_head)[4])


PAYLOAD_ALIGN = 64  # bytes; where a framed payload starts inside its buffer


def frame_offsets(meta_len: int) -> tuple[int, int]:
    """(value start, payload start) in a buffer laid out for ``encode_in_place``: the payload is
    ``PAYLOAD_ALIGN``-aligned and header + metadata fit right before it."""
    payload_start = -(-(HEADER.size + meta_len) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
    return payload_start - HEADER.size - meta_len, payload_start


def encode_in_place(
    frame: memoryview, dtype: torch.dtype, shape: tuple[int, ...], meta: bytes = b""
) -> None:
    """Write header and metadata into the head of ``frame``, whose tail already holds the payload:
    ``frame`` becomes the whole value with no copy of the payload (``encode``'s twin)."""
    lead = HEADER.size + len(meta)
    payload = frame[lead:]
    prefix = _prefix(dtype, shape, len(meta), payload.nbytes)
    frame[: _PREFIX.size] = prefix
    frame[_PREFIX.size : HEADER.size] = checksum(prefix, meta, payload)
    frame[HEADER.size : lead] = meta


def decode_header(value: memoryview | bytes) -> Header:
    """Parse and validate a header against the value's real length. Raises CorruptEntryError."""
    view = memoryview(value)
    if view.nbytes < HEADER.size:
        raise CorruptEntryError(f"value of {view.nbytes} bytes is shorter than a header")
    magic, version, code, ndim, meta_len, reserved, nbytes, *rest = HEADER.unpack_from(view)
    dims, digest = rest[:MAX_NDIM], rest[MAX_NDIM]
    if magic != MAGIC:
        raise CorruptEntryError("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptEntryError(f"format version {version}, expected {FORMAT_VERSION}")
    if code not in DTYPES:
        raise CorruptEntryError(f"unknown dtype code {code}")
    if ndim > MAX_NDIM or any(dims[ndim:]):
        raise CorruptEntryError(f"bad shape header (ndim {ndim})")
    if reserved != 0 or meta_len > MAX_META_BYTES:
        raise CorruptEntryError(f"bad metadata header (meta_len {meta_len})")
    shape = tuple(dims[:ndim])
    dtype, itemsize = DTYPES[code]
    if nbytes != view.nbytes - HEADER.size - meta_len or math.prod(shape) * itemsize != nbytes:
        raise CorruptEntryError(
            f"length mismatch: header says {meta_len} + {nbytes} bytes for {shape} of {dtype}, "
            f"value holds {view.nbytes - HEADER.size}"
        )
    return Header(dtype_name=dtype, shape=shape, nbytes=nbytes, meta_len=meta_len, checksum=digest)


def verify(value: memoryview | bytes) -> Header:
    """Validate header and checksum of a whole value; return its header or raise."""
    view = memoryview(value)
    header = decode_header(view)
    prefix = bytes(view[: _PREFIX.size])
    meta = view[HEADER.size : header.payload_offset]
    if checksum(prefix, meta, view[header.payload_offset :]) != header.checksum:
        raise CorruptEntryError("checksum mismatch")
    return header


def meta(value: memoryview | bytes, header: Header) -> bytes:
    return bytes(memoryview(value)[HEADER.size : header.payload_offset])


def payload(value: memoryview | bytes, header: Header) -> memoryview:
    return memoryview(value)[header.payload_offset :]
