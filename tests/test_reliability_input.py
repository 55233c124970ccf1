"""Hostile input: images given to ``image_key``, values planted in the store, and code paths
that could run what a store holds.

``image_key`` takes decoded images (PIL, uint8 arrays) or encoded bytes, which it hashes as
given: decoding is the caller's. Here: every PIL mode keys or raises a clear error; damaged files
opened lazily raise ValueError; encoded bytes are never decoded; a large image keys in bounded
time. Stored values: headers fuzzed (hypothesis) never crash the disk reader nor make it
allocate more than the value holds; no pickle, marshal, eval or torch.load anywhere in the
package, and a pickle planted in the store is reported corrupt (or served as the raw bytes it
is), never run. Caller input (issue 11): keys, tensors, metadata, sizes and options that the
cache cannot store or use are refused at the call with TypeError/ValueError naming them; a disk
batch skips an op LMDB cannot hold; disk budgets beyond the address space open with a smaller
map or raise StoreOpenError naming ``disk_bytes``.

Already proven elsewhere: empty/float/4-D arrays, empty bytes and non-image types raise
(tests/test_keys.py::test_bad_images_raise_clear_errors); random byte strings and headers with
a valid magic never crash ``codec.verify`` (tests/test_codec.py::test_fuzzed_*); a header
declaring more than the value holds is rejected before any allocation
(tests/test_codec.py::test_header_declaring_more_than_the_value_holds_...); a feature tensor
too large for every tier is not stored and reads miss
(tests/test_cache.py::test_a_put_too_large_for_every_tier_removes_the_old_value).
"""

from __future__ import annotations

import ast
import dataclasses
import io
import math
import os
import pickle
import random
import re
import struct
import time
import warnings
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

import featcache
from featcache import CacheConfig, FeatureCache, codec, image_key, parse_bytes
from featcache.store import env as store_env
from featcache.store import layout
from featcache.tiers.disk import DiskOp, DiskTier

try:
    import _lmdeploy_stack
    import _reliability as rel
except ImportError:  # tests/ became a package
    from tests import _lmdeploy_stack
    from tests import _reliability as rel

PIL_MODES = ["1", "L", "P", "RGB", "RGBA", "CMYK", "YCbCr", "LAB", "HSV", "I", "F", "LA", "PA",
             "RGBX", "RGBa", "La", "I;16", "I;16L", "I;16B", "I;16N"]


# -- images --------------------------------------------------------------------------------------
def test_every_pil_mode_keys_or_raises_a_clear_error():
    """Every mode this Pillow offers: a 16-byte key, distinct per mode even for the same bytes,
    stable across calls; or TypeError/ValueError."""
    rng = np.random.default_rng(0)
    keys: dict[str, bytes] = {}
    refused: dict[str, str] = {}
    for mode in PIL_MODES:
        probe = Image.new(mode, (7, 5))
        raw = rng.integers(0, 256, len(probe.tobytes()), dtype=np.uint8).tobytes()
        img = Image.frombytes(mode, (7, 5), raw)
        if mode in ("P", "PA"):
            img.putpalette(list(range(256)) * 3)
        try:
            k = image_key(img, namespace="modes")
        except (TypeError, ValueError) as e:
            refused[mode] = str(e)
            continue
        assert len(k) == 32 and k == image_key(img.copy(), namespace="modes")
        keys[mode] = k
    assert len(set(keys.values())) == len(keys), "two modes gave the same key"
    # Same pixel bytes, another mode of the same size: another key.
    a = Image.frombytes("I;16L", (4, 4), bytes(range(32)))
    b = Image.frombytes("I;16B", (4, 4), bytes(range(32)))
    assert image_key(a) != image_key(b)
    for mode in ("BGR;15", "RGB;15", "no-such-mode"):  # modes Pillow itself refuses
        with pytest.raises(ValueError):
            Image.new(mode, (2, 2))
    rel.report("input/pil-modes", runs=len(PIL_MODES), faults=0, wrong=0, failed=0,
               keyed=len(keys), refused_clearly=len(refused))


def _encoded() -> dict[str, bytes]:
    rng = np.random.default_rng(1)
    img = Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
    out = {}
    for fmt in ("PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP", "PPM", "TGA"):
        buf = io.BytesIO()
        img.save(buf, format=fmt)
        out[fmt] = buf.getvalue()
    return out


@pytest.mark.parametrize("load_truncated", [False, True])
def test_damaged_files_opened_lazily_raise_value_error_never_anything_else(
    monkeypatch, load_truncated
):
    """Truncated and garbage-tailed files of 8 formats: what PIL's lazy Image.open accepts,
    image_key either keys (the part PIL decoded) or refuses with ValueError. With PIL's
    ``LOAD_TRUNCATED_IMAGES`` (which lmdeploy turns on when imported) PIL pads truncated data
    instead of failing, and the padded image is keyed."""
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", load_truncated)
    rng = random.Random(3)
    outcomes = {"keyed": 0, "value_error": 0, "open_refused": 0, "other": 0}
    for data in _encoded().values():
        for frac in (0.1, 0.25, 0.5, 0.9, 0.99):
            cut = max(1, int(len(data) * frac))
            for blob in (data[:cut], data[:cut] + rng.randbytes(len(data) - cut)):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        img = Image.open(io.BytesIO(blob))
                except Exception:  # the caller's decoder refused it: not image_key's business
                    outcomes["open_refused"] += 1
                    continue
                try:
                    image_key(img)
                    outcomes["keyed"] += 1
                except ValueError:
                    outcomes["value_error"] += 1
                except Exception:
                    outcomes["other"] += 1
    assert outcomes["other"] == 0, outcomes
    assert outcomes["value_error"] > 0 or load_truncated
    rel.report(f"input/damaged-files (LOAD_TRUNCATED_IMAGES={load_truncated})",
               runs=sum(outcomes.values()), faults=sum(outcomes.values()), wrong=0,
               failed=outcomes["other"], **outcomes)


def test_encoded_bytes_are_hashed_never_decoded(monkeypatch):
    def no_decoding(*args, **kwargs):
        raise AssertionError("image_key decoded encoded bytes")

    monkeypatch.setattr(Image, "open", no_decoding)
    rng = random.Random(5)
    samples = [
        *(d[: len(d) // 2] for d in _encoded().values()),  # truncated files
        rng.randbytes(1), rng.randbytes(4096),  # garbage
        b"\x89PNG\r\n\x1a\n" + b"\xff" * 100,  # a PNG signature and nothing valid
        pickle.dumps({"evil": True}),
    ]
    keys = {image_key(s, namespace="raw") for s in samples}
    keys |= {image_key(bytearray(samples[0]), namespace="raw"),
             image_key(memoryview(samples[1]), namespace="raw")}
    assert len(keys) == len(samples)  # bytes, bytearray and memoryview of the same bytes agree
    with pytest.raises(TypeError):
        image_key(memoryview(np.arange(10, dtype=np.uint8))[::2])  # not contiguous: refused


def test_a_large_image_keys_in_bounded_time_and_zero_sizes_are_refused():
    big = np.zeros((4096, 4096, 3), dtype=np.uint8)  # 48 MiB of pixels
    big[::7, ::11] = 255
    started = time.perf_counter()
    k = image_key(big)
    array_s = time.perf_counter() - started
    started = time.perf_counter()
    assert image_key(Image.fromarray(big)) != k  # a PIL image and an array are other kinds
    pil_s = time.perf_counter() - started
    assert array_s < 2.0 and pil_s < 5.0, (array_s, pil_s)
    for bad in (np.zeros((0, 5, 3), np.uint8), np.zeros((5, 0), np.uint8), b"", bytearray()):
        with pytest.raises(ValueError):
            image_key(bad)
    for size in ((0, 5), (5, 0), (0, 0)):
        with pytest.raises(ValueError):
            image_key(Image.new("RGB", size))
    print(f"\nkeying a 4096x4096 RGB image: {array_s * 1000:.0f} ms as an array, "
          f"{pil_s * 1000:.0f} ms as a PIL image")


# -- values in the store -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    t = DiskTier(tmp_path_factory.mktemp("fuzz") / "store", 1 << 30, sync=False)
    yield t
    t.close()


@st.composite
def hostile_values(draw) -> bytes:
    """Values whose checksum is right (so the reader gets past it) but whose header fields are
    anything: consistent with the payload, or not."""
    consistent = draw(st.booleans())
    code = draw(st.sampled_from(sorted(codec.DTYPES)) if consistent else st.integers(0, 255))
    meta = draw(st.binary(max_size=64))
    payload = draw(st.binary(max_size=512))
    if consistent and code in codec.DTYPES:
        item = codec.DTYPES[code][1]
        payload = payload[: len(payload) // item * item]
        shape = [len(payload) // item]
        ndim, nbytes, meta_len = 1, len(payload), len(meta)
        version = codec.FORMAT_VERSION
    else:
        ndim = draw(st.integers(0, 255))
        shape = draw(st.lists(st.integers(0, 2**64 - 1), min_size=0, max_size=8))
        nbytes = draw(st.integers(0, 2**64 - 1))
        meta_len = draw(st.integers(0, 2**32 - 1))
        version = draw(st.sampled_from([codec.FORMAT_VERSION, 1, 3, 0xFFFF]))
    dims = (shape + [0] * 8)[:8]
    prefix = codec._PREFIX.pack(codec.MAGIC, version, code, ndim, meta_len, 0, nbytes, *dims)
    value = prefix + codec.checksum(prefix, meta, payload) + meta + payload
    cut = draw(st.one_of(st.none(), st.integers(0, len(value))))
    return value if cut is None else value[:cut]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=hostile_values())
def test_fuzzed_stored_values_never_crash_the_reader_nor_over_allocate(tier, value):
    key = b"fuzz"
    assert tier.write_batch([DiskOp("put", key, value)]) == 1
    asked: list[int] = []

    def alloc(nbytes: int) -> torch.Tensor:
        asked.append(nbytes)
        assert nbytes <= len(value), f"asked for {nbytes} bytes, the value holds {len(value)}"
        return torch.empty(nbytes, dtype=torch.uint8)

    corrupt = tier.stats()["corrupt"]
    entry = tier.get(key, alloc)  # never raises
    if entry is None:
        assert tier.stats()["corrupt"] == corrupt + 1 and asked == []
        return
    header = codec.decode_header(value)
    assert asked == [header.nbytes] and header.nbytes <= len(value) - codec.HEADER.size
    assert entry.tensor.dtype == header.dtype and tuple(entry.tensor.shape) == header.shape
    raw = entry.tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if header.nbytes else b""
    assert raw == value[header.payload_offset :]
    assert math.prod(header.shape) * entry.tensor.element_size() == header.nbytes


# -- no code from the store ----------------------------------------------------------------------
_FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle",
                      "joblib", "copyreg"}
_FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
_FORBIDDEN_ATTRS = {("torch", "load"), ("np", "load"), ("numpy", "load"), ("pickle", "loads"),
                    ("pickle", "load"), ("marshal", "loads"), ("torch", "frombuffer_pickle")}


def test_the_package_has_no_pickle_marshal_eval_or_torch_load():
    root = Path(featcache.__file__).parent
    findings = []
    files = sorted(root.rglob("*.py"))
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                findings += [f"{where} import {a.name}" for a in node.names
                             if a.name.split(".")[0] in _FORBIDDEN_MODULES]
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.split(".")[0] in _FORBIDDEN_MODULES:
                    findings.append(f"{where} from {node.module} import ...")
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in _FORBIDDEN_CALLS:
                    findings.append(f"{where} {f.id}()")
                elif (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                      and (f.value.id, f.attr) in _FORBIDDEN_ATTRS):
                    findings.append(f"{where} {f.value.id}.{f.attr}()")
                for kw in node.keywords:
                    if kw.arg == "allow_pickle":
                        findings.append(f"{where} allow_pickle=")
    assert len(files) > 10
    assert findings == [], findings
    rel.report("input/no-pickle-in-the-package", runs=len(files), faults=0, wrong=0, failed=0,
               findings=len(findings))


class _Payload:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_pickle_planted_in_the_store_is_never_run(tmp_path):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Payload(marker))
    with pytest.raises(FileNotFoundError):
        marker.stat()
    store = tmp_path / "store"
    with rel.disk_cache(store) as cache:
        cache.put(b"honest", torch.ones(4))
        cache.flush()
    tier = DiskTier(store, 64 << 20)
    try:
        # 1. the whole value is a pickle; 2. a valid header, a pickle for metadata and payload
        #    (a forger who can write the store can also compute the checksum: not a MAC).
        prefix = codec._PREFIX.pack(codec.MAGIC, codec.FORMAT_VERSION,
                                    codec.DTYPE_CODES[torch.uint8], 1, len(evil), 0, len(evil),
                                    len(evil), *[0] * 7)
        forged = prefix + codec.checksum(prefix, evil, evil) + evil + evil
        tier.write_batch([DiskOp("put", b"pickle", evil), DiskOp("put", b"forged", forged)])
    finally:
        tier.close()
    with rel.disk_cache(store) as cache:
        assert cache.get(b"pickle") is None  # not a featcache value: a miss
        assert cache.stats()["disk"]["corrupt"] == 1
        lease = cache.acquire(b"forged")  # a well-formed value: served as the bytes it holds
        assert lease is not None and lease.meta == evil
        assert lease.tensor.dtype == torch.uint8 and lease.tensor.numpy().tobytes() == evil
        lease.release()
        assert rel.same_bits(cache.get(b"honest"), torch.ones(4))
    assert not marker.exists(), "a value from the store was unpickled"
    # And the operator's marker check works: unpickling it does create the file.
    pickle.loads(evil)
    assert marker.exists()
    os.unlink(marker)
    rel.report("input/planted-pickle", runs=1, faults=2, wrong=0, failed=0, executed=0,
               reported_corrupt=1)


def test_hostile_header_lengths_are_checked_against_the_value_not_trusted():
    """The two length fields a reader could be tricked with, at their largest: rejected by
    arithmetic on the real length before anything is allocated."""
    for meta_len, nbytes in ((2**32 - 1, 0), (0, 2**64 - 1), (2**32 - 1, 2**64 - 1)):
        head = struct.pack("<4sHBBIIQ8Q16s", codec.MAGIC, codec.FORMAT_VERSION, 5, 1, meta_len, 0,
                           nbytes, nbytes, *[0] * 7, b"\0" * 16)
        with pytest.raises(featcache.CorruptEntryError):
            codec.decode_header(head + b"\0" * 32)


# -- keys the store can hold ---------------------------------------------------------------------
def test_the_longest_key_accepted_fits_every_record_the_store_writes(tmp_path):
    """Every LMDB key the disk tier writes for a cache key (its value, meta and lru records,
    the lru one 8 bytes longer) fits LMDB's 511 bytes: a 503-byte key round-trips through disk
    after a reopen, a 504-byte one is refused at ``put`` (it used to be accepted, and its lru
    record failed the whole disk batch with MDB_BAD_VALSIZE)."""
    assert layout.MAX_KEY_BYTES == layout.LMDB_MAX_KEY_BYTES - 8 == 503
    longest, value = b"k" * 503, torch.arange(6, dtype=torch.float32)
    with rel.disk_cache(tmp_path / "store") as cache:
        cache.put(longest, value)
        cache.put(b"other", torch.ones(2))
        with pytest.raises(ValueError, match="1 to 503 bytes"):
            cache.put(b"k" * 504, value)
        cache.flush()
        assert cache.stats()["disk"]["errors"] == 0
    with rel.disk_cache(tmp_path / "store") as cache:
        assert rel.same_bits(cache.get(longest), value)
        assert rel.same_bits(cache.get(b"other"), torch.ones(2))
        assert cache.stats()["disk"]["errors"] == 0


def test_a_batch_with_an_op_lmdb_cannot_hold_lands_the_rest_and_counts_a_drop(tmp_path):
    """``DiskTier.write_batch`` skips an op whose key (empty, over ``MAX_KEY_BYTES``) or value
    (over LMDB's 4 GiB - 1) cannot be stored: the put counts as a drop, the other ops of its
    batch land, and the key's older value is not served. (Before: MDB_BAD_VALSIZE failed the
    whole batch and dropped every put of it.)"""

    class Huge:  # a value LMDB refuses, without allocating 4 GiB
        def __len__(self) -> int:
            return layout.MAX_VALUE_BYTES + 1

    good = {b"a": codec.encode(torch.uint8, (3,), b"abc"), b"b": codec.encode(torch.uint8, (2,), b"de")}
    tier = DiskTier(tmp_path / "store", 8 << 30, sync=False)
    try:
        assert tier.write_batch([DiskOp("put", b"big", good[b"a"])]) == 1
        ops = [DiskOp("put", b"a", good[b"a"]), DiskOp("put", b"x" * 504, good[b"a"]),
               DiskOp("put", b"", good[b"a"]), DiskOp("touch", b"y" * 600),
               DiskOp("discard", b"z" * 600), DiskOp("put", b"big", Huge()),  # type: ignore[arg-type]
               DiskOp("put", b"b", good[b"b"])]
        assert tier.write_batch(ops) == 2
        stats = tier.stats()
        assert (stats["drops"], stats["errors"], stats["entries"]) == (3, 0, 2)
        assert tier.get(b"a").tensor.numpy().tobytes() == b"abc"
        assert tier.get(b"b").tensor.numpy().tobytes() == b"de"
        assert tier.get(b"big") is None  # its older value was deleted, not left behind
    finally:
        tier.close()
    rel.report("input/unstorable-ops-in-a-batch", runs=1, faults=5, wrong=0, failed=0,
               landed=2, dropped=3)


def test_bad_keys_are_refused_by_every_call_and_contained_by_none(tmp_path):
    """``key in cache`` is False for a key ``put`` would refuse and counts nothing (it used to
    ask LMDB, which counted a disk error); every other call raises TypeError/ValueError."""
    with rel.disk_cache(tmp_path / "store", host_bytes="1MiB") as cache:
        cache.put(b"k", torch.ones(2))
        cache.flush()
        before = cache.stats()
        for bad in (b"", b"x" * 504, b"x" * 600, "k", bytearray(b"k"), None, 5):
            assert bad not in cache
            for call in (cache.get, cache.acquire, cache.lease, cache.discard,
                         lambda key: cache.put(key, torch.ones(2))):
                with pytest.raises((TypeError, ValueError), match="key"):
                    call(bad)
        assert cache.stats() == before
        for meta, error in (("text", TypeError), (bytearray(b"m"), TypeError),
                            (b"m" * (codec.MAX_META_BYTES + 1), ValueError)):
            with pytest.raises(error, match="meta"):
                cache.put(b"m", torch.ones(2), meta=meta)  # type: ignore[arg-type]
        assert b"m" not in cache and cache.stats()["cache"]["puts"] == before["cache"]["puts"]


# -- tensors the cache can store -----------------------------------------------------------------
def _refused_tensors() -> dict[str, torch.Tensor]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prototype/beta/deprecated kinds: exactly what is probed
        return _make_refused(fake)


def _make_refused(fake: torch.Tensor) -> dict[str, torch.Tensor]:
    kinds = {
        "meta": torch.empty(3, device="meta"),
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "nested-jagged": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                                    layout=torch.jagged),
        "sparse-coo": torch.eye(3).to_sparse(),
        "sparse-csr": torch.eye(3).to_sparse_csr(),
        "quantized": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
        "complex": torch.ones(2, dtype=torch.complex64).conj(),  # conj bit: a complex dtype
        "fake": fake,
    }
    if torch.backends.mkldnn.is_available():
        kinds["mkldnn"] = torch.ones(2, 2).to_mkldnn()
    return kinds


def test_tensors_the_cache_cannot_store_are_refused_at_put(tmp_path):
    """Meta and nested tensors used to raise NotImplementedError from ``put`` or fail in the
    background (``worker_errors``); they, sparse/mkldnn layouts, quantized and complex dtypes,
    FakeTensors and functorch-wrapped tensors are refused at ``put`` with a TypeError saying
    what is allowed, and nothing is stored or counted as a worker error."""
    with rel.disk_cache(tmp_path / "store", device_bytes="1MiB", host_bytes="1MiB") as cache:
        for name, tensor in _refused_tensors().items():
            with pytest.raises(TypeError, match="cannot be cached") as raised:
                cache.put(name.encode(), tensor)
            assert "meta tensors hold no data" in str(raised.value) or name != "meta"
        with pytest.raises(TypeError, match="outside the transform"):
            torch.vmap(lambda t: cache.put(b"vmap", t) or t)(torch.ones(2, 3))
        cache.flush()
        stats = cache.stats()
        assert stats["cache"]["worker_errors"] == 0 and stats["cache"]["puts"] == 0
        assert all(name.encode() not in cache for name in _refused_tensors())


def test_neg_views_round_trip_bit_identically_from_every_tier(tmp_path):
    """A tensor with the negative bit set (``torch._neg_view``: its storage holds the values
    negated) is stored as its values: from the device, the host and the disk after a reopen.
    (Before: its raw bytes were read, so the copy down failed and the device tier served the
    lazy view.)"""
    base = torch.arange(-3, 5, dtype=torch.float32).reshape(2, 4)
    expected = base.neg()  # the values the view shows, materialised
    assert torch._neg_view(base).is_neg()
    served = {}
    with rel.disk_cache(tmp_path / "store", device_bytes="1MiB") as cache:  # the device tier
        cache.put(b"n", torch._neg_view(base))
        served["device"] = cache.get(b"n")
        cache.flush()
        assert cache.stats()["cache"]["worker_errors"] == 0
    with rel.disk_cache(tmp_path / "store", host_bytes="1MiB") as cache:  # the host tier
        cache.put(b"h", torch._neg_view(base))
        cache.flush()
        served["host"] = cache.get(b"h")
        assert cache.stats()["host"]["hits"] == 1
    with rel.disk_cache(tmp_path / "store") as cache:  # disk, after the reopen
        served["disk"] = cache.get(b"n")
        assert cache.stats()["disk"]["hits"] == 1
    for tier, tensor in served.items():
        assert tensor is not None and not tensor.is_neg(), tier
        assert rel.same_bits(tensor, expected), tier
    rel.report("input/neg-view-tensors", runs=3, faults=3, wrong=0, failed=0)


# -- sizes and options ---------------------------------------------------------------------------
def test_sizes_are_parsed_exactly_and_bounded():
    assert parse_bytes("2.01kB") == 2010  # float: 2009
    assert parse_bytes("8388607.99999999999999999999999TiB") == 2**63 - 1
    for bad in ("9" * 400 + "TiB", "8388608TiB", 2**63, 2**64):
        with pytest.raises(ValueError, match=r"too large: at most 9223372036854775807 bytes"):
            parse_bytes(bad)  # "9" * 400: OverflowError before (float -> inf -> int)
    for bad in ("nan", "inf", "1e9"):
        with pytest.raises(ValueError, match="cannot parse size"):
            parse_bytes(bad)


SIZE_ARGS = ["device_bytes", "host_bytes", "disk_bytes", "host_slab_bytes", "remote_chunk_bytes"]


@pytest.mark.parametrize("name", SIZE_ARGS)
def test_size_arguments_of_the_wrong_type_or_out_of_range_name_the_argument(tmp_path, name):
    """A float size raised a bare AssertionError, 2**64 an OverflowError: now TypeError /
    ValueError naming the argument and what it takes."""
    def make(value: object) -> None:
        FeatureCache(device="cpu", disk_path=tmp_path / "store", **{name: value}).close()

    with pytest.raises(TypeError, match=rf"^{name} must be an int or a string like '64MiB', not "
                                        r"the float 2500000000.0: pass int\(2500000000.0\) or a "
                                        r"string such as '2.5GB'"):
        make(2.5e9)
    for value in (float("nan"), True, [1], b"1MiB"):
        with pytest.raises(TypeError, match=rf"^{name} must be an int or a string like '64MiB'"):
            make(value)
    for value in (2**64, "9" * 400 + "TiB", -1, "lots"):
        with pytest.raises(ValueError, match=rf"^{name}: "):
            make(value)
    with pytest.raises(TypeError, match=rf"^{name} must be an int number of bytes"):
        CacheConfig(**{**dataclasses.asdict(CacheConfig.create(device="cpu")), name: 1.5})
    with pytest.raises(ValueError, match=rf"^{name} must be 0 to 9223372036854775807 bytes"):
        CacheConfig(**{**dataclasses.asdict(CacheConfig.create(device="cpu")), name: 2**63})


@pytest.mark.parametrize("option, value, words", [
    ("demote_queue_entries", "x", "demote_queue_entries must be an int, not str"),
    ("disk_queue_entries", True, "disk_queue_entries must be an int, not bool"),
    ("remote_queue_entries", 2.0, "remote_queue_entries must be an int, not float"),
    ("remote_ttl_s", "1", "remote_ttl_s must be an int"),
    ("remote_timeout_ms", 1.5, "remote_timeout_ms must be an int"),
    ("disk_sync", "no", "disk_sync must be True or False"),
    ("remote_prefix", 5, "remote_prefix must be a string"),
    ("remote_url", 5, "remote_url must be a string or None"),
    ("device", 5, "device must be a string like 'cuda:0' or 'cpu'"),
    ("disk_path", b"/tmp/store", "disk_path must be a str or a path-like of str"),
])
def test_options_of_the_wrong_type_raise_type_errors_naming_them(option, value, words):
    """These used to fail comparisons with a raw TypeError, or pass (bool, float)."""
    with pytest.raises(TypeError, match=re.escape(words)):
        FeatureCache(**{"device": "cpu", option: value})


def test_an_unknown_device_string_is_a_value_error():
    with pytest.raises(ValueError, match="device must be 'cuda\\[:N\\]' or 'cpu', not 'gpu'"):
        FeatureCache(device="gpu")  # torch's RuntimeError before


# -- disk budgets beyond the address space -------------------------------------------------------
TiB = 1 << 40


def _lmdb_maps_at_most(monkeypatch, limit: int) -> list[int]:
    """Make ``lmdb.open`` fail with ENOMEM for maps over ``limit`` (as mmap does past the address
    space) and open smaller ones for real, with a small map; returns the sizes asked for."""
    real_open, asked = lmdb.open, []

    def fake_open(path, map_size, **kwargs):
        asked.append(map_size)
        if map_size > limit:
            raise lmdb.MemoryError(f"{path}: Cannot allocate memory")
        return real_open(path, map_size=min(map_size, 64 << 20), **kwargs)

    monkeypatch.setattr(lmdb, "open", fake_open)
    return asked


def test_a_disk_budget_beyond_the_address_space_falls_back_to_a_smaller_map(tmp_path,
                                                                                monkeypatch):
    """64 TiB used to fail with "Cannot allocate memory" (a map of twice the budget): the map
    falls back to smaller sizes, down to budget + data file + headroom."""
    asked = _lmdb_maps_at_most(monkeypatch, 100 * TiB)
    with rel.disk_cache(tmp_path / "store", "64TiB") as cache:
        cache.put(b"k", torch.ones(3))
        cache.flush()
        assert rel.same_bits(cache.get(b"k"), torch.ones(3))
    floor = store_env.map_size_floor(64 * TiB)
    assert asked == [128 * TiB, floor] and 72 * TiB < floor < 100 * TiB
    # A small budget under a small address space (ulimit -v): halved from the 1 TiB default.
    asked = _lmdb_maps_at_most(monkeypatch, 8 << 30)
    DiskTier(tmp_path / "small", 1 << 30).close()
    assert asked == [TiB >> i for i in range(8)]


def test_a_disk_budget_that_cannot_be_mapped_raises_store_open_error_naming_disk_bytes(
    tmp_path, monkeypatch
):
    asked = _lmdb_maps_at_most(monkeypatch, 50 * TiB)
    floor = store_env.map_size_floor(64 * TiB)
    with pytest.raises(featcache.StoreOpenError,
                       match=rf"disk_bytes={64 * TiB} \(64.0 TiB\): LMDB must map at least {floor} "
                             r"bytes .* lower disk_bytes"):
        rel.disk_cache(tmp_path / "store", "64TiB")
    assert asked == [128 * TiB, floor]


def test_huge_disk_budgets_open_or_raise_store_open_error_never_anything_else(tmp_path):
    """For real (no patched LMDB): 64 TiB opens if this machine can map it; the largest budget
    accepted (2**63-1 bytes) cannot be mapped anywhere; 2**64 is refused at config time (it was
    an OverflowError from LMDB)."""
    try:
        with rel.disk_cache(tmp_path / "a", "64TiB") as cache:
            cache.put(b"k", torch.ones(3))
            cache.flush()
            assert rel.same_bits(cache.get(b"k"), torch.ones(3))
    except featcache.StoreOpenError as e:
        assert "disk_bytes=" in str(e)
    with pytest.raises(featcache.StoreOpenError, match="disk_bytes=9223372036854775807"):
        rel.disk_cache(tmp_path / "b", 2**63 - 1)
    with pytest.raises(ValueError, match="^disk_bytes: size 18446744073709551616 is too large"):
        rel.disk_cache(tmp_path / "c", 2**64)


def test_a_bad_disk_bytes_on_the_command_line_is_one_line_not_a_traceback(tmp_path, capsys,
                                                                          monkeypatch):
    _lmdeploy_stack.need("lmdeploy")  # serve and warm are lmdeploy's commands (absent on the GPU box)
    from featcache.cli import main as cli

    with pytest.raises(SystemExit) as exited:  # argparse's one-line usage error
        cli(["serve", "m", "--disk-bytes", "9" * 400 + "TiB"])
    assert exited.value.code == 2 and "too large" in capsys.readouterr().err
    image = tmp_path / "a.png"
    Image.new("RGB", (4, 4)).save(image)
    argv = ["warm", "some/model", str(image), "--cache-dir", str(tmp_path / "store")]
    import featcache.cli.serving as serving

    monkeypatch.setattr(serving, "model_problem", lambda model: None)  # the store fails first
    monkeypatch.setattr(serving, "arch_problem", lambda *a: None)  # (no config to read: a stand-in)
    monkeypatch.setattr(serving, "cuda_problem", lambda: None)
    assert cli([*argv, "--disk-bytes", "9" * 400 + "TiB"]) == 2  # OverflowError before
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "too large" in err
    _lmdb_maps_at_most(monkeypatch, 1 << 30)
    assert cli([*argv, "--disk-bytes", "64TiB"]) == 1  # StoreOpenError's traceback before
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "disk_bytes=" in err
