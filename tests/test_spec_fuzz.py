"""Hypothesis: generated specs load to what was generated; any input gives a Spec or a SpecError."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import schedc
from schedc.diagnostics import SpecError
from schedc.load import decode_spec, load_text
from schedc.printer import print_spec
from spec_strategies import spec_texts

# The fuzz tests share the profile's budget: a few thousand examples in CI in total.
_BASE = settings().max_examples
FUZZ = settings(max_examples=max(20, _BASE * 2), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

_VALID = open(os.path.join(os.path.dirname(__file__), "..", "specs", "example.sched"), encoding="utf-8").read()


def _assert_clean(text: str) -> None:
    """A valid Spec or a SpecError whose diagnostics all point inside the input."""
    try:
        load_text(text, name="fuzz")
    except SpecError as exc:
        assert exc.diagnostics
        # Spans count lines by "\n" (a lone "\r" is a line break too: it is normalized first).
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        for d in exc.diagnostics:
            exc.render()
            if d.span is None:
                continue
            assert 1 <= d.span.line <= len(lines) + 1, d
            width = len(lines[d.span.line - 1]) if d.span.line <= len(lines) else 0
            assert 1 <= d.span.column <= width + 1, (d, text)


@FUZZ
@given(spec_texts())
def test_generated_specs_load_to_their_values(case):
    text, v = case
    spec = load_text(text)
    assert (spec.dp, spec.pp, spec.cluster.gpus_per_node) == (v["dp"], v["pp"], v["gpus_per_node"])
    assert spec.cluster.placement == v["placement"] and spec.microbatches == v["microbatches"]
    assert spec.cluster.gpu.memory == v["memory"]
    assert (spec.cluster.link.latency, spec.cluster.link.bandwidth) == (v["latency"], v["bandwidth"])
    for got, want in zip(spec.stages, v["stages"]):
        assert {k: getattr(got, k) for k in want} == want
    assert {(g.dp, g.pp) for g in spec.gpus if not g.live} == set(v["failed"])
    assert {((g.dp, g.pp), g.speed) for g in spec.gpus if g.live and (g.dp, g.pp) in dict(v["slow"])} == \
        {(c, s) for c, s in v["slow"]}
    assert spec.schedule.solver == v["solver"]
    assert (None if spec.recovery is None else vars(spec.recovery)) == v["recovery"]
    for g in spec.gpus:
        assert spec.cluster.rank_of(g.dp, g.pp) == g.rank
    assert schedc.load(print_spec(spec)) == spec


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text_never_crashes(text):
    _assert_clean(text)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(data):
    try:
        text = decode_spec(data, "fuzz")
    except SpecError as exc:
        assert exc.codes == ["E106"]
        return
    _assert_clean(text)


_TOKENS = _VALID.replace("{", " { ").replace("}", " } ").split()


@FUZZ
@given(st.data())
def test_mutated_valid_specs_never_crash(data):
    tokens = list(_TOKENS)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(tokens) - 1))
        op = data.draw(st.sampled_from(["delete", "duplicate", "swap", "replace"]))
        if op == "delete":
            del tokens[i]
        elif op == "duplicate":
            tokens.insert(i, tokens[i])
        elif op == "swap":
            j = data.draw(st.integers(0, len(tokens) - 1))
            tokens[i], tokens[j] = tokens[j], tokens[i]
        else:
            tokens[i] = data.draw(st.sampled_from(["=", "{", "}", "0", "-1", "1.5", "x", '"s"', "fail", "9GiB",
                                                   "layers[1:0]", "stage", "gpu(dp=9, pp=0)", "node"]))
    sep = data.draw(st.sampled_from([" ", "\n"]))
    _assert_clean(sep.join(tokens))
