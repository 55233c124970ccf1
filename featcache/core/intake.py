"""What ``FeatureCache.put`` hands its tiers, checked and made its own: the key (bytes, 1 to
``MAX_KEY_BYTES`` long: every tier can store it), the metadata stored with the tensor (the
caller's, with the namespace and the cost recorded in it: ``featcache.entrymeta``) and the tensor
the top tier keeps.

Invariants:
- a key the cache takes is one every tier can store (the disk tier's records for it fit LMDB's
  key limit); any other raises ``TypeError``/``ValueError`` before a tier is touched;
- the tensor kept is on the cache's device, dense and owns its whole storage, so the books count
  all the memory it holds (a view would keep its whole base alive); a lazy negation or
  conjugation is resolved first (its raw bytes are not its values).
"""

from __future__ import annotations

import torch

from ..codec import check_meta
from ..entrymeta import recorded, with_cost
from .chain import MAX_KEY_BYTES
from .copier import dense_copy


def valid_key(key: object) -> bool:
    """Whether ``key`` is one the cache stores: bytes, 1 to ``MAX_KEY_BYTES`` long."""
    return isinstance(key, bytes) and 0 < len(key) <= MAX_KEY_BYTES


def check_key(key: object) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"keys are bytes (from featcache.image_key), not {type(key).__name__}")
    if not valid_key(key):
        raise ValueError(f"a key must be 1 to {MAX_KEY_BYTES} bytes long, got {len(key)}")


def stored_meta(meta: bytes | None, namespace: str | None, key: bytes,
                cost_s: float | None) -> bytes:
    """The metadata stored with an entry: ``meta`` with the namespace (given, else the one the
    key carries) and ``cost_s`` recorded (``put``'s rules), checked (at most 64 KiB)."""
    meta_bytes = recorded(meta, namespace, getattr(key, "namespace", None))
    if cost_s is not None:
        meta_bytes = with_cost(meta_bytes, cost_s)
    return check_meta(meta_bytes)


def owned(features: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor the top tier keeps: on ``device``, dense, owning its storage."""
    tensor = features.detach()
    if tensor.is_neg() or tensor.is_conj():  # lazy views: the raw bytes are not the values
        tensor = tensor.resolve_neg().resolve_conj()
    if tensor.device != device:
        return tensor.to(device).contiguous()
    whole = (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes
    )
    # A view would keep its whole base alive while the books count only the view.
    if whole:
        return tensor
    if device.type == "cpu":  # NumPy's copy: torch's pool would hang a forked child
        return dense_copy(tensor)
    return tensor.clone(memory_format=torch.contiguous_format)
