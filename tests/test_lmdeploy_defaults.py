"""featcache.lmdeploy.default_cache(): the budgets and directory docs/lmdeploy.md promises."""

import os

import _lmdeploy_stack
import torch

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

from featcache.lmdeploy import default_cache  # noqa: E402


def test_default_cache_budgets_and_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCACHE_DIR", str(tmp_path / "store"))
    st = os.statvfs(tmp_path)  # before: the store's own files may take a little space
    cache = default_cache()
    try:
        cfg = cache.config
        assert cfg.disk_path == str(tmp_path / "store") and os.path.isdir(cfg.disk_path)
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert cfg.host_bytes == min(8 << 30, ram // 10)
        assert 0 < cfg.disk_bytes <= min(32 << 30, st.f_bavail * st.f_frsize // 2)
        if torch.cuda.is_available():
            assert 0 < cfg.device_bytes <= 2 << 30
        else:
            assert cfg.device_bytes == 0 and cache.device.type == "cpu"
        assert oct(os.stat(cfg.disk_path).st_mode & 0o777) == "0o700"
    finally:
        cache.close()
