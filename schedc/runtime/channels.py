"""The order in which each rank sends its boundary messages to each other rank.

NCCL matches a send with a receive by their order on a (sender, receiver)
channel, with no tags: the k-th receive a rank posts from a peer gets the
k-th tensor that peer sent it. A schedule does not promise that a receiver
wants its messages in the order the sender produces them (stage s+1 may run
microbatch 3 before microbatch 2 of the same sender), so the receiver posts
its receives in the sender's order and keeps the ones it wants later
(`Transport._recv_in_order`). `ReceiveOrder` is that order, read from the
schedule the programs were generated from: a rank's program is its ops in
schedule order, so what a rank sends to a neighbour, and when, is fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from schedc.diagnostics import RunError, error

ACTIVATION, GRADIENT = 0, 1  # the kinds of boundary messages (`schedc.runtime.transport.Message`)
SHADOW_GRADIENT = 2  # a stage's summed gradient, streamed to a live shadow's holder (`schedc.live.shadow`)
KINDS = 3


@dataclass(frozen=True)
class ReceiveOrder:
    """For one receiving rank: per (sender, kind), the microbatches (d, mb) the sender sends it
    in one iteration, in the order it sends them."""

    rank: int
    sequences: dict[tuple[int, int], tuple[tuple[int, int], ...]]

    def sent_to_me(self, sender: int, kind: int) -> tuple[tuple[int, int], ...]:
        return self.sequences.get((sender, kind), ())

    def index(self, sender: int, kind: int, d: int, mb: int, what: str) -> int:
        try:
            return self.sent_to_me(sender, kind).index((d, mb))
        except ValueError:
            raise RunError([error("E540", f"rank {self.rank} waits for {what} from rank {sender}, "
                                          "which its program never sends",
                                  hint="the programs and schedule.json differ; recompile")]) from None


def receive_order(schedule, rank: int) -> ReceiveOrder:
    """What every rank sends `rank`, in program order, from a `schedc.schedule.Schedule` (or a
    symmetric one: only the copy that holds `rank` is expanded; its peers are all in it)."""
    if hasattr(schedule, "copy_holding"):
        schedule = schedule.copy_holding(rank)
    pp = schedule.instance.pp
    executor = {(op.dp, op.mb, op.pp): op.rank for op in schedule.ops if op.kind == "F"}
    sequences: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for sender, ops in sorted(schedule.programs.items()):
        for op in ops:
            if op.kind == "F" and op.pp < pp - 1:
                to, kind = executor.get((op.dp, op.mb, op.pp + 1)), ACTIVATION
            elif op.kind == "B" and op.pp > 0:
                to, kind = executor.get((op.dp, op.mb, op.pp - 1)), GRADIENT
            else:
                continue
            if to == rank:
                sequences.setdefault((sender, kind), []).append((op.dp, op.mb))
    return ReceiveOrder(rank, {k: tuple(v) for k, v in sequences.items()})


def load_receive_order(out_dir: Path | str, rank: int) -> ReceiveOrder:
    """`receive_order` of the `schedule.json` beside the programs in `out_dir`."""
    from schedc.schedule_io import read_schedule

    path = Path(out_dir) / "schedule.json"
    if not path.exists():
        raise RunError([error("E522", f"`{path}` is missing; NCCL needs it to order messages",
                              hint="recompile: `schedc compile SPEC -o OUT`")])
    schedule, _ = read_schedule(path)
    return receive_order(schedule, rank)
