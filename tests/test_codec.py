import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from featcache import codec
from featcache.errors import CorruptEntryError


def encode(t: torch.Tensor, meta: bytes = b"") -> bytes:
    data = t.reshape(-1).view(torch.uint8).numpy().data
    return codec.encode(t.dtype, tuple(t.shape), data, meta)


@pytest.mark.parametrize("dtype", list(codec.DTYPE_CODES))
def test_roundtrip_every_dtype(dtype):
    t = (torch.randn(3, 5) * 4).to(dtype)
    value = encode(t)
    header = codec.verify(value)
    back = torch.frombuffer(bytearray(codec.payload(value, header)), dtype=torch.uint8)
    back = back.view(header.dtype).view(header.shape)
    assert header.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_header_size_is_fixed():
    assert codec.HEADER.size == 104
    assert len(encode(torch.zeros(()))) == codec.HEADER.size + 4
    assert len(encode(torch.zeros(0))) == codec.HEADER.size


def test_metadata_roundtrip_and_checksum():
    value = encode(torch.arange(4, dtype=torch.int32), meta=b'{"image_tokens": 256}')
    header = codec.verify(value)
    assert codec.meta(value, header) == b'{"image_tokens": 256}'
    assert bytes(codec.payload(value, header)) == torch.arange(4, dtype=torch.int32).numpy().tobytes()
    flipped = bytearray(value)
    flipped[codec.HEADER.size + 3] ^= 1  # a metadata byte
    with pytest.raises(CorruptEntryError, match="checksum"):
        codec.verify(bytes(flipped))
    with pytest.raises(ValueError, match="at most"):
        codec.check_meta(b"x" * (codec.MAX_META_BYTES + 1))
    with pytest.raises(TypeError, match="bytes"):
        codec.check_meta("text")


@pytest.mark.parametrize("where", ["magic", "version", "dtype", "shape", "payload", "checksum"])
def test_any_flipped_byte_is_detected(where):
    value = bytearray(encode(torch.arange(64, dtype=torch.float32)))
    offset = {
        "magic": 0, "version": 4, "dtype": 6, "shape": 24,
        "checksum": codec.HEADER.size - 1, "payload": codec.HEADER.size + 10,
    }[where]
    value[offset] ^= 0x40
    with pytest.raises(CorruptEntryError):
        codec.verify(bytes(value))


def test_truncated_values_are_detected():
    value = encode(torch.arange(64, dtype=torch.float32))
    for cut in (0, 10, codec.HEADER.size, len(value) - 1):
        with pytest.raises(CorruptEntryError):
            codec.verify(value[:cut])


def test_header_declaring_more_than_the_value_holds_is_rejected_before_any_allocation():
    prefix = codec._PREFIX.pack(
        codec.MAGIC, codec.FORMAT_VERSION, 1, 1, 0, 0, 1 << 40, 1 << 38, *[0] * 7)
    with pytest.raises(CorruptEntryError, match="length mismatch"):
        codec.decode_header(prefix + b"\0" * 16)


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=0, max_size=300))
def test_fuzzed_values_never_crash_the_reader(blob):
    try:
        codec.verify(blob)
    except CorruptEntryError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 0xFFFF), st.integers(0, 255), st.integers(0, 255), st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1), st.lists(st.integers(0, 2**64 - 1), min_size=8, max_size=8),
)
def test_fuzzed_headers_with_valid_magic_never_crash(version, code, ndim, meta_len, nbytes, dims):
    head = struct.pack(
        "<4sHBBIIQ8Q16s", codec.MAGIC, version, code, ndim, meta_len, 0, nbytes, *dims, b"\0" * 16)
    try:
        codec.verify(head + b"\0" * 64)
    except CorruptEntryError:
        pass


def test_unstorable_tensors_are_refused():
    with pytest.raises(TypeError, match="dtype"):
        codec.check_storable(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        codec.check_storable([1, 2])
    with pytest.raises(TypeError, match="dense"):
        codec.check_storable(torch.eye(3).to_sparse())
    with pytest.raises(ValueError, match="dims"):
        codec.check_storable(torch.zeros([1] * 9))


@pytest.mark.parametrize("meta", [b"", b'{"image_tokens": 256}', b"m" * 1000])
def test_encoding_in_place_gives_the_same_value_as_encode(meta):
    t = torch.randn(7, 33).to(torch.bfloat16)
    payload = t.reshape(-1).view(torch.uint8)
    start, offset = codec.frame_offsets(len(meta))
    assert offset % codec.PAYLOAD_ALIGN == 0 and offset - start == codec.HEADER.size + len(meta)
    buffer = torch.zeros(offset + payload.numel(), dtype=torch.uint8)
    buffer[offset:] = payload
    frame = buffer[start:].numpy().data
    codec.encode_in_place(frame, t.dtype, tuple(t.shape), meta)
    assert bytes(frame) == encode(t, meta)
    assert codec.verify(frame).shape == (7, 33)
