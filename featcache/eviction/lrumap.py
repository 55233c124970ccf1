"""A bounded, thread-safe map that forgets its least recently used entries first.

For what the lmdeploy frontend remembers between requests (``resolve``, ``frontend``):
small values, a fixed number of entries. Invariant: never more than ``capacity`` entries, and
with a ``weigh`` never more than ``capacity_bytes`` by its weights (``bytes_used``); a ``get`` or
``put`` makes its key the most recently used.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruMap(Generic[K, V]):
    def __init__(self, capacity: int, capacity_bytes: int | None = None,
                 weigh: Callable[[K, V], int] | None = None) -> None:
        """``weigh(key, value)``: an entry's bytes, held against ``capacity_bytes`` (both or
        neither)."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if (capacity_bytes is None) != (weigh is None):
            raise ValueError("capacity_bytes and weigh go together")
        if capacity_bytes is not None and capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0  # the weights of the entries held (0 without a weigh)
        self._weigh = weigh
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            if self._weigh is not None:
                held = self._items.get(key)
                self.bytes_used += self._weigh(key, value) - (
                    0 if held is None else self._weigh(key, held))
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity or (
                    self.capacity_bytes is not None and self.bytes_used > self.capacity_bytes):
                self._forget(*self._items.popitem(last=False))

    def _forget(self, key: K, value: V) -> None:
        if self._weigh is not None:
            self.bytes_used -= self._weigh(key, value)

    def setdefault(self, key: K, value: V) -> V:
        """The value held for ``key`` (made the most recent), else ``value``, put."""
        with self._lock:
            held = self._items.get(key)
            if held is not None:
                self._items.move_to_end(key)
                return held
        self.put(key, value)
        return value

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove ``key``; its value, else ``default``."""
        with self._lock:
            held = self._items.pop(key, None)
            if held is None:
                return default
            self._forget(key, held)
            return held

    def __len__(self) -> int:
        return len(self._items)
