"""A pool of host memory (page-locked when CUDA is available) carved into blocks.

Page-locking memory is slow (milliseconds per call) and fragments the driver's bookkeeping, so the
host tier never pins per entry: it takes slabs of ``slab_bytes`` lazily, up to ``capacity_bytes``
in all, and carves variable-size blocks out of them with a best-fit allocator that coalesces freed
neighbours. (torch's caching host allocator also pools pinned memory, but rounds every request up to
a power of two: a 40.9 MB entry would hold 64 MiB, so the budget would not be what it says.)

Invariants:
- the pool never holds more than ``capacity_bytes`` of slabs;
- a block is handed out again only when nobody references it (``refs == 0``) and the last GPU
  copy that touched it has completed (its ``fence``), so a reused block is safe to write by the
  CPU or by any stream.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 512  # bytes; every block starts on this boundary, enough for any dtype view


def _round_up(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


@dataclass(eq=False)
class Block:
    slab: int
    offset: int
    size: int
    tensor: torch.Tensor  # uint8 view of exactly `size` bytes
    refs: int = 1
    fence: Any = None  # a torch.cuda.Event (or None) ordering the last GPU use of the bytes


@dataclass
class _Slab:
    tensor: torch.Tensor
    free_offsets: list[int] = field(default_factory=list)  # sorted
    free_sizes: dict[int, int] = field(default_factory=dict)  # offset -> size


class HostPool:
    def __init__(self, capacity_bytes: int, slab_bytes: int, pin: bool) -> None:
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = max(ALIGN, min(_round_up(slab_bytes), capacity_bytes))
        self.pin = pin
        self.allocated_bytes = 0  # slabs taken from the system
        self.block_bytes = 0  # bytes in blocks handed out (including deferred ones)
        self._slabs: list[_Slab] = []
        self._deferred: list[Block] = []  # released, waiting for their fence
        self._lock = threading.Lock()

    @property
    def max_block_bytes(self) -> int:
        return self.slab_bytes

    def alloc(self, nbytes: int) -> Block | None:
        """A block of at least ``nbytes``, or None when no free extent fits (caller evicts)."""
        size = _round_up(nbytes)
        if size > self.slab_bytes:
            return None
        with self._lock:
            self._reclaim()
            found = self._best_fit(size)
            if found is None and self.allocated_bytes + size <= self.capacity_bytes:
                found = self._new_slab(), 0
            if found is None:
                return None
            slab_index, offset = found
            self._take(slab_index, offset, size)
            self.block_bytes += size
            tensor = self._slabs[slab_index].tensor[offset : offset + size]
            return Block(slab_index, offset, size, tensor)

    def retain(self, block: Block) -> None:
        with self._lock:
            assert block.refs > 0, "retain of a freed block"
            block.refs += 1

    def release(self, block: Block) -> None:
        with self._lock:
            block.refs -= 1
            assert block.refs >= 0, "release of a freed block"
            if block.refs == 0:
                self._deferred.append(block)
                self._reclaim()

    def _reclaim(self) -> None:
        keep = []
        for block in self._deferred:
            if block.fence is not None and not block.fence.query():
                keep.append(block)
            else:
                self._give_back(block)
        self._deferred = keep

    def _best_fit(self, size: int) -> tuple[int, int] | None:
        best: tuple[int, int, int] | None = None  # (extent size, slab, offset)
        for index, slab in enumerate(self._slabs):
            for offset in slab.free_offsets:
                extent = slab.free_sizes[offset]
                if extent >= size and (best is None or extent < best[0]):
                    best = (extent, index, offset)
        return None if best is None else (best[1], best[2])

    def _new_slab(self) -> int:
        size = min(self.slab_bytes, self.capacity_bytes - self.allocated_bytes)
        with torch.inference_mode(False):  # writable from any thread, in or out of inference mode
            tensor = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self._slabs.append(_Slab(tensor, [0], {0: size}))
        self.allocated_bytes += size
        return len(self._slabs) - 1

    def _take(self, slab_index: int, offset: int, size: int) -> None:
        slab = self._slabs[slab_index]
        extent = slab.free_sizes.pop(offset)
        slab.free_offsets.remove(offset)
        if extent > size:
            rest = offset + size
            bisect.insort(slab.free_offsets, rest)
            slab.free_sizes[rest] = extent - size

    def _give_back(self, block: Block) -> None:
        slab = self._slabs[block.slab]
        offset, size = block.offset, block.size
        self.block_bytes -= size
        i = bisect.bisect_left(slab.free_offsets, offset)
        if i < len(slab.free_offsets) and slab.free_offsets[i] == offset + size:  # merge right
            size += slab.free_sizes.pop(offset + size)
            slab.free_offsets.pop(i)
        if i > 0:  # merge left
            left = slab.free_offsets[i - 1]
            if left + slab.free_sizes[left] == offset:
                slab.free_sizes[left] += size
                return
        slab.free_offsets.insert(i, offset)
        slab.free_sizes[offset] = size
