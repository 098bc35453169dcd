"""Fault injection for live runs: `schedc train --inject "at iteration 3 during B: fail gpu(dp=1, pp=2)"`.

An injection is ``at MOMENT: EVENT``. The event is a statement of the spec
language's `failures` block, carried out for real on the target's processes:

* ``fail gpu(dp=D, pp=S)`` / ``fail rank R`` / ``fail node N``: SIGKILL.
* ``hang gpu(dp=D, pp=S)`` / ``hang rank R`` / ``hang node N``: SIGSTOP (the
  process stops answering; the supervisor must notice it by its silence).
* ``slow gpu(dp=D, pp=S) speed = X [until iteration B]``: from the moment
  (an iteration's start) until iteration B, every op of that GPU takes 1/X
  times as long (emulated ops sleep longer; computed ops spin on its thread).
* ``slow link gpu(dp=D, pp=S) delay = T [until iteration B]`` (or ``rank R``):
  every message that GPU sends arrives T later; its own ops are not slower.
* ``recover gpu(dp=D, pp=S)``: a failed GPU comes back: a new process starts
  for it, catches up from a live peer and rejoins (the supervisor carries
  this one out, at the start of the iteration or at the time given).

The moment is one of:

* ``iteration I``: when the target starts iteration I;
* ``iteration I during K [M]``: in the target's first op of kind K (F, B, W
  or O) of iteration I (of microbatch M if given), once its inputs have
  arrived and before it computes or sends anything (for O: before its
  gradient all-reduce, so the stage's other GPUs block in the all-reduce);
* ``iteration I after K [M]``: right after that op (for O: after the
  optimizer step: the stage has stepped, later stages may not have);
* ``recovery N``: when the target starts joining generation N (the plan
  after the N-th replan), i.e. a failure during recovery;
* ``T s`` or ``T ms``: T seconds after training started (wall clock).

Several targets (a node) are signalled together, as soon as the first of
them reaches the moment. The text is read by `schedc.live.inject_syntax`
(grammar/inject.lark); `parse_injections` checks every injection against
the plan (the GPU exists and runs, the moment is reached) and raises a
`SpecError` whose spans point into the injection text (file ``<inject N>``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Literal, Mapping, Sequence

from schedc.diagnostics import Diagnostic, Span, SpecError, error
from schedc.failures import describe_failure, failure_ranks
from schedc.live.inject_syntax import ACTIONS, OP_KINDS, Moment, parse_injection
from schedc.spec import Spec

__all__ = ["ACTIONS", "OP_KINDS", "Injection", "Moment", "Trigger", "parse_injections", "parsed_span"]


@dataclass(frozen=True)
class Injection:
    """One `--inject`: when, what signal, and the schedule ranks it hits."""

    index: int  # 0-based position among the --inject options
    moment: Moment
    action: Literal["kill", "stop", "slow", "slow_link", "rejoin"]
    target: str  # as written: "gpu(dp=1, pp=2)", "rank 3", "node 1"
    ranks: tuple[int, ...]  # the schedule ranks it hits (live ones, except for a rejoin)
    speed: float | None = None  # slow: the GPU's speed
    delay: float | None = None  # slow_link: seconds added to every message it sends
    until: int | None = None  # slow, slow_link: the iteration it ends at (None: the end of the run)

    @property
    def signal_name(self) -> str:
        return "SIGKILL" if self.action == "kill" else "SIGSTOP"

    def active(self, iteration: int) -> bool:
        """slow, slow_link: in effect during `iteration`."""
        return self.moment.iteration <= iteration and (self.until is None or iteration < self.until)

    def __str__(self) -> str:
        verb = {"kill": "fail", "stop": "hang", "slow": "slow", "slow_link": "slow link",
                "rejoin": "recover"}[self.action]
        text = f"at {self.moment}: {verb} {self.target}"
        if self.speed is not None:
            text += f" speed = {self.speed:g}"
        if self.delay is not None:
            text += f" delay = {self.delay * 1e3:g}ms"
        if self.until is not None:
            text += f" until iteration {self.until}"
        return text

    def on_layout(self, physical: Mapping[int, int]) -> "Injection":
        """This injection as the layout that runs carries it, `physical` mapping its ranks to the
        job's GPUs (the identity until a re-partition renumbers them). A GPU or node target names
        the job's GPUs, so it hits the layout's ranks that run them (none, when none is in the
        layout); a `rank R` target names a rank of the layout that runs, and a rejoin the job's
        GPU (the supervisor carries it out by that name): both as written."""
        if self.action == "rejoin" or self.target.startswith("rank ") or all(r == p for r, p in physical.items()):
            return self
        return replace(self, ranks=tuple(r for r, p in sorted(physical.items()) if p in self.ranks))

    def to_json(self) -> dict:
        m = self.moment
        return {"index": self.index, "text": str(self), "action": self.action, "target": self.target,
                "ranks": list(self.ranks), "speed": self.speed, "delay": self.delay, "until": self.until,
                "moment": {"kind": m.kind, "iteration": m.iteration, "phase": m.phase, "op": m.op, "mb": m.mb,
                           "generation": m.generation, "seconds": m.seconds}}

    @classmethod
    def from_json(cls, obj: dict) -> "Injection":
        m = obj["moment"]
        moment = Moment(kind=m["kind"], iteration=m["iteration"], phase=m["phase"], op=m["op"], mb=m["mb"],
                        generation=m["generation"], seconds=m["seconds"])
        return cls(index=obj["index"], moment=moment, action=obj["action"], target=obj["target"],
                   ranks=tuple(obj["ranks"]), speed=obj.get("speed"), delay=obj.get("delay"),
                   until=obj.get("until"))


def parse_injections(texts: Sequence[str], spec: Spec, *, iterations: int) -> tuple[Injection, ...]:
    """Every `--inject`, checked against the plan's spec and the run's length.

    Raises one `SpecError` with every problem: syntax (E1xx, E560), a target
    that does not exist (E207) or does not run (E561), a moment the run never
    reaches (E562).
    """
    out: list[Injection] = []
    diags: list[Diagnostic] = []
    sources: dict[str, str] = {}
    for i, text in enumerate(texts):
        file = f"<inject {i + 1}>"
        sources[file] = text
        try:
            parsed = parse_injection(text, i)
        except SpecError as exc:
            diags.extend(exc.diagnostics)
            sources.update(exc.sources)
            continue
        failure, moment = parsed.failure, parsed.moment
        ranks, problem = failure_ranks(spec.cluster, failure)
        if problem is not None:
            diags.append(problem)
            continue
        target = describe_failure(failure).split(" ", 1)[1]
        if failure.kind == "slow_gpu":
            target = target.split(" speed")[0]
        what = f"GPU ({target[4:-1]})" if target.startswith("gpu(") else target
        live = [r for r in ranks if spec.gpus[r].live]
        if parsed.action == "rejoin":
            live = ranks  # it names a failed GPU; whether it failed is checked below
        elif not live:
            diags.append(error("E561", f"{what} is already failed in the plan: no process runs there",
                               failure.span, label="failed in the plan",
                               hint="inject into a GPU that runs (see `schedc check` for the live GPUs)"))
            continue
        problem = _unreachable(moment, spec, iterations, parsed.spans)
        if problem is None and parsed.until is not None and parsed.until <= (moment.iteration or 0):
            problem = error("E562", f"`until iteration {parsed.until}` is not after iteration {moment.iteration}",
                            parsed.spans.get("until"), label="not after the start")
        if problem is not None:
            diags.append(problem)
            continue
        out.append(Injection(index=i, moment=moment, action=parsed.action, target=target, ranks=tuple(live),
                             speed=parsed.speed, delay=parsed.delay, until=parsed.until))
    for inj in out:  # a GPU can only come back if it fails, in the plan or by another injection
        if inj.action == "rejoin":
            (rank,) = inj.ranks
            killed = any(o.action in ("kill", "stop") and rank in o.ranks for o in out)
            if spec.gpus[rank].live and not killed:
                diags.append(error("E561", f"GPU (dp={spec.gpus[rank].dp}, pp={spec.gpus[rank].pp}) never fails "
                                           "in this run: there is nothing to recover",
                                   parsed_span(texts, inj.index), label="runs already",
                                   hint="recover a GPU the plan has failed, or fail it with another injection"))
    if diags:
        raise SpecError(diags, sources)
    return tuple(out)


def parsed_span(texts: Sequence[str], index: int) -> Span:
    """The event part of injection `index` (for diagnostics found after parsing)."""
    text = texts[index]
    colon = text.find(":")
    event = text[colon + 1:]
    column = colon + 2 + len(event) - len(event.lstrip())
    return Span(f"<inject {index + 1}>", 1, column, 1, column + max(len(event.strip()), 1))


def _unreachable(moment: Moment, spec: Spec, iterations: int, spans: dict[str, Span]) -> Diagnostic | None:
    """E562 when the run never reaches the moment (pointing at the word that says so)."""
    if moment.kind != "iteration":
        return None
    assert moment.iteration is not None
    if moment.iteration >= iterations:
        return error("E562", f"iteration {moment.iteration} is never reached: the run has {iterations} "
                             f"iteration{'s' if iterations != 1 else ''} (0..{iterations - 1})",
                     spans.get("iteration"), label="never reached",
                     hint="choose an earlier iteration or run more (--iterations)")
    if moment.op == "W" and not spec.schedule.decouple_backward:
        return error("E562", "the plan has no W op: backward is not decoupled (B does all of it)", spans.get("op"),
                     label="no W op", hint="inject `during B` instead, or set `decouple_backward = true`")
    if moment.mb is not None and moment.mb >= spec.microbatches:
        return error("E562", f"there is no microbatch {moment.mb}: each pipeline has {spec.microbatches} "
                             f"(0..{spec.microbatches - 1})", spans.get("mb"), label="no such microbatch")
    return None


@dataclass
class Trigger:
    """The injections armed on one rank, looked up per op at a dictionary's cost.

    `fire(...)` answers the injection due at that point (once each) or None.
    """

    injections: Sequence[Injection]

    def __post_init__(self) -> None:
        self._fired: set[int] = set()
        self._ops: dict[tuple[int, str, str], list[Injection]] = {}
        self._starts: dict[int, list[Injection]] = {}
        self._recoveries: dict[int, list[Injection]] = {}
        self._slow = [i for i in self.injections if i.action in ("slow", "slow_link")]
        for inj in self.injections:
            m = inj.moment
            if inj.action not in ("kill", "stop"):
                continue  # slowdowns are windows (below); rejoins are the supervisor's
            if m.kind == "iteration" and m.phase == "start":
                self._starts.setdefault(m.iteration, []).append(inj)  # type: ignore[arg-type]
            elif m.kind == "iteration":
                self._ops.setdefault((m.iteration, m.phase, m.op), []).append(inj)  # type: ignore[arg-type]
            elif m.kind == "recovery":
                self._recoveries.setdefault(m.generation, []).append(inj)  # type: ignore[arg-type]

    def __bool__(self) -> bool:
        return bool(self._ops or self._starts or self._recoveries)

    def slowdown(self, iteration: int) -> float:
        """How many times longer this GPU's ops take in `iteration` (1.0: not slowed)."""
        factor = 1.0
        for inj in self._slow:
            if inj.action == "slow" and inj.active(iteration):
                factor /= inj.speed
        return factor

    def link_delay(self, iteration: int) -> float:
        """Seconds added to every message this GPU sends in `iteration`."""
        return sum(inj.delay for inj in self._slow if inj.action == "slow_link" and inj.active(iteration))

    def at_op(self, iteration: int, phase: str, kind: str, mb: int | None) -> Injection | None:
        return self._first(self._ops.get((iteration, phase, kind), ()), mb)

    def at_iteration_start(self, iteration: int) -> Injection | None:
        return self._first(self._starts.get(iteration, ()), None)

    def at_recovery(self, generation: int) -> Injection | None:
        return self._first(self._recoveries.get(generation, ()), None)

    def _first(self, candidates, mb: int | None) -> Injection | None:
        for inj in candidates:
            if inj.index not in self._fired and (inj.moment.mb is None or inj.moment.mb == mb):
                self._fired.add(inj.index)
                return inj
        return None


class Injections:
    """A run's injections as the supervisor keeps them: which are still armed, which fired,
    when (`time.time()`) and on which ranks. A rank reaching an injection's moment fires it
    through its agent (`fired`); the supervisor fires those due at a time or an iteration
    (`due_at`, `due_rejoins`)."""

    def __init__(self, injections: Sequence[Injection], clock: Callable[[], float] = time.time):
        self.all = tuple(injections)
        self.clock = clock  # when an injection fires here (the supervisor's clock: its fault times are its)
        self.fired: dict[int, tuple[float, tuple[int, ...]]] = {}  # index -> (when, ranks)
        self.begun: set[int] = set()  # slowdowns whose window the run has reached (each worker applies its own)
        self._physical: dict[int, int] = {}  # the running layout's rank -> the job's GPU (empty: the identity)
        self.unplaced: set[int] = set()  # due when no rank of the layout ran their GPU(s): never fired

    def place(self, physical: Mapping[int, int]) -> None:
        """The layout that runs from now on (a re-partition, a growth): its rank -> the job's GPU."""
        self._physical = dict(physical)

    def armed(self) -> list[dict]:
        """Those not fired yet, as a generation of the layout that runs carries them to its members."""
        return [i.on_layout(self._physical).to_json() for i in self.all if i.index not in self.fired]

    def fired_by_agent(self, index: int, t: float, ranks) -> Injection:
        """An agent carried injection `index` out at `t` on `ranks`."""
        self.fired[index] = (t, tuple(ranks))
        return next(i for i in self.all if i.index == index)

    def due_at(self, elapsed: float) -> list[Injection]:
        """Injections at a time that `elapsed` seconds of training reached: fired now, on the
        ranks of the layout that runs (`Injection.on_layout`)."""
        return self._fire([i for i in self.all if i.moment.kind == "time" and elapsed >= i.moment.seconds])

    def due_rejoins(self, done: int) -> list[Injection]:
        """`at iteration I: recover gpu(...)` once iteration I-1 is done (`done`): fired now."""
        return self._fire([i for i in self.all if i.action == "rejoin" and i.moment.kind == "iteration"
                           and i.moment.iteration <= done + 1])

    def slowdowns_begun(self, starting: int) -> list[Injection]:
        """Slowdowns (slow, slow link) whose window begins by iteration `starting`, each once:
        to say so. (They stay armed: every generation's workers apply them by the iteration.)"""
        due = [i for i in self.all if i.action in ("slow", "slow_link") and i.moment.kind == "iteration"
               and i.moment.iteration <= starting and i.index not in self.begun]
        self.begun.update(i.index for i in due)
        return due

    def never_fired(self) -> list[Injection]:
        """The injections that did nothing in this run (none fired, no slowdown window reached)."""
        return [i for i in self.all if i.index not in self.fired and i.index not in self.begun]

    def begun_lines(self, starting: int) -> list[tuple[Injection, str]]:
        """`slowdowns_begun(starting)`, each with the line that says it began."""
        out = []
        for inj in self.slowdowns_begun(starting):
            what = (f"runs at speed {inj.speed:g}" if inj.action == "slow" else
                    f"sends every message {inj.delay * 1e3:g} ms late")
            until = f" until iteration {inj.until}" if inj.until is not None else ""
            out.append((inj, f"injected `{inj}`: rank(s) {list(inj.ranks)} {what} from iteration "
                             f"{inj.moment.iteration}{until}"))
        return out

    def never_fired_lines(self, trained_s: float, generations: int) -> list[tuple[Injection, str]]:
        """`never_fired()`, each with the warning that says why, at the end of a run that trained
        for `trained_s` seconds through `generations` replans."""
        out = []
        for inj in self.never_fired():
            m = inj.moment
            unplaced = (f"no rank of the layout that ran then held its GPU(s) (the job's GPU(s) {list(inj.ranks)} "
                        "had left it)")
            if inj.index in self.unplaced:
                why = unplaced
            elif m.kind == "time":
                why = f"training ended {trained_s:.2f} s after it started, before {m.seconds:g} s"
            elif m.kind == "recovery":
                why = (f"there was no generation {m.generation} (the run had {generations} replan(s))"
                       if generations < m.generation else
                       f"rank(s) {list(inj.ranks)} did not run in generation {m.generation}")
            elif not inj.on_layout(self._physical).ranks:
                why = unplaced
            else:
                why = (f"rank(s) {list(inj.ranks)} never reached that moment (they had left the run, or "
                       "their plan no longer had that op)")
            out.append((inj, f"warning: injection `{inj}` never fired: {why}"))
        return out

    def fault_time(self, ranks) -> float | None:
        """When the earliest injection that hit any of `ranks` fired (None: none did)."""
        times = [t for t, hit in self.fired.values() if set(hit) & set(ranks)]
        return min(times) if times else None

    def _fire(self, due: list[Injection]) -> list[Injection]:
        due = [i.on_layout(self._physical) for i in due if i.index not in self.fired and i.index not in self.unplaced]
        self.unplaced.update(i.index for i in due if not i.ranks)  # (its GPUs left the layout: nothing to signal)
        due = [i for i in due if i.ranks]
        for i in due:
            self.fired[i.index] = (self.clock(), tuple(i.ranks))
        return due
