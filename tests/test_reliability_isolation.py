"""Isolation: features never cross model namespaces or dtypes; keyed mode keys are unpredictable
without the secret; featcache takes no client-supplied ids.

A key is a digest of the namespace (model identity), the preprocessing parameters and the image;
the cache stores and serves whatever tensor was put under a key, with its dtype in the value's
checksummed header. So isolation is two claims, each tested here: different (namespace, params,
image) give different keys, and each key serves, from every tier, exactly its own tensor.

tests/test_keys.py already shows that one changed pixel, namespace or parameter changes the key
and that keyed mode depends on the secret; here the same holds at scale and through the store.
"""

from __future__ import annotations

import inspect
import io
import os
import zlib

import numpy as np
import torch
from PIL import Image, PngImagePlugin

from featcache import FeatureCache, KeyHasher, image_key

try:
    import _reliability as rel
except ImportError:  # tests/ became a package
    from tests import _reliability as rel

MiB = 1 << 20
NAMESPACES = ["OpenGVLab/InternVL2_5-2B", "Qwen/Qwen2-VL-2B-Instruct", "OpenGVLab/InternVL2_5-8B"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def images(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (16, 24, 3), dtype=np.uint8) for _ in range(n)]


def features(image: int, ns: int, dtype: torch.dtype) -> torch.Tensor:
    """The features model ``ns`` computes for ``image`` in ``dtype``: the same numbers for every
    model, so only the key keeps them apart (the worst case for isolation)."""
    g = torch.Generator().manual_seed(image)
    return torch.randn(8, 64, generator=g).to(dtype)


def test_namespaces_and_dtypes_never_serve_each_others_features(tmp_path):
    store = tmp_path / "store"
    imgs = images(30)
    grid = {}
    for i, img in enumerate(imgs):
        for n, ns in enumerate(NAMESPACES):
            for dtype in DTYPES:
                k = image_key(img, namespace=ns, params={"dtype": str(dtype), "max_patches": 12})
                grid[k] = features(i, n, dtype)
    assert len(grid) == len(imgs) * len(NAMESPACES) * len(DTYPES), "two cells share a key"
    reads = wrong = 0

    def check(cache: FeatureCache) -> None:
        nonlocal reads, wrong
        for k, want in grid.items():
            got = cache.get(k)
            reads += 1
            wrong += not rel.same_bits(got, want)  # dtype, shape and bytes

    with FeatureCache(device="cpu", device_bytes=4 * MiB, host_bytes=4 * MiB, disk_path=store,
                      disk_bytes=64 * MiB) as cache:
        for i, (k, t) in enumerate(grid.items()):
            cache.put(k, t.clone())
            if i % 16 == 15:
                cache.flush()  # no copy dropped: every tier gets every entry
        cache.flush()
        check(cache)  # device tier
        for k in grid:
            cache._chain.top.discard(k)
        check(cache)  # host tier
    with rel.disk_cache(store) as cache:
        check(cache)  # disk tier, after a reopen
        assert cache.stats()["disk"]["hits"] == len(grid)
    assert wrong == 0
    rel.report("isolation/namespaces-x-dtypes", runs=3, faults=0, wrong=wrong, failed=0,
               entries=len(grid), reads=reads)


def _bits(keys: list[bytes]) -> np.ndarray:
    return np.unpackbits(np.frombuffer(b"".join(keys), dtype=np.uint8)).reshape(len(keys), -1)


def test_keyed_mode_keys_look_random_without_the_secret():
    """2000 images: keyed keys differ from unkeyed ones and from another secret's, every bit is
    set about half the time, and a key is as far (in bits) from the unkeyed key of the same
    image, or from another secret's, as two random strings are."""
    n = 2000
    imgs = images(n, seed=7)
    s1, s2 = os.urandom(32), os.urandom(32)
    k1 = [image_key(im, namespace="m", algorithm="blake2b", secret=s1) for im in imgs]
    k2 = [image_key(im, namespace="m", algorithm="blake2b", secret=s2) for im in imgs]
    plain = [image_key(im, namespace="m", algorithm="blake2b") for im in imgs]
    fast = [image_key(im, namespace="m", algorithm="xxh3_128") for im in imgs]
    assert len(set(k1) | set(k2) | set(plain)) == 3 * n
    assert not set(k1) & {k[:16] for k in fast} and not {k[:16] for k in k1} & set(fast)
    b1, b2, bp = _bits(k1), _bits(k2), _bits(plain)
    per_bit = b1.mean(axis=0)  # 256 positions, each over 2000 keys: sd 0.011
    assert abs(b1.mean() - 0.5) < 0.005
    assert np.all(np.abs(per_bit - 0.5) < 0.06), "a key bit is biased"
    to_other_secret = (b1 != b2).sum(axis=1)  # Hamming distances, expected 128 +- 8
    to_unkeyed = (b1 != bp).sum(axis=1)
    for d in (to_other_secret, to_unkeyed):
        assert abs(d.mean() - 128) < 1.5 and d.min() > 80
    # One pixel changed: about half the key bits flip (no structure an attacker could follow).
    flipped = []
    for im in imgs[:200]:
        other = im.copy()
        other[0, 0, 0] ^= 1
        a = image_key(im, namespace="m", algorithm="blake2b", secret=s1)
        b = image_key(other, namespace="m", algorithm="blake2b", secret=s1)
        flipped.append(int((_bits([a]) != _bits([b])).sum()))
    assert abs(np.mean(flipped) - 128) < 3
    print(f"\nkeyed mode over {n} images: mean bit {b1.mean():.4f}, bits per position in "
          f"[{per_bit.min():.3f}, {per_bit.max():.3f}], distance to another secret's key "
          f"{to_other_secret.mean():.1f} bits, to the unkeyed key {to_unkeyed.mean():.1f}, "
          f"after one pixel bit {np.mean(flipped):.1f}")
    assert KeyHasher("blake2b", s1).image_key(imgs[0], namespace="m") == k1[0]
    rel.report("isolation/keyed-mode", runs=n, faults=0, wrong=0, failed=0, collisions=0,
               mean_bit=round(float(b1.mean()), 4),
               distance_to_other_secret=round(float(to_other_secret.mean()), 1),
               distance_to_unkeyed=round(float(to_unkeyed.mean()), 1))


def test_the_api_takes_no_client_supplied_ids():
    """The only way to name an entry is a key, and keys come from content (image_key): no
    parameter of the public API accepts an image id, a URL or a client's hash."""
    cache_params = {
        name: list(inspect.signature(getattr(FeatureCache, name)).parameters)
        for name in ("put", "get", "acquire", "lease", "discard")
    }
    assert cache_params == {  # put's namespace and cost are recorded in the metadata, never a key
        "put": ["self", "key", "features", "meta", "namespace", "block", "cost_s"],
        "get": ["self", "key"],
        "acquire": ["self", "key"], "lease": ["self", "key"], "discard": ["self", "key"],
    }
    assert list(inspect.signature(image_key).parameters) == [
        "image", "namespace", "params", "algorithm", "secret"]


def test_image_files_cannot_plant_the_frontends_key_hint():
    """The lmdeploy frontend takes a decoded image's key from ``image.info["featcache_key"]``
    when it is bytes (set by featcache itself for images it keyed by their encoded bytes).
    A client controls image files: metadata in PNG text chunks (tEXt, zTXt, iTXt), JPEG and GIF
    comments and EXIF must never arrive there as bytes after decoding."""
    name = "featcache_key"
    try:
        from featcache.lmdeploy.request.sources import KEY_INFO
    except ImportError:
        KEY_INFO = name
    assert KEY_INFO == name, "the hint's name changed: update this test"
    forged = b"\x00" * 16
    img = Image.fromarray(images(1)[0])
    files = {}
    info = PngImagePlugin.PngInfo()
    info.add_text(name, forged.decode("latin-1"))
    info.add_text(name, "x", zip=True)
    info.add_itxt(name, "y")
    buf = io.BytesIO()
    img.save(buf, format="PNG", pnginfo=info)
    files["png-text-chunks"] = buf.getvalue()
    raw = bytearray(files["png-text-chunks"])  # a tEXt chunk whose key is exactly the name
    chunk = name.encode() + b"\x00" + forged
    body = b"tEXt" + chunk
    raw[33:33] = len(chunk).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")
    files["png-raw-text"] = bytes(raw)
    for fmt, kwargs in (("JPEG", {"comment": forged}), ("GIF", {"comment": forged}),
                        ("WEBP", {"exif": forged}), ("TIFF", {})):
        buf = io.BytesIO()
        img.save(buf, format=fmt, **kwargs)
        files[fmt.lower()] = buf.getvalue()
    planted = []
    for what, data in files.items():
        for decoded in (Image.open(io.BytesIO(data)), Image.open(io.BytesIO(data)).convert("RGB")):
            if isinstance(decoded.info.get(KEY_INFO), (bytes, bytearray)):
                planted.append(what)
    assert planted == [], f"an image file set info[{KEY_INFO!r}] to bytes: {planted}"
