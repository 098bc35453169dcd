"""schedule.json (schedc.schedule/v1): round trip, extra keys, and diagnostics for bad files."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from strategies import instances
from test_verify import base_instance, hand_schedule, one_f_one_b_programs, rerouted_programs

from schedc.diagnostics import SchedcError
from schedc.schedule_io import FORMAT, ScheduleFileError, read_schedule, schedule_to_json, write_schedule
from schedc.simulate import metrics_of


def test_round_trip_with_metrics(tmp_path):
    inst = base_instance(failed=[(1, 1)], slow={(0, 2): 0.6})
    sched = hand_schedule(inst, lambda i: rerouted_programs(i, (1, 1), 0))
    metrics = metrics_of(sched, fault_free_iteration_time=1234)
    path = write_schedule(tmp_path / "schedule.json", sched, metrics)
    back, stored = read_schedule(path)
    assert back == sched
    assert stored["iteration_time"] == metrics.iteration_time
    assert stored["fault_free_iteration_time"] == 1234
    obj = json.loads(path.read_text())
    assert obj["format"] == FORMAT
    rerouted = [o for o in obj["ops"] if o.get("rerouted")]
    assert rerouted and all(o["dp"] == 1 and o["pp"] == 1 for o in rerouted)
    assert {g["state"] for g in obj["gpus"]} == {"live", "failed"}


@given(inst=instances(failures=False))
def test_round_trip_random(tmp_path_factory, inst):
    sched = hand_schedule(inst, one_f_one_b_programs)
    path = tmp_path_factory.mktemp("rt") / "schedule.json"
    write_schedule(path, sched)
    assert read_schedule(path)[0] == sched


def test_extra_keys_are_allowed(tmp_path):
    sched = hand_schedule(base_instance())
    obj = schedule_to_json(sched)
    obj["comment"] = "hand edited"
    obj["ops"][0]["note"] = "x"
    p = tmp_path / "s.json"
    p.write_text(json.dumps(obj))
    assert read_schedule(p)[0] == sched


def _read_bad(tmp_path, mutate) -> ScheduleFileError:
    obj = schedule_to_json(hand_schedule(base_instance()))
    mutate(obj)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(obj))
    with pytest.raises(ScheduleFileError) as exc:
        read_schedule(p)
    assert isinstance(exc.value, SchedcError)
    return exc.value


def test_bad_field_names_its_json_path(tmp_path):
    err = _read_bad(tmp_path, lambda o: o["ops"][3].__setitem__("start", "soon"))
    assert err.codes == ["E602"] and "`$.ops[3].start`" in err.diagnostics[0].message


def test_negative_time_and_unknown_kind(tmp_path):
    def mutate(o):
        o["ops"][0]["end"] = -1
        o["ops"][1]["kind"] = "X"
    err = _read_bad(tmp_path, mutate)
    text = err.render()
    assert "$.ops[0].end" in text and "$.ops[1].kind" in text


def test_missing_field_and_wrong_format(tmp_path):
    err = _read_bad(tmp_path, lambda o: o.pop("gpu_memory"))
    assert "`$.gpu_memory` is missing" in err.diagnostics[0].message
    err = _read_bad(tmp_path, lambda o: o.__setitem__("format", "schedc.schedule/v9"))
    assert "$.format" in err.diagnostics[0].message


def test_inconsistent_parts(tmp_path):
    err = _read_bad(tmp_path, lambda o: o["gpus"].pop())
    assert err.codes == ["E603"] and "dp x pp" in err.diagnostics[0].message


def test_not_json_and_missing_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{ not json")
    with pytest.raises(ScheduleFileError) as exc:
        read_schedule(p)
    assert exc.value.codes == ["E601"] and "line 1" in exc.value.diagnostics[0].message
    with pytest.raises(ScheduleFileError) as exc:
        read_schedule(tmp_path / "nope.json")
    assert exc.value.codes == ["E601"]
    p.write_text("[1, 2]")
    with pytest.raises(ScheduleFileError) as exc:
        read_schedule(p)
    assert exc.value.codes == ["E602"]


def test_round_trip_of_a_redundant_plan(tmp_path):
    """The `redundant` baseline's plans (Bamboo) carry R ops and a holder running a failed
    GPU's stage; the file says `redundant_forward` and reads back to the same schedule, which
    verifies again. Other plans' files have no such key."""
    from schedc.instance import make_instance
    from schedc.solvers import SolveOptions, get_solver
    from schedc.verify import verify_schedule

    sched = get_solver("redundant")(make_instance(2, 3, 4, failed=[(1, 1)]), SolveOptions())
    path = write_schedule(tmp_path / "schedule.json", sched, metrics_of(sched))
    obj = json.loads(path.read_text())
    assert obj["redundant_forward"] is True and any(o["kind"] == "R" for o in obj["ops"])
    back, _ = read_schedule(path)
    assert back == sched
    verify_schedule(back)
    plain = hand_schedule(base_instance(), one_f_one_b_programs)
    assert "redundant_forward" not in schedule_to_json(plain)
    # With decoupled B/W there is no R slot: the file is refused, not misread.
    err = _read_bad(tmp_path, lambda o: o.update(redundant_forward=True))
    assert err.codes == ["E603"] and "redundant_forward" in err.diagnostics[0].message
