"""The store's settings: one frozen dataclass, validated at construction, units in the names."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .sizes import parse_bytes

# The one table of defaults (sizes as people write them; parsed by CacheConfig.create).
DEFAULTS: dict[str, int | str | bool | None] = {
    "device_bytes": "1GiB",
    "host_bytes": "4GiB",
    "disk_path": None,
    "disk_bytes": "64GiB",
    "host_slab_bytes": "256MiB",
    "demote_queue_entries": 64,
    "disk_queue_entries": 64,
    "disk_sync": True,
}


ENV_DIR = "FEATCACHE_DIR"
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "featcache")


def default_store_dir() -> str:
    """Where a store lives when none is named: ``$FEATCACHE_DIR``, else ``~/.cache/featcache``
    (the CLI's default and ``featcache.lmdeploy.default_cache()``'s)."""
    return os.environ.get(ENV_DIR) or DEFAULT_DIR


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class CacheConfig:
    device: str
    device_bytes: int
    host_bytes: int
    disk_path: str | None
    disk_bytes: int
    host_slab_bytes: int = 256 << 20  # pinned memory is taken in slabs of this size, lazily
    demote_queue_entries: int = 64  # device->host copies waiting; beyond this, copies are dropped
    disk_queue_entries: int = 64  # disk writes waiting; beyond this, writes are dropped
    disk_sync: bool = True  # fsync each disk transaction (metadata sync is always off)

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "disk_bytes", "host_slab_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of bytes, got {value!r}")
        for name in ("demote_queue_entries", "disk_queue_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but CUDA is not available here")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda[:N]' or 'cpu', not {self.device!r}")

    @classmethod
    def create(
        cls,
        device: str | torch.device | None = None,
        device_bytes: int | str | None = None,
        host_bytes: int | str | None = None,
        disk_path: str | os.PathLike[str] | None = None,
        disk_bytes: int | str | None = None,
        **options: int | str | bool,
    ) -> CacheConfig:
        """Build a config from user values: sizes as ints or strings like "2GiB"; None = default."""
        def size(name: str, value: int | str | None) -> int:
            raw = DEFAULTS[name] if value is None else value
            assert isinstance(raw, (int, str))
            return parse_bytes(raw)

        unknown = set(options) - set(DEFAULTS)
        if unknown:
            raise TypeError(f"unknown cache option(s): {', '.join(sorted(unknown))}")
        extra = {k: size(k, v) if k.endswith("_bytes") else v for k, v in options.items()}
        if "host_slab_bytes" not in extra:
            extra["host_slab_bytes"] = size("host_slab_bytes", None)
        return cls(
            device=str(device) if device is not None else default_device(),
            device_bytes=size("device_bytes", device_bytes),
            host_bytes=size("host_bytes", host_bytes),
            disk_path=os.fspath(disk_path) if disk_path is not None else None,
            disk_bytes=size("disk_bytes", disk_bytes),
            **extra,  # type: ignore[arg-type]
        )
