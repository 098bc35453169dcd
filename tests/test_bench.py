"""`schedc bench --quick` on a tiny matrix: the files appear and the numbers hang together."""

from __future__ import annotations

import csv

from schedc.cli import main
from schedc.bench.chart import line_chart
from schedc.bench.scenarios import Scenario, scenarios


def test_bench_quick_smoke(tmp_path):
    out = tmp_path / "bench"
    rc = main(["bench", "--quick", "--no-scale", "--time-limit", "0.2", "--limit", "2", "-o", str(out)])
    assert rc == 0
    for name in ("results.md", "results.csv", "latency.csv", "ablation.csv", "throughput.svg", "latency.svg"):
        assert (out / name).exists(), name
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 2
    for row in rows:
        cp, gr, lb = int(row["cpsat_us"]), int(row["greedy_us"]), float(row["lower_bound_us"])
        proven = float(row["proven_bound_us"])
        assert lb <= proven <= cp <= gr
        assert int(row["peak_memory"]) <= int(row["memory_limit"])
    md = (out / "results.md").read_text()
    assert "cpsat / proven bound (re-routing plans)" in md and "proven optimal among re-routing plans in" in md
    assert "`optimal`, its proven bound and the lower bounds hold among re-routing plans" in md
    assert "## Quality" in md and "## Planning latency" in md and "## Ablation" in md
    ablation = list(csv.DictReader((out / "ablation.csv").open()))
    assert {(r["decouple_backward"], r["stagger_optimizer"]) for r in ablation} == {
        ("True", "True"), ("True", "False"), ("False", "True"), ("False", "False")}
    assert "<polyline" in (out / "throughput.svg").read_text()


def test_matrix_never_loses_a_stage_and_is_seeded():
    a, b = scenarios(quick=False, seeds=2), scenarios(quick=False, seeds=2)
    assert a == b
    for sc in a:
        assert 16 <= sc.gpus <= 64
        failed = [f for f in sc.failures if f.startswith("fail gpu")]
        stages = [int(f.split("pp=")[1].rstrip(")")) for f in failed]
        assert all(stages.count(s) < sc.dp for s in set(stages))


def test_scenario_specs_load():
    from schedc.load import load

    for model in ("explicit", "gpt3-medium", "gpt3-2.7b"):
        sc = Scenario("t", model, 2, 4, 8, ("fail gpu(dp=1, pp=2)", "slow gpu(dp=0, pp=1) speed = 0.5"))
        spec = load(sc.spec_text())
        assert spec.dp == 2 and spec.pp == 4 and not spec.gpu(1, 2).live


def test_line_chart_draws_every_series():
    svg = line_chart({"a": [(1, 1.0), (2, 0.5)], "b": [(1, 0.9), (2, 0.8)]}, "t", "x", "y")
    assert svg.count("<polyline") == 2 and svg.startswith("<svg")


def test_live_bench_counts_only_iterations_that_advance_training():
    """The live recovery plot: an iteration run again after a restart adds no throughput."""
    from bench.live_recovery import plot, useful_throughput

    steady = [(float(t), t) for t in range(10)]  # one iteration per second
    assert all(abs(y - 1.0) < 1e-9 for _, y in useful_throughput(steady, 0.0))
    # Iterations 5 and 6 run again from t=7 to t=8: no progress there.
    redone = [(float(t), t) for t in range(7)] + [(7.5, 5), (8.0, 6)] + [(9.0 + k, 7 + k) for k in range(5)]
    rates = dict(useful_throughput(redone, 7.0))
    assert min(rates.values()) < 0.5 and max(rates.values()) <= 1.0 + 1e-9
    svg = plot({"reroute": steady, "restart": redone}, {"reroute": 4.0, "restart": 7.0}, "t")
    assert svg.startswith("<svg") and "restart" in svg and "seconds since the fault" in svg


def test_zero_bubble_grid_row_and_csv(tmp_path):
    """bench/zero_bubble_grid.py: a row compiles its spec and times both references on it; the
    CSV holds the plan columns two runs must agree on."""
    from bench.zero_bubble_grid import PLAN_COLUMNS, main as grid_main, run_instance

    row = run_instance(4, 8, "F=B=W", 10, 2, True, solver="greedy", time_limit=1.0)
    assert (row["zb_h1_ms"], row["zb_h2_ms"]) == ("27.120", "24.060")
    assert float(row["schedc_ms"]) <= 24.060 and float(row["vs_reference"]) <= 1.0
    out = tmp_path / "grid.csv"
    assert grid_main(["--quick", "--solver", "greedy", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 16 and list(rows[0])[:len(PLAN_COLUMNS)] == PLAN_COLUMNS


def test_scale_bench_point():
    """bench/scale.py's smallest point, planned by classes: compile, write, and one replan of
    each event (figures are the benchmark's business; here only that it runs and is consistent)."""
    from bench.scale import point

    row = point(1024, 8, calls=1, deadline=5.0, symmetric=None)
    assert row["mode"] == "classes" and row["reduced_dp"] < row["dp"] == 128
    assert row["files"] < 1024 and set(row["events"]) == {"fail gpu", "fail node", "slow gpu"}
    for ev in row["events"].values():
        assert ev["iteration_ms"] >= row["iteration_ms"] * 0.99 and "classes" in ev["classes"]


def test_live_plots_redraw_from_the_json_the_scripts_write(tmp_path):
    """bench/live_recovery.py and bench/live_slowness.py keep what their plots are drawn from, so
    `--replot` draws them again without a run (the figures in docs/figures)."""
    import json

    from bench import live_recovery, live_slowness

    rows = [{"scenario": "one GPU", "method": m, "t_fault": 4.0,
             "series": [[float(t) * k, t] for t in range(12)]} for k, m in ((1, "reroute"), (1.5, "restart"))]
    (tmp_path / "live_recovery.json").write_text(json.dumps(rows))
    assert live_recovery.main(["--replot", str(tmp_path / "live_recovery.json"), "-o", str(tmp_path)]) == 0
    svg = (tmp_path / "throughput-one-GPU.svg").read_text()
    assert svg.count("<polyline") == 2 and "reroute" in svg and "restart" in svg

    def run(period: float, switch: bool) -> dict:
        doc = {"iterations": [{"iteration": i, "start": i * period, "end": (i + 1) * period, "speeds": {}}
                              for i in range(live_slowness.UNTIL + 10)],
               "events": [{"kind": "slow", "t": 31 * period, "speed": 0.51, "rank": 5, "message": "slow"}],
               "switches": [{"kind": "rebalance", "t_decide": 33 * period}] if switch else []}
        return live_slowness.plotted(doc)

    report = {"slow": [{"speed": 0.5, "plotted": {"no slowdown": run(0.5, False), "unmitigated": run(0.9, False),
                                                  "mitigated": run(0.6, True)}}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert live_slowness.main(["--replot", str(tmp_path / "report.json"), "-o", str(tmp_path)]) == 0
    svg = (tmp_path / "slow-0.5.svg").read_text()
    assert svg.count("<polyline") == 3 and "rebalance" in svg and "seen 0.51" in svg
