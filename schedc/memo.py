"""`IdentityCache`: results kept for an object while it lives, found by identity."""

from __future__ import annotations

import weakref


class IdentityCache:
    """Results computed for an object, kept while it lives, found by identity (`is`), never by
    equality: a part of a symmetric schedule that a replan reuses as it is need not be verified
    or summarised again. Small: the last `size` objects."""

    def __init__(self, size: int = 4):
        self._size = size
        self._items: list[tuple[weakref.ref, object, object]] = []

    def get(self, obj, key=None):
        for ref, k, value in self._items:
            if ref() is obj and k == key:
                return value
        return None

    def put(self, obj, value, key=None) -> None:
        self._items = [(ref, k, v) for ref, k, v in self._items if ref() is not None and ref() is not obj]
        self._items.append((weakref.ref(obj), key, value))
        del self._items[:-self._size]
