"""One rank's process: join the process group, run the program's iterations, report.

`run_rank` is shared by `schedc run` (which forks the ranks from a
forkserver and passes a queue for progress) and by `torchrun_main`
(``torchrun --nproc-per-node=L OUT/main.py``; torch's RANK r runs the r-th
live schedule rank and progress goes to stdout).
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

from schedc.diagnostics import RunError, SchedcError, error, exception_site
from schedc.live.protocol import IterationDone, Weights, WorkerError
from schedc.runtime.manifest import load_manifest
from schedc.runtime.program import load_program
from schedc.runtime.rendezvous import connect_store

Report = Callable[[object], None]  # takes a `schedc.live.protocol` message


def run_rank(out_dir: Path, dist_rank: int, init_method: str, *, iterations: int, emulate: bool,
             timeout: float, want_weights: bool, report: Report, device: str = "cpu",
             backend: str = "gloo", ordered: bool = False) -> None:
    """Run every iteration of one rank's program; report progress, then (optionally) weights.

    `device` is where this rank computes, `backend` how it talks (`schedc.runtime.placement`);
    with `ordered` (always with NCCL) messages are matched by the sender's program order.

    Reports are `schedc.live.protocol` messages, as in a live run: `IterationDone` after each
    iteration (times from `time.monotonic`, shared by processes of one machine; `loss` is
    this rank's part of the loss) and `Weights` (a `torch.save`d state_dict) at the end.
    """
    import torch
    import torch.distributed as dist

    from schedc.runtime.primitives import Runtime
    from schedc.runtime.transport import Transport

    torch.set_num_threads(1)
    manifest = load_manifest(out_dir)
    rank = manifest.live_ranks[dist_rank]
    program = load_program(out_dir, manifest, rank)
    world = len(manifest.live_ranks)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    order = None
    if ordered or backend == "nccl":
        from schedc.runtime.channels import load_receive_order

        order = load_receive_order(out_dir, rank)
    if "://" in init_method:  # torchrun's env://
        dist.init_process_group(backend, init_method=init_method, rank=dist_rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
    else:  # `schedc run`: the launcher serves the store at host:port (schedc.runtime.rendezvous)
        dist.init_process_group(backend, store=connect_store(init_method, timeout), rank=dist_rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
    finished = False
    try:
        transport = Transport.over_default_group(manifest, rank, timeout, device=device, backend=backend, order=order)
        rt = Runtime(manifest, rank, transport, emulate=emulate, device=device)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        for it in range(iterations):
            rt.begin_iteration(it)
            t0 = time.monotonic()
            program.iteration(rt)
            loss = rt.loss_sum  # on a GPU: waits for this rank's work of the iteration
            sync()
            report(IterationDone(rank=rank, it=it, t0=t0, t1=time.monotonic(), loss=loss))
        rt.transport.flush()
        sync()
        if want_weights and not emulate and rank == manifest.stage_groups[rt.stage][0]:
            buf = io.BytesIO()
            torch.save(rt.state_dict(), buf)
            report(Weights(rank=rank, blob=buf.getvalue()))
        finished = True
    finally:
        # Only after a clean run: with a peer dead, tearing the group down can block on it, and
        # the error must reach the launcher first (the process exits right after reporting it).
        if finished:
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def child_main(out_dir: str, dist_rank: int, init_method: str, options: dict, conn) -> None:
    """Entry of a process started by `schedc run`: reports, and errors as diagnostics, go to the
    launcher over this rank's own pipe `conn` (a queue shared by all ranks would be wedged for
    every rank if one were killed while writing to it).

    The launcher holds the pipe's other end alone: once it is gone (killed: SIGKILL, the OOM
    killer), nobody reads this rank's reports or stops it, so the rank ends at once with one
    line (`_orphaned`): a thread notices the end closed even while the rank waits in C++ (for
    the launcher's store, for a peer), and a report that finds it closed ends the same way."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _watch_launcher(conn, dist_rank)

    def send(msg) -> None:
        try:
            conn.send(msg)
        except OSError:  # BrokenPipeError: the launcher is gone
            _orphaned(dist_rank)

    try:
        run_rank(Path(out_dir), dist_rank, init_method, report=send, **options)
    except SchedcError as exc:
        send(WorkerError(rank=dist_rank, diagnostics=tuple(d.to_json() for d in exc.diagnostics)))
        conn.close()
        os._exit(1)
    except BaseException as exc:  # a bug or a broken model: still a diagnostic, with the frame
        msg = f"{type(exc).__name__}: {exc} (at {exception_site(exc)})"
        send(WorkerError(rank=dist_rank, diagnostics=({"code": "E590", "message": f"schedule rank "
                                                  f"{_schedule_rank(out_dir, dist_rank)} failed: {msg}"},)))
        conn.close()
        os._exit(1)
    conn.close()


_ORPHANED = threading.Lock()  # taken by the first thread that finds the launcher gone


def _orphaned(dist_rank: int) -> None:
    """The launcher is gone: one line on stderr (from one thread), and the process ends now,
    without the interpreter's teardown (the process group, its peers gone too, could block it)."""
    if _ORPHANED.acquire(blocking=False):
        try:
            # One write for the whole line: the ranks share the launcher's stderr, and print()'s
            # separate write of the newline interleaved two ranks' lines.
            os.write(2, f"schedc run: torch rank {dist_rank}: its launcher is gone; the rank stops\n".encode())
        except OSError:
            pass
        os._exit(1)
    while True:  # another thread is ending the process
        time.sleep(1.0)


def _watch_launcher(conn, dist_rank: int) -> None:
    """A daemon thread that calls `_orphaned` once the read end of `conn` (the launcher's) is
    closed: the write end of a pipe polls POLLERR then (Linux; elsewhere only a report finds out)."""
    import select

    if not hasattr(select, "poll"):
        return
    poller = select.poll()
    poller.register(conn.fileno(), 0)  # (POLLERR and POLLHUP are reported whatever the mask)

    def watch() -> None:
        while True:
            for _, events in poller.poll():
                if events & select.POLLNVAL:
                    return  # this process closed `conn` itself: it is ending (or has reported its end)
                if events & (select.POLLERR | select.POLLHUP):
                    _orphaned(dist_rank)

    threading.Thread(target=watch, name="schedc-launcher-watch", daemon=True).start()


def _torchrun_placement() -> tuple[str, str]:
    """(device, backend) of this torchrun process from SCHEDC_DEVICE / SCHEDC_BACKEND / LOCAL_RANK."""
    device = os.environ.get("SCHEDC_DEVICE", "cpu")
    backend = os.environ.get("SCHEDC_BACKEND", "auto")
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    if backend == "auto":
        backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend not in ("gloo", "nccl") or (backend == "nccl" and device == "cpu"):
        raise RunError([error("E581", f"SCHEDC_BACKEND={backend} with SCHEDC_DEVICE={device}",
                              hint="use gloo on the CPU; gloo or nccl on cuda")])
    return device, backend


def _schedule_rank(out_dir: str, dist_rank: int) -> int | str:
    try:
        return load_manifest(out_dir).live_ranks[dist_rank]
    except Exception:
        return f"(torch rank {dist_rank})"


def torchrun_main(out_dir: Path) -> int:
    """`OUT/main.py` under torchrun: RANK/WORLD_SIZE/MASTER_* from the environment.

    SCHEDC_ITERATIONS, SCHEDC_EMULATE=1 and SCHEDC_TIMEOUT (seconds) override
    the manifest's iteration count, real compute and the 60 s default timeout.
    SCHEDC_DEVICE=cuda puts each rank on the GPU of its LOCAL_RANK (NCCL unless
    SCHEDC_BACKEND=gloo); the default is the CPU with gloo.
    """
    manifest = load_manifest(out_dir)
    dist_rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != len(manifest.live_ranks):
        print(f"error[E523]: started with {world} processes but the schedule has "
              f"{len(manifest.live_ranks)} live ranks\n  = hint: torchrun --nproc-per-node="
              f"{len(manifest.live_ranks)} {out_dir / 'main.py'}", file=sys.stderr)
        return 1

    last_stage = set(manifest.stage_groups[-1])

    def report(msg) -> None:
        if isinstance(msg, IterationDone):
            rank, it, t0, t1, loss = msg.rank, msg.it, msg.t0, msg.t1, msg.loss
            # A last-stage rank's part: the sum of loss/(D*M) over the microbatches it ran.
            part = f", loss part {loss:.6f}" if rank in last_stage else ""
            print(f"rank {rank}: iteration {it} took {t1 - t0:.4f} s{part}", flush=True)

    try:
        from schedc.runtime.manifest import refuse_tensor_parallel

        refuse_tensor_parallel(manifest.tp)
        device, backend = _torchrun_placement()
        run_rank(out_dir, dist_rank, "env://",
                 iterations=int(os.environ.get("SCHEDC_ITERATIONS", manifest.iterations)),
                 emulate=os.environ.get("SCHEDC_EMULATE", "") == "1",
                 timeout=float(os.environ.get("SCHEDC_TIMEOUT", "60")),
                 want_weights=False, report=report, device=device, backend=backend)
    except SchedcError as exc:
        print(exc.render(), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # no interpreter teardown: the process group, its peer gone, could block it
    return 0
