"""The store's settings: one frozen dataclass, validated at construction, units in the names; and
the defaults, in tables: ``DEFAULTS`` (a cache's options), ``SERVING_BUDGETS`` (the tier budgets a
serving process takes from the machine), ``AUTO_BUDGETS`` (``budgets="auto"``'s rules),
``MEDIA_DEFAULTS`` (what a server reads of a request's images), the default store directory.

Invariant: each default is written here once; ``CacheConfig.create`` (and so ``FeatureCache``),
the lmdeploy integration, ``featcache serve``/``warm`` and the CLI take theirs from these tables
(help texts included) and restate none."""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from .sizes import MAX_BYTES, parse_bytes

# The one table of defaults of a FeatureCache's options (sizes as people write them), filled in
# by CacheConfig.create, which builds every CacheConfig: its fields have no defaults of their own.
DEFAULTS: dict[str, int | str | bool | None] = {
    "device_bytes": "1GiB",
    "host_bytes": "4GiB",
    "disk_path": None,
    "disk_bytes": "64GiB",
    "host_slab_bytes": "256MiB",
    "demote_queue_entries": 64,
    "disk_queue_entries": 64,
    "disk_sync": True,
    # False: this cache reads the disk tier and never writes it, another process of the same
    # store does (tp ranks > 0: the features are the same on every rank; rank 0 writes them).
    "disk_writes": True,
    # The remote tier (Redis/Valkey; docs/tuning.md "Remote tier"); off while remote_url is None.
    "remote_url": None,
    "remote_prefix": "featcache",
    "remote_ttl_s": 7 * 24 * 3600,
    "remote_chunk_bytes": "4MiB",
    "remote_timeout_ms": 250,
    "remote_breaker_failures": 3,
    "remote_breaker_cooldown_ms": 5000,
    "remote_queue_entries": 16,
    "remote_tls_ca_file": None,
    "remote_tls_cert_file": None,
    "remote_tls_key_file": None,
    # How keys are made (featcache.keysecret): keyed blake3 under the store's (or the remote
    # tier's, or key_secret_file's) random secret; "xxh3_128" is an opt-in for one trusted tenant.
    "key_algorithm": "blake3",
    "key_secret_file": None,
    # How the device and host tiers choose what to evict (featcache.eviction, EVICTIONS below):
    # "admit", the one policy within 2% of LRU on every trace of bench/eviction.py (issue 44).
    "eviction": "admit",
}

# URL schemes of the remote tier: one server (redis-py's own forms), a Redis Cluster (any node), or
# Mooncake Store (featcache.tiers.mooncake: mooncake://MASTER:PORT?metadata=...).
REMOTE_SCHEMES = ("redis", "rediss", "unix", "redis-cluster", "rediss-cluster", "mooncake")

# Where `featcache serve` runs the PyTorch engine (--engine-process); the first is the default:
# "mp" lmdeploy's own engine process (what `lmdeploy serve api_server` does), "in" the server's
# process (the default with client image ids: an id alone gives the engine process no bytes).
ENGINE_PROCESSES = ("mp", "in")

# What `featcache serve` tells each response of what its request got from the cache
# (--featcache-report; featcache.server.report): the X-Featcache header (the default), the header
# and the usage object's "featcache" member, or nothing.
REPORTS = ("header", "usage", "off")

# `featcache serve --trust-client-image-ids [verify]`: "on" trusts ids as given, "verify" checks
# the bytes that come with an id (featcache.lmdeploy.request.sources).
ID_MODES = ("on", "verify")

# `featcache serve --key-algorithm`: keyed blake3 (the default) or unkeyed xxh3 for one trusted
# tenant (featcache.keysecret; keys.ALGORITHMS also has blake2b for the Python API).
KEY_ALGORITHMS = ("blake3", "xxh3_128")

# `eviction` (FeatureCache, `featcache serve --eviction`): what the device and host tiers evict
# first. "admit" (the default): GreedyDual by what a hit saves (the vision time of its miss) per
# byte, behind a TinyLFU admission filter that is on only while it pays (featcache.eviction.admission);
# "value": the lowest GreedyDual-Size-Frequency priority, what a hit saves x its uses / its bytes
# (the default until issue 44: up to 36% below LRU where large images come back too late);
# "lru": the least recently used entry (featcache.eviction; docs/design.md, "Eviction").
EVICTIONS = ("lru", "value", "admit")

# What featcache reads of the image a request names (featcache.lmdeploy.request.media.MediaPolicy;
# `featcache serve --max-image-bytes`, `--allowed-local-media-path`): at most max_image_bytes of
# any source (a file, a data URL, an http body): a 4K RGBA PNG stored uncompressed is 32 MiB, a
# camera JPEG ~10 MiB. Local files only under allowed_local_media_path (None: none; the Python
# pipeline()/wrap() API, one trusted user, reads any file: media.LOCAL_FILES).
MEDIA_DEFAULTS: dict[str, str | None] = {
    "max_image_bytes": "64MiB",
    "allowed_local_media_path": None,
}

# What one video a request names may cost (featcache.lmdeploy.request.media.VideoLimits; each a
# `featcache serve` option, named in its refusals): its encoded bytes, its stated duration and
# frames (what the decoder walks through), the frames its sampling keeps (each held decoded), one
# frame's pixels (4K). Memory: max_video_bytes + max_sampled_frames x max_frame_pixels x 3.
VIDEO_DEFAULTS: dict[str, float] = {
    "max_video_bytes": 256 << 20,
    "max_video_seconds": 3600.0,
    "max_video_frames": 108_000,  # an hour at 30 frames a second
    "max_sampled_frames": 256,
    "max_frame_pixels": 3840 * 2160,
}
VIDEO_OPTIONS = {  # each limit's featcache serve option
    "max_video_bytes": "--max-video-bytes", "max_video_seconds": "--max-video-seconds",
    "max_video_frames": "--max-video-frames", "max_sampled_frames": "--max-sampled-frames",
    "max_frame_pixels": "--max-video-frame-pixels"}

# Where a store lives when none is named (the CLI, featcache.lmdeploy.default_cache()).
ENV_DIR = "FEATCACHE_DIR"
DEFAULT_DIR_SHOWN = "~/.cache/featcache"
DEFAULT_DIR = os.path.expanduser(DEFAULT_DIR_SHOWN)
STORE_DIR_HELP = f"${ENV_DIR}, else {DEFAULT_DIR_SHOWN}"  # the default as help texts say it


def default_store_dir() -> str:
    """Where a store lives when none is named: ``$FEATCACHE_DIR``, else ``~/.cache/featcache``
    (the CLI's default and ``featcache.lmdeploy.default_cache()``'s)."""
    return os.environ.get(ENV_DIR) or DEFAULT_DIR


@dataclass(frozen=True)
class MachineBudget:
    """A tier budget sized from the machine: ``percent`` of an amount (``of``), at most ``cap``."""

    percent: int
    of: str  # what the amount is, for help texts
    cap: str

    def bytes_from(self, amount: int) -> int:
        """The budget for ``amount`` bytes of the resource (integer arithmetic: exact)."""
        return min(parse_bytes(self.cap), amount * self.percent // 100)

    def __str__(self) -> str:
        return f"{self.percent}% of {self.of}, at most {self.cap}"


# The tier budgets featcache.lmdeploy.default_cache() gives a serving process (and so `featcache
# serve` and `featcache warm`) where DEFAULTS' fixed sizes would not fit: a share of what the
# machine has. The device tier stays small: lmdeploy takes most of the GPU for its KV cache.
DEMO_TURNS = 6  # chat turns of `featcache demo`
DEMO_WINDOW = 8  # images a demo turn sends: its new one and up to 7 before it (linear in turns)
DEMO_MAX_TURNS = 200  # more is refused (linear: 200 turns ran in 68 s on the shared 2-core CPU machine)

SERVING_BUDGETS: dict[str, MachineBudget] = {
    "device_bytes": MachineBudget(4, "free GPU memory", "2GiB"),
    "host_bytes": MachineBudget(10, "RAM", "8GiB"),
    "disk_bytes": MachineBudget(50, "the free space", "32GiB"),
}

# `budgets` (featcache.lmdeploy.pipeline/default_cache, `featcache serve --budgets`): "share" is
# SERVING_BUDGETS' fixed shares, capped; "auto" sizes each tier from what the machine has free,
# the device tier from what lmdeploy's KV cache left (AUTO_BUDGETS, featcache.autosize).
# FeatureCache(budgets="auto") does the same; without it, FeatureCache takes DEFAULTS' sizes.
BUDGETS = ("share", "auto")
# The serving default stays "share" until bench/checks/auto_budgets_check.py has run on a GPU (the
# device rule rests on lmdeploy's memory accounting, so far checked on the CPU with faked
# figures only): docs/tuning.md, "Budgets that size themselves".
SERVING_BUDGETS_DEFAULT = "share"


@dataclass(frozen=True)
class AutoBudget:
    """``budgets="auto"``'s rule for one tier: ``percent`` of what is free (``of``) less a margin
    of ``margin_percent`` of the resource's total (``total``), at least ``margin_min``; split
    evenly among the processes that size themselves from the same free amount (``split``)."""

    percent: int
    of: str  # what the free amount is, for help texts
    margin_min: str
    margin_percent: int = 0
    total: str = ""  # what the margin is a share of
    split: str = ""  # among whom the budget is split, if it is

    def margin(self, total: int) -> int:
        return max(parse_bytes(self.margin_min), total * self.margin_percent // 100)

    def bytes_from(self, free: int, total: int, shared_by: int = 1) -> int:
        """The budget for ``free`` of ``total`` bytes (integer arithmetic: exact)."""
        return max(0, free - self.margin(total)) * self.percent // 100 // max(1, shared_by)

    def __str__(self) -> str:
        margin = (f"{self.margin_percent}% of {self.total} (at least {self.margin_min})"
                  if self.margin_percent else self.margin_min)
        split = f", split among {self.split}" if self.split else ""
        return f"{self.percent}% of {self.of} less {margin}{split}"


# Why each share (featcache.autosize has the measurements): the device tier takes a quarter of
# what lmdeploy's KV cache left, because the rest still holds lmdeploy's activations, its runtime
# buffers and the vision model's; the 1 GiB covers CUDA graphs and allocator fragmentation. The
# host tier is page-locked (never swapped): a quarter of the available RAM, split among the GPUs'
# processes. The disk keeps half of its free space, and 5% of the filesystem, for everything else.
AUTO_BUDGETS: dict[str, AutoBudget] = {
    "device_bytes": AutoBudget(25, "the GPU memory lmdeploy's KV cache leaves", "1GiB"),
    "host_bytes": AutoBudget(25, "the available RAM", "2GiB", 5, "the RAM",
                             "the machine's GPUs"),
    "disk_bytes": AutoBudget(50, "the free space at the store (its own file counted free)",
                             "1GiB", 5, "the filesystem"),
}

if TYPE_CHECKING:
    import torch


def default_device() -> str:
    import torch  # here, not at the top: the store tools read this module without torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class CacheConfig:
    device: str
    device_bytes: int
    host_bytes: int
    disk_path: str | None
    disk_bytes: int
    host_slab_bytes: int  # pinned memory is taken in slabs of this size, lazily
    demote_queue_entries: int  # device->host copies waiting; beyond this, copies are dropped
    disk_queue_entries: int  # disk writes waiting; beyond this, writes are dropped
    disk_sync: bool  # fsync each disk transaction (metadata sync is always off)
    disk_writes: bool  # False: the disk tier is read (hits promoted), never written by this cache
    remote_url: str | None = field(repr=False)  # may hold a password: never shown
    remote_prefix: str  # namespace of this cache's keys on the server (per model)
    remote_ttl_s: int  # lifetime of a published entry; 0: none (eviction only)
    remote_chunk_bytes: int  # values larger than this are split into chunks this size
    remote_timeout_ms: int  # connect and socket timeout of every remote call
    remote_breaker_failures: int  # consecutive failed calls that open the breaker
    remote_breaker_cooldown_ms: int  # remote skipped this long, then one trial call
    remote_queue_entries: int  # publishes waiting; beyond this, publishes are dropped
    remote_tls_ca_file: str | None  # rediss: CA bundle to verify the server with
    remote_tls_cert_file: str | None  # rediss: client certificate (mutual TLS)
    remote_tls_key_file: str | None  # rediss: the client certificate's key
    key_algorithm: str  # the keys' digest: "blake3" (keyed), "blake2b" (keyed), "xxh3_128"
    key_secret_file: str | None  # the key secret's file (None: the remote tier's, else the store's)
    eviction: str  # the memory tiers' eviction policy: one of EVICTIONS

    def __post_init__(self) -> None:
        self._check_types()
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_bytes") and not 0 <= value <= MAX_BYTES:
                raise ValueError(
                    f"{f.name} must be 0 to {MAX_BYTES} bytes (2**63-1), got {value}"
                )
        for name in ("demote_queue_entries", "disk_queue_entries", "remote_queue_entries",
                     "remote_breaker_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        self._check_remote()
        from .keys import ALGORITHMS

        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {', '.join(EVICTIONS)}, not {self.eviction!r}")
        if self.key_algorithm not in ALGORITHMS:
            raise ValueError(f"key_algorithm must be one of {', '.join(ALGORITHMS)}, not "
                             f"{self.key_algorithm!r}")
        import torch

        try:
            device = torch.device(self.device)
        except RuntimeError:  # torch's message lists device types the cache cannot use
            device = torch.device("meta")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but CUDA is not available here")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda[:N]' or 'cpu', not {self.device!r}")

    def _check_types(self) -> None:
        """Each field holds its annotated type (a bool is not an int here), so that a bad value
        gets a message naming the option rather than a failed comparison later."""
        for f in fields(self):
            value = getattr(self, f.name)
            kinds = _FIELD_TYPES[str(f.type)]
            if isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)):
                continue
            wanted = _DESCRIBE["_bytes" if f.name.endswith("_bytes") else str(f.type)]
            shown = "" if f.name == "remote_url" else f" {value!r}"  # may hold a password
            raise TypeError(f"{f.name} must be {wanted}, not {type(value).__name__}{shown}")

    @property
    def remote_url_redacted(self) -> str | None:
        """``remote_url`` with its password replaced by ``***`` (for logs, repr and errors)."""
        return redact_url(self.remote_url) if self.remote_url is not None else None

    def _check_remote(self) -> None:
        url = self.remote_url
        if url is not None:
            scheme = urlsplit(url).scheme if isinstance(url, str) else None
            if scheme not in REMOTE_SCHEMES:
                raise ValueError(
                    f"remote_url must start with one of {', '.join(s + '://' for s in REMOTE_SCHEMES)}"
                    f", not {redact_url(str(url))!r}"
                )
            tls = (self.remote_tls_ca_file, self.remote_tls_cert_file, self.remote_tls_key_file)
            if any(tls) and not str(scheme).startswith("rediss"):
                raise ValueError("remote_tls_* options need a rediss:// (TLS) remote_url")
        if not re.fullmatch(r"[A-Za-z0-9_.:/-]{1,128}", self.remote_prefix):
            raise ValueError("remote_prefix must be 1-128 characters of A-Z a-z 0-9 _ . : / - "
                             f"(no braces: they pick Redis Cluster slots), not {self.remote_prefix!r}")
        if self.remote_ttl_s < 0:
            raise ValueError("remote_ttl_s must be >= 0 (0: entries do not expire)")
        if self.remote_chunk_bytes < 4096:
            raise ValueError("remote_chunk_bytes must be at least 4KiB")
        if self.remote_timeout_ms < 1 or self.remote_breaker_cooldown_ms < 0:
            raise ValueError("remote_timeout_ms must be >= 1 and remote_breaker_cooldown_ms >= 0")

    @classmethod
    def create(
        cls,
        device: str | torch.device | None = None,
        device_bytes: int | str | None = None,
        host_bytes: int | str | None = None,
        disk_path: str | os.PathLike[str] | None = None,
        disk_bytes: int | str | None = None,
        **options: int | str | bool | None,
    ) -> CacheConfig:
        """Build a config from user values: sizes as ints or strings like "2GiB"; None = default.

        Raises ``TypeError``/``ValueError`` naming the argument for a value of the wrong type or
        out of range."""
        unknown = set(options) - set(DEFAULTS)
        if unknown:
            raise TypeError(f"unknown cache option(s): {', '.join(sorted(unknown))}")
        torch_device = getattr(sys.modules.get("torch"), "device", ())  # a torch.device needs torch
        if device is not None and not isinstance(device, (str, torch_device)):
            raise TypeError(
                f"device must be a string like 'cuda:0' or 'cpu', or a torch.device, not "
                f"{type(device).__name__} {device!r}"
            )
        path = os.fspath(disk_path) if isinstance(disk_path, (str, os.PathLike)) else disk_path
        if path is not None and not isinstance(path, str):
            raise TypeError(f"disk_path must be a str or a path-like of str (None: no disk tier), "
                            f"not {type(path).__name__} {path!r}")
        extra: dict[str, object] = {}
        for name in DEFAULTS.keys() - _ARGUMENTS:  # every other option: given, else its default
            value = options.get(name)
            extra[name] = size_option(name, value) if name.endswith("_bytes") else (
                DEFAULTS[name] if value is None else value)
        return cls(
            device=str(device) if device is not None else default_device(),
            device_bytes=size_option("device_bytes", device_bytes),
            host_bytes=size_option("host_bytes", host_bytes),
            disk_path=path,
            disk_bytes=size_option("disk_bytes", disk_bytes),
            **extra,  # type: ignore[arg-type]
        )


# The options CacheConfig.create takes as named arguments (the rest come through **options).
_ARGUMENTS = {"device", "device_bytes", "host_bytes", "disk_path", "disk_bytes"}

# The annotations of CacheConfig's fields (strings: postponed evaluation) and the types they admit.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "bool": (bool,), "str": (str,), "str | None": (str, type(None)),
}
_DESCRIBE = {
    "_bytes": "an int number of bytes (FeatureCache also takes a string like '64MiB')",
    "int": "an int", "bool": "True or False", "str": "a string", "str | None": "a string or None",
}


def size_option(name: str, value: object) -> int:
    """The byte count of size argument ``name`` (``value`` an int, a string like "2GiB", or None:
    the default); ``TypeError``/``ValueError`` naming ``name`` and what it takes otherwise."""
    raw = DEFAULTS[name] if value is None else value
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        raise ValueError(f"{name}: 'auto' is not a size; pass budgets='auto' (featcache serve "
                         "--budgets auto) to size every tier not given from the machine")
    if isinstance(raw, float):
        hint = f": pass int({raw!r}) or a string such as {_as_text(raw)!r}" if raw >= 0 else ""
        raise TypeError(
            f"{name} must be an int or a string like '64MiB', not the float {raw!r}{hint}"
        )
    try:
        return parse_bytes(raw)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{name} must be an int or a string like '64MiB', not {type(raw).__name__} {raw!r}"
        ) from None
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _as_text(value: float) -> str:
    """A float byte count as a size string (2.5e9 -> '2.5GB'); nan and inf have none."""
    if not math.isfinite(value):
        return "64MiB"
    for power, unit in ((4, "TB"), (3, "GB"), (2, "MB"), (1, "kB")):
        if abs(value) >= 1000**power:
            return f"{value / 1000**power:g}{unit}"
    return f"{value:g}B"


def redact_url(url: str) -> str:
    """``url`` without its password (``redis://user:***@host:6379/0``); other parts kept."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
