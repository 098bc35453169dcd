"""Hypothesis strategies shared by the test suite: random scheduling instances."""

from __future__ import annotations

from hypothesis import strategies as st

from schedc.instance import Instance, make_instance


def bench_explicit(**kwargs) -> Instance:
    """The bench's explicit-cost 4 x 4 x 8 scenario (`schedc bench`), with `failed=`/`slow=` and
    any other `make_instance` argument on top."""
    return make_instance(4, 4, 8, **{**dict(
        forward=[1200, 1000, 1000, 1400], backward_input=[1000, 1000, 1000, 1500],
        backward_weight=800, optimizer=400, send=16 << 20, latency=20), **kwargs})


@st.composite
def instances(
    draw,
    *,
    max_dp: int = 3,
    max_pp: int = 4,
    max_microbatches: int = 8,
    failures: bool = True,
    slow: bool = True,
    tight_memory: bool = True,
    decouple: bool | None = None,
    stagger: bool | None = None,
) -> Instance:
    """A random valid instance: every stage keeps at least one live GPU.

    With `tight_memory`, the memory limit sometimes allows only a few
    microbatches in flight (never fewer than one), so solvers must respect it.
    """
    dp = draw(st.integers(1, max_dp))
    pp = draw(st.integers(1, max_pp))
    mbs = draw(st.integers(1, max_microbatches))
    durations = st.integers(1, 40).map(lambda x: x * 50)
    fwd = draw(st.lists(durations, min_size=pp, max_size=pp))
    bi = draw(st.lists(durations, min_size=pp, max_size=pp))
    bw = draw(st.lists(durations, min_size=pp, max_size=pp))
    opt = draw(st.lists(st.integers(0, 10).map(lambda x: x * 50), min_size=pp, max_size=pp))
    act = draw(st.lists(st.integers(1, 8).map(lambda x: x << 20), min_size=pp, max_size=pp))
    stash = [draw(st.integers(0, a >> 20)) << 20 for a in act]
    static = draw(st.lists(st.integers(0, 16).map(lambda x: x << 20), min_size=pp, max_size=pp))
    send = draw(st.lists(st.integers(0, 4).map(lambda x: x << 20), min_size=pp, max_size=pp))
    latency = draw(st.integers(0, 50))

    failed: set[tuple[int, int]] = set()
    speeds: dict[tuple[int, int], float] = {}
    if failures and dp > 1:
        for s in range(pp):
            lost = draw(st.integers(0, dp - 1))  # keep at least one live replica
            failed |= {(d, s) for d in draw(st.permutations(range(dp)))[:lost]}
    if slow:
        live = [(d, s) for d in range(dp) for s in range(pp) if (d, s) not in failed]
        for g in draw(st.lists(st.sampled_from(live), max_size=2, unique=True)):
            speeds[g] = draw(st.sampled_from([0.5, 0.6, 0.75, 0.8]))

    # Memory: enough for the worst stage's static plus k microbatches in flight.
    k = draw(st.integers(1, pp + 2)) if tight_memory else 4 * max_microbatches * max(dp, 1)
    memory = max(static[s] + k * act[s] for s in range(pp))

    return make_instance(
        dp, pp, mbs,
        forward=fwd, backward_input=bi, backward_weight=bw, optimizer=opt,
        activation=act, stash=stash, static=static, send=send,
        gpu_memory=memory, latency=latency, bandwidth=10_000_000_000,
        decouple_backward=draw(st.booleans()) if decouple is None else decouple,
        stagger_optimizer=draw(st.booleans()) if stagger is None else stagger,
        failed=failed, slow=speeds,
    )
