"""The typed messages of a live run: each one round-trips through its one encoding."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedc.live import protocol
from schedc.live.protocol import (IterationDone, Phase, ProtocolError, RunConfig, StopAgent, WorkerError, decode,
                                  encode)

# Every message that travels through the store (Weights carries bytes: pipes only).
STORED = [cls for kind, cls in sorted(protocol._KINDS.items()) if cls is not protocol.Weights]

_VALUES = {
    int: st.integers(-5, 10**6), float: st.floats(allow_nan=False, allow_infinity=False),
    str: st.text(max_size=20), bool: st.booleans(),
}


def _strategy(annotation: str):
    return _values(eval(annotation, vars(protocol) | {"typing": typing}))  # the field's annotation, as written


def _values(hint):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        if args[0] is dict:
            return st.lists(st.fixed_dictionaries({"code": st.text(max_size=4), "message": st.text(max_size=9)}),
                            max_size=3).map(tuple)
        if len(args) > 1 and args[1] is not Ellipsis:  # a fixed-length tuple: (a, b)
            return st.tuples(*map(_values, args))
        return st.lists(_VALUES[args[0]], max_size=4).map(tuple)
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        (inner,) = [a for a in args if a is not type(None)]
        return st.none() | _values(inner)
    return _VALUES[hint]


@pytest.mark.parametrize("cls", STORED, ids=lambda c: c.__name__)
@given(data=st.data())
def test_every_message_round_trips(cls, data):
    values = {f.name: data.draw(_strategy(f.type), label=f.name) for f in dataclasses.fields(cls)}
    msg = cls(**values)
    assert decode(encode(msg)) == msg


def test_kinds_are_the_wire_names_and_unknown_ones_are_refused():
    assert encode(StopAgent()) == b'{"kind":"stop"}'
    assert decode(encode(IterationDone(rank=1, it=2, t0=0.0, t1=1.0))) == IterationDone(1, 2, 0.0, 1.0)
    assert decode(b'{"kind":"error","rank":3,"diagnostics":[{"code":"E590","message":"x"}]}') == WorkerError(
        3, ({"code": "E590", "message": "x"},))
    with pytest.raises(ProtocolError):
        decode(b'{"kind":"no such message"}')


def test_phases_read_as_their_names():
    assert str(Phase.RECOVERING) == "recovering" and Phase("running") is Phase.RUNNING
    assert f"the run is {Phase.FINISHING}" == "the run is finishing"


def test_the_run_config_round_trips():
    config = RunConfig(iterations=5, emulate=True, heartbeat_interval=0.05, wait_timeout=600.0, checkpoint_every=2,
                       checkpoint_dir="/tmp/c", want_weights=False, injections=({"index": 0, "ranks": [1]},),
                       coords={"0": (0, 0), "1": (0, 1)}, probe=True, cluster=(1, 2))
    assert RunConfig.decode(config.encode()) == config
