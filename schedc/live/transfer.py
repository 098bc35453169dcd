"""Moving state between two ranks of a live run: one seam, two ways through it.

A `StateTransfer` is one end of a one-way channel of a session: the sending
rank hands it objects under keys (``send``), the receiving rank asks for them
by key (``recv``). An object is anything a state dict holds: nested dicts,
lists and tuples of tensors, numbers, strings, booleans and None (weights,
optimizer state, a step's gradient, a rollback copy). A catch-up session
(`schedc.live.catchup`) is one such channel, donor to joiner; moving layers
between surviving ranks would be another.

- `StoreTransfer`: ``torch.save`` bytes through the job's store (chunked
  blobs, `JobStore.put_blob`). It needs nothing but the store, and the
  sender need not wait for the receiver; but every byte goes through the
  supervisor's process, at about 60 MB/s.
- `DirectTransfer`: a two-rank gloo group between the two ranks, formed
  under the store prefix ``xfer/<session>/``; the store carries nothing
  else but a ``closed`` flag. Its keys stay (a few bytes): a session's
  name is used once per job, as the group would meet the old addresses. Per object: its header's length, the header
  (the object's structure, each tensor's dtype and shape, the non-tensor
  values, as JSON: nothing is unpickled), then its tensors as one stream of
  raw bytes cut into chunks of at most `CHUNK_BYTES` (a chunk within one
  large tensor goes straight from and into its memory; small tensors are
  packed into a staging buffer), two chunks in flight.

Threads. The direct one does everything on a thread of its own per end,
with a store connection of its own: forming the group blocks until both
ends have joined, and a send blocks until the receiver has taken the
bytes, neither of which may hold up the caller (a donor's training loop, a
standby rank's loop). ``send`` only queues; ``recv`` hands out what the
receiving thread has taken. Every wait of those threads is bounded by
`timeout`: a peer that never joins, or stops, fails the transfer within
it; one that dies fails it at once (its connection closes). A failed
transfer raises `TransferError` on the next ``send`` or ``recv`` (a
receiver first gets every object that arrived whole); `TransferClosed`
when the other end closed. The receiving thread waits for the next object
inside a gloo receive (that is how it sees a dead sender at once), which
nothing can interrupt and whose timeout would break the pair: closing the
receiving end sets the store's ``closed`` flag, which the sending thread
reads between objects and answers with an end-of-session message.

The store one sends on the executor it is given (the donor's side thread)
or on the caller's thread, and polls the store to receive; it cannot tell a
lost peer from a slow one, so its ``recv`` only ever answers None.
"""

from __future__ import annotations

import base64
import collections
import io
import json
import os
import sys
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Executor
from datetime import timedelta
from typing import Any, Callable

from schedc.live.membership import JobStore

#: Bytes per gloo message of the direct transfer: big enough that a message's fixed cost is
#: noise, small enough that the staging buffers (two per end) stay small.
CHUNK_BYTES = 16 << 20
#: Seconds any wait of a transfer may last (forming the group, one chunk, the next message).
DEFAULT_TIMEOUT = 60.0
#: The two implementations, by name.
KINDS = ("direct", "store")
#: Which one a catch-up uses unless told (the store one stays for comparison and as a fallback).
DEFAULT_KIND = "direct"
#: How often the store one's `recv` looks for its key while it waits, seconds.
_POLL = 0.005
#: Seconds between two looks of an idle sending end at whether the receiving end closed.
_SENDER_LOOKS = 0.2
#: Messages a direct end has in flight at once (posting the next chunk while one is on the wire).
_WINDOW = 2


class TransferError(RuntimeError):
    """The transfer cannot go on: its peer is gone (or never came), or it was closed."""


class TransferClosed(TransferError):
    """The other end closed the session (nothing is wrong: nothing more will come, or be read)."""


class StateTransfer(ABC):
    """One end of a one-way channel of a session: the sending end `send`s, the receiving end `recv`s."""

    #: bytes of the objects `recv` has handed out
    received: int = 0

    @abstractmethod
    def send(self, key: str, obj: Any) -> None:
        """Hand `obj` over under `key` (once per key), without waiting for the receiver. Tensors
        in `obj` must not change afterwards: they may be read later, from another thread. `obj`
        is not None (`recv` answers None for "not here"): wrap a value that may be None."""

    @abstractmethod
    def recv(self, key: str, timeout: float = 0.0) -> Any | None:
        """The object sent under `key`, once all of it is here (each key is handed out once),
        else None after `timeout` seconds (0: just look). Raises `TransferError` when it
        cannot come any more (the peer is lost)."""

    @abstractmethod
    def drop(self, key: str) -> None:
        """Nobody will read `key`: free it, sent or queued (sending end) or received (receiving end)."""

    @abstractmethod
    def close(self) -> None:
        """End this end of the session without waiting: what is queued and not sent is dropped."""


def open_transfer(kind: str | None, job: JobStore, session: str, sending: bool, *,
                  side: Callable[[], Executor] | None = None, timeout: float | None = None,
                  chunk_bytes: int | None = None) -> StateTransfer:
    """One end of session `session` between two ranks: `sending` for the rank that sends.
    `kind`: "direct" or "store" (None: $SCHEDC_TRANSFER, else `DEFAULT_KIND`); `side`: the
    executor that runs the store one's sends (None: the caller's thread)."""
    kind = kind or os.environ.get("SCHEDC_TRANSFER") or DEFAULT_KIND
    if kind == "store":
        return StoreTransfer(job, session, side=side)
    if kind == "direct":
        return DirectTransfer(job, session, sending, timeout=timeout or DEFAULT_TIMEOUT,
                              chunk_bytes=chunk_bytes or CHUNK_BYTES)
    raise ValueError(f"unknown state transfer {kind!r} (known: {', '.join(KINDS)})")


# -- through the store -------------------------------------------------------------------------

def _dump(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(blob: bytes):
    import torch

    return torch.load(io.BytesIO(blob), weights_only=True)


class StoreTransfer(StateTransfer):
    """Objects as ``torch.save`` blobs under ``<session>/<key>`` in the job's store."""

    def __init__(self, job: JobStore, session: str, *, side: Callable[[], Executor] | None = None):
        self.job = job  # used only on the sending thread (or the caller's): one connection, one thread
        self.prefix = f"{session}/"
        self.side = side
        self.received = 0
        self._stored: list[str] = []

    def _run(self, fn: Callable[[], Any]) -> None:
        # On the side executor, in order: a drop queued after a store runs after it.
        if self.side is None:
            fn()
        else:
            self.side().submit(fn)

    def send(self, key: str, obj: Any) -> None:
        _sendable(obj)
        job, full = self.job, self.prefix + key
        self._stored.append(full)
        self._run(lambda: job.put_blob(full, _dump(obj)))

    def recv(self, key: str, timeout: float = 0.0) -> Any | None:
        full = self.prefix + key
        deadline = time.monotonic() + timeout
        try:
            while (blob := self.job.blob(full)) is None:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(_POLL)
            self.job.drop_blob(full)  # the store's memory is the supervisor's: free each piece once read
        except RuntimeError as exc:  # torch's store errors: the sender's `close` freed the keys under it
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TransferError(f"`{key}` went away while it was read (the session ended): {why}") from None
        self.received += len(blob)
        return _load(blob)

    def drop(self, key: str) -> None:
        job, full = self.job, self.prefix + key
        self._run(lambda: job.drop_blob(full))

    def close(self) -> None:
        # Free what the receiver did not read (a session cancelled halfway, or ended by a failure).
        job, keys, self._stored = self.job, self._stored, []
        if keys:
            self._run(lambda: [job.drop_blob(k) for k in keys])


# -- direct, over a two-rank gloo group -----------------------------------------------------------

def _dtype(name: str):
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"unknown dtype {name!r} in a transfer header")
    return dtype


def _flatten(obj: Any, tensors: list) -> Any:
    """`obj`'s structure as JSON, each tensor replaced by its index in `tensors` (appended there).
    Every container is an object of one tag (``l`` list, ``u`` tuple, ``d`` dict as key/value
    pairs, ``o`` OrderedDict, with ``m`` its ``_metadata``, ``t`` tensor, ``b`` bytes), so none can
    be taken for another; scalars stay themselves
    (Python's JSON writes floats exactly, inf and nan included)."""
    import torch

    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_quantized:
            raise TypeError(f"a state transfer carries dense tensors only, not {obj.layout} / quantized")
        tensors.append(obj)
        return {"t": len(tensors) - 1}
    if isinstance(obj, list):
        return {"l": [_flatten(v, tensors) for v in obj]}
    if isinstance(obj, tuple) and type(obj) is tuple:
        return {"u": [_flatten(v, tensors) for v in obj]}
    if isinstance(obj, dict):
        pairs = [[_flatten(k, tensors), _flatten(v, tensors)] for k, v in obj.items()]
        if not isinstance(obj, collections.OrderedDict):
            return {"d": pairs}
        # A module's state_dict: its `_metadata` (per-module versions) steers load_state_dict.
        meta = getattr(obj, "_metadata", None)
        return {"o": pairs} if meta is None else {"o": pairs, "m": _flatten(meta, tensors)}
    if isinstance(obj, bytes):
        return {"b": base64.b64encode(obj).decode()}
    raise TypeError(f"a state transfer cannot carry a {type(obj).__name__}")


def _unflatten(node: Any, tensors: list) -> Any:
    if not isinstance(node, dict):
        return node
    if "o" in node:
        obj = collections.OrderedDict((_unflatten(k, tensors), _unflatten(x, tensors)) for k, x in node["o"])
        if "m" in node:
            obj._metadata = _unflatten(node["m"], tensors)
        return obj
    ((tag, v),) = node.items()
    if tag == "t":
        return tensors[v]
    if tag == "l":
        return [_unflatten(x, tensors) for x in v]
    if tag == "u":
        return tuple(_unflatten(x, tensors) for x in v)
    if tag == "d":
        return {_unflatten(k, tensors): _unflatten(x, tensors) for k, x in v}
    if tag == "b":
        return base64.b64decode(v)
    raise TransferError(f"unknown node {tag!r} in a transfer header")


def _bytes_of(t):
    """A tensor's bytes, as a flat uint8 view (contiguous: a copy only if it was not)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _chunks(sizes: list[int], chunk: int):
    """The byte stream of tensors of `sizes` bytes, laid end to end, in chunks of at most `chunk`
    bytes: for each, its length and its pieces (tensor index, start, end within that tensor)."""
    total = sum(sizes)
    i, at = 0, 0  # the tensor, and the offset within it, where the next chunk starts
    for begin in range(0, total, chunk):
        length = min(chunk, total - begin)
        pieces, need = [], length
        while need:
            while sizes[i] == at:  # an empty tensor, or one used up
                i, at = i + 1, 0
            take = min(need, sizes[i] - at)
            pieces.append((i, at, at + take))
            at += take
            need -= take
        yield length, pieces


class DirectTransfer(StateTransfer):
    """A two-rank gloo group between the sending end (group rank 0) and the receiving end (1),
    driven by one thread per end (see the module docstring). Keys under ``xfer/<session>/`` in the
    store: the group's rendezvous, and ``closed`` once the receiving end closed."""

    def __init__(self, job: JobStore, session: str, sending: bool, *, timeout: float = DEFAULT_TIMEOUT,
                 chunk_bytes: int = CHUNK_BYTES):
        self.session = session
        self.sending = sending
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.prefix = f"xfer/{session}/"
        self.received = 0
        self._job = job  # cloned by the thread: its own connection
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()  # (key, structure, tensors) to send
        self._arrived: dict[str, tuple[Any, int]] = {}  # key -> (obj, bytes) received, not yet handed out
        self._dropped: set[str] = set()
        self._closed = False
        self._failure: TransferError | None = None
        self._thread = threading.Thread(target=self._main, daemon=True,
                                        name=f"schedc-xfer-{'send' if sending else 'recv'}-{session}")
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------

    def send(self, key: str, obj: Any) -> None:
        if not self.sending:
            raise TransferError(f"transfer {self.session}: this is the receiving end")
        _sendable(obj)
        tensors: list = []
        skeleton = _flatten(obj, tensors)  # here: a value it cannot carry is the caller's error
        with self._cond:
            self._check()
            self._queue.append((key, skeleton, tensors))
            self._cond.notify_all()

    def recv(self, key: str, timeout: float = 0.0) -> Any | None:
        if self.sending:
            raise TransferError(f"transfer {self.session}: this is the sending end")
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._arrived:
                self._check()
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            obj, size = self._arrived.pop(key)
            self.received += size
            return obj

    def drop(self, key: str) -> None:
        with self._cond:
            self._queue = collections.deque(item for item in self._queue if item[0] != key)  # not sent yet
            if self._arrived.pop(key, None) is None and not self.sending:
                self._dropped.add(key)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._arrived.clear()
            self._cond.notify_all()
        if not self.sending and self._thread.is_alive():
            # This end's thread may be inside a gloo receive, which nothing here can cut short:
            # ask the sender (it looks between messages) to send the end, which the receive takes.
            job, key = self._job, f"{self.prefix}closed"
            threading.Thread(target=_quietly, args=(lambda: job.clone().store.set(key, "1"),), daemon=True,
                             name=f"schedc-xfer-close-{self.session}").start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for this end's thread to end (it ends `timeout` after its last wait began, at the
        latest); whether it has. A process that exits normally while the thread still holds its
        group may abort in gloo's destructors: join first, or leave with os._exit as workers do."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def error(self) -> str | None:
        return None if self._failure is None else str(self._failure)

    def _check(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))
        if self._closed:
            raise TransferError(f"transfer {self.session} is closed")

    # -- this end's thread ----------------------------------------------------------------------

    def _main(self) -> None:
        pg = None
        try:
            import torch.distributed as dist

            job = self._job.clone()
            try:
                pg = dist.ProcessGroupGloo(dist.PrefixStore(self.prefix, job.store), 0 if self.sending else 1, 2,
                                           timedelta(seconds=self.timeout))
            except Exception as exc:
                raise TransferError(f"the {self._peer()} did not join within {self.timeout:g} s "
                                    f"({_reason(exc)})") from None
            self._pg = pg
            self._closed_key = f"{self.prefix}closed"
            self._own = job  # this thread's connection
            if self.sending:
                self._send_loop()
            else:
                self._recv_loop()
        except _Closed:
            pass
        except Exception as exc:  # a lost peer (or a bug): the caller learns it at its next call
            if not isinstance(exc, TransferError):
                exc = TransferError(f"the {self._peer()} was lost ({_reason(exc)})")
            with self._cond:
                if not self._closed:
                    self._failure = type(exc)(f"transfer {self.session}: {exc}")
                self._cond.notify_all()
        finally:
            self._pg = None
            del pg  # this thread made the group and is the only one to use it: no wait of it is pending

    def _peer(self) -> str:
        return "receiving end" if self.sending else "sending end"

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except Exception as exc:
            raise TransferError(f"the {self._peer()} was lost during {what} ({_reason(exc)})") from None

    def _send_loop(self) -> None:
        import torch

        gone = False  # the receiving end closed
        while not gone:
            with self._cond:
                if not self._queue and not self._closed:
                    self._cond.wait(_SENDER_LOOKS)
                if self._closed:
                    break
                item = self._queue.popleft() if self._queue else None
            gone = self._own.store.check([self._closed_key])
            if item is not None and not gone:
                self._send_one(*item)
        # The end, which the receiver's waiting receive takes: it then knows the sender did not die.
        try:
            self._wait(self._pg.send([torch.tensor([-1], dtype=torch.int64)], 1, 0), "the end")
        except TransferError:
            if not gone:
                raise
        if gone:
            raise TransferClosed(f"the {self._peer()} closed the session")

    def _send_one(self, key: str, skeleton: Any, tensors: list) -> None:
        import torch

        tensors = [t.detach().cpu() for t in tensors]  # gloo sends from host memory
        views = [_bytes_of(t) for t in tensors]
        sizes = [v.numel() for v in views]
        header = {"key": key, "obj": skeleton, "bytes": sum(sizes),
                  "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]}
        blob = torch.frombuffer(bytearray(json.dumps(header, separators=(",", ":")).encode()), dtype=torch.uint8)
        # The length, then the header: the receiver waits for the next message inside a gloo
        # receive, where a sender that dies is seen at once (its connection closes).
        self._wait(self._pg.send([torch.tensor([blob.numel()], dtype=torch.int64)], 1, 0), f"`{key}`")
        self._wait(self._pg.send([blob], 1, 0), f"`{key}`")
        staging = [None] * _WINDOW
        # A message, once announced, is sent whole even if this end is closed meanwhile: the
        # receiver is inside it, and leaving would tear the group down under pending waits.
        with _Pending() as works:
            for c, (length, pieces) in enumerate(_chunks(sizes, self.chunk_bytes)):
                while len(works) >= _WINDOW:
                    self._wait(works.popleft(), f"`{key}`")
                if len(pieces) == 1:  # a chunk within one tensor: straight from its memory
                    i, a, b = pieces[0]
                    buf = views[i][a:b]
                else:
                    slot = c % _WINDOW  # the chunk that used this buffer before is sent by now
                    if staging[slot] is None:
                        staging[slot] = torch.empty(self.chunk_bytes, dtype=torch.uint8)
                    buf, at = staging[slot][:length], 0
                    for i, a, b in pieces:
                        buf[at:at + b - a].copy_(views[i][a:b])
                        at += b - a
                works.append(self._pg.send([buf], 1, 0))
            while works:
                self._wait(works.popleft(), f"`{key}`")

    def _recv_loop(self) -> None:
        import torch

        while True:
            size = torch.zeros(1, dtype=torch.int64)
            # Between two messages (a donor's training step): this wait cannot be cut short by
            # `close`; it ends when the sender sends, closes or dies, or after `timeout`.
            work = self._pg.recv([size], 0, 0)
            try:
                work.wait(timedelta(seconds=self.timeout))
            except Exception as exc:
                if self._closed:
                    raise _Closed() from None
                raise TransferError(f"the {self._peer()} was lost, or sent nothing for {self.timeout:g} s "
                                    f"({_reason(exc)})") from None
            if int(size[0]) < 0:
                raise TransferClosed(f"the {self._peer()} closed the session")
            header = torch.empty(int(size[0]), dtype=torch.uint8)
            self._wait(self._pg.recv([header], 0, 0), "a header")
            # Closed or not, on to the sender's end: leaving now would break the group under a
            # message it may be sending (closed, what comes is dropped).
            self._recv_one(json.loads(header.numpy().tobytes()), header.numel() + 8)

    def _recv_one(self, header: dict, header_bytes: int) -> None:
        import torch

        key = header["key"]
        tensors = [torch.empty(shape, dtype=_dtype(dtype)) for dtype, shape in header["tensors"]]
        views = [_bytes_of(t) for t in tensors]  # views: filling them fills the tensors
        sizes = [v.numel() for v in views]
        if sum(sizes) != header["bytes"]:
            raise TransferError(f"transfer {self.session}: the header of `{key}` does not add up")
        staging = [None] * _WINDOW
        landing: collections.deque = collections.deque()  # (staging buffer or None, pieces) per work

        def land(work) -> None:
            self._wait(work, f"`{key}`")
            buf, pieces = landing.popleft()
            if buf is not None:  # scatter the staged chunk into its tensors
                at = 0
                for i, a, b in pieces:
                    views[i][a:b].copy_(buf[at:at + b - a])
                    at += b - a

        with _Pending() as works:
            for c, (length, pieces) in enumerate(_chunks(sizes, self.chunk_bytes)):
                while len(works) >= _WINDOW:
                    land(works.popleft())
                if len(pieces) == 1:  # a chunk within one tensor: straight into its memory
                    i, a, b = pieces[0]
                    target, staged = views[i][a:b], None
                else:
                    slot = c % _WINDOW  # the chunk that used this buffer before is scattered by now
                    if staging[slot] is None:
                        staging[slot] = torch.empty(self.chunk_bytes, dtype=torch.uint8)
                    target = staged = staging[slot][:length]
                works.append(self._pg.recv([target], 0, 0))
                landing.append((staged, pieces))
            while works:
                land(works.popleft())
        obj = _unflatten(header["obj"], tensors)
        with self._cond:
            if key in self._dropped:
                self._dropped.discard(key)
            elif not self._closed:
                self._arrived[key] = (obj, header_bytes + header["bytes"])
            self._cond.notify_all()


class _Pending:
    """The works of one message in flight; on the way out after a failure, each is waited for
    (briefly: the pair is broken, they fail at once) before the group can be torn down."""

    def __init__(self):
        self.works: collections.deque = collections.deque()

    def __enter__(self) -> collections.deque:
        return self.works

    def __exit__(self, *exc) -> None:
        while self.works:
            try:
                self.works.popleft().wait(timedelta(seconds=1))
            except Exception:
                pass


class _Closed(Exception):
    """This end was closed: its thread leaves quietly."""


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:  # the store is gone: so is the session, and the sender with it
        pass


def _sendable(obj: Any) -> None:
    if obj is None:
        raise ValueError("a state transfer does not send a bare None (recv's answer for \"not here yet\")")


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]


def warn(message: str) -> None:
    """A transfer that failed is not fatal to a rank (its session is cancelled or started again):
    say so on stderr, where the rank's agent keeps its output."""
    print(f"warning: {message}", file=sys.stderr, flush=True)
