"""The job's store in memory, for the simulation: the subset of `torch.distributed.Store`
that `schedc.live.membership.JobStore` uses, on the simulated clock.

Queues deliver in order, each message after a delay that the world chooses
(a loaded store or network); keys are visible at once.
"""

from __future__ import annotations

from collections import deque
from typing import Callable


class MemoryStore:
    def __init__(self, now: Callable[[], float], delay: Callable[[str], float] = lambda key: 0.0):
        self._now = now
        self._delay = delay
        self._keys: dict[str, bytes] = {}
        self._queues: dict[str, deque] = {}  # key -> deque of (deliver_at, value)

    def clone(self) -> "MemoryStore":
        return self

    @staticmethod
    def _bytes(value) -> bytes:
        return value if isinstance(value, bytes) else str(value).encode()

    def set(self, key: str, value) -> None:
        self._keys[key] = self._bytes(value)

    def get(self, key: str) -> bytes:
        if key not in self._keys:
            raise RuntimeError(f"simulated store: no key {key!r} (a real store would wait, then time out)")
        return self._keys[key]

    def check(self, keys) -> bool:
        return all(k in self._keys for k in keys)

    def multi_set(self, keys, values) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def multi_get(self, keys) -> list[bytes]:
        return [self.get(k) for k in keys]

    def add(self, key: str, amount: int) -> int:
        value = int(self._keys.get(key, b"0")) + amount
        self._keys[key] = str(value).encode()
        return value

    def delete_key(self, key: str) -> bool:
        return self._keys.pop(key, None) is not None

    def queue_push(self, key: str, value) -> None:
        q = self._queues.setdefault(key, deque())
        at = self._now() + self._delay(key)
        if q:
            at = max(at, q[-1][0])  # in order, as a real queue
        q.append((at, self._bytes(value)))

    def queue_len(self, key: str) -> int:
        now = self._now()
        return sum(1 for at, _ in self._queues.get(key, ()) if at <= now)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        q = self._queues.get(key)
        if not q or q[0][0] > self._now():
            raise RuntimeError(f"simulated store: queue {key!r} is empty")
        return q.popleft()[1]
