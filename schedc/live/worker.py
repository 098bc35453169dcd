"""A rank's process in a live run: one generation after another, its state kept in memory.

The loop of `LiveWorker.run`:

1. wait for the newest generation (`membership.Generation`) that names
   this rank (or for ``stop``);
2. **join**: mark ``join/N/R`` and wait (abortably) until every member has,
   so no member builds process groups with a peer that is already gone;
3. **connect**: gloo groups for generation N under the store prefix
   ``gN/``: one over all members (point to point), one over this stage's
   members (the gradient all-reduce);
4. **resume**: restore a checkpoint (or the initial weights) when the
   generation says so; otherwise agree with every member on the iteration
   boundary to resume from (all-reduce MIN of the steps applied) and roll
   back the last step if this rank is one ahead (`schedc.live.rollback`);
5. **run** the generation's program for every remaining iteration,
   reporting each one; then report ``done`` and go back to 1 (a failure
   elsewhere may still roll the last iteration back).

Whenever the supervisor aborts the generation (its heartbeat thread sees
``abort``) or a peer's connection breaks, the iteration stops at the next
wait, the groups are dropped (which unblocks peers waiting on this rank),
the work of the interrupted iteration is forgotten, and the worker reports
``aborted`` with the steps it has applied. Weights and optimizer state stay
in memory. A program error (not a lost peer) ends the worker with a
diagnostic: that is a bug to report, not a GPU to route around.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
import traceback
import types
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

from schedc.diagnostics import RunError, SchedcError, error
from schedc.live import checkpoint
from schedc.live.inject import Injection, Trigger
from schedc.live.membership import Generation, Heartbeat, JobStore
from schedc.live.rollback import StepSnapshot, roll_back, rollback_target
from schedc.runtime.manifest import Manifest

#: Exit status of a worker that stopped on an error of its own (it reported a diagnostic first).
EXIT_ERROR = 1
#: Seconds a worker waits for its agent to carry out an injection it asked for.
INJECT_WAIT = 10.0
#: Seconds a store request may wait (a key that a generation's process groups need, once every
#: member has joined, is there in milliseconds; a member dying in between makes the others wait this).
CONNECT_TIMEOUT = 15.0
_POLL = 0.005


def worker_main(store_host: str, store_port: int, rank: int, host: int) -> None:
    """Entry of a worker process (started by an agent)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    import torch

    torch.set_num_threads(1)
    job = None
    try:
        job = JobStore.connect(store_host, store_port, timeout=CONNECT_TIMEOUT)
        LiveWorker(job, rank, host).run()
    except SchedcError as exc:
        _report_error(job, rank, [d.to_json() for d in exc.diagnostics])
        os._exit(EXIT_ERROR)
    except BaseException as exc:  # a bug or a broken model: a diagnostic with the frame
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
        _report_error(job, rank, [{"code": "E590", "message": f"rank {rank} failed: {type(exc).__name__}: {exc}{at}"}])
        os._exit(EXIT_ERROR)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: old process groups may still hold threads


def _report_error(job: JobStore | None, rank: int, diagnostics: list[dict]) -> None:
    if job is None:
        print("\n".join(f"error[{d['code']}]: {d['message']}" for d in diagnostics), file=sys.stderr)
        return
    try:
        job.report({"kind": "error", "rank": rank, "diagnostics": diagnostics})
    except Exception:
        pass


class LiveWorker:
    """One schedule rank's process across generations (see the module docstring)."""

    def __init__(self, job: JobStore, rank: int, host: int):
        self.job = job
        self.rank = rank
        self.host = host
        self.config = job.config()
        self.generation = -1
        self.iteration = -1
        self.ops = 0
        self.state = "idle"
        self._seq = 0
        self.rt = None
        self.snapshot: StepSnapshot | None = None
        self.trigger = Trigger(())
        self._writer: ThreadPoolExecutor | None = None
        self._writer_job: JobStore | None = None
        self.heartbeat = Heartbeat(job.clone(), rank, self.config["heartbeat_interval"], self._payload)

    # -- what the heartbeat thread sends, and the abort flag it keeps ---------------------

    def _payload(self) -> str:
        self._seq += 1
        rt = self.rt
        state = self.state
        if state == "run" and rt is not None and rt.transport is not None and getattr(rt.transport, "waiting", None):
            state = "wait"
        return f"{self._seq} {self.generation} {self.iteration} {self.ops} {state}"

    def aborted(self) -> bool:
        return self.heartbeat.aborted >= self.generation >= 0

    # -- the generation loop -----------------------------------------------------------------

    def run(self) -> None:
        self.heartbeat.start()
        self.job.report({"kind": "started", "rank": self.rank, "pid": os.getpid(), "host": self.host})
        number = self._next_generation(after=-1)
        while number is not None:
            gen = self.job.generation(number)
            if self.rank not in gen.members:
                return  # no longer part of the run
            self._serve(gen)
            number = self._next_generation(after=gen.number)
        self.heartbeat.halt()

    def _next_generation(self, after: int) -> int | None:
        """The newest generation after `after`, or None once the run is stopped."""
        while True:
            if self.heartbeat.stopped or self.job.stopped():
                return None
            latest = self.job.latest_generation()
            if latest > after:
                return latest
            time.sleep(_POLL * 2)

    def _serve(self, gen: Generation) -> None:
        from schedc.runtime.runtime import Interrupted

        self.generation = gen.number
        self.state = "join"
        manifest = Manifest.from_json(gen.manifest)
        if self.rt is None:
            self._build(manifest)
        self.trigger = Trigger([Injection.from_json(j) for j in gen.injections if self.rank in j["ranks"]])
        transport = None
        try:
            self._fire(self.trigger.at_recovery(gen.number))
            self.job.join(gen.number, self.rank)
            self._wait_joined(gen)
            transport = self._connect(gen, manifest)
            self.rt.retarget(manifest, transport)
            start, undone = self._resume(gen, transport)
            program = self._program(gen)
            self.job.report({"kind": "ready", "rank": self.rank, "gen": gen.number, "start": start,
                             "undone": undone, "t": time.time()})
            self.state = "run"
            for it in range(start, self.config["iterations"]):
                if self.aborted():
                    raise Interrupted("aborted between iterations")
                self.iteration = it
                self._fire(self.trigger.at_iteration_start(it))
                self.rt.begin_iteration(it)
                t0 = time.time()
                program.iteration(self.rt)
                self.job.report({"kind": "iter", "rank": self.rank, "gen": gen.number, "it": it, "t0": t0,
                                 "t1": time.time(), "loss": self.rt.iteration_loss, "steps": self.rt.steps_done})
                self._maybe_checkpoint(gen)
            transport.flush()
            self._finish(gen)
        except (Interrupted, RunError) as exc:
            if isinstance(exc, RunError) and not _lost_peer(exc):
                raise  # the program broke a rule: a bug, not a failure to route around
            self.job.report({"kind": "aborted", "rank": self.rank, "gen": gen.number, "steps": self.rt.steps_done,
                             "reason": _reason(exc), "t": time.time()})
        finally:
            if transport is not None:
                transport.close()
            if self.rt is not None:
                self.rt.abandon_iteration()
            self.state = "idle"

    # -- steps of a generation -----------------------------------------------------------------

    def _build(self, manifest: Manifest) -> None:
        from schedc.runtime.runtime import Runtime

        self.rt = Runtime(manifest, self.rank, transport=None, emulate=self.config["emulate"], observer=self,
                          reduce_loss=True)
        self.snapshot = StepSnapshot(self.rt.module, getattr(self.rt, "optimizer", None))

    def _wait_joined(self, gen: Generation) -> None:
        from schedc.runtime.runtime import Interrupted

        while not self.job.all_joined(gen.number, gen.members):
            if self.aborted():
                raise Interrupted(f"generation {gen.number} was aborted while its members joined")
            time.sleep(_POLL)

    def _connect(self, gen: Generation, manifest: Manifest):
        import torch.distributed as dist

        from schedc.runtime.runtime import Transport

        # The main thread's own store connection: building the groups over a fresh `clone()`
        # stalls for 5 s every few generations (measured with torch 2.13; the same connection never).
        store = self.job.store
        timeout = timedelta(seconds=self.config["wait_timeout"])
        n = gen.number
        mine = [r for r in gen.members if manifest.coords[r][1] == self.rt.stage]
        try:
            world = dist.ProcessGroupGloo(dist.PrefixStore(f"g{n}/world/", store), gen.members.index(self.rank),
                                          len(gen.members), timeout)
            stage = None
            if len(mine) > 1:
                stage = dist.ProcessGroupGloo(dist.PrefixStore(f"g{n}/stage{self.rt.stage}/", store),
                                              mine.index(self.rank), len(mine), timeout)
        except RuntimeError as exc:  # a member died while the groups formed (or the store timed out)
            raise RunError([error("E530", f"rank {self.rank} could not connect generation {n}: "
                                          f"{_reason(exc)}")]) from None
        return Transport(manifest, self.rank, self.config["wait_timeout"], world=world, stage=stage,
                         interrupted=self.aborted)

    def _resume(self, gen: Generation, transport) -> tuple[int, bool]:
        """(iteration to start from, whether this rank undid its last step)."""
        import torch

        if gen.restore is not None:
            self._restore(gen.restore)
            return self.rt.steps_done, False
        # One all-reduce MIN of (steps, -steps): the fewest and the most steps any member applied.
        steps = torch.tensor([self.rt.steps_done, -self.rt.steps_done], dtype=torch.int64)
        transport.all_reduce_min(steps, "the members' step counts")
        target = rollback_target([int(steps[0]), -int(steps[1])])
        undone = roll_back(self.rt.steps_done, target, self.snapshot)
        self.rt.steps_done = target
        return target, undone

    def _restore(self, restore: str) -> None:
        if restore == "initial":
            state = self.rt.initial_stage_state()
        else:
            state = checkpoint.load_stage(checkpoint.read(Path(restore)), self.rt.stage)
        self.rt.load_stage_state(state)
        self.snapshot.steps = None

    def _program(self, gen: Generation):
        text = self.job.program(gen.number, self.rank)
        module = types.ModuleType(f"schedc_gen{gen.number}_rank{self.rank}")
        exec(compile(text, f"<generation {gen.number}, rank {self.rank}>", "exec"), module.__dict__)
        return module

    def _maybe_checkpoint(self, gen: Generation) -> None:
        every = self.config["checkpoint_every"]
        steps = self.rt.steps_done
        if not every or steps % every or not self._stage_writer(gen):
            return
        state = self.rt.stage_state()  # copies: training goes on while a thread saves them
        root = Path(self.config["checkpoint_dir"])
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="schedc-checkpoint")
            self._writer_job = self.job.clone()  # a connection of its own (one per thread)
        report = {"rank": self.rank, "stage": self.rt.stage, "iteration": steps, "gen": gen.number}

        def save() -> None:
            try:
                checkpoint.write_stage(root, steps, self.rt.stage, state)
            except Exception as exc:  # a full or read-only disk: the supervisor says so; training goes on
                self._writer_job.report({"kind": "ckpt_error", "reason": _reason(exc), **report})
                return
            self._writer_job.report({"kind": "ckpt", **report})

        self._writer.submit(save)

    def _stage_writer(self, gen: Generation) -> bool:
        """The lowest live rank of this stage writes for it (every member holds the same state)."""
        coords = gen.manifest["coords"]
        mine = [r for r in gen.members if coords[str(r)][1] == self.rt.stage]
        return self.rank == min(mine)

    def _finish(self, gen: Generation) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self.config["want_weights"] and not self.config["emulate"] and self._stage_writer(gen):
            import torch

            buf = io.BytesIO()
            torch.save(self.rt.state_dict(), buf)
            self.job.put_weights(gen.number, self.rt.stage, buf.getvalue())
        self.job.report({"kind": "done", "rank": self.rank, "gen": gen.number, "steps": self.rt.steps_done,
                         "t": time.time()})

    # -- injection ---------------------------------------------------------------------------

    def _fire(self, inj: Injection | None) -> None:
        """Ask this host's agent to carry out `inj` on its targets, this process among them, and
        wait here to be killed or stopped: the fault lands exactly at this point of the program."""
        if inj is None:
            return
        self.job.command(self.host, {"op": "inject", "id": inj.index, "rank": self.rank,
                                     "iteration": self.iteration, "t": time.time()})
        deadline = time.monotonic() + INJECT_WAIT
        while time.monotonic() < deadline:
            time.sleep(0.01)
        raise RunError([error("E563", f"rank {self.rank}: injection `{inj}` was not carried out within "
                                      f"{INJECT_WAIT:g} s", hint="its agent did not answer; see the agent's output")])

    # -- OpObserver: called by the runtime around every op --------------------------------------

    def op_ready(self, kind: str, d: int, mb: int | None) -> None:
        if kind == "O":
            self.snapshot.take(self.rt.steps_done)
        if self.trigger:
            self._fire(self.trigger.at_op(self.iteration, "during", kind, mb))

    def op_done(self, kind: str, d: int, mb: int | None) -> None:
        self.ops += 1
        if self.trigger:
            self._fire(self.trigger.at_op(self.iteration, "after", kind, mb))


def _lost_peer(exc: RunError) -> bool:
    """A peer's connection broke or a wait ran out: the run lost a member, not this rank's fault."""
    return any(code in ("E530", "E531", "E532") for code in exc.codes)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RunError):
        return exc.diagnostics[0].message
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]
