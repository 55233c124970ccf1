"""A cache keys with keyed BLAKE3 under a secret kept with its store (or the remote tier, or a file):
keys nobody else can predict or collide, the same in every process that shares the store."""

import multiprocessing
import os
import stat
from pathlib import Path

import _redis
import pytest
import torch

from featcache import FeatureCache, image_key
from featcache.keys import KeyHasher
from featcache.keysecret import SECRET_FILE, read_secret

IMAGE = b"\x89PNG not really, but bytes are keyed as given" * 10


def store(path: Path, **options) -> FeatureCache:
    return FeatureCache(device="cpu", device_bytes="1MiB", host_bytes=0, disk_path=path,
                        disk_bytes="16MiB", **options)


def test_a_store_keys_with_its_own_secret_made_at_first_open(tmp_path):
    with store(tmp_path / "a") as a:
        key = a.image_key(IMAGE, namespace="m")
        assert a.hasher.algorithm == "blake3" and a.hasher.keyed
        a.put(key, torch.ones(2))
    info = os.stat(tmp_path / "a" / SECRET_FILE)
    assert stat.S_IMODE(info.st_mode) == 0o600
    with store(tmp_path / "a") as again:  # a restart: the same keys, the entry found
        assert again.image_key(IMAGE, namespace="m") == key
        assert torch.equal(again.get(key), torch.ones(2))
    with store(tmp_path / "b") as b:  # another store: another secret, unpredictable keys
        assert b.image_key(IMAGE, namespace="m") != key
    assert key != image_key(IMAGE, namespace="m")  # not the unkeyed digest anyone can compute
    assert key != image_key(IMAGE, namespace="m", algorithm="xxh3_128")


def test_a_memory_only_cache_keys_with_a_secret_of_its_own():
    with FeatureCache(device="cpu", host_bytes=0) as a, FeatureCache(device="cpu", host_bytes=0) as b:
        assert a.hasher.keyed and a.image_key(IMAGE) != b.image_key(IMAGE)


def test_xxh3_is_an_explicit_opt_in(tmp_path):
    with store(tmp_path / "s", key_algorithm="xxh3_128") as cache:
        key = cache.image_key(IMAGE, namespace="m")
        assert len(key) == 16 and not cache.hasher.keyed
        assert key == image_key(IMAGE, namespace="m", algorithm="xxh3_128")
    with pytest.raises(ValueError, match="key_algorithm"):
        store(tmp_path / "t", key_algorithm="md5")


def test_a_secret_file_names_the_secret(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(bytes(range(32)).hex() + "\n")
    with store(tmp_path / "a", key_secret_file=str(secret)) as a, \
            store(tmp_path / "b", key_secret_file=str(secret)) as b:
        assert a.image_key(IMAGE) == b.image_key(IMAGE) == \
            KeyHasher("blake3", bytes(range(32))).image_key(IMAGE)
    made = tmp_path / "made"  # a file that does not exist yet is created, 0600
    with store(tmp_path / "c", key_secret_file=str(made)) as c:
        assert read_secret(str(made)) == c.hasher.secret
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o600


@pytest.mark.parametrize("kind", ["garbage", "short", "link", "fifo", "directory"])
def test_a_file_that_is_no_secret_is_refused_not_replaced(tmp_path, kind):
    path = tmp_path / "secret"
    if kind == "garbage":
        path.write_bytes(b"not hex at all\n")
    elif kind == "short":
        path.write_text("abcd\n")
    elif kind == "link":
        target = tmp_path / "target"
        target.write_text(bytes(32).hex())
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)  # opened without blocking, then refused
    else:
        path.mkdir()
    with pytest.raises((ValueError, OSError)):
        store(tmp_path / "s", key_secret_file=str(path))
    assert kind == "directory" or path.is_symlink() or path.exists()


def test_a_bad_store_secret_is_a_cache_that_still_works(tmp_path, caplog):
    (tmp_path / "s").mkdir(mode=0o700)
    (tmp_path / "s" / SECRET_FILE).write_text("zz\n")  # damaged: refused, never overwritten
    with store(tmp_path / "s") as cache:
        key = cache.image_key(IMAGE)
        cache.put(key, torch.ones(1))
        assert torch.equal(cache.get(key), torch.ones(1))
    assert "cannot keep the key secret" in caplog.text
    assert (tmp_path / "s" / SECRET_FILE).read_text() == "zz\n"


def _first_open(path: str, queue) -> None:
    with store(Path(path)) as cache:
        queue.put(cache.image_key(IMAGE).hex())


def test_processes_opening_a_new_store_at_once_agree_on_one_secret(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_first_open, args=(str(tmp_path / "s"), queue), daemon=True)
             for _ in range(4)]
    for p in procs:
        p.start()
    keys = {queue.get(timeout=120) for _ in procs}
    for p in procs:
        p.join(timeout=60)
    assert len(keys) == 1
    with store(tmp_path / "s") as cache:
        assert keys == {cache.image_key(IMAGE).hex()}


@pytest.fixture
def redis_url(tmp_path):
    server = _redis.RedisServer(_redis.redis_binary(), tmp_path)
    yield server.url
    server.kill()


def test_replicas_sharing_a_remote_tier_share_its_secret_and_their_stores_take_it(tmp_path, redis_url):
    with store(tmp_path / "a", remote_url=redis_url) as a:
        key = a.image_key(IMAGE)
    with store(tmp_path / "b", remote_url=redis_url) as b:  # another machine's store
        assert b.image_key(IMAGE) == key
    # the stores keep the fleet's secret: a start without the server keys alike
    with store(tmp_path / "b") as b_alone:
        assert b_alone.image_key(IMAGE) == key


@pytest.mark.parametrize("before", ["no store yet", "a secret of its own"])
def test_a_store_that_adopts_the_fleets_secret_keeps_it_0600(tmp_path, redis_url, before):
    """The store's file rewritten with the remote tier's secret is its owner's alone, like the
    one made at first open (under the usual umask 022, which would leave a new file 0644)."""
    old = os.umask(0o022)
    try:
        with store(tmp_path / "fleet", remote_url=redis_url) as fleet:  # the fleet's secret
            key, fleet_secret = fleet.image_key(IMAGE), fleet.hasher.secret
        if before == "a secret of its own":  # a replica that ran alone before it joined
            with store(tmp_path / "b") as alone:
                assert alone.image_key(IMAGE) != key
        with store(tmp_path / "b", remote_url=redis_url) as joined:
            assert joined.image_key(IMAGE) == key
    finally:
        os.umask(old)
    path = tmp_path / "b" / SECRET_FILE
    assert read_secret(str(path)) == fleet_secret  # adopted: the file now holds the fleet's
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in (tmp_path / "b").iterdir() if p.name.startswith(".key-secret")] == []


def test_an_unreachable_remote_leaves_the_stores_secret(tmp_path, caplog):
    with store(tmp_path / "a") as a:
        key = a.image_key(IMAGE)
    url = f"redis://127.0.0.1:{_redis.free_port()}/0"
    with store(tmp_path / "a", remote_url=url, remote_timeout_ms=100) as a:
        assert a.image_key(IMAGE) == key
    assert "cannot read the key secret from the remote tier" in caplog.text
    assert url not in caplog.text


def test_a_compacted_copy_keeps_the_secret_and_so_its_entries(tmp_path):
    from featcache.storetools.maintenance import compact
    from featcache.storetools.view import StoreView

    with store(tmp_path / "s") as cache:
        key = cache.image_key(IMAGE)
        cache.put(key, torch.arange(4.0))
    with StoreView(tmp_path / "s") as view:
        compact(view, tmp_path / "copy")
    assert stat.S_IMODE(os.stat(tmp_path / "copy" / SECRET_FILE).st_mode) == 0o600
    with store(tmp_path / "copy") as copy:
        assert copy.image_key(IMAGE) == key
        assert torch.equal(copy.get(key), torch.arange(4.0))
