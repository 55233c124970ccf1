"""``budgets="auto"``: each tier's budget sized from what this machine has free, with its reason.

The rules are ``config.AUTO_BUDGETS`` (a share of the free amount less a safety margin); what is
free is read by the probes below (``gpu_memory``, ``ram``, ``disk``, ``gpus_on_machine``: the
functions tests replace). A size given for a tier is kept ("given").

- **device, on a GPU**: ``torch.cuda.mem_get_info``'s free bytes of the cache's GPU. Read after
  lmdeploy built its engine (``featcache.lmdeploy`` decides there: ``engine`` is then its
  reservation, for the reason), this is what the KV cache left: lmdeploy 0.18's PyTorch engine
  measures the free memory once the weights are loaded, sets aside its runtime buffers (prefill
  logits) and any state cache, and takes ``cache_max_entry_count`` (0.8 by default) of the rest
  for its KV cache (``pytorch/engine/executor/base.py``, ``update_configs``). What stays free
  must still hold lmdeploy's activations, its runtime buffers (reserved, not yet allocated) and
  the vision model's activations: featcache takes a quarter of it less a 1 GiB margin, and the
  tier grows only as entries arrive. Read before any engine (a ``FeatureCache(budgets="auto")``
  of one's own), the same rule sizes from what is free now: build such a cache after the model
  and its caches.
- **device, on the CPU** (no CUDA, or TurboMind, which takes host tensors): the device tier is
  RAM, sized by the host rule; the host tier is then 0 (it would hold a second copy in RAM).
- **host**: the available RAM (``MemAvailable``: free plus reclaimable caches; not the total),
  a quarter of it less a margin of 5% of the RAM (at least 2 GiB), split among the machine's
  GPUs: each runs a serving process of its own (the ranks of one server, or one server per GPU),
  and each takes its share of the same free RAM. Page-locked memory cannot be swapped out.
- **disk**: the free space at the store plus the store's own files (space the store reuses:
  without it every restart would size the budget from a disk the store already fills, and shrink
  it), half of it less a margin of 5% of the filesystem (at least 1 GiB).

Each figure is read once, when the budgets are decided; nothing is re-sized later.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import AUTO_BUDGETS
from .sizes import format_bytes

log = logging.getLogger("featcache")

TIERS = ("device", "host", "disk")
LMDEPLOY_KV_SHARE = 0.8  # lmdeploy 0.18's default cache_max_entry_count (its engine configs')


@dataclass(frozen=True)
class Choice:
    """One tier's budget and why it is that."""

    tier: str  # "device", "host" or "disk"
    nbytes: int
    reason: str
    at_most: bool = False  # a bound, read before what decides it (``before_engine``)

    @property
    def size(self) -> str:
        if self.at_most:
            return f"at most {format_bytes(self.nbytes)}"
        return format_bytes(self.nbytes) if self.nbytes else "off"

    def __str__(self) -> str:
        return f"{self.tier} {self.size}: {self.reason}"


@dataclass(frozen=True)
class Budgets:
    """The tier budgets of one cache, each with its reason (``line()``: the start-up line)."""

    mode: str  # "auto", or "share" (config.SERVING_BUDGETS)
    device: str  # the device tier's device: "cuda:0", "cpu"
    choices: tuple[Choice, ...]  # device, host, disk

    def sizes(self) -> dict[str, int]:
        """``device_bytes``, ``host_bytes``, ``disk_bytes``: a cache's size arguments."""
        return {f"{c.tier}_bytes": c.nbytes for c in self.choices}

    def line(self) -> str:
        return f"budgets {self.mode} ({self.device}): " + "; ".join(str(c) for c in self.choices)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "device": self.device,
                "tiers": [{"tier": c.tier, "bytes": c.nbytes, "at_most": c.at_most,
                           "reason": c.reason} for c in self.choices]}


@dataclass(frozen=True)
class EngineMemory:
    """What lmdeploy's engine config says of its KV-cache reservation (for the reasons)."""

    cache_max_entry_count: float | None = None  # the share of the free memory taken for KV
    # KV blocks: given (the share then unused), or, read after the engine is built, the number
    # lmdeploy computed (it writes it back into the engine config)
    num_gpu_blocks: int = 0

    @classmethod
    def of(cls, config: Any) -> EngineMemory:
        """From an lmdeploy engine config (``PytorchEngineConfig``, ``TurbomindEngineConfig``), a
        dict of the same fields, or None (unknown)."""
        get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
        share, blocks = get("cache_max_entry_count"), get("num_gpu_blocks")
        return cls(float(share) if isinstance(share, (int, float)) else None,
                   blocks if isinstance(blocks, int) else 0)

    def as_dict(self) -> dict[str, Any]:
        return {"cache_max_entry_count": self.cache_max_entry_count,
                "num_gpu_blocks": self.num_gpu_blocks}

    def __str__(self) -> str:
        parts = []
        if self.cache_max_entry_count is not None:
            parts.append(f"cache_max_entry_count {self.cache_max_entry_count:g}")
        if self.num_gpu_blocks > 0:
            parts.append(f"{self.num_gpu_blocks} blocks")
        return ", ".join(parts) or "its reservation unknown"


# -- the probes (tests replace these) ----------------------------------------------------------
def gpu_memory(device: str) -> tuple[int, int]:
    """Free and total bytes of the GPU ``device`` (``torch.cuda.mem_get_info``: the whole GPU's
    free memory, other processes' use included; memory torch's allocator keeps cached in this
    process counts as used)."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


def ram() -> tuple[int, int]:
    """Available and total bytes of RAM: ``MemAvailable`` and ``MemTotal`` of /proc/meminfo (the
    kernel's estimate of what can be had without swapping); elsewhere the free pages (less than
    available: page caches count as used)."""
    try:
        with open("/proc/meminfo") as f:
            info = {name: int(rest.split()[0]) * 1024
                    for name, _, rest in (line.partition(":") for line in f) if rest.strip()}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")


def disk(path: str) -> tuple[int, int, int]:
    """Free bytes for this user at ``path`` (or, before it is made, its nearest existing parent),
    the filesystem's size, and the bytes the store's files there take (the directory's regular
    files, allocated: what the store reuses). Only ``stat``s: nothing of a store is opened."""
    where = os.path.abspath(path)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    st = os.statvfs(where)
    store = 0
    if os.path.isdir(path):
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False):
                info = entry.stat(follow_symlinks=False)
                store += min(info.st_size, info.st_blocks * 512)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, store


def gpus_on_machine() -> int:
    """NVIDIA GPUs on this machine, those hidden by ``CUDA_VISIBLE_DEVICES`` included (the
    driver's /proc entries); else the GPUs torch sees; 0 without CUDA."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def current_gpu() -> str:
    """This process's current GPU, as "cuda:N" (where a cache with ``device=None`` lives)."""
    import torch

    return f"cuda:{torch.cuda.current_device()}"


# -- the decision ------------------------------------------------------------------------------
def sized(budgets: object, device: str | None, disk_path: str | None,
          given: dict[str, int | str | None]) -> dict[str, int | str | None]:
    """``FeatureCache(budgets="auto")``'s sizes: ``given`` (``device_bytes``, ``host_bytes``,
    ``disk_bytes``; None: not given) with each one not given chosen by ``decide`` for a cache on
    ``device`` (None: the default one) with its store at ``disk_path`` (the choice logged)."""
    from .config import default_device, size_option

    if budgets != "auto":
        raise ValueError(f"budgets must be 'auto' (each tier not given sized from what the machine "
                         f"has free) or None (the fixed sizes of config.DEFAULTS), not {budgets!r}")
    known = {name: size_option(name, value) if value is not None else None
             for name, value in given.items()}  # bad sizes are refused first, by name
    where = str(device) if device is not None else default_device()
    if where.startswith("cuda") and not cuda_available():
        return dict(given)  # the config refuses the device, naming it
    chosen = decide(device=where, disk_path=disk_path, given=known)
    log.info("featcache: %s", chosen.line())
    return {**chosen.sizes()}


def decide(*, device: str, disk_path: str | None, given: Mapping[str, int | None] | None = None,
           engine: EngineMemory | None = None, cpu_why: str | None = None) -> Budgets:
    """The budgets ``budgets="auto"`` gives a cache on ``device`` ("cuda[:N]" or "cpu") with its
    store at ``disk_path`` (None: no disk tier), each tier of ``given`` (``device_bytes``,
    ``host_bytes``, ``disk_bytes``; None: decide it) kept as given. ``engine``: the lmdeploy
    engine whose KV cache was reserved before this call (None: no engine known, the GPU's free
    memory as it is now). ``cpu_why``: why the device tier is on the CPU (for the reason)."""
    given = dict(given or {})
    on_gpu = device.startswith("cuda")
    choices: list[Choice] = []
    device_given = given.get("device_bytes")
    if device_given is not None:
        choices.append(Choice("device", device_given, "given"))
    elif on_gpu:
        choices.append(_device_on_gpu(device, engine))
    else:
        choices.append(_ram_tier("device", cpu_why or _cpu_why()))
    host_given = given.get("host_bytes")
    if host_given is not None:
        choices.append(Choice("host", host_given, "given"))
    elif on_gpu:
        choices.append(_ram_tier("host", None))
    else:
        choices.append(Choice("host", 0, "the device tier is in RAM already (a host tier would "
                                         "hold a second copy)"))
    disk_given = given.get("disk_bytes")
    if disk_path is None:
        choices.append(Choice("disk", disk_given or 0, "no store directory"))
    elif disk_given is not None:
        choices.append(Choice("disk", disk_given, "given"))
    else:
        choices.append(_disk_tier(disk_path))
    return Budgets("auto", device, tuple(choices))


def _cpu_why() -> str:
    return "no CUDA" if not cuda_available() else "device 'cpu' asked for"


def _device_on_gpu(device: str, engine: EngineMemory | None) -> Choice:
    rule = AUTO_BUDGETS["device_bytes"]
    free, total = gpu_memory(device)
    margin = rule.margin(total)
    where = (f"after lmdeploy's KV cache ({engine})" if engine is not None else
             "now (no engine known: build the cache after the model and its KV cache)")
    return Choice("device", rule.bytes_from(free, total),
                  f"{rule.percent}% of the {format_bytes(free)} free on {device} {where}, less "
                  f"a {format_bytes(margin)} margin")


def _ram_tier(tier: str, on_cpu: str | None) -> Choice:
    """The host rule, for the host tier or (``on_cpu``: why) a device tier in RAM."""
    rule = AUTO_BUDGETS["host_bytes"]
    available, total = ram()
    shared_by = max(1, gpus_on_machine())
    margin = rule.margin(total)
    reason = (f"{rule.percent}% of the {format_bytes(available)} of available RAM (of "
              f"{format_bytes(total)}), less a {format_bytes(margin)} margin")
    if shared_by > 1:
        reason += f", split among the machine's {shared_by} GPUs"
    if on_cpu is not None:
        reason = f"in RAM ({on_cpu}): {reason}"
    return Choice(tier, rule.bytes_from(available, total, shared_by), reason)


def _disk_tier(path: str) -> Choice:
    rule = AUTO_BUDGETS["disk_bytes"]
    free, size, store = disk(path)
    room = free + store
    margin = rule.margin(size)
    mine = f", {format_bytes(store)} of it the store's own files" if store else ""
    return Choice("disk", rule.bytes_from(room, size),
                  f"{rule.percent}% of the {format_bytes(room)} free at {path}{mine}, less a "
                  f"{format_bytes(margin)} margin ({rule.margin_percent}% of the filesystem)")


def before_engine(device: str, engine: EngineMemory) -> Choice:
    """What ``decide`` would give a device tier on the GPU ``device`` once an lmdeploy engine
    reserved its KV cache, read before any engine (``featcache doctor``): at most the rule over
    the share the KV cache leaves of the memory free now (the model's weights, loaded first,
    leave less)."""
    rule = AUTO_BUDGETS["device_bytes"]
    free, total = gpu_memory(device)
    share = (engine.cache_max_entry_count if engine.cache_max_entry_count is not None
             else LMDEPLOY_KV_SHARE)
    left = free - int(free * share)  # lmdeploy's arithmetic: its KV cache is int(free * share)
    return Choice("device", rule.bytes_from(left, total),
                  f"decided once lmdeploy's engine has reserved its KV cache, as {rule.percent}% "
                  f"of what it leaves less a {format_bytes(rule.margin(total))} margin; {device} "
                  f"has {format_bytes(free)} free now, of which {engine} leaves at most "
                  f"{format_bytes(left)} (less once the model's weights are loaded)", at_most=True)
