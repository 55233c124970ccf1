"""The namespace given through the core API is recorded where the store tools read it (issue 18:
entries made through the Python API used to show namespace "-")."""

from __future__ import annotations

import json

import pytest
import torch

from featcache import FeatureCache, image_key
from featcache.cli import main
from featcache.entrymeta import namespace_of, with_namespace


@pytest.fixture
def cache(tmp_path):
    with FeatureCache(device="cpu", device_bytes="1MiB", host_bytes=0, disk_path=str(tmp_path / "s"),
                      disk_bytes="64MiB") as c:
        yield c


def _ls(path, capsys, *args) -> list[dict]:
    assert main(["ls", str(path), "--json", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_put_and_get_or_compute_record_the_namespace_for_ls_and_purge(cache, tmp_path, capsys):
    a = image_key(b"image a", namespace="model-A")
    b = image_key(b"image b", namespace="model-B")
    cache.put(a, torch.ones(4), namespace="model-A")
    cache.get_or_compute(b, lambda: torch.zeros(4), namespace="model-B")
    cache.put(b"c" * 16, torch.ones(2))  # plain bytes, no namespace=: none recorded
    lease = cache.acquire(a)
    assert lease is not None and json.loads(lease.meta) == {"ns": "model-A"}
    lease.release()
    cache.close()  # (the tools open the store themselves: LMDB allows one open per process)
    store = tmp_path / "s"
    assert sorted(str(e["namespace"]) for e in _ls(store, capsys)) == ["None", "model-A", "model-B"]
    assert [e["key"] for e in _ls(store, capsys, "--namespace", "model-B")] == [b.hex()]
    assert main(["purge", str(store), "--namespace", "model-A", "--yes"]) == 0
    capsys.readouterr()
    assert sorted(str(e["namespace"]) for e in _ls(store, capsys)) == ["None", "model-B"]


def test_a_json_object_meta_gets_the_namespace_added(cache):
    key = image_key(b"x", namespace="m")
    cache.put(key, torch.ones(1), meta=b'{"tokens": 7}', namespace="m")
    lease = cache.acquire(key)
    assert lease is not None and json.loads(lease.meta) == {"ns": "m", "tokens": 7}
    lease.release()


@pytest.mark.parametrize("meta, namespace, error", [
    (b"\x00opaque", "m", ValueError),       # nowhere to record it
    (b"[1, 2]", "m", ValueError),           # JSON, but not an object
    (b'{"ns": "other"}', "m", ValueError),  # records another namespace
    (None, "", TypeError),
    (None, 3, TypeError),
])
def test_what_cannot_record_a_namespace_is_refused_and_nothing_is_stored(cache, meta, namespace, error):
    key = image_key(b"y", namespace="m")
    with pytest.raises(error):
        cache.put(key, torch.ones(1), meta=meta, namespace=namespace)
    assert key not in cache


def test_with_namespace_round_trips_through_the_tools_reader() -> None:
    assert namespace_of(with_namespace(None, "ns-1")) == "ns-1"
    assert namespace_of(with_namespace(b'{"ns": "ns-1", "a": 1}', "ns-1")) == "ns-1"


def test_a_key_from_image_key_carries_its_namespace_into_the_entry(cache, tmp_path, capsys) -> None:
    import pickle

    key = image_key(b"photo", namespace="org/model@rev")
    assert key == bytes(key) and hash(key) == hash(bytes(key)) and key.namespace == "org/model@rev"
    assert pickle.loads(pickle.dumps(key)).namespace == "org/model@rev"
    cache.put(key, torch.ones(3))  # no namespace= needed
    opaque = image_key(b"other", namespace="org/model@rev")
    cache.put(opaque, torch.ones(3), meta=b"\x00user bytes")  # the caller's metadata wins
    lease = cache.acquire(opaque)
    assert lease is not None and lease.meta == b"\x00user bytes"
    lease.release()
    cache.close()
    found = {e["key"]: e["namespace"] for e in _ls(tmp_path / "s", capsys)}
    assert found == {key.hex(): "org/model@rev", opaque.hex(): None}
