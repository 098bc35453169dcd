"""Static per-stage programs of the classic schedules: GPipe, 1F1B, ZB-H1 and ZB-H2.

The fixed op orders the template solvers (`gpipe`, `1f1b`, `zb_h1`, `zb_h2`,
docs/baselines.md) and `drop_pipeline` hand out, and the seeds `greedy`
tries; nothing here is a jinja2 template (those are `schedc.codegen`'s).

A template is built for a *chain*: the GPUs of one pipeline, stage 0 to S-1,
that all execute the same microbatches in the same order. Within a chain the
programs are deadlock-free as long as the warm-up (microbatches in flight
before the first B) never grows from one stage to the next, which
`chain_warmups` guarantees.
"""

from __future__ import annotations

from typing import Sequence

from schedc.instance import Instance
from schedc.schedule import OpId
from schedc.solvers.common import fits_in_flight, program_peak

Unit = tuple[int, int]  # (dp, mb): a microbatch by its owner pipeline and index


def chain_warmups(instance: Instance, chain: Sequence[int], n: int, factor: int = 1,
                  short: int = 0) -> list[int]:
    """Warm-up per stage of a chain: `factor` x (S - s) - `short` forwards (1F1B: S - s), capped
    by memory and by n, at least 1, and never increasing along the chain."""
    out = []
    prev = n
    for s, rank in enumerate(chain):
        k = max(1, min(factor * (instance.pp - s) - short, fits_in_flight(instance, rank), n, prev))
        out.append(k)
        prev = k
    return out


def deferred_w_program(instance: Instance, rank: int, units: Sequence[Unit], pp: int, warmup: int,
                       lag: int) -> list[OpId]:
    """`one_f_one_b_program` with W deferred by `lag` backwards, shortened until the program
    fits in the GPU's memory (deferred W hold their stash; lag 0 always fits)."""
    for defer in range(min(lag, len(units)), -1, -1):
        prog = one_f_one_b_program(units, pp, warmup, True, w_lag=defer)
        if program_peak(instance, rank, prog) <= instance.gpu_memory:
            break
    return prog


def gpipe_program(units: Sequence[Unit], pp: int, decoupled: bool) -> list[OpId]:
    """All forwards, then all backwards (each W right after its B)."""
    prog = [OpId("F", d, pp, m) for d, m in units]
    for d, m in units:
        prog.append(OpId("B", d, pp, m))
        if decoupled:
            prog.append(OpId("W", d, pp, m))
    return prog


def one_f_one_b_program(units: Sequence[Unit], pp: int, warmup: int, decoupled: bool,
                        w_lag: int | None = None) -> list[OpId]:
    """`warmup` forwards, then B/F alternating, then the remaining B.

    W (when decoupled) follows its B at once, or, with `w_lag` = r, the W of
    the i-th backward is issued after the (i + r)-th backward (ZB-H1's
    deferral) and the rest at the end.
    """
    n = len(units)
    k = max(1, min(warmup, n)) if n else 0
    prog = [OpId("F", d, pp, m) for d, m in units[:k]]
    w_next = 0
    for i, (d, m) in enumerate(units):
        prog.append(OpId("B", d, pp, m))
        if decoupled:
            lag = 0 if w_lag is None else w_lag
            if i - lag >= w_next:
                wd, wm = units[w_next]
                prog.append(OpId("W", wd, pp, wm))
                w_next += 1
        if k + i < n:
            fd, fm = units[k + i]
            prog.append(OpId("F", fd, pp, fm))
    if decoupled:
        for wd, wm in units[w_next:]:
            prog.append(OpId("W", wd, pp, wm))
    return prog


#: ZB-H2 variants (warm-up 2(S - s) - `short` forwards, W deferred by `lag` x s backwards), by name.
#: "zb-h2" is the construction of the paper; the others won instances of the fault-free
#: comparison grid (bench/zero_bubble_grid.py) where it did not.
ZB_H2_VARIANTS: dict[str, tuple[int, float]] = {
    "zb-h2": (1, 2.0),
    "zb-h2/deep": (0, 2.0),
    "zb-h2/late-w": (1, 3.0),
    "zb-h2/deep-late-w": (0, 3.0),
}


#: Deferrals (W of the i-th backward after the (i + lag x s)-th) of the *split* ZB-H2 shapes.
SPLIT_LAGS = (2.0, 2.5, 3.0, 3.5)


def split_styles(pp: int) -> list[str]:
    """The split ZB-H2 shapes of a pipeline of `pp` stages, as template styles: stages before
    `split` warm up with 2(S - s) forwards, the others with one fewer, for every split and
    every deferral of `SPLIT_LAGS` (`zb_h2_split_chain`)."""
    return [f"zb-h2/split-{k}/lag-{lag:g}" for k in range(pp + 1) for lag in SPLIT_LAGS]


def _split_params(style: str) -> tuple[int, float] | None:
    """(split, lag) of a `split_styles` name; None for any other style."""
    if not style.startswith("zb-h2/split-"):
        return None
    split, lag = style[len("zb-h2/split-"):].split("/lag-")
    return int(split), float(lag)


def chain_programs(instance: Instance, chain: Sequence[int], units: Sequence[Unit],
                   style: str) -> dict[int, list[OpId]]:
    """Programs of one chain of GPUs (stage order) over `units`, in `style` gpipe | 1f1b | zb-h1,
    a ZB-H2 variant (`ZB_H2_VARIANTS`) or a split ZB-H2 shape (`split_styles`).

    ZB-H1 (Qi et al. 2024; torch's `_get_1f1b_rank_ops` with zero bubble):
    stage s keeps the 1F1B warm-up and defers its W by s backwards, so the
    last stage, which finishes its B first, fills its cool-down with W. A
    deferral that does not fit in memory is shortened until it does.
    """
    decoupled = instance.decouple_backward
    n = len(units)
    if style == "gpipe":
        return {rank: gpipe_program(units, s, decoupled) for s, rank in enumerate(chain)}
    if style in ZB_H2_VARIANTS and decoupled:
        return zb_h2_chain(instance, chain, units, *ZB_H2_VARIANTS[style])
    split = _split_params(style)
    if split is not None and decoupled:
        return zb_h2_split_chain(instance, chain, units, *split)
    warm = chain_warmups(instance, chain, n)
    out: dict[int, list[OpId]] = {}
    for s, rank in enumerate(chain):
        if style == "zb-h1" and decoupled:
            out[rank] = deferred_w_program(instance, rank, units, s, warm[s], lag=s)
        else:
            out[rank] = one_f_one_b_program(units, s, warm[s], decoupled)
    return out


def zb_h2_chain(instance: Instance, chain: Sequence[int], units: Sequence[Unit], short: int,
                lag: float) -> dict[int, list[OpId]]:
    """ZB-H2 (Qi et al. 2024, section 3): where memory holds about 2S microbatches, stage s
    runs a warm-up of 2(S - s) - `short` forwards, which fills the bubble before its first
    B, and defers the W of its i-th backward by `lag` x s backwards, which moves the W of
    later stages to the tail (the schedule's parallelogram). Warm-ups are capped by memory
    and by n and kept non-increasing along the chain (deadlock freedom, as for 1F1B); a
    deferral that does not fit in memory is shortened until it does.
    """
    warm = chain_warmups(instance, chain, len(units), factor=2, short=short)
    return {rank: deferred_w_program(instance, rank, units, s, warm[s], lag=int(lag * s))
            for s, rank in enumerate(chain)}


def zb_h2_split_chain(instance: Instance, chain: Sequence[int], units: Sequence[Unit], split: int,
                      lag: float) -> dict[int, list[OpId]]:
    """A ZB-H2 shape whose warm-up is 2(S - s) forwards on the stages before `split` and one
    fewer from `split` on (capped by memory and n, then kept non-increasing, as `zb_h2_chain`),
    with the W of stage s's i-th backward deferred by `lag` x s backwards.

    With a staggered optimizer, each stage's next iteration starts when its upstream
    neighbour's O ends, so a stage must keep enough deferred W to fill the wait for its
    neighbour's last B, deferred W and first forward (about 3 W at F:B:W = 1 : 1.2 : 0.8,
    hence deferrals of 2-3.5 s), while the early stages keep the deepest warm-up memory
    allows so that stage 0 never waits for a backward. Neither of the paper's two warm-ups
    does both where memory holds 2p microbatches: on the comparison grid's p = 8, m = 32,
    1 : 1.2 : 0.8, 10 us instance the split at stage 4 with deferral 3s runs at 96.66 ms,
    the best of `ZB_H2_VARIANTS` at 97.54 ms.
    """
    warm = [max(1, k - (1 if s >= split else 0))
            for s, k in enumerate(chain_warmups(instance, chain, len(units), factor=2))]
    return {rank: deferred_w_program(instance, rank, units, s, warm[s], lag=int(lag * s))
            for s, rank in enumerate(chain)}
