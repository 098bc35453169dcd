"""Catch-up time against a stage's size: the state transfer through the job's store vs direct.

Two processes play a donor and a joiner of one stage (`schedc.live.catchup.Donor`/`Joiner`,
exactly as a live run drives them), the parent hosts the job's store as the supervisor does.
The stage is 4 Linear layers holding SIZE MB of float32 parameters, with Adam (its state is
twice the parameters again). The clock starts when the donor copies its state at an iteration
boundary; the donor then takes STEPS optimizer steps (random gradients), streaming each step's
gradient; it stops when the joiner has loaded the state and replayed every step. The joiner's
final weights and optimizer state are checked bit for bit against the donor's.

    python bench/catchup_transfer.py                  # 10, 50, 200 MB; store and direct
    python bench/catchup_transfer.py --sizes 10 --kinds direct -o /tmp/xfer

Columns: the parameters' size; the state (weights and Adam's state, tensor bytes), when the
joiner had it loaded (seconds from the donor's copy) and at what rate; everything the joiner
received (the state, then STEPS gradients, as the transfer counts it: with the store's pickle or
the direct one's headers); when the donor had taken its own STEPS steps (the joiner cannot be
done before); when the joiner had replayed them all; the rate over the whole catch-up.
Both processes run one torch thread; the numbers are of a shared machine, so compare the two
kinds row by row rather than across runs.
"""

from __future__ import annotations

import argparse
import copy
import csv
import hashlib
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Seconds any step of the benchmark may take before it is declared stuck (an environment variable,
# not an option: the spawned donor and joiner read it too).
WAIT = float(os.environ.get("BENCH_WAIT", 300))
LAYERS = 4


class Stage:
    """What a Donor and a Joiner use of a runtime, on a real Adam stage of `mb` MB of parameters."""

    def __init__(self, mb: float):
        import torch

        width = int((mb * 1e6 / 4 / LAYERS) ** 0.5)
        torch.manual_seed(0)
        self.module = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(LAYERS)])
        self.params = list(self.module.parameters())
        self.optimizer = torch.optim.Adam(self.params, lr=1e-3)
        self.numel = sum(p.numel() for p in self.params)
        self.steps_done = 0
        self.keep_step_grad = False
        self.last_step_grad = None
        self.loaded: tuple[float, int] | None = None  # when a state was loaded, and its tensors' bytes

    def train_step(self, seed: int) -> None:
        import torch

        flat = torch.randn(self.numel, generator=torch.Generator().manual_seed(seed))
        self.last_step_grad = flat if self.keep_step_grad else None
        self.apply_step(flat)

    def apply_step(self, flat) -> None:
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.optimizer.step()
        self.steps_done += 1

    def stage_state(self) -> dict:
        return {"steps": self.steps_done, "model": {k: v.detach().clone() for k, v in self.module.state_dict().items()},
                "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_stage_state(self, state: dict) -> None:
        nbytes = sum(t.nbytes for t in state["model"].values())
        nbytes += sum(v.nbytes for st in state["optimizer"]["state"].values() for v in st.values())
        self.loaded = (time.time(), nbytes)
        self.steps_done = int(state["steps"])
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def digest(self) -> str:
        """A hash of every bit of the weights and the optimizer state."""
        h = hashlib.sha256(str(self.steps_done).encode())
        for t in list(self.module.state_dict().values()) + [v for s in self.optimizer.state.values()
                                                             for v in s.values()]:
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()


def _leave(out, msg, status: int) -> None:
    """Send `msg` and exit at once (no interpreter teardown under live transfer threads); the
    queue's feeder thread must have written it first."""
    out.put(msg)
    out.close()
    out.join_thread()
    os._exit(status)


def _setup() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def donor_main(port: int, session: int, kind: str, mb: float, steps: int, ready, go, done, out) -> None:
    _setup()
    from schedc.live.catchup import Donor
    from schedc.live.membership import JobStore

    job = JobStore.connect("127.0.0.1", port, timeout=WAIT)
    rt = Stage(mb)
    rt.train_step(0)  # Adam's state exists from the first step on
    side = ThreadPoolExecutor(1)
    donor = Donor(job.clone(), lambda: side, transfer=kind, timeout=WAIT)
    ready.set()
    go.wait(WAIT)
    t0 = time.time()
    donor.boundary(rt, {"role": "donate", "session": session})
    for s in range(steps):
        rt.train_step(1 + s)
        donor.after_step(rt)
    out.put(("donor", t0, time.time(), rt.digest()))
    done.wait(WAIT)  # the session stays open until the joiner is done
    donor.boundary(rt, None)
    side.shutdown(wait=True)
    os._exit(0)


def joiner_main(port: int, session: int, kind: str, mb: float, steps: int, ready, go, done, out) -> None:
    _setup()
    from schedc.live.catchup import Joiner
    from schedc.live.membership import JobStore

    job = JobStore.connect("127.0.0.1", port, timeout=WAIT)
    rt = Stage(mb)
    joiner = Joiner(job, transfer=kind, timeout=WAIT)
    ready.set()
    go.wait(WAIT)
    directive = {"role": "join", "session": session}
    deadline = time.time() + WAIT
    while joiner.steps is None or joiner.steps < 1 + steps:
        if time.time() > deadline:
            _leave(out, ("joiner", None, None, None, None), 1)
        if not joiner.follow(rt, directive):
            time.sleep(0.005)  # the standby loop's pace
    t_end, received = time.time(), joiner.received
    joiner.follow(rt, None)  # the session ends (this resets `received`)
    _leave(out, ("joiner", rt.loaded, t_end, received, rt.digest()), 0)


def run_one(job, session: int, kind: str, mb: float, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go, done = ctx.Event(), ctx.Event()
    ready = [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=fn, args=(job.port, session, kind, mb, steps, r, go, done, out), daemon=True)
             for fn, r in ((donor_main, ready[0]), (joiner_main, ready[1]))]
    for p in procs:
        p.start()
    try:
        for r in ready:
            if not r.wait(WAIT):
                raise SystemExit("a process did not start")
        go.set()
        got = {}
        while len(got) < 2:
            msg = out.get(timeout=WAIT)
            got[msg[0]] = msg[1:]
        done.set()  # the donor may end its session
        for p in procs:
            p.join(WAIT)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, 9)
    t0, t_donor, donor_digest = got["donor"]
    loaded, t_end, received, joiner_digest = got["joiner"]
    if t_end is None:
        raise SystemExit(f"{kind} {mb} MB: the joiner did not catch up within {WAIT:g} s")
    t_state, state_bytes = loaded
    return {"kind": kind, "params_mb": mb, "state_mb": state_bytes / 1e6, "state_s": t_state - t0,
            "state_mb_per_s": state_bytes / 1e6 / (t_state - t0), "received_mb": received / 1e6,
            "donor_steps_s": t_donor - t0, "catchup_s": t_end - t0, "mb_per_s": received / 1e6 / (t_end - t0),
            "exact": donor_digest == joiner_digest}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[10, 50, 200], help="MB of parameters")
    ap.add_argument("--kinds", nargs="+", default=["store", "direct"], choices=["store", "direct"])
    ap.add_argument("--steps", type=int, default=3, help="steps the donor takes (and streams) after the copy")
    ap.add_argument("-o", "--out", default="bench/results/catchup-transfer", help="folder for the CSV")
    args = ap.parse_args(argv)
    _setup()
    from schedc.live.membership import JobStore

    job = JobStore.serve(timeout=WAIT)
    rows = []
    print(f"{'params':>8} {'kind':>7} | {'state':>9} {'loaded at':>9} {'MB/s':>6} | {'received':>9} "
          f"{'donor done':>10} {'caught up':>9} {'MB/s':>6} | exact")
    for mb in args.sizes:
        for kind in args.kinds:
            r = run_one(job, len(rows) + 1, kind, mb, args.steps)  # a session name is used once per store
            rows.append(r)
            print(f"{mb:>6g}MB {kind:>7} | {r['state_mb']:>7.1f}MB {r['state_s']:>8.2f}s {r['state_mb_per_s']:>6.0f} | "
                  f"{r['received_mb']:>7.1f}MB {r['donor_steps_s']:>9.2f}s {r['catchup_s']:>8.2f}s {r['mb_per_s']:>6.0f} "
                  f"| {'yes' if r['exact'] else 'NO'}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "catchup_transfer.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out / 'catchup_transfer.csv'}")
    if not all(r["exact"] for r in rows):
        raise SystemExit("a joiner did not end with its donor's bits")


if __name__ == "__main__":
    main()
