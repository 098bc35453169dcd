"""False alarms and detection delay of `schedc train`'s failure and slowness detection under CPU load.

A small computing-mode job (3 pipelines x 3 stages of the shipped MLP, real
tensors, not --emulate) is trained on a host that other processes load:

* **false alarms**: fault-free runs of N iterations while B busy loops
  (``python3 -c "while True: pass"``, started here and killed by pid
  afterwards) compete for the CPUs. Every rank declared failed, every
  "slow" report and every planned switch is a false alarm (target: 0);
* **detection delay of a real throttle**: one worker process is throttled
  from outside, SIGSTOP/SIGCONT at 50% duty (nothing injected, nothing
  emulated), from iteration THROTTLE_FROM; reported: the iterations and
  seconds from the throttle's start to the first "slow" report of that
  rank, reports about any other rank (false alarms), and, once the
  throttle ends, whether the GPU is taken back.

    python bench/live_false_alarms.py [--iterations 500] [--loops 2 4]
        [--throttle-loops 2] [-o DIR]

Prints one line per run and writes DIR/false_alarms.json (and each run's log, DIR/<case>.json).
Each fault-free run's per-rank log speeds against its peers', as the fail-slow policy judges
them, go to DIR/loaded_trace-<loops>.json (tests/data/loaded_trace.json is one: the change-point
detector must find nothing in it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import schedc  # noqa: E402
from schedc.live.options import TrainOptions  # noqa: E402
from schedc.live.supervisor import Supervisor, TrainError  # noqa: E402

SPEC = """
model "m" { source = "schedc.models.mlp:build" }
cluster { dp = 3  pp = 3  gpus_per_node = 3
          gpu { memory = 1GiB }  link { latency = 50us  bandwidth = 1GB/s } }
stages { all { forward = 2ms  backward_input = 2ms  backward_weight = 1ms  optimizer = 0.5ms
               activation = 4MiB  stash = 1MiB  static = 16MiB  send = 64KiB } }
train { microbatches = 3  optimizer = sgd  lr = 0.05  iterations = 500 }
schedule { solver = greedy  decouple_backward = true  stagger_optimizer = true }
"""
THROTTLED = 4  # rank 4: GPU (dp=1, pp=1), a middle stage
THROTTLE_FROM = 40  # the throttle begins once this many iterations are done
THROTTLE_FOR = 60  # ... and lasts this many iterations
DUTY_PERIOD = 0.1  # seconds: stopped for half of it, running for the other half


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(timeout=10)


def alarms(doc: dict, exclude_rank: int | None = None) -> dict:
    """Ranks declared failed, slow reports (speed under 0.88) and switches, excluding one rank's."""
    failed = [e["message"] for e in doc["events"] if e["kind"] == "failure" and e.get("rank") != exclude_rank]
    slow = [f"{e['message']} [{e.get('signal', '?')}]" for e in doc["events"] if e["kind"] == "slow"
            and e.get("speed", 1.0) < 0.88 and e.get("rank") != exclude_rank]
    switches = [s["kind"] for s in doc["switches"] if exclude_rank is None or exclude_rank not in s.get("ranks", [])]
    return {"failed": failed, "slow": slow, "switches": switches}


def train_run(out: Path, iterations: int, during=None) -> tuple[dict, Supervisor]:
    """Train `out` for `iterations` in this process; `during(sup)` runs on a thread meanwhile."""
    sup = Supervisor(out, TrainOptions(iterations=iterations))
    stop = threading.Event()
    th = threading.Thread(target=during, args=(sup, stop), daemon=True) if during else None
    if th:
        th.start()
    rates: list = []  # (seconds, iterations completed, rank -> heartbeats per second), for a look afterwards

    def sample() -> None:
        while not stop.wait(0.25):
            now = sup._now()
            try:  # (read while the supervisor's thread writes: a torn read is skipped)
                seen = sup.detector.beat_rates(now)
                stalled = sup.detector.stall_fractions(now)
            except RuntimeError:
                continue
            rates.append((round(now, 2), sup.completed, {r: round(v, 1) for r, v in seen.items()},
                          {r: round(v, 3) for r, v in stalled.items()}))

    threading.Thread(target=sample, daemon=True).start()
    t = time.time()
    error = None
    try:
        sup.run()
    except TrainError as exc:
        error = exc.diagnostics[0].message
    finally:
        stop.set()
        if th:
            th.join(timeout=10)
    doc = sup.result().to_json()
    doc["bench_wall_s"] = time.time() - t
    doc["bench_error"] = error
    doc["bench_beat_rates"] = rates
    return doc, sup


def peer_trace(doc: dict, loops: int) -> dict:
    """Each rank's log speed against the median of the other ranks' in every iteration (what
    `schedc.live.slowness` feeds the change-point detector), rounded to 4 places."""
    import math
    import statistics

    ranks: dict[str, list[float]] = {}
    for rec in doc["iterations"]:
        logs = {r: math.log(v) for r, v in (rec.get("speeds") or {}).items() if v}
        for r, y in logs.items():
            rel = y - statistics.median(v for q, v in logs.items() if q != r)
            ranks.setdefault(r, []).append(round(rel, 4))
    return {"source": f"bench/live_false_alarms.py: fault-free, {loops} busy loops", "ranks": ranks}


def false_alarm_run(out: Path, iterations: int, loops: int) -> dict:
    procs = busy_loops(loops)
    try:
        doc, _ = train_run(out, iterations)
    finally:
        end(procs)
    (out.parent / f"fault-free-{loops}.json").write_text(json.dumps(doc))
    (out.parent / f"loaded_trace-{loops}.json").write_text(json.dumps(peer_trace(doc, loops)))
    a = alarms(doc)
    row = {"case": f"fault-free, {loops} busy loops", "loops": loops, "iterations": iterations,
           "done": len(doc["iterations"]), "wall_s": round(doc["bench_wall_s"], 1), "error": doc["bench_error"],
           **a, "false_alarms": len(a["failed"]) + len(a["slow"]), "stalled": spread(stalled(doc, None))}
    print(f"{row['case']}: {row['done']}/{iterations} iterations in {row['wall_s']} s; "
          f"{len(a['failed'])} declared failed, {len(a['slow'])} slow reports, {len(a['switches'])} switches"
          f"; stalled fraction of all ranks (10%, median, 90%, max): {row['stalled']}"
          + (f"; error: {row['error']}" if row["error"] else ""), flush=True)
    for m in a["failed"] + a["slow"]:
        print(f"    {m}", flush=True)
    return row


def spread(values: list[float]) -> list[float] | None:
    """[10th percentile, median, 90th percentile, max] of `values`, rounded (None when empty)."""
    v = sorted(values)
    if not v:
        return None
    return [round(v[len(v) // 10], 3), round(statistics.median(v), 3), round(v[-1 - len(v) // 10], 3), round(v[-1], 3)]


def stalled(doc: dict, ranks, t0: float = 0.0, t1: float = 1e12) -> list[float]:
    """The stalled fractions (`Detector.stall_fractions`) of `ranks` (None: every rank) sampled from t0 to t1."""
    return [v for t, _, _, fr in doc["bench_beat_rates"] if t0 <= t <= t1
            for r, v in fr.items() if ranks is None or int(r) in ranks]


def beat_ratio(seen: dict, rank: int) -> float | None:
    """`rank`'s heartbeat rate against the median of the other ranks' (None without three)."""
    rates = {int(r): v for r, v in seen.items() if v > 0}
    if rank not in rates or len(rates) < 3:
        return None
    return rates[rank] / statistics.median(v for r, v in rates.items() if r != rank)


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller (`--throttle-kind quota`)
QUOTA_PERIOD_US = 100_000


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stop_duty(pid: int, while_on) -> None:
    """SIGSTOP/SIGCONT at 50% duty while `while_on()`."""
    try:
        while while_on():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(DUTY_PERIOD / 2)
            os.kill(pid, signal.SIGCONT)
            time.sleep(DUTY_PERIOD / 2)
    except ProcessLookupError:
        pass
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _cpu_quota(pid: int, quota: float, while_on) -> None:
    """The process in a cgroup of its own whose CFS quota is `quota` of one CPU (a container's CPU
    limit) while `while_on()`; then back in the root group, and the group removed."""
    group = CPU_CGROUP / f"schedc-bench-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text(str(QUOTA_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(int(quota * QUOTA_PERIOD_US)))
        (group / "cgroup.procs").write_text(str(pid))  # (v1: every thread of the process)
        while while_on():
            time.sleep(0.01)
    except ProcessLookupError:
        pass
    finally:
        for tid in (group / "tasks").read_text().split():
            try:
                (CPU_CGROUP / "tasks").write_text(tid)
            except OSError:
                pass
        group.rmdir()


def throttle_run(out: Path, iterations: int, loops: int, kind: str = "stop", quota: float = 0.1) -> dict:
    marks: dict = {}

    def throttle(sup: Supervisor, stop: threading.Event) -> None:
        while not stop.is_set() and sup.completed < THROTTLE_FROM:
            time.sleep(0.01)
        if stop.is_set():
            return
        pid = sup.fleet.local.local.processes[THROTTLED].pid
        marks["start_t"], marks["start_it"] = time.time() - sup.t0, sup.completed
        # Its own CPU share before (what a quota must be under to bite): over the last iterations.
        marks["cpu_s_at_start"] = _cpu_seconds(pid)
        on = lambda: not stop.is_set() and sup.completed < THROTTLE_FROM + THROTTLE_FOR  # noqa: E731
        _stop_duty(pid, on) if kind == "stop" else _cpu_quota(pid, quota, on)
        marks["end_t"], marks["end_it"] = time.time() - sup.t0, sup.completed
        try:
            marks["cpu_share_throttled"] = round((_cpu_seconds(pid) - marks["cpu_s_at_start"])
                                                 / (marks["end_t"] - marks["start_t"]), 3)
        except (OSError, ZeroDivisionError):
            pass

    procs = busy_loops(loops)
    try:
        doc, _ = train_run(out, iterations, throttle)
    finally:
        end(procs)
    (out.parent / f"throttle-{kind}-{loops}.json").write_text(json.dumps(doc))
    found = [e for e in doc["events"] if e["kind"] == "slow" and e.get("rank") == THROTTLED
             and e.get("speed", 1.0) < 0.88 and e["t"] >= marks.get("start_t", 0)
             and e.get("since", 0) <= marks.get("end_it", 1 << 30)]  # (a report dated after it is no finding)
    first = found[0] if found else None
    back = [s["kind"] for s in doc["switches"] if THROTTLED in s.get("ranks", [])]
    other = alarms(doc, exclude_rank=THROTTLED)
    # Its heartbeat rate against the median of the others' while throttled (the fail-slow
    # policy's second measure; BEAT_SLOW is the bar it must pass on its own).
    ratios = sorted(beat_ratio(seen, THROTTLED) for t, _, seen, _ in doc["bench_beat_rates"]
                    if marks.get("start_t", 1e9) + 2.0 <= t <= marks.get("end_t", 0)
                    and beat_ratio(seen, THROTTLED) is not None)
    how = "50% (SIGSTOP/SIGCONT)" if kind == "stop" else f"by a CPU quota of {quota:g} CPU (cgroup)"
    row = {"case": f"rank {THROTTLED} throttled {how}, {loops} busy loops", "loops": loops,
           "iterations": iterations, "done": len(doc["iterations"]), "error": doc["bench_error"],
           "throttle": marks,
           "delay_iterations": first["seen"] - marks["start_it"] if first else None,
           "delay_s": round(first["t"] - marks["start_t"], 2) if first else None,
           "reported_speed": first["speed"] if first else None,
           "switches_of_throttled": back,
           "beat_ratio": ([round(ratios[len(ratios) // 10], 2), round(statistics.median(ratios), 2),
                           round(ratios[-1 - len(ratios) // 10], 2)] if ratios else None),
           "stalled_throttled": spread(stalled(doc, {THROTTLED}, marks.get("start_t", 1e9) + 1.0,
                                               marks.get("end_t", 0))),
           "stalled_others": spread(stalled(doc, set(range(9)) - {THROTTLED}, marks.get("start_t", 1e9),
                                            marks.get("end_t", 0))),
           "failed_throttled": [e["message"] for e in doc["events"] if e["kind"] == "failure"
                                and e.get("rank") == THROTTLED],
           "others": other, "false_alarms": len(other["failed"]) + len(other["slow"])}
    print(f"{row['case']}: throttled from iteration {marks.get('start_it')} to {marks.get('end_it')} "
          f"(its CPU share meanwhile {marks.get('cpu_share_throttled')}); "
          + (f"reported slow (speed {first['speed']:.2f}, {first.get('signal', '?')}) after "
             f"{row['delay_iterations']} iterations, "
             f"{row['delay_s']} s" if first else "never reported slow")
          + (f"; its beat rate {row['beat_ratio'][1]:.2f} of its peers' (10-90%: {row['beat_ratio'][0]:.2f}-"
             f"{row['beat_ratio'][2]:.2f})" if row["beat_ratio"] else "")
          + f"; stalled fraction (10%, median, 90%, max) throttled {row['stalled_throttled']}, others "
            f"{row['stalled_others']}"
          + f"; its switches {back}; other ranks: {len(other['failed'])} declared failed, "
            f"{len(other['slow'])} slow reports" + (f"; error: {row['error']}" if row["error"] else ""), flush=True)
    for m in row["failed_throttled"] + other["failed"] + other["slow"]:
        print(f"    {m}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", default="bench-out/false-alarms")
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--loops", type=int, nargs="*", default=[2, 4], help="busy loops of each fault-free run")
    parser.add_argument("--throttle-loops", type=int, nargs="*", default=[2],
                        help="busy loops of each throttle run (none: no throttle run)")
    parser.add_argument("--throttle-iterations", type=int, default=200)
    parser.add_argument("--throttle-kind", choices=("stop", "quota"), default="stop",
                        help="stop: SIGSTOP/SIGCONT at 50%% duty; quota: a cgroup CPU quota (cgroup v1 cpu "
                             "controller, root), as a container's CPU limit")
    parser.add_argument("--quota", type=float, default=0.1, help="--throttle-kind quota: CPUs allowed (0.1)")
    args = parser.parse_args(argv)
    if args.throttle_kind == "quota" and args.throttle_loops and not os.access(CPU_CGROUP, os.W_OK):
        parser.error(f"--throttle-kind quota needs a writable {CPU_CGROUP} (cgroup v1's cpu controller, as root)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan_dir = out / "plan-3x3"
    schedc.compile(SPEC).write(plan_dir)
    rows = [false_alarm_run(plan_dir, args.iterations, n) for n in args.loops]
    rows += [throttle_run(plan_dir, args.throttle_iterations, n, args.throttle_kind, args.quota)
             for n in args.throttle_loops]
    (out / "false_alarms.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
