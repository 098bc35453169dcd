"""`schedc replay`: availability traces (parse, diagnostics, GPU picks), the replay's invariants
on a small job, and the command line (JSON, diagnostics, the plot)."""

from __future__ import annotations

import json
import random
import xml.etree.ElementTree as ET

import pytest

import schedc
import schedc.cli as cli
from schedc.diagnostics import SpecError
from schedc.recovery_cost import Costs
from schedc.replay import POLICIES, check_policies, replay
from schedc.trace import Trace, availability, check_fits, parse_trace, read_trace

# 2 pipelines of 2 stages. A stage's static memory (5 GiB of 8) keeps one GPU from holding both
# stages: re-partitioning needs 2 live GPUs (a 1 x 2 layout), so the time it stalls is known.
SPEC_TEXT = """
cluster { dp = 2  pp = 2  gpus_per_node = 2
          gpu { memory = 8GiB }  link { latency = 10us  bandwidth = 10GB/s } }
stages { all { forward = 1ms  backward_input = 1ms  backward_weight = 0.5ms  optimizer = 0.2ms
               activation = 512MiB  stash = 128MiB  static = 5GiB  send = 8MiB } }
train { microbatches = 4 }
"""
MODEL_NEEDS = 2  # live GPUs the smallest re-partitioned layout of SPEC_TEXT runs on

# ~10 rows: losses, a burst to 1 and 0 GPUs, returns; times in seconds.
TRACE_TEXT = """\
seconds,available
# a hand-written trace: every count from 0 to 4
0,4
600,3
1500,3
1500,2
2400,4
3000,1
3300,0
3600,2
4800,3
6000,4
7200,4
"""


@pytest.fixture(scope="module")
def spec():
    return schedc.load(SPEC_TEXT, name="small.sched")


@pytest.fixture(scope="module")
def trace():
    return parse_trace(TRACE_TEXT, "small.csv")


@pytest.fixture(scope="module")
def result(spec, trace):
    return replay(spec, trace, seed=0)


def time_below(trace: Trace, live: int) -> float:
    """Seconds the trace spends with fewer than `live` instances up."""
    return sum(t2 - t for (t, c), (t2, _) in zip(trace.rows, trace.rows[1:]) if c < live)


# -- traces ------------------------------------------------------------------------------------------


def test_trace_header_comments_and_blank_lines():
    text = "# spot instances\n\ntime , count  # header\n0,4\n  10.5 , 3 # lost one\n\n10.5,4\n"
    t = parse_trace(text, "x.csv")
    assert t.rows == ((0.0, 4), (10.5, 3), (10.5, 4))
    assert t.lines == (4, 5, 7) and t.duration_s == 10.5 and t.most == 4
    assert parse_trace("0,4\n10,3\n").rows == ((0.0, 4), (10.0, 3))  # no header
    assert parse_trace("0,4\n1e3,2\n").rows == ((0.0, 4), (1000.0, 2))


def codes_at(text: str) -> list[tuple[str, int, int]]:
    with pytest.raises(SpecError) as exc:
        parse_trace(text, "x.csv")
    return [(d.code, d.span.line, d.span.column) for d in exc.value.diagnostics]


def test_trace_row_errors_point_at_the_field():
    assert codes_at("0,4\n10\n") == [("E641", 2, 1)]  # one field
    assert codes_at("0,4\n 10,3,1\n") == [("E641", 2, 2)]  # three
    assert codes_at("0,4\nten,3\n") == [("E641", 2, 1)]  # a time that is not a number
    assert codes_at("0,4\n10, 2.5\n") == [("E641", 2, 5)]  # not a whole count
    assert codes_at("0,4\n1.5,1.5\n") == [("E641", 2, 5)]  # the count, not the time with the same text
    assert codes_at("0,4\n10,\n") == [("E641", 2, 4)]  # a missing count
    assert codes_at("0,4\n10,inf\n") == [("E641", 2, 4)]
    assert codes_at("0,4\n-5,3\n") == [("E642", 2, 1)]
    assert codes_at("0,4\n5,-3\n") == [("E642", 2, 1)]
    assert codes_at("0,4\n10,3\n5,2\n") == [("E642", 3, 1)]
    assert codes_at("0,4\n1e308,2\n") == [("E642", 2, 1)]  # (a replay of it printed nan and wrote NaN into its JSON)
    # A header only on the first data line: later words are errors, all reported at once.
    assert codes_at("a,b\n0,4\nc,d\n5,x\n6,1\n3,1\n") == [("E641", 3, 1), ("E641", 4, 3), ("E642", 6, 1)]


def test_trace_error_renders_the_row_with_a_caret():
    with pytest.raises(SpecError) as exc:
        parse_trace("seconds,available\n0,4\n60,3.5  # half an instance\n", "spot.csv")
    assert exc.value.render() == (
        "error[E641]: `3.5` is not a whole count of instances\n"
        " --> spot.csv:3:4\n"
        "  |\n"
        "3 | 60,3.5  # half an instance\n"
        "  |    ^^^ not a whole number\n"
        "  = hint: rows are `seconds,available`: a time (e.g. 3600 or 3600.5) and a count (e.g. 12)")


def test_trace_without_rows_and_unreadable_files(tmp_path):
    for text in ("", "# nothing\n\n", "seconds,available\n"):
        with pytest.raises(SpecError) as exc:
            parse_trace(text, "x.csv")
        assert exc.value.codes == ["E644"]
    # Rows at one time only: a replay of no time would report 0 of 0 samples.
    for text, line in (("5,4\n", 1), ("0,4\n0,3 # then\n", 2)):
        with pytest.raises(SpecError) as exc:
            parse_trace(text, "x.csv")
        d = exc.value.diagnostics[0]
        assert (d.code, d.span.line, d.span.column) == ("E644", line, 1) and "spans no time" in d.message
    with pytest.raises(SpecError) as exc:
        read_trace(tmp_path / "missing.csv")
    assert exc.value.codes == ["E640"] and "No such file" in exc.value.diagnostics[0].message
    with pytest.raises(SpecError) as exc:
        read_trace(tmp_path)
    assert exc.value.codes == ["E640"] and "directory" in exc.value.diagnostics[0].message
    (tmp_path / "bin.csv").write_bytes(b"0,4\n\xff\xfe\n")
    with pytest.raises(SpecError) as exc:
        read_trace(tmp_path / "bin.csv")
    assert exc.value.codes == ["E641"]
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf0,4\n10,3\n")
    assert read_trace(tmp_path / "bom.csv").rows == ((0.0, 4), (10.0, 3))


def test_more_instances_than_the_job_points_at_the_row():
    t = parse_trace("0,2\n10,4\n20,5  # too many\n30,6\n", "x.csv")
    check_fits(t, 6, 1, "job")
    with pytest.raises(SpecError) as exc:
        check_fits(t, 4, 1, "job")
    d = exc.value.diagnostics[0]
    assert (d.code, d.span.line, d.span.column) == ("E643", 3, 4)
    assert "6 instance(s)" in d.message and "^ more than 4 instance(s)" in exc.value.render()
    with pytest.raises(SpecError) as exc:
        check_fits(t, 11, 2, "job")  # 5 instances x 2 GPUs fit in 11, 6 do not
    assert exc.value.diagnostics[0].span.line == 4


# -- which GPUs ------------------------------------------------------------------------------------


def random_trace(rng: random.Random, instances: int, rows: int = 40) -> Trace:
    return Trace("r", tuple((float(k), rng.randint(0, instances)) for k in range(rows)))


@pytest.mark.parametrize("per_instance", [1, 2, 3])
def test_availability_counts_and_returns(per_instance):
    rng = random.Random(7)
    gpus = 12
    instances = gpus // per_instance
    for seed in range(20):
        trace = random_trace(rng, instances)
        states = availability(trace, gpus, seed=seed, per_instance=per_instance)
        assert states == availability(trace, gpus, seed=seed, per_instance=per_instance)
        prev = frozenset(range(gpus))  # the job starts with every GPU up
        for (t, count), (ts, live) in zip(trace.rows, states):
            assert ts == t and len(live) == count * per_instance and live <= frozenset(range(gpus))
            # whole instances: GPU i * K + k is up with its instance
            assert all({g // per_instance * per_instance + k for k in range(per_instance)} <= live for g in live)
            if count * per_instance >= len(prev):
                assert prev <= live  # a rise brings back lost GPUs only; no live GPU swaps out
            else:
                assert live <= prev  # a drop loses live GPUs only
            prev = live


def test_availability_picks_uniformly():
    """Which GPU a one-GPU loss takes: about equally often each, over seeds (and the seed matters)."""
    trace = Trace("t", ((0.0, 4), (1.0, 3), (2.0, 4), (3.0, 3)))
    first = [next(iter(frozenset(range(4)) - availability(trace, 4, seed=s)[1][1])) for s in range(2000)]
    counts = [first.count(g) for g in range(4)]
    assert all(400 <= c <= 600 for c in counts), counts  # 500 each; 5 sigma is +-97
    # The returning GPU is the lost one (the only one lost), the next loss again any of the four.
    second = [next(iter(frozenset(range(4)) - availability(trace, 4, seed=s)[3][1])) for s in range(2000)]
    assert second != first and all(400 <= second.count(g) <= 600 for g in range(4))


# -- the replay -----------------------------------------------------------------------------------


def test_samples_within_bounds(result):
    assert set(result.policies) == set(POLICIES)
    for name, p in result.policies.items():
        # Only a re-partitioned layout may beat the user's own shape (it picks the fastest layout
        # of the live GPUs, which can be faster than the spec's); the others run the user's shape
        # with fewer or as many GPUs.
        top = 1.05 if name in ("auto", "repartition") else 1 + 1e-9
        assert 0 <= p.samples_fraction <= top, (name, p.samples_fraction)
        assert p.stalled_s + p.transition_s <= result.duration_s + 1e-6
        assert p.switches >= 1  # the trace changes, so every policy switched at least once
        covered = sum(b - a for a, b, _ in p.segments)
        assert covered == pytest.approx(result.duration_s)
        trained = sum((b - a) * f for a, b, f in p.segments) / result.duration_s
        assert trained == pytest.approx(p.samples_fraction, rel=1e-6)


def test_the_burst_stalls_the_fixed_layouts_but_not_auto(result, trace):
    below = time_below(trace, MODEL_NEEDS)
    assert below == 600  # 1 GPU from 3000 s, 0 from 3300 s, 2 at 3600 s
    for name in ("repartition", "auto"):
        assert result.policies[name].stalled_s == pytest.approx(below), name
    # restart runs whole pipelines of the user's shape (2 stages): it stalls exactly as long.
    assert result.policies["restart"].stalled_s == pytest.approx(below)
    # reroute needs every stage and drop-pipeline a whole pipeline: at least as long.
    assert result.policies["reroute"].stalled_s >= below
    assert result.policies["drop-pipeline"].stalled_s >= result.policies["reroute"].stalled_s


def test_all_gpus_up_is_fault_free(spec):
    trace = parse_trace("0,4\n3600,4\n7200,4\n", "up.csv")
    r = replay(spec, trace, seed=3)
    assert r.events == 0
    for name, p in r.policies.items():
        assert p.samples_fraction == pytest.approx(1.0, abs=1e-12), name
        assert (p.switches, p.stalled_s, p.transition_s) == (0, 0.0, 0.0), name


def test_a_lost_stage_stalls_reroute_but_not_repartition(spec):
    # Find a seed whose pick of 2 lost GPUs takes both GPUs of one stage.
    trace = parse_trace("0,4\n600,2\n3600,2\n", "burst.csv")
    stage = {g.rank: g.pp for g in spec.gpus}
    seed = next(s for s in range(100)
                if len({stage[r] for r in availability(trace, 4, seed=s)[1][1]}) == 1)
    r = replay(spec, trace, seed=seed, policies=["reroute", "repartition"])
    assert r.policies["reroute"].stalled_s == pytest.approx(3000)
    assert r.policies["reroute"].samples_fraction == pytest.approx(600 / 3600)
    rep = r.policies["repartition"]
    assert rep.stalled_s == 0 and rep.samples_fraction > 600 / 3600
    # The lost stage's state comes from the checkpoint: the transition pays a restore.
    d = rep.decisions[-1]
    assert "checkpoint" in d.chosen.detail
    assert d.chosen.transition_s >= Costs().restart_s + Costs().lost_work_s


def test_replay_is_deterministic(spec, trace, result):
    again = replay(spec, trace, seed=0)
    assert json.dumps(again.to_json(decisions=True)) == json.dumps(result.to_json(decisions=True))


def test_replay_checks_its_inputs(spec, trace):
    with pytest.raises(SpecError) as exc:
        replay(spec, trace, policies=["auto", "re-route"])
    assert exc.value.codes == ["E645"] and "reroute" in exc.value.diagnostics[0].hint
    assert check_policies(["restart", "auto", "restart"]) == ("restart", "auto")
    with pytest.raises(SpecError) as exc:
        replay(spec, parse_trace("0,4\n10,5\n", "x.csv"))
    assert exc.value.codes == ["E643"] and exc.value.diagnostics[0].span.line == 2


# -- the command line -------------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path):
    (tmp_path / "small.sched").write_text(SPEC_TEXT)
    (tmp_path / "small.csv").write_text(TRACE_TEXT)
    return tmp_path


def test_cli_json(files, capsys, trace):
    code = cli.main(["replay", str(files / "small.sched"), str(files / "small.csv"), "--json",
                     "--policy", "reroute,auto", "--policy", "repartition", "--restart-cost", "60",
                     "--checkpoint-every", "600", "--horizon", "300", "--decisions"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"] is True
    assert list(out["policies"]) == ["reroute", "auto", "repartition"]
    for p in out["policies"].values():
        assert {"samples_fraction", "stalled_s", "switches", "transition_s", "decisions"} <= set(p)
        assert all({"t", "live", "method", "reason", "options"} <= set(d) for d in p["decisions"])
    assert out["costs"] == {"reconfigure_s": 1.0, "restart_s": 60.0, "checkpoint_every_s": 600.0,
                            "default_horizon_s": 300.0}
    assert (out["gpus"], out["events"], out["duration_s"]) == (4, 8, trace.duration_s)
    assert out["policies"]["repartition"]["stalled_s"] == time_below(trace, MODEL_NEEDS)


def test_cli_table(files, capsys):
    code = cli.main(["replay", str(files / "small.sched"), str(files / "small.csv"), "--seed", "2"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("policy")))
    assert [line.split()[0] for line in lines[head + 1:head + 1 + len(POLICIES)]] == list(POLICIES)
    assert "seed 2" in out and "2.0 h, 8 event(s)" in out and "uniformly at random" in out


def run_cli(argv, capsys):
    code = cli.main(["replay", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_diagnostics(files, capsys):
    spec, csv = str(files / "small.sched"), str(files / "small.csv")
    (files / "bad.csv").write_text("seconds,available\n0,4\n60,four\n")
    code, out, err = run_cli([spec, str(files / "bad.csv")], capsys)
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.startswith(f"error[E641]: `four` is not a whole count of instances\n --> {files / 'bad.csv'}:3:4\n")
    assert "3 | 60,four\n  |    ^^^^ not a whole number" in err
    (files / "big.csv").write_text("0,4\n60,8\n")
    code, _, err = run_cli([spec, str(files / "big.csv")], capsys)
    assert code == 1 and "error[E643]" in err and f"{files / 'big.csv'}:2:4" in err
    code, _, err = run_cli([spec, str(files / "big.csv"), "--gpus-per-instance", "2"], capsys)
    assert code == 1 and "8 instance(s) x 2 GPU(s)" in err
    code, _, err = run_cli([spec, str(files / "none.csv")], capsys)
    assert code == 1 and "error[E640]" in err
    (files / "empty.csv").write_text("# nothing yet\n")
    code, _, err = run_cli([spec, str(files / "empty.csv")], capsys)
    assert code == 1 and "error[E644]" in err
    code, _, err = run_cli([spec, csv, "--policy", "reroute,restrat"], capsys)
    assert code == 1 and "error[E645]: unknown recovery policy `restrat`" in err and "`restart`" in err
    code, out, _ = run_cli([spec, str(files / "bad.csv"), "--json"], capsys)
    d = json.loads(out)
    assert code == 1 and d["ok"] is False and (d["diagnostics"][0]["code"], d["diagnostics"][0]["line"],
                                                d["diagnostics"][0]["column"]) == ("E641", 3, 4)
    code, _, err = run_cli([spec, csv, "--plot", str(files / "no" / "p.svg")], capsys)
    assert code == 1 and "error[E558]" in err


@pytest.mark.parametrize("option, value, words", [
    ("--restart-cost", "-1", "--restart-cost must be a number of seconds >= 0 (at most 1e+09), got -1"),
    ("--reconfigure-cost", "nan", "--reconfigure-cost must be a number of seconds >= 0 (at most 1e+09), got nan"),
    ("--horizon", "0", "--horizon must be a number of seconds > 0 (at most 1e+09), got 0"),
    # (the spec's `recovery` block and `schedc train --horizon` take the same range)
    ("--horizon", "2e9", "--horizon must be a number of seconds > 0 (at most 1e+09), got 2e+09"),
    ("--gpus-per-instance", "0", "--gpus-per-instance must be a whole number >= 1, got 0"),
    ("--seed", "-3", "--seed must be a whole number >= 0, got -3"),
    ("--seed", "2.5", "--seed must be a whole number >= 0, got 2.5"),
])
def test_cli_refuses_option_values_out_of_range_with_exit_1(files, capsys, option, value, words):
    """Values out of range are invalid input (exit 1, as every other command's), not usage (they were exit 2)."""
    code, out, err = run_cli([str(files / "small.sched"), str(files / "small.csv"), option, value], capsys)
    assert code == 1 and out == "" and err.startswith(f"error[E206]: {words}\n"), err


@pytest.mark.parametrize("option, value", [("--checkpoint-every", "soon"), ("--seed", "x"), ("--policy", ",")])
def test_cli_rejects_option_text_that_is_no_value_as_usage(files, capsys, option, value):
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", str(files / "small.sched"), str(files / "small.csv"), option, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {option}:" in err and repr(value) in err


def test_cli_plot(files, capsys):
    plot = files / "replay.svg"
    code, out, _ = run_cli([str(files / "small.sched"), str(files / "small.csv"), "--plot", str(plot)], capsys)
    assert code == 0 and f"wrote {plot}" in out
    svg = plot.read_text()
    root = ET.fromstring(svg)  # well-formed XML
    ns = "{http://www.w3.org/2000/svg}"
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert all(name in texts for name in POLICIES) and "live GPUs (share)" in texts
    assert len(list(root.iter(f"{ns}polyline"))) == len(POLICIES) + 1
    assert len(svg) < 60_000
    assert [p.name for p in files.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_bucket_means_keep_the_area():
    from schedc.cli.replay import bucket_means

    segments = [(0.0, 10.0, 1.0), (10.0, 10.5, 0.0), (10.5, 33.3, 0.6), (33.3, 100.0, 0.25)]
    for n in (1, 7, 400):
        means = bucket_means(segments, 0.0, 100.0, n)
        assert len(means) == n
        assert sum(means) * 100.0 / n == pytest.approx(sum((b - a) * f for a, b, f in segments))
    assert bucket_means(segments, 0.0, 100.0, 10)[0] == pytest.approx(1.0)
    assert bucket_means(segments, 0.0, 100.0, 10)[1] == pytest.approx((0.5 * 0 + 9.5 * 0.6) / 10)
