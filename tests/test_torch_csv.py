"""Per-pipeline CSVs are accepted by torch.distributed.pipelining's own validators."""

from __future__ import annotations

import csv
import re

import pytest
from test_verify import base_instance, hand_schedule, rerouted_programs

from schedc.export import torch_csv_pipelines, write_torch_csvs
from schedc.instance import make_instance

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_check(path, pp, mbs):
    with open(path, newline="") as fh:
        actions = {rank: [schedules._Action.from_str(c) for c in row] for rank, row in enumerate(csv.reader(fh))}
    assert len(actions) == pp
    cells = {rank: [str(a) for a in row] for rank, row in actions.items()}
    schedules._validate_schedule(actions, pp, pp, mbs)
    with_comms = schedules._add_send_recv(actions, stage_to_rank=lambda s: s, num_stages=pp)
    schedules._simulate_comms_compute(with_comms, lambda s: s, pp)  # raises if it cannot finish
    return cells


def _solver(name):
    """A registered solver: one that is missing or fails to import fails the test, not skips it."""
    from schedc.solvers import SolveOptions, get_solver

    return get_solver(name), SolveOptions()


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "gpipe"])
@pytest.mark.parametrize("pp,mbs", [(2, 2), (4, 8), (3, 5), (4, 4)])
def test_torch_accepts_solver_csvs(tmp_path, name, pp, mbs):
    solve, options = _solver(name)
    sched = solve(make_instance(2, pp, mbs), options)
    paths = write_torch_csvs(tmp_path, sched)
    assert [p.name for p in paths] == ["pipeline_0.csv", "pipeline_1.csv"]
    for p in paths:
        actions = _torch_check(p, pp, mbs)
        kinds = {re.sub(r"\d", "", c) for row in actions.values() for c in row}
        assert kinds == ({"F", "I", "W"} if sched.instance.decouple_backward else {"F", "B"})


def test_cells_match_programs(tmp_path):
    sched = hand_schedule(base_instance())
    write_torch_csvs(tmp_path, sched)
    rows = list(csv.reader(open(tmp_path / "pipeline_1.csv", newline="")))
    assert rows[2][:3] == ["2F0", "2I0", "2W0"]
    assert all("O" not in c for row in rows for c in row)


def test_rerouted_pipelines_are_left_out(tmp_path):
    inst = base_instance(failed=[(1, 1)])
    sched = hand_schedule(inst, lambda i: rerouted_programs(i, (1, 1), 0))
    assert torch_csv_pipelines(sched) == []  # pipeline 1 lost a GPU, pipeline 0 hosts its work
    assert write_torch_csvs(tmp_path, sched) == []
