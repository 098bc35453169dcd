"""Point to point and stage collectives of a rank, with timeouts: what `Runtime` talks through.

Every message carries a tag unique per (iteration, kind, d, m, boundary), so
re-routed microbatches and back-to-back iterations never mix up. Every wait
has a timeout: a dead peer turns into a `RunError` naming this rank, the
peer and the op, never a hang; a live supervisor's abort (`Interrupted`)
ends a wait early.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from datetime import timedelta
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from schedc.diagnostics import RunError, error
from schedc.runtime.channels import KINDS, ReceiveOrder
from schedc.runtime.manifest import Manifest

# Tags repeat after this many iterations. Messages only pass between neighbouring stages,
# and a rank cannot finish iteration k+1 before its neighbours have sent it their part of
# k+1, so neighbours are never more than one iteration apart: 16 is ample, and keeps tags
# below 2**31 for up to 16*3*D*M*S < 2**31 (three kinds of message; e.g. D = M = 256, S = 64).
_TAG_ITERATIONS = 16
EMULATED_MESSAGE = 16  # floats sent per boundary message in --emulate mode (no model to size it)
#: The longest pause between two looks at a generation-start collective (`all_reduce_min`),
#: seconds: what that once-per-generation wait may add after the collective completes.
POLL_MAX_S = 0.002
#: Seconds a generation that ends gives a posted receive to show it has its message
#: (`Transport.landed`): what it may add to a recovery when the message never came.
LANDED_WAIT = 0.05


class Message(NamedTuple):
    """One boundary message: the activation (`kind` ACTIVATION) or input gradient (GRADIENT)
    of microbatch (d, mb) across the boundary after stage `boundary`, in `iteration`."""

    iteration: int
    kind: int
    d: int
    mb: int
    boundary: int


def message_tag(iteration: int, kind: int, d: int, m: int, boundary: int, manifest: Manifest) -> int:
    """A tag unique per (iteration, kind, d, m, boundary) among messages that can be in flight."""
    tag = (iteration % _TAG_ITERATIONS) * KINDS + kind
    tag = tag * manifest.dp + d
    tag = tag * manifest.microbatches + m
    return tag * manifest.pp + boundary


class Interrupted(Exception):
    """The run this rank belongs to was stopped from outside (a live supervisor aborted its
    generation): leave the iteration at once. Not an error of this rank."""


class Transport:
    """Point to point and stage collectives over gloo or NCCL process groups, with timeouts.

    Tensors travel on `wire` (the CPU for gloo, the GPU for NCCL): a gloo transport of
    a rank that computes on a GPU copies what it sends to the CPU and what it receives
    back to `device`. Messages are matched by tag (gloo), or, when `order` is given,
    by their place in the sender's program (`schedc.runtime.channels`), as NCCL,
    which has no tags, needs; `channels` are then the groups activations and
    gradients travel over (one each, so that a send blocked in one direction never
    holds up a receive in the other).

    `world` spans the live ranks (its rank i is ``manifest.live_ranks[i]``);
    `stage` spans the live ranks of this rank's stage in rank order (None when
    the stage has a single live GPU: nothing to all-reduce). `interrupted`,
    when given, is asked before every blocking wait; once it answers True the
    wait raises `Interrupted` instead of blocking (a wait already blocked ends
    when a peer's connection closes: a live supervisor kills a failed rank, and
    every rank that aborts drops its groups, which closes theirs).
    """

    def __init__(self, manifest: Manifest, rank: int, timeout: float, *, world, stage,
                 interrupted: Callable[[], bool] | None = None, device: str | torch.device = "cpu",
                 wire: str | torch.device = "cpu", order: ReceiveOrder | None = None, channels=None):
        self.manifest = manifest
        self.rank = rank
        self.timeout = timeout
        self.world = world
        self.stage = stage
        self.interrupted = interrupted
        self.device = torch.device(device)
        self.wire = torch.device(wire)
        self.host_waits = self.wire.type == "cpu"  # NCCL waits only order the GPU's streams
        self.order = order
        self.channels = channels or (world, world)
        self._posted: dict[tuple[int, int], tuple[int, int]] = {}  # (src, kind) -> next (iteration, index)
        self._early: dict[tuple[int, Message], tuple[object, torch.Tensor]] = {}
        self.waiting: str | None = None  # what this rank is blocked on now (read by a heartbeat thread)
        # Sends of this iteration and the one before. gloo completes a send only once the peer
        # has posted its receive, and reports it complete only after `wait`; a peer has received
        # everything this rank sent in iteration i by the time this rank ends iteration i+1 (each
        # iteration needs messages from every neighbour stage, which that stage sends only after
        # its own iteration i), so waiting for them then does not block and frees their tensors.
        self._pending: list[tuple[object, str]] = []
        self._pending_before: list[tuple[object, str]] = []
        # Fault injection: every send is posted this many seconds late by a thread of its own, as
        # over a slow link (the sender goes on at once; only its peers wait longer).
        self.send_delay = 0.0
        self._late: _LateSends | None = None
        self._stranded = False  # a collective was left unfinished (`_poll`): its groups go on a thread

    @classmethod
    def over_default_group(cls, manifest: Manifest, rank: int, timeout: float, *, device: str = "cpu",
                           backend: str = "gloo", order: ReceiveOrder | None = None) -> "Transport":
        """A transport over `torch.distributed`'s default group (`schedc run`, torchrun)."""
        # Every rank creates every group, in the same order: new_group is collective.
        groups = [dist.new_group([manifest.dist_rank(r) for r in ranks], backend=backend,
                                 timeout=timedelta(seconds=timeout))
                  for ranks in manifest.stage_groups]
        channels = None
        if backend == "nccl":
            channels = (dist.group.WORLD, dist.new_group(backend="nccl", timeout=timedelta(seconds=timeout)))
        stage = manifest.coords[rank][1]
        mine = groups[stage] if len(manifest.stage_groups[stage]) > 1 else None
        wire = device if backend == "nccl" else "cpu"
        return cls(manifest, rank, timeout, world=dist.group.WORLD, stage=mine, device=device, wire=wire,
                   order=order, channels=channels)

    def send(self, tensor: torch.Tensor, to: int, msg: Message, what: str) -> None:
        tensor = tensor.to(self.wire).contiguous()
        group, tag = self._route(msg)

        def post():
            return self._post(lambda: group.send([tensor], self.manifest.dist_rank(to), tag),
                              f"{what} to rank {to}", peer=to)

        if self.send_delay > 0:
            if self._late is None:
                self._late = _LateSends()
            self._late.put(time.monotonic() + self.send_delay, post, what, self._pending)
            return
        self._pending.append((post(), what))

    def recv(self, shape, dtype, frm: int, msg: Message, what: str) -> torch.Tensor:
        what = f"{what} from rank {frm}"
        self._check_interrupted(what)
        if self.order is None:
            buf = torch.empty(shape, dtype=dtype, device=self.wire)
            group, tag = self._route(msg)
            work = self._post(lambda: group.recv([buf], self.manifest.dist_rank(frm), tag), what, peer=frm)
        else:
            work, buf = self._recv_in_order(shape, dtype, frm, msg, what)
        self._wait(work, what, peer=frm)
        return buf.to(self.device)

    def post_recv(self, shape, dtype, frm: int, msg: Message, what: str) -> tuple[object, torch.Tensor]:
        """Post a receive and go on: (its work, its buffer), for `wait_posted` later (a message
        wanted later than it may come; by tag, so not with `order`)."""
        if self.order is not None:
            raise RuntimeError("a posted receive is matched by its tag: not with a receive order")
        self._check_interrupted(what)
        buf = torch.empty(shape, dtype=dtype, device=self.wire)
        group, tag = self._route(msg)
        return self._post(lambda: group.recv([buf], self.manifest.dist_rank(frm), tag), what, peer=frm), buf

    def wait_posted(self, work, buf: torch.Tensor, frm: int, what: str) -> torch.Tensor:
        """Wait for a receive `post_recv` posted: its tensor, on this rank's device."""
        self._check_interrupted(what)
        self._wait(work, what, peer=frm)
        return buf.to(self.device)

    def landed(self, work) -> bool:
        """Whether a posted receive has its message, waiting LANDED_WAIT at most: for a generation
        that ends (gloo reports a receive complete only once waited for, whatever has arrived; a
        wait that times out may break the group's connections, which then close anyway). One
        left unfinished makes the groups go on a thread, as a stranded collective's."""
        try:
            if work.wait(timedelta(seconds=LANDED_WAIT)) is not False:
                return True
        except RuntimeError:
            pass
        self._stranded = True
        return False

    def _route(self, msg: Message) -> tuple[object, int]:
        """The group a message travels over and its tag (with `order`: the tag is the kind)."""
        if self.order is None:
            return self.world, message_tag(*msg, self.manifest)
        return self.channels[msg.kind], msg.kind

    def _recv_in_order(self, shape, dtype, frm: int, msg: Message, what: str):
        """Post receives from `frm` in the order `frm` sends, up to and including `msg`: the
        ones before it (sent earlier, wanted later) wait in `_early` for their turn."""
        channel = (frm, msg.kind)
        key = (frm, msg)
        if key not in self._early:
            sequence = self.order.sent_to_me(frm, msg.kind)
            want = (msg.iteration, self.order.index(frm, msg.kind, msg.d, msg.mb, what))
            it, i = self._posted.get(channel, (msg.iteration, 0))
            group, tag = self._route(msg)
            while (it, i) <= want:
                d, mb = sequence[i]
                early = Message(it, msg.kind, d, mb, msg.boundary)
                buf = torch.empty(shape, dtype=dtype, device=self.wire)
                work = self._post(lambda: group.recv([buf], self.manifest.dist_rank(frm), tag), what, peer=frm)
                self._early[(frm, early)] = (work, buf)
                it, i = (it, i + 1) if i + 1 < len(sequence) else (it + 1, 0)
            self._posted[channel] = (it, i)
        return self._early.pop(key)

    def all_reduce_stage(self, stage: int, tensor: torch.Tensor) -> None:
        if self.stage is not None:
            ranks = self.manifest.stage_groups[stage]
            what = f"the gradient all-reduce of stage {stage} with ranks {list(ranks)}"
            self._check_interrupted(what)
            onwire = tensor.to(self.wire)
            self._wait(self._post(lambda: self.stage.allreduce([onwire]), what), what)
            if onwire is not tensor:
                tensor.copy_(onwire)

    def barrier(self, what: str) -> None:
        self._check_interrupted(what)
        self._wait(self._post(lambda: self.world.allreduce([torch.zeros(1, device=self.wire)]), what), what)

    def all_reduce_min(self, tensor: torch.Tensor, what: str) -> None:
        """Element-wise minimum of `tensor` over every live rank, in place.

        A live run's first collective of a generation (the members' step counts): a member
        may have formed its groups while a peer abandoned the generation while forming its
        own (the generation was aborted meanwhile). That peer never posts its side and its
        connections stay open, so no error ends the wait: it is waited for by looking at the
        work (`_poll`), which an abort ends at once. Once it completes, every member has
        formed its groups, and a member that leaves later drops them, which ends its peers'
        waits (the rest of a generation's waits block in gloo, as they may)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._check_interrupted(what)
        self._wait(self._post(lambda: self.world.allreduce([tensor], opts), what), what, poll=True)

    def exchange_blobs(self, sends: dict[tuple[int, int], bytes], receives: list[tuple[int, int]],
                       what: str) -> dict[tuple[int, int], bytes]:
        """Bytes point to point over the world group, before any iteration's message is in flight
        (a live run's layers moved in place: `schedc.live.move`): ``sends[(to, key)]`` goes to
        rank `to`, and what ``(frm, key)`` in `receives` names comes back, by key (0 <= key
        < 2**20; a pair of ranks moves one blob per key). Sizes first, then the bytes."""
        world, dist_rank = self.world, self.manifest.dist_rank
        self._check_interrupted(what)
        sizes = {}
        for frm, key in receives:
            buf = torch.zeros(1, dtype=torch.int64)
            sizes[(frm, key)] = (self._post(lambda: world.recv([buf], dist_rank(frm), 2 * key), what, peer=frm), buf)
        posted = []
        for (to, key), blob in sends.items():
            size = torch.tensor([len(blob)], dtype=torch.int64)
            body = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)
            posted.append((self._post(lambda: world.send([size], dist_rank(to), 2 * key), what, peer=to), to))
            posted.append((self._post(lambda: world.send([body], dist_rank(to), 2 * key + 1), what, peer=to), to))
        bodies = {}
        for (frm, key), (work, buf) in sizes.items():
            self._wait(work, f"{what} from rank {frm}", peer=frm)  # (gloo: a receive completes when waited for)
            body = torch.empty(int(buf[0]), dtype=torch.uint8)
            bodies[(frm, key)] = (self._post(lambda: world.recv([body], dist_rank(frm), 2 * key + 1), what,
                                             peer=frm), body)
        out = {}
        for (frm, key), (work, body) in bodies.items():
            self._wait(work, f"{what} from rank {frm}", peer=frm)
            out[(frm, key)] = body.numpy().tobytes()
        for work, to in posted:
            self._wait(work, f"{what} to rank {to}", peer=to)
        return out

    def begin_iteration(self) -> None:
        """Wait for the sends of the iteration before the one that just ended (see __init__)."""
        if self._late is not None:
            self._late.drain()
        for work, what in self._pending_before:
            self._wait(work, f"{what} to be received")
        self._pending_before, self._pending = self._pending, []

    def flush(self) -> None:
        """Wait for every send posted so far (at the end of a run)."""
        if self._late is not None:
            self._late.drain()
        for work, what in self._pending_before + self._pending:
            self._wait(work, f"{what} to be received")
        self._pending_before, self._pending = [], []

    def close(self) -> None:
        """Drop the process groups and unfinished sends: their connections close, so a peer
        blocked on this rank stops waiting (used when a live run's generation is aborted)."""
        self._pending_before, self._pending = [], []
        self._early.clear()
        if self._late is not None:
            self._late.stop()
            self._late = None
        groups = [self.world, self.stage, *(self.channels or ())]
        self.world = self.stage = self.channels = None  # the last references: the groups go
        if self._stranded:
            # A gloo group whose collective still runs holds its destructor until that
            # collective ends (the peer's exit, or gloo's own timeout): let the last references
            # go on a thread of its own, not on this rank's.
            threading.Thread(target=groups.clear, name="schedc-drop-groups", daemon=True).start()
        del groups

    def _check_interrupted(self, what: str) -> None:
        if self.interrupted is not None and self.interrupted():
            raise Interrupted(f"rank {self.rank} stopped before waiting for {what}")

    def _post(self, start: Callable, what: str, peer: int | None = None):
        """Start a send, receive or collective; a group broken by a dead peer fails here already."""
        try:
            return start()
        except RuntimeError as exc:
            raise self._lost(exc, what, peer) from None

    def _wait(self, work, what: str, peer: int | None = None, *, poll: bool = False) -> None:
        self.waiting = what
        try:
            # NCCL: wait() orders this rank's compute stream after the transfer and returns at
            # once (the process group's watchdog ends a transfer that outlives its timeout).
            if not self.host_waits:
                ok = work.wait()
            elif poll and self.interrupted is not None:
                ok = self._poll(work, what)
            else:
                ok = work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise self._lost(exc, what, peer) from None
        finally:
            self.waiting = None
        if ok is False:
            raise RunError([error("E530", f"rank {self.rank} waited {self.timeout:g} s for {what}")])

    def _poll(self, work, what: str) -> bool:
        """Wait for `work` by looking whether it completed, asking `interrupted` in between, for
        `timeout` seconds at most (False then). No gloo wait with a timeout is made: one that
        times out can leave the group's connections unusable for the waits after it."""
        deadline = time.monotonic() + self.timeout
        pause = 0.0001
        while not work.is_completed():
            if self.interrupted():
                self._stranded = True
                raise Interrupted(f"rank {self.rank} stopped while waiting for {what}")
            if time.monotonic() > deadline:
                self._stranded = True
                return False
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        return work.wait()  # completed: returns at once, or raises what the work failed with

    def _lost(self, exc: RuntimeError, what: str, peer: int | None) -> Exception:
        """The error a failed wait becomes: `Interrupted` when the run was stopped from outside, else E530."""
        if self.interrupted is not None and self.interrupted():
            return Interrupted(f"rank {self.rank} stopped while waiting for {what}")
        reason = _short_reason(exc)
        timed_out = "timeout" in reason.lower() or "timed out" in reason.lower()
        msg = (f"rank {self.rank} waited {self.timeout:g} s for {what}" if timed_out
               else f"rank {self.rank} lost {what} ({reason})")
        hint = (f"rank {peer} died or is stuck; see its own error" if peer is not None
                else "a rank of the group died or is stuck; see the other ranks' errors")
        return RunError([error("E530", msg, hint=hint)])


class _LateSends:
    """Posts sends at their due time, in order, from a thread of its own (a slow link)."""

    def __init__(self):
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="schedc-slow-link", daemon=True)
        self._thread.start()

    def put(self, due: float, post, what: str, pending: list) -> None:
        with self._cond:
            self._queue.append((due, post, what, pending))
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every queued send is posted."""
        with self._cond:
            while (self._queue or self._busy) and not self._stopped:
                self._cond.wait(0.05)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                due, post, what, pending = self._queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                self._queue.popleft()
                self._busy = True
            try:
                pending.append((post(), what))
            except Exception:  # the group broke: the main thread's next wait reports it
                pass
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def _short_reason(exc: BaseException) -> str:
    """gloo's message without its source location and boilerplate: "connection reset by peer"."""
    import re

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # "[.../pair.cc:537] "
    text = re.sub(r"\s*\[[0-9.:\[\]]+\]:\d+", "", text)  # " [127.0.0.1]:28585"
    text = text.split(". This is typically")[0]
    text = text.rstrip(".")
    return text[:1].lower() + text[1:]
