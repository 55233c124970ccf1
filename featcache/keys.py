"""Content keys: digests of a framed, ordered stream describing an image and how it was processed.

The stream is, in order: a format tag and version, the namespace (the model identity), the
preprocessing parameters (canonically encoded, dict keys sorted), then the image: its kind (PIL
image, uint8 array or encoded bytes), its mode or dtype/shape, its size, its palette where the mode
has one, and its bytes. Every field is framed (tag + length + bytes), so no two different inputs
produce the same stream. Unknown parameter types raise ``TypeError``; nothing is pickled. A PIL
image that fails to decode (a lazily opened, truncated or broken file) raises ``ValueError``.

Digests: ``blake3`` (the default: 32 bytes, cryptographic; 0.8 ms for 5 MB on one core,
``bench/checks/hit_path_costs.py``),
keyed with ``secret`` (a ``FeatureCache`` keys with its store's random secret,
``featcache.keysecret``): a client that does not know the secret can neither predict keys nor
craft collisions. ``blake2b`` (the same, slower) and ``xxh3_128`` (16 bytes, fast, unkeyed and not
collision-resistant against an adversary: an explicit opt-in for a single trusted tenant).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3
import numpy as np
import xxhash

KEY_FORMAT_VERSION = 2  # 2: blake3 by default, decode options in the stream (issue 26)
_MAGIC = b"featcache-key"
ALGORITHMS = ("blake3", "xxh3_128", "blake2b")
DEFAULT_ALGORITHM = "blake3"
_BLAKE3_CONTEXT = "featcache 2026-12 image key secret"  # derives blake3's 32-byte key from a secret



class _Framer:
    """Feeds tagged, length-prefixed fields into a hash object."""

    def __init__(self, hasher: Any) -> None:
        self._h = hasher

    def field(self, tag: bytes, data: bytes | memoryview) -> None:
        self._h.update(tag + struct.pack("<Q", len(data)))
        self._h.update(data)

    def value(self, v: Any) -> None:
        # bool before int: bool is a subclass of int and True must differ from 1.
        if v is None:
            self.field(b"N", b"")
        elif isinstance(v, bool):
            self.field(b"?", b"\x01" if v else b"\x00")
        elif isinstance(v, (int, np.integer)):
            self.field(b"i", str(int(v)).encode())
        elif isinstance(v, (float, np.floating)):
            self.field(b"f", struct.pack("<d", float(v)))
        elif isinstance(v, str):
            self.field(b"s", v.encode("utf-8"))
        elif isinstance(v, (bytes, bytearray)):
            self.field(b"b", bytes(v))
        elif isinstance(v, (list, tuple)):
            self.field(b"[", struct.pack("<Q", len(v)))
            for item in v:
                self.value(item)
        elif isinstance(v, Mapping):
            self.mapping(v)
        else:
            raise TypeError(
                f"cannot key a parameter of type {type(v).__name__}: use None, bool, int, float, "
                "str, bytes, or lists/tuples/dicts of those"
            )

    def mapping(self, m: Mapping[Any, Any]) -> None:
        for k in m:
            if not isinstance(k, str):
                raise TypeError(f"parameter names must be str, not {type(k).__name__}: {k!r}")
        self.field(b"{", struct.pack("<Q", len(m)))
        for k in sorted(m):
            self.field(b"k", k.encode("utf-8"))
            self.value(m[k])

    def digest(self) -> bytes:
        return bytes(self._h.digest())


class ImageKey(bytes):
    """A key (the digest: compares, hashes and stores as those bytes) that remembers the
    ``namespace`` it was made for, so that ``FeatureCache.put`` records it in the entry's metadata
    for the store tools (a digest cannot tell its model). Any other bytes are keys too."""

    namespace: str

    def __new__(cls, digest: bytes, namespace: str) -> ImageKey:
        key = super().__new__(cls, digest)
        key.namespace = namespace
        return key

    def __reduce__(self) -> tuple[Any, ...]:  # pickles with its namespace
        return (ImageKey, (bytes(self), self.namespace))


@dataclass(frozen=True)
class KeyHasher:
    """How keys are computed: the digest algorithm and, for keyed mode, the secret (never shown
    in ``repr``).

    Keys made with different settings never match each other (the algorithm and whether a secret
    is used are part of the stream), so changing the setting on a live store only causes misses.
    """

    algorithm: str = DEFAULT_ALGORITHM
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown key algorithm {self.algorithm!r}; choose one of {ALGORITHMS}")
        if self.secret is not None:
            if self.algorithm == "xxh3_128":
                raise ValueError("keyed mode needs algorithm='blake3' or 'blake2b' (xxh3 is not a "
                                 "keyed MAC)")
            if not isinstance(self.secret, bytes) or not 16 <= len(self.secret) <= 64:
                raise ValueError("the secret must be 16 to 64 random bytes (e.g. os.urandom(32))")
            if self.algorithm == "blake3":  # blake3's key is 32 bytes: derived from the secret
                key = blake3.blake3(self.secret, derive_key_context=_BLAKE3_CONTEXT).digest()
                object.__setattr__(self, "_blake3_key", key)

    @property
    def keyed(self) -> bool:
        return self.secret is not None

    def _framer(self) -> _Framer:
        if self.algorithm == "blake3":
            key = getattr(self, "_blake3_key", None)
            hasher: Any = (blake3.blake3(key=key, max_threads=blake3.blake3.AUTO) if key is not None
                           else blake3.blake3(max_threads=blake3.blake3.AUTO))
        elif self.algorithm == "xxh3_128":
            hasher = xxhash.xxh3_128()
        elif self.secret is not None:
            hasher = hashlib.blake2b(key=self.secret, digest_size=32)
        else:
            hasher = hashlib.blake2b(digest_size=32)
        framer = _Framer(hasher)
        framer.field(b"M", _MAGIC + struct.pack("<H", KEY_FORMAT_VERSION))
        framer.field(b"A", (self.algorithm + ("+keyed" if self.secret else "")).encode())
        return framer

    def _framed(self, namespace: str, params: Mapping[str, Any] | None) -> _Framer:
        """A framer past the fields every key starts with: settings, namespace, parameters."""
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
        framer = self._framer()
        framer.field(b"n", namespace.encode("utf-8"))
        framer.mapping(params or {})
        return framer

    def prefix(self, namespace: str, shared: Mapping[str, Any], last: str) -> KeyPrefix:
        """The keys whose params are ``{**shared, last: p}``, for many ``p``, with ``shared``
        framed once (``KeyPrefix``): a request's decode options, shared by all its images."""
        return KeyPrefix(self, namespace, shared, last)

    def image_key(
        self, image: Any, *, namespace: str = "", params: Mapping[str, Any] | None = None
    ) -> ImageKey:
        """Key of ``image`` as processed by model ``namespace`` with preprocessing ``params``."""
        framer = self._framed(namespace, params)
        _frame_image(framer, image)
        return ImageKey(framer.digest(), namespace)

    def client_key(
        self, image_id: str, *, namespace: str = "", params: Mapping[str, Any] | None = None
    ) -> ImageKey:
        """Key of the image a client names ``image_id``: its own field, so it never equals a
        content key; the namespace and params are hashed in as for ``image_key``, so the ids of
        different models never meet. Raises ``ValueError`` for an id that is not 1 to
        ``MAX_IMAGE_ID_CHARS`` characters of text."""
        framer = self._framed(namespace, params)
        framer.field(b"C", _id_bytes(image_id))  # a client's id: no content field follows
        return ImageKey(framer.digest(), namespace)


MAX_IMAGE_ID_CHARS = 256  # a client-supplied image id (featcache serve --trust-client-image-ids)


class KeyPrefix:
    """``KeyHasher.prefix``: the stream of keys whose params are ``{**shared, last: p}`` framed up
    to ``p``, once; each key copies that state and frames only its own ``p`` and image.

    Invariant: ``image_key(image, p)`` and ``client_key(id, p)`` equal the hasher's own for
    ``params={**shared, last: p}``, byte for byte (params are framed in sorted order, so every
    name of ``shared`` must sort before ``last``: ``ValueError`` otherwise). The framed state is
    never updated after construction: copies of it may be taken from any thread."""

    def __init__(self, hasher: KeyHasher, namespace: str, shared: Mapping[str, Any],
                 last: str) -> None:
        for name in shared:
            if not isinstance(name, str) or not name < last:
                raise ValueError(f"a shared parameter name must be a str sorting before {last!r}, "
                                 f"not {name!r}")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
        self.hasher = hasher
        self.namespace = namespace
        framer = hasher._framer()
        framer.field(b"n", namespace.encode("utf-8"))
        framer.field(b"{", struct.pack("<Q", len(shared) + 1))  # (as _Framer.mapping frames it)
        for name in sorted(shared):
            framer.field(b"k", name.encode("utf-8"))
            framer.value(shared[name])
        framer.field(b"k", last.encode("utf-8"))
        self._head = framer._h

    def _framed(self, own: Any) -> _Framer:
        framer = _Framer(self._head.copy())
        framer.value(own)
        return framer

    def image_key(self, image: Any, own: Any) -> ImageKey:
        framer = self._framed(own)
        _frame_image(framer, image)
        return ImageKey(framer.digest(), self.namespace)

    def client_key(self, image_id: str, own: Any) -> ImageKey:
        framer = self._framed(own)
        framer.field(b"C", _id_bytes(image_id))
        return ImageKey(framer.digest(), self.namespace)


def _id_bytes(image_id: Any) -> bytes:
    if not isinstance(image_id, str) or not 0 < len(image_id) <= MAX_IMAGE_ID_CHARS:
        raise ValueError(f"an image id is a string of 1 to {MAX_IMAGE_ID_CHARS} characters, "
                         f"not {image_id!r:.80}")
    return image_id.encode("utf-8")


def _frame_image(framer: _Framer, image: Any) -> None:
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = memoryview(image).cast("B")
        if data.nbytes == 0:
            raise ValueError("cannot key an empty image (0 bytes)")
        framer.field(b"E", data)  # encoded bytes, hashed as given: no decode
        return
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise TypeError(
                f"arrays must be uint8 HxW or HxWxC, got dtype {image.dtype} with {image.ndim} dims"
            )
        if image.size == 0:
            raise ValueError(f"cannot key an empty image of shape {image.shape}")
        arr = np.ascontiguousarray(image)
        framer.field(b"D", struct.pack("<B", arr.ndim) + struct.pack(f"<{arr.ndim}Q", *arr.shape))
        framer.field(b"P", arr.data.cast("B"))
        return
    if _is_pil_image(image):
        width, height = image.size
        if width == 0 or height == 0:
            raise ValueError(f"cannot key an empty image of size {image.size}")
        try:
            image.load()  # an image opened lazily (Image.open) is decoded here, not earlier
        except (OSError, SyntaxError, EOFError) as e:  # PIL's errors for damaged image data
            raise ValueError(f"cannot key a PIL image that does not decode: {e}") from e
        framer.field(b"I", image.mode.encode() + struct.pack("<QQ", width, height))
        palette = image.getpalette(rawmode=None) if image.mode in ("P", "PA") else None
        if palette is not None:
            framer.field(b"L", bytes(palette))
        framer.field(b"P", image.tobytes())
        return
    raise TypeError(
        f"cannot key an image of type {type(image).__name__}: pass a PIL image, a uint8 numpy "
        "array (HxW or HxWxC) or the encoded bytes"
    )


def _is_pil_image(obj: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # PIL is optional: without it no object can be a PIL image
        return False
    return isinstance(obj, Image.Image)


_DEFAULT = KeyHasher()


def image_key(
    image: Any,
    *,
    namespace: str = "",
    params: Mapping[str, Any] | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
    secret: bytes | None = None,
) -> ImageKey:
    """Content key of an image for a model (``namespace``) and its preprocessing ``params``: the
    digest's bytes, carrying ``namespace`` for ``FeatureCache.put`` to record.

    ``image`` is a PIL image, a uint8 numpy array (HxW or HxWxC) or raw encoded bytes (hashed as
    given, not decoded). Equal inputs give equal keys in any process; any change of pixel, size,
    mode, namespace or parameter value gives another key; the order of ``params`` does not matter.
    The digest is unkeyed BLAKE3 unless ``secret`` is given; a ``FeatureCache`` user keys with
    ``cache.image_key`` instead, under the cache's own secret (what its server and tools use).
    """
    hasher = _DEFAULT if (algorithm, secret) == (DEFAULT_ALGORITHM, None) else KeyHasher(algorithm, secret)
    return hasher.image_key(image, namespace=namespace, params=params)


def client_image_key(image_id: str, *, namespace: str = "", params: Mapping[str, Any] | None = None,
                     algorithm: str = DEFAULT_ALGORITHM, secret: bytes | None = None) -> ImageKey:
    """Key of the image a trusted client names ``image_id`` (``KeyHasher.client_key``)."""
    hasher = _DEFAULT if (algorithm, secret) == (DEFAULT_ALGORITHM, None) else KeyHasher(algorithm, secret)
    return hasher.client_key(image_id, namespace=namespace, params=params)
