"""Copies between the device and host, and the ordering that makes them safe.

``CudaCopier`` runs device-to-host copies (demotion, off the request path) on one dedicated
stream, and host-to-device copies (promotion, on the request path) on the caller's stream,
ordered with events:
- a D2H copy waits for the producer's event (recorded at ``put`` on the producer's stream), and the
  source tensor is recorded on the copy stream so the caching allocator cannot reuse its memory
  before the copy has read it;
- an H2D copy is queued on the caller's current stream, after the host bytes' fence: the tensor is
  needed there next, so a side stream would only add a hand-off (a stream switch, an event wait,
  ``record_stream``: the copier's host time for 13.6 MB went from 0.098 to 0.038 ms on an
  H200, bench/results/HISTORY.md, "Core store"). Its event is the fence for reusing the host
  block and for users on other streams (``ready``);
- a tensor handed to a stream other than its producer's is recorded on that stream.

``SyncCopier`` is the same interface on the CPU: copies are synchronous and fences are None.
Its copies are memcpy through NumPy (``copy_bytes``), never a torch kernel: torch's CPU copy
splits large tensors over its intra-op thread pool (OpenMP), which does not survive ``fork()``,
so a forked child that used it hung (issue 27). The same holds for ``dense_copy``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the CPU uint8 tensor ``src`` into ``dst`` (same size) with a memcpy: no torch kernel,
    so no intra-op thread pool (safe in a forked child whose parent used it)."""
    np.copyto(dst.detach().numpy(), src.detach().numpy())


# NumPy integer types of each element size: a tensor viewed as one of them can be copied by NumPy
# whatever its own dtype (bfloat16 and the float8 types have no NumPy twin)
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dense_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the CPU tensor ``tensor`` that owns its storage, made by NumPy (see
    ``copy_bytes``); ``clone`` for element sizes NumPy has no integer for (complex128)."""
    as_int = _SAME_SIZE.get(tensor.element_size())
    if as_int is None:
        return tensor.clone(memory_format=torch.contiguous_format)
    out = owned_empty(tensor.nbytes, tensor.device).view(tensor.dtype).view(tensor.shape)
    np.copyto(out.view(as_int).numpy(), tensor.detach().view(as_int).numpy())
    return out


def owned_empty(nbytes: int, device: torch.device, pin: bool = False) -> torch.Tensor:
    """A fresh uint8 buffer that any thread may write, in or out of inference mode."""
    with torch.inference_mode(False):
        return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)


class SyncCopier:
    """Copies for a cache whose device is the CPU: synchronous, no fences."""

    pin = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def producer_fence(self) -> Any:
        return None

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, after: Any) -> Any:
        copy_bytes(dst, as_bytes(src))
        return None

    def to_device(
        self, src: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], after: Any
    ) -> tuple[torch.Tensor, Any]:
        out = owned_empty(src.numel(), self.device)
        copy_bytes(out, src)  # a private copy: the host block may be reused once released
        return out.view(dtype).view(shape), None

    def ready(self, tensor: torch.Tensor, fence: Any) -> None:
        return None

    def wait(self, fence: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


class CudaCopier:
    """Copies for a CUDA device: D2H on a dedicated side stream, H2D on the caller's stream,
    ordered by events (never a device-wide synchronisation on the request path)."""

    pin = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self.d2h_stream = torch.cuda.Stream(device=device)

    def producer_fence(self) -> torch.cuda.Event:
        """An event on the caller's current stream: the put tensor is complete after it."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._index))
        return event

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, after: Any) -> torch.cuda.Event:
        """Start copying ``src`` into the pinned bytes ``dst``; the returned event marks the end."""
        with torch.cuda.stream(self.d2h_stream):
            if after is not None:
                self.d2h_stream.wait_event(after)
            dst.copy_(as_bytes(src), non_blocking=True)
            src.record_stream(self.d2h_stream)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        return done

    def to_device(
        self, src: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], after: Any
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Queue a copy of host bytes into a new device tensor on the current stream (after
        ``after``, the bytes' fence). Returns the tensor and the copy's event (the fence for
        reusing ``src``, and for users on other streams)."""
        current = torch.cuda.current_stream(self._index)
        if after is not None:
            current.wait_event(after)
        out = owned_empty(src.numel(), self.device)  # allocated for the current stream
        out.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(current)
        return out.view(dtype).view(shape), done

    def ready(self, tensor: torch.Tensor, fence: Any) -> None:
        """Make ``tensor`` (complete after ``fence``) safe to use on the caller's current stream."""
        current = torch.cuda.current_stream(self._index)
        if fence is not None:
            current.wait_event(fence)
        tensor.record_stream(current)

    def wait(self, fence: Any) -> None:
        """Block this (background) thread until ``fence`` has passed."""
        if fence is not None:
            fence.synchronize()

    def synchronize(self) -> None:
        self.d2h_stream.synchronize()


Copier = SyncCopier | CudaCopier


def make_copier(device: torch.device) -> Copier:
    return CudaCopier(device) if device.type == "cuda" else SyncCopier(device)
