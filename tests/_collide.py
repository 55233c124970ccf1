"""Two different images whose xxh3-128 keys collide, built in a few lines, no search (issue 26).

XXH3's long-input loop adds each 8-byte lane of the input to a neighbouring accumulator and the
product of the lane's two 32-bit halves, each XORed with the (public, default) secret. A lane whose
low half equals the secret's makes that product 0 whatever its high half holds; so adding d to the
high half of one such lane and subtracting it from another lane feeding the same accumulator in
the same block leaves every accumulator, and so the hash, unchanged. The offsets of an image's
bytes in featcache's framed stream depend on the namespace's length, not its value, so a client
who knows the model's architecture can aim at a server's keys.
"""

from __future__ import annotations

import io
import struct
from unittest import mock

import numpy as np
from PIL import Image

import featcache.keys as keys

# The first 64 bytes of XXH3's default secret (kSecret, xxhash.h): stripe n of a block reads 8
# bytes at n*8, so the two stripes used below need no more.
XXH3_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c")


def _stream_offset(namespace: str, params: dict) -> int:
    """Where an encoded image's first byte lands in the stream xxh3 hashes."""
    class Recorder:
        def __init__(self) -> None:
            self.buf = bytearray()

        def update(self, data: bytes) -> None:
            self.buf += bytes(data)

    rec = Recorder()
    with mock.patch.object(keys.xxhash, "xxh3_128", lambda: rec):
        keys.KeyHasher("xxh3_128")._framed(namespace, params)
    return len(rec.buf) + 1 + 8  # the image field's tag and length


def xxh3_twins(namespace: str, params: dict, seed: int = 0) -> tuple[bytes, bytes]:
    """Two 64x64 BMPs with different pixels whose ``image_key(..., algorithm="xxh3_128")``
    under ``namespace`` and ``params`` are equal."""
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, "BMP")
    a = bytearray(buf.getvalue())
    start = _stream_offset(namespace, params)
    j1 = next(j for j in range(54, len(a)) if (start + j) % 64 == 0)  # past the BMP header
    j2 = j1 + 64
    if (start + j1) // 1024 != (start + j2) // 1024:  # the same block (16 stripes)
        j1, j2 = j1 + 64, j2 + 64
    for j in (j1, j2):  # lane 0 of two stripes: low halves equal to the secret's
        at = (start + j) // 64 % 16 * 8
        a[j:j + 4] = XXH3_SECRET[at:at + 4]
    b = bytearray(a)
    for j, sign in ((j1, 1), (j2, -1)):
        high = struct.unpack_from("<I", b, j + 4)[0]
        struct.pack_into("<I", b, j + 4, (high + sign * 0x1234567) % 2**32)
    return bytes(a), bytes(b)
