"""Hypothesis strategies that write spec *text* from random values (tests of the spec language)."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def spec_texts(draw) -> tuple[str, dict]:
    """A valid spec's text and the values it was written from (integers in µs and bytes)."""
    dp = draw(st.integers(1, 4))
    pp = draw(st.integers(1, 4))
    gpn = draw(st.integers(1, 8))
    placement = draw(st.sampled_from(["pipeline_major", "stage_major"]))
    mbs = draw(st.integers(1, 16))
    stages = []
    for _ in range(pp):
        act = draw(st.integers(1, 64)) << 20
        stages.append({
            "forward": draw(st.integers(1, 5000)), "backward_input": draw(st.integers(1, 5000)),
            "backward_weight": draw(st.integers(1, 5000)), "optimizer": draw(st.integers(0, 2000)),
            "activation": act, "stash": draw(st.integers(0, act >> 20)) << 20,
            "static": draw(st.integers(0, 1024)) << 20, "send": draw(st.integers(0, 1 << 24)),
        })
    memory = max(s["static"] + s["activation"] for s in stages) + (draw(st.integers(0, 4)) << 30)
    latency = draw(st.integers(0, 100))
    bandwidth = draw(st.sampled_from([10**9, 25 * 10**9, 2**30, 123456789]))
    # Failures: keep a live GPU in every stage; each GPU listed at most once.
    coords = [(d, s) for d in range(dp) for s in range(pp)]
    chosen = draw(st.lists(st.sampled_from(coords), unique=True, max_size=min(3, len(coords))))
    failed, slow = [], []
    for g in chosen:
        alive = [c for c in coords if c[1] == g[1] and c not in failed]
        if draw(st.booleans()) and len(alive) > 1:
            failed.append(g)
        else:
            slow.append((g, draw(st.sampled_from([0.25, 0.5, 0.75, 0.9, 1.0]))))
    solver = draw(st.sampled_from(["cpsat", "greedy", "1f1b", "zb-h1"]))
    decouple, stagger = draw(st.booleans()), draw(st.booleans())
    time_limit = draw(st.sampled_from(["5s", "0.5s", "250ms", "30s"]))

    def time(us: int) -> str:
        return draw(st.sampled_from([f"{us}us", f"{us / 1000:g}ms" if us % 10 == 0 else f"{us}us"]))

    lines = ["# random spec", "cluster {", f"  dp = {dp}  pp = {pp}  gpus_per_node = {gpn}",
             f"  placement = {placement}", f"  gpu {{ memory = {memory}B }}",
             f"  link {{ latency = {latency}us  bandwidth = {bandwidth}B/s }}", "}", "stages {"]
    for i, s in enumerate(stages):
        parts = [f"{k} = {time(s[k])}" for k in ("forward", "backward_input", "backward_weight", "optimizer")]
        parts += [f"{k} = {s[k] >> 20}MiB" if k != "send" else f"send = {s[k]}B"
                  for k in ("activation", "stash", "static", "send")]
        lines.append(f"  stage {i} {{ " + "  ".join(parts) + " }")
    lines += ["}", f"train {{ microbatches = {mbs} }}"]
    if failed or slow:
        lines.append("failures {")
        lines += [f"  fail gpu(dp={d}, pp={s})" for d, s in failed]
        lines += [f"  slow gpu(dp={d}, pp={s}) speed = {v}" for (d, s), v in slow]
        lines.append("}")
    q = (lambda x: f'"{x}"') if solver[0].isdigit() else (lambda x: x)
    lines.append(f"schedule {{ decouple_backward = {str(decouple).lower()}  "
                 f"stagger_optimizer = {str(stagger).lower()}  solver = {q(solver)}  time_limit = {time_limit} }}")
    recovery = None
    if draw(st.booleans()):  # a recovery block, its keys in any order and any subset
        keys = draw(st.lists(st.sampled_from(["policy", "horizon", "checkpoint_every", "restart_cost",
                                              "reconfigure_cost"]), unique=True))
        recovery = {"policy": draw(st.sampled_from(["auto", "reroute", "drop-pipeline", "repartition", "restart"])),
                    "horizon": draw(st.sampled_from([900.0, 60.0, 0.5])),
                    "checkpoint_every": draw(st.sampled_from([1800.0, 60.0, 1.5])),
                    "restart_cost": draw(st.sampled_from([30.0, 0.0, 2.25])),
                    "reconfigure_cost": draw(st.sampled_from([1.0, 0.0, 0.125]))}
        shown = {k: recovery[k] for k in keys}
        recovery = {**{"policy": "auto", "horizon": 900.0, "checkpoint_every": 1800.0, "restart_cost": 30.0,
                       "reconfigure_cost": 1.0}, **shown}
        lines.append("recovery { " + "  ".join(f"{k} = {v if k == 'policy' else f'{v:g}s'}"
                                               for k, v in shown.items()) + " }")
    values = dict(dp=dp, pp=pp, gpus_per_node=gpn, placement=placement, microbatches=mbs, stages=stages,
                  memory=memory, latency=latency, bandwidth=bandwidth, failed=failed, slow=slow, solver=solver,
                  decouple=decouple, stagger=stagger, recovery=recovery)
    return "\n".join(lines) + "\n", values
