"""Start every live rank of compiled programs as a local process (gloo) and watch them.

`launch` is what `schedc run` does. Ranks are started through
`schedc.runtime.processes.LocalProcesses`, as a live run's agents start
theirs: forked from a forkserver that has imported torch once, so a run of L
ranks does not pay L torch imports, and later runs in the same Python
process start in milliseconds. Ranks rendezvous over TCP at
127.0.0.1 on a free port; ``OMP_NUM_THREADS=1`` in every rank.

A rank that fails reports diagnostics; one that dies (killed, crashed) is
named by its exit status. The run then fails with a `RunError` (E5xx)
holding both, and nothing is returned as if the iterations had finished.
"""

from __future__ import annotations

import io
import math
import multiprocessing as mp
import signal
import socket
import time
from multiprocessing.connection import wait as wait_connections
from pathlib import Path
from typing import Callable

from schedc.diagnostics import Diagnostic, RunError, error
from schedc.limits import MAX_ITERATIONS, count_problem
from schedc.live.protocol import IterationDone, Weights, WorkerError
from schedc.runtime.manifest import Manifest, load_manifest, refuse_tensor_parallel
from schedc.runtime.processes import LocalProcesses, forkserver_context
from schedc.runtime.result import IterationRecord, RunResult

#: Seconds the other ranks have, once one failed, to report what they were waiting for before
#: they are stopped: a rank that fails at its start would else keep the others in the store's
#: rendezvous for their whole --timeout (60 s), its own error buried among theirs.
FAILED_GRACE = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """A running set of rank processes; `wait` collects their reports.

    Exposed so a caller (a test, a launcher) can watch or kill ranks: `processes`
    maps schedule rank -> `multiprocessing.Process`.
    """

    def __init__(self, out_dir: Path | str, *, iterations: int | None = None, emulate: bool = False,
                 timeout: float = 60.0, want_weights: bool = False, device: str = "cpu", backend: str = "auto",
                 ordered: bool = False):
        self.out_dir = Path(out_dir)
        self.manifest = load_manifest(self.out_dir)
        refuse_tensor_parallel(self.manifest.tp)
        self.iterations = self.manifest.iterations if iterations is None else iterations
        problem = count_problem(self.iterations, "--iterations", 1, MAX_ITERATIONS)
        if problem:
            raise RunError([error("E524", problem)])
        self.timeout = timeout
        self.want_weights = want_weights and not emulate
        from schedc.runtime.placement import place

        self.placement = place(device, backend, len(self.manifest.live_ranks))
        # CUDA cannot be used in a process forked from one that touched it: GPU ranks start
        # fresh ("spawn", a torch import each); CPU ranks fork from the warm forkserver.
        on_gpu = any(d != "cpu" for d in self.placement.devices)
        self.local = LocalProcesses(mp.get_context("spawn") if on_gpu else forkserver_context())
        from schedc.runtime.rendezvous import serve_store

        self.store = serve_store("127.0.0.1", 0, timeout)  # the ranks meet here (kept alive by this object)
        init = f"127.0.0.1:{self.store.port}"
        options = dict(iterations=self.iterations, emulate=emulate, timeout=timeout,
                       want_weights=self.want_weights, backend=self.placement.backend,
                       ordered=ordered or self.placement.ordered)
        from schedc.runtime.rank import child_main

        self._pipes: dict = {}  # connection -> schedule rank: one per rank (a killed rank breaks only its own)
        for dist_rank, rank in enumerate(self.manifest.live_ranks):
            reader, writer = self.local.context.Pipe(duplex=False)
            self.local.start(rank, child_main, (str(self.out_dir), dist_rank, init,
                                                {**options, "device": self.placement.devices[dist_rank]}, writer),
                             f"schedc-rank-{rank}")
            writer.close()  # the child has it: its end of file is the rank's exit
            self._pipes[reader] = rank
        self.started = time.monotonic()

    @property
    def processes(self) -> dict[int, mp.Process]:
        """Schedule rank -> its process (for a caller that watches or kills ranks)."""
        return self.local.processes

    def wait(self, progress: Callable[[IterationRecord], None] | None = None) -> RunResult:
        """Collect reports until every rank exits; `progress` sees each finished iteration."""
        m = self.manifest
        n = len(m.live_ranks)
        last_stage = set(m.stage_groups[-1])
        per_iter: dict[int, dict[int, IterationDone]] = {}
        done: list[IterationRecord] = []
        weights: dict[int, bytes] = {}
        errors: dict[int, list[dict]] = {}
        last_news = time.monotonic()
        # A rank waits at most `timeout` per receive, so after a failure the others
        # report within about that; beyond it (plus slack) something hangs: stop it.
        patience = self.timeout + 15.0
        failed_at: float | None = None  # when a rank was first seen failed

        def handle(rank: int, msg) -> None:
            nonlocal last_news
            last_news = time.monotonic()
            if isinstance(msg, IterationDone):
                per_iter.setdefault(msg.it, {})[rank] = msg
                while len(per_iter.get(len(done), {})) == n:
                    reps = per_iter.pop(len(done))
                    loss_sum = math.fsum(v.loss for r, v in reps.items() if r in last_stage)
                    rec = IterationRecord(len(done), 0, loss_sum, min(v.t0 for v in reps.values()),
                                          max(v.t1 for v in reps.values()))
                    done.append(rec)
                    if progress is not None:
                        progress(rec)
            elif isinstance(msg, Weights):
                weights[rank] = msg.blob
            elif isinstance(msg, WorkerError):
                errors[rank] = list(msg.diagnostics)

        while True:
            if self._receive(handle, timeout=0.05):
                continue
            alive = [r for r, p in self.processes.items() if p.exitcode is None]
            if not alive:
                break
            failed = sorted(r for r, p in self.processes.items() if p.exitcode not in (None, 0)) or sorted(errors)
            if failed and failed_at is None:
                failed_at = time.monotonic()
            # Once a rank has failed the run cannot finish (`schedc run` does not recover): the
            # others have FAILED_GRACE seconds (their timeout, if shorter) to say what they were
            # waiting for, then they are stopped. One that stays silent beyond the patience
            # (stopped, stuck outside a wait) is stopped too.
            grace = min(self.timeout + 2.0, FAILED_GRACE)
            if failed and time.monotonic() - failed_at > grace:
                for r in alive:
                    self.processes[r].kill()
                for r in alive:
                    errors.setdefault(r, [{"code": "E532", "message": f"rank {r} was stopped {grace:g} s after rank(s) "
                                           f"{failed} failed: it had not ended by itself (stuck, or waiting for "
                                           "them; the run cannot go on)"}])
                break
            if not failed and time.monotonic() - last_news > patience:
                for r in alive:
                    self.processes[r].kill()
                for r in alive:
                    errors.setdefault(r, [{"code": "E532", "message": f"rank {r} made no progress for "
                                           f"{patience:g} s and was stopped"}])
                break
        self.local.stop_all(grace=0)  # every rank has ended: joined, and this process stops adopting orphans
        while self._receive(handle, timeout=0):  # reports that raced with the exits
            pass
        self._raise_if_failed(errors)
        if len(done) != self.iterations:
            raise RunError([error("E533", f"the run ended after {len(done)} of {self.iterations} iterations "
                                          "without an error report")])
        state = None
        if self.want_weights:
            state = _merge_weights(weights, m)
        return RunResult(done, time.monotonic() - self.started, state_dict=state, manifest=m,
                         placement=self.placement, out=str(self.out_dir))

    def _receive(self, handle: Callable[[int, object], None], timeout: float) -> bool:
        """Hand every report that arrives within `timeout` to `handle` (with the schedule rank whose
        pipe it came on); whether any did."""
        got = False
        for conn in wait_connections(list(self._pipes), timeout) if self._pipes else ():
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the rank exited (or died mid-message): nothing more from it
                del self._pipes[conn]
                conn.close()
                continue
            handle(self._pipes[conn], msg)
            got = True
        return got

    def kill(self) -> None:
        self.local.stop_all(grace=0)

    def _raise_if_failed(self, errors: dict[int, list[dict]]) -> None:
        diags: list[Diagnostic] = []
        for rank, p in sorted(self.processes.items()):
            code = p.exitcode
            if code and code < 0 and rank not in errors:
                name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
                diags.append(error("E531", f"rank {rank} died (killed by {name})",
                                   hint="the other ranks' errors below say what they were waiting for"))
            elif code and rank not in errors:
                diags.append(error("E531", f"rank {rank} exited with status {code} without a report"))
        seen = set()
        # The ranks' own errors first, those stopped because another failed (E532) after them.
        for rank in sorted(errors, key=lambda r: (all(d.get("code") == "E532" for d in errors[r]), r)):
            for d in errors[rank]:
                if (d.get("code"), d["message"]) in seen:  # e.g. every rank failing to load the model
                    continue
                seen.add((d.get("code"), d["message"]))
                diags.append(error(d.get("code", "E590"), d["message"], hint=d.get("hint", "")))
        if diags:
            raise RunError(diags)


def _merge_weights(weights: dict[int, bytes], manifest: Manifest) -> dict:
    import torch

    state: dict = {}
    for group in manifest.stage_groups:
        blob = weights.get(group[0])
        if blob is None:
            raise RunError([error("E534", f"rank {group[0]} sent no weights for its stage")])
        state.update(torch.load(io.BytesIO(blob), weights_only=True))
    return state  # stages in order, each in module order: the full nn.Sequential's key order


def launch(out_dir: Path | str, *, iterations: int | None = None, emulate: bool = False,
           timeout: float = 60.0, want_weights: bool = False,
           progress: Callable[[IterationRecord], None] | None = None, device: str = "cpu",
           backend: str = "auto", ordered: bool = False) -> RunResult:
    """Run the compiled programs in `out_dir` on local processes; raise `RunError` if any rank fails.

    `device` and `backend` as in `schedc.runtime.placement`; `ordered` matches messages by the
    sender's program order even over gloo (as NCCL must; a check of that protocol on the CPU).

    >>> result = launch("out", iterations=2, want_weights=True)   # doctest: +SKIP
    >>> result.losses, sorted(result.state_dict)[:2]              # doctest: +SKIP
    """
    run = Launch(out_dir, iterations=iterations, emulate=emulate, timeout=timeout, want_weights=want_weights,
                 device=device, backend=backend, ordered=ordered)
    try:
        return run.wait(progress)
    finally:
        run.kill()
