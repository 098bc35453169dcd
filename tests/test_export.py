"""trace.json and timeline.svg."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from test_verify import base_instance, hand_schedule, rerouted_programs

from schedc.export import render_timeline, trace_events, write_trace
from schedc.simulate import metrics_of


def _rerouted():
    inst = base_instance(failed=[(1, 1)], slow={(0, 2): 0.6})
    return hand_schedule(inst, lambda i: rerouted_programs(i, (1, 1), 0))


def test_trace_tracks_names_and_rerouted(tmp_path):
    sched = _rerouted()
    path = write_trace(tmp_path / "trace.json", sched)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert names[4] == "rank 4 (d1, s1) FAILED" and names[5] == "rank 5 (d1, s2)"
    assert names[2] == "rank 2 (d0, s2) speed 0.6"
    ops = [e for e in events if e["ph"] == "X"]
    assert len(ops) == len(sched.ops)
    f = next(e for e in ops if e["name"] == "d1:1F0")
    assert f["tid"] == 1 and f["cat"] == "forward" and f["args"]["rerouted"] is True
    assert all("rerouted" not in e["args"] for e in ops if not e["name"].startswith("d1:1"))


def test_trace_is_deterministic():
    assert trace_events(_rerouted()) == trace_events(_rerouted())


def test_timeline_svg_is_valid_xml_with_every_part():
    sched = _rerouted()
    svg = render_timeline(sched, metrics_of(sched))
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    text = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    for piece in ("FAILED", "speed 0.6", "time (ms)", "stage 2", "iteration", "re-routed", "+d1",
                  "W backward-weight"):
        assert piece in text
    rects = [r for r in root.iter() if r.tag.endswith("rect") and r.get("fill") == "url(#hatch)"]
    assert len(rects) == 1 + sum(1 for o in sched.ops if o.id in sched.rerouted)  # ops + legend
