"""A bounded, thread-safe map that forgets its least recently used entries first.

For what the frontend remembers between requests (``lmdeploy.urlkeys``, ``lmdeploy.frontend``):
small values, a fixed number of entries. Invariant: never more than ``capacity`` entries; a
``get`` or ``put`` makes its key the most recently used.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruMap(Generic[K, V]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
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
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

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
            return self._items.pop(key, default)

    def __len__(self) -> int:
        return len(self._items)
