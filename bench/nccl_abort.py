"""What this torch's NCCL does when a peer dies, measured on one GPU: the facts live recovery over
NCCL (`schedc train --backend nccl`, not built yet) would rest on.

Each case runs in a process of its own, bounded by a timeout (a hang is a finding, not a stall):

- ``formation-blocking`` / ``formation-nonblocking``: rank 0 of a 2-rank NCCL group whose peer
  never comes (it died after the generation was announced). Its first collective starts the
  communicator and waits for the peer; after 2 s another thread calls ``abort()``. Does abort
  return, does the waiting thread end, does the process survive, and does a fresh communicator
  (the next generation, a new store prefix) then work?
- ``watchdog-N``: a collective that cannot finish within its group's timeout (the GPU is held by a
  long kernel ahead of it, standing in for a receive from a dead peer), under
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=N``: does NCCL's watchdog take the process down?
- ``generations``: the cost of one generation's communicator on one rank: form it (first
  collective), use it, abort it; five times in one process, as survivors would.

One GPU cannot hold two ranks of one NCCL communicator (NCCL refuses duplicate GPUs), so no case
here has two live ranks; see docs/live.md for what that leaves unmeasured.

    python bench/nccl_abort.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

CASES = ["formation-blocking", "formation-nonblocking", "watchdog-0", "watchdog-2", "watchdog-3", "generations"]
LIMIT_S = 25.0


def _step(what: str) -> None:
    """Where the case is (read back when it hangs)."""
    print(f"STEP {what}", flush=True)


def _group(store, prefix: str, rank: int, size: int, timeout_s: float, blocking: bool = True):
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    if not blocking:
        opts.config.blocking = 0
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, opts)


def _store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)


def _one_allreduce(pg) -> float:
    import torch

    t = torch.ones(1024, device="cuda")
    pg.allreduce([t]).wait()
    torch.cuda.synchronize()
    return float(t[0])


def _formation(blocking: bool) -> dict:
    import torch

    torch.cuda.set_device(0)
    store = _store()
    pg = _group(store, "g0/", 0, 2, timeout_s=60, blocking=blocking)
    ended: dict = {}

    def first_collective():
        try:
            t = torch.ones(4, device="cuda")
            pg.allreduce([t]).wait()
            torch.cuda.synchronize()
            ended["how"] = "returned"
        except BaseException as exc:  # what an aborted formation raises
            ended["how"] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        ended["t"] = time.perf_counter()

    thread = threading.Thread(target=first_collective, daemon=True)
    _step("first collective of a 2-rank group, peer absent")
    thread.start()
    thread.join(2.0)
    out = {"waiting_after_2s": thread.is_alive()}
    t0 = time.perf_counter()
    _step("abort")
    pg.abort()
    _step("abort returned")
    out["abort_s"] = round(time.perf_counter() - t0, 4)
    thread.join(10.0)
    out["waiter_ended"] = not thread.is_alive()
    if "t" in ended:
        out["waiter_ended_after_abort_s"] = round(ended["t"] - t0, 4)
        out["waiter"] = ended["how"]
    t1 = time.perf_counter()
    _step("next generation")
    fresh = _group(store, "g1/", 0, 1, timeout_s=30)
    out["next_generation_allreduce"] = _one_allreduce(fresh)
    out["next_generation_formed_s"] = round(time.perf_counter() - t1, 4)
    fresh.abort()
    return out


def _sleep_cycles(seconds: float) -> int:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 100_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    per_s = cycles / (start.elapsed_time(end) / 1000)
    return int(per_s * seconds)


def _watchdog(variant: str = "") -> dict:
    """`variant`: "" (abort the timed-out group, then form the next on the same store), "noabort"
    (leave it), "newstore" (the next group on a store of its own), "nodump" (as "", with
    TORCH_NCCL_DUMP_ON_TIMEOUT=0 set by the caller)."""
    import torch

    torch.cuda.set_device(0)
    store = _store()
    pg = _group(store, "g0/", 0, 1, timeout_s=2)
    _one_allreduce(pg)  # formed
    cycles = _sleep_cycles(5.0)
    _step("collective behind a 5 s kernel, timeout 2 s")
    torch.cuda._sleep(cycles)  # the GPU is busy for 5 s: the next collective times out at 2 s
    t = torch.ones(4, device="cuda")
    work = pg.allreduce([t])
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 8.0 and not work.is_completed():
        time.sleep(0.05)
    out = {"alive_after_timeout": True, "completed": work.is_completed(),
           "waited_s": round(time.perf_counter() - t0, 3)}
    print("RESULT " + json.dumps(out), flush=True)  # (in case what follows hangs)
    if variant != "noabort":
        _step("abort")
        t1 = time.perf_counter()
        pg.abort()
        out["abort_s"] = round(time.perf_counter() - t1, 4)
    _step("synchronize")
    torch.cuda.synchronize()
    _step("next generation: form")
    fresh = _group(_store() if variant == "newstore" else store, "g1/", 0, 1, timeout_s=30)
    _step("next generation: first collective")
    out["next_generation_allreduce"] = _one_allreduce(fresh)
    fresh.abort()
    return out


def _generations(n: int = 5) -> dict:
    import torch

    torch.cuda.set_device(0)
    store = _store()
    formed, aborted = [], []
    for g in range(n):
        t0 = time.perf_counter()
        pg = _group(store, f"g{g}/", 0, 1, timeout_s=30)
        assert _one_allreduce(pg) == 1.0
        formed.append(round(time.perf_counter() - t0, 4))
        t1 = time.perf_counter()
        pg.abort()
        aborted.append(round(time.perf_counter() - t1, 4))
    return {"formed_s": formed, "abort_s": aborted}


def _child(case: str) -> None:
    if case.startswith("formation"):
        out = _formation(blocking=case == "formation-blocking")
    elif case.startswith("watchdog"):
        out = _watchdog(case.split("-")[2] if case.count("-") == 2 else "")
    else:
        out = _generations()
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # (no teardown of what an abort left: the finding is already out)


def _run(case: str) -> dict:
    env = dict(os.environ)
    if case.startswith("watchdog-"):
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = case.split("-")[1]
        if case.endswith("-nodump"):
            env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "0"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--case", case], env=env, capture_output=True,
                              text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        row = {"case": case, "outcome": f"hung: no answer in {LIMIT_S:.0f} s"}
        for line in text.splitlines():
            if line.startswith("RESULT "):
                row.update(json.loads(line[len("RESULT "):]))
        steps = [line[len("STEP "):] for line in text.splitlines() if line.startswith("STEP ")]
        row["stuck_in"] = steps[-1] if steps else "start-up"
        return row
    row: dict = {"case": case, "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 2)}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            row.update(json.loads(line[len("RESULT "):]))
    if "next_generation_allreduce" not in row and "formed_s" not in row:
        row["outcome"] = "the process died" if proc.returncode else "no result"
        row["stderr_tail"] = proc.stderr[-600:]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--cases", nargs="+", default=CASES, metavar="CASE",
                        help="which cases (default: all; watchdog-N may end in -noabort, -newstore or -nodump)")
    args = parser.parse_args()
    if args.case:
        _child(args.case)
    import torch

    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        print("needs a CUDA GPU and a torch built with NCCL", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    rows = []
    for case in args.cases:
        row = _run(case)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "nccl": list(torch.cuda.nccl.version()), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
