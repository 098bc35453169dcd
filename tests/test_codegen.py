"""The generator: per-rank programs that compile, read well and match golden files."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from schedc.codegen import program_name, render_programs, write_programs
from schedc.diagnostics import RunError
from schedc.instance import make_instance
from schedc.runtime.manifest import Manifest, load_manifest
from schedc.schedule import Schedule
from test_runtime_support import list_schedule, schedule_for, spec_for

GOLDEN = Path(__file__).parent / "golden" / "codegen"
CALL = re.compile(r"^    rt\.(\w+)\((.*)\)  # (\S+) t=(\d+)$")


def _rerouted_case():
    inst = make_instance(2, 3, 2, failed=[(1, 1)], slow={(0, 2): 0.5}, latency=5)
    return inst, list_schedule(inst)


def test_golden_programs():
    """The text of the programs is the contract: compare with tests/golden/codegen (UPDATE_GOLDEN=1 rewrites)."""
    inst, sched = _rerouted_case()
    files = render_programs(spec_for(inst, name="golden.sched"), sched, metrics={"iteration_time": 12345},
                            out_name="out")
    assert sorted(files) == ["main.py", "programs.json", "rank_00.py", "rank_01.py", "rank_02.py",
                             "rank_03.py", "rank_05.py"]  # rank 4 = GPU (1, 1) failed: no program
    for name, text in files.items():
        path = GOLDEN / "rerouted_2x3" / name
        if os.environ.get("UPDATE_GOLDEN"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        assert text == path.read_text(), f"{name} differs from its golden file"


def test_programs_follow_the_schedule():
    """Each rank's calls are its ops in program order, with peers from the executors (re-routing included)."""
    inst, sched = _rerouted_case()
    files = render_programs(spec_for(inst), sched)
    executor = {(o.dp, o.mb, o.pp): o.rank for o in sched.ops if o.kind == "F"}
    assert executor[(1, 0, 1)] != inst.gpu(1, 1).rank  # the case really re-routes
    for rank, ops in sched.programs.items():
        lines = [CALL.match(l) for l in files[program_name(rank, 6)].splitlines() if l.startswith("    rt.")]
        assert all(lines)
        assert [m.group(3) for m in lines] == [str(o.id) for o in ops]
        for m, op in zip(lines, ops):
            args = dict(kv.split("=") for kv in m.group(2).split(", "))
            assert args["us"] == str(op.end - op.start)
            if op.kind == "F":
                assert args["recv_from"] == (str(executor[(op.dp, op.mb, op.pp - 1)]) if op.pp else "None")
                assert args["send_to"] == (str(executor[(op.dp, op.mb, op.pp + 1)]) if op.pp < 2 else "None")
            if op.kind == "B":
                assert args["recv_from"] == (str(executor[(op.dp, op.mb, op.pp + 1)]) if op.pp < 2 else "None")
                assert args["send_to"] == (str(executor[(op.dp, op.mb, op.pp - 1)]) if op.pp else "None")


@pytest.mark.parametrize("solver", ["1f1b", "greedy", "cpsat"])
def test_real_schedules_compile(solver):
    inst = make_instance(3, 4, 4, decouple_backward=solver != "1f1b")
    sched = schedule_for(inst, solver)
    files = render_programs(spec_for(inst), sched)
    for name, text in files.items():
        if name.endswith(".py"):
            compile(text, name, "exec")
    assert sum(text.count("rt.") for name, text in files.items() if name.startswith("rank_")) == len(sched.ops)


def test_manifest_round_trip_and_binding(tmp_path):
    inst = make_instance(2, 2, 3, failed=[(0, 1)])
    spec = spec_for(inst, source="schedc.models.gpt:build", optimizer="adamw", lr=0.5,
                    partition=((0, 3), (3, 6)))
    write_programs(spec, list_schedule(inst), tmp_path)
    m = load_manifest(tmp_path)
    assert m == Manifest.from_json(json.loads((tmp_path / "programs.json").read_text()))
    assert m.live_ranks == (0, 2, 3) and m.stage_groups == ((0, 2), (3,))
    assert (m.source, m.data, m.partition, m.optimizer, m.lr) == (
        "schedc.models.gpt:build", None, ((0, 3), (3, 6)), "adamw", 0.5)
    assert m.global_microbatches == 6 and m.dist_rank(3) == 2


def test_width_of_names_follows_world_size():
    assert program_name(3, 4) == "rank_03.py"
    assert program_name(7, 128) == "rank_007.py"


def test_rewrite_removes_programs_of_ranks_no_longer_live(tmp_path):
    inst = make_instance(2, 2, 2)
    write_programs(spec_for(inst), list_schedule(inst), tmp_path)
    assert (tmp_path / "rank_03.py").exists()
    (tmp_path / "rank_notes.py").write_text("mine")  # a user's file, named like a program
    inst2 = make_instance(2, 2, 2, failed=[(1, 1)])
    paths = write_programs(spec_for(inst2), list_schedule(inst2), tmp_path)
    assert not (tmp_path / "rank_03.py").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p.name for p in paths] + ["rank_notes.py"])


def test_a_failed_generation_writes_nothing(tmp_path):
    inst = make_instance(2, 2, 2)
    sched = list_schedule(inst)
    broken = Schedule(inst, tuple(o for o in sched.ops if not (o.kind == "F" and o.pp == 1)), sched.solver)
    with pytest.raises(RunError) as exc:
        write_programs(spec_for(inst), broken, tmp_path / "out")
    assert exc.value.codes == ["E502"] and "d0:1F0" in str(exc.value)
    assert not (tmp_path / "out").exists()


def test_shape_mismatch_is_a_diagnostic():
    inst = make_instance(2, 2, 2)
    with pytest.raises(RunError) as exc:
        render_programs(spec_for(make_instance(1, 2, 2)), list_schedule(inst))
    assert exc.value.codes == ["E501"]
