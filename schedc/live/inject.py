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
them reaches the moment. `parse_injections` checks every injection against
the plan (the GPU exists and runs, the moment is reached) and raises a
`SpecError` whose spans point into the injection text (file ``<inject N>``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Sequence

from schedc.diagnostics import Diagnostic, Span, SpecError, did_you_mean, error
from schedc.failures import describe_failure, failure_from_statement, failure_ranks
from schedc.parse import parse_statements
from schedc.spec import Failure, Spec

OP_KINDS = ("F", "B", "W", "O")
_OP_NAMES = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W",
             "optimizer": "O", **{k: k for k in OP_KINDS}}
#: What each verb does: a signal (kill, stop), a slowdown the target applies to itself (slow,
#: slow_link), or a rejoin the supervisor starts.
ACTIONS = {"fail": "kill", "hang": "stop", "slow": "slow", "recover": "rejoin"}
_SYNTAX = ("write `at iteration I: fail gpu(dp=D, pp=S)`; the moment may also be "
           "`iteration I during F|B|W|O [M]`, `iteration I after F|B|W|O [M]`, `recovery N` or `2.5s`")


@dataclass(frozen=True)
class Moment:
    """When an injection fires (see the module docstring)."""

    kind: Literal["iteration", "recovery", "time"]
    iteration: int | None = None
    phase: Literal["start", "during", "after"] = "start"
    op: str | None = None
    mb: int | None = None
    generation: int | None = None
    seconds: float | None = None

    def __str__(self) -> str:
        if self.kind == "time":
            return f"{self.seconds:g}s"
        if self.kind == "recovery":
            return f"recovery {self.generation}"
        text = f"iteration {self.iteration}"
        if self.phase != "start":
            text += f" {self.phase} {self.op}" + ("" if self.mb is None else f" {self.mb}")
        return text


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


@dataclass(frozen=True)
class _Word:
    text: str
    col: int  # 1-based column of its first character


def _span(file: str, col: int, length: int) -> Span:
    return Span(file, 1, col, 1, col + max(length, 1))


def _whole(file: str, text: str, word: _Word | None) -> Span:
    if word is None:
        return _span(file, max(len(text.rstrip()), 1), 1)
    return _span(file, word.col, len(word.text))


def _integer(word: _Word | None, what: str, file: str, text: str, minimum: int = 0) -> tuple[int | None,
                                                                                          Diagnostic | None]:
    if word is None:
        return None, error("E560", f"the injection needs {what} here", _whole(file, text, None),
                           label=f"expected {what}", hint=_SYNTAX)
    if not re.fullmatch(r"[0-9]{1,9}", word.text) or int(word.text) < minimum:
        low = "a whole number" if minimum == 0 else f"a whole number >= {minimum}"
        return None, error("E560", f"{what} must be {low}, got `{word.text}`", _whole(file, text, word),
                           label=f"expected {low}")
    return int(word.text), None


def _moment(words: list[_Word], file: str, text: str) -> tuple[Moment | None, Diagnostic | None]:
    """The words between `at` and `:` (their spans go to `_spans` for later checks)."""
    if not words:
        return None, error("E560", "the injection has no moment after `at`", _whole(file, text, None),
                           label="expected a moment", hint=_SYNTAX)
    head = words[0]
    timed = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ms|s)?", head.text)
    if timed:
        unit = timed.group(2)
        rest = words[1:]
        if unit is None and rest and rest[0].text in ("s", "ms"):
            unit, rest = rest[0].text, rest[1:]
        if unit is None:
            return None, error("E560", f"the time `{head.text}` needs a unit", _whole(file, text, head),
                               label="write s or ms", hint="e.g. `at 2.5s: fail rank 3`")
        if rest:
            return None, error("E560", f"unexpected `{rest[0].text}` after the time", _whole(file, text, rest[0]),
                               label="expected `:`", hint=_SYNTAX)
        seconds = float(timed.group(1)) / (1000.0 if unit == "ms" else 1.0)
        if seconds > 1e6:
            return None, error("E560", "the time is out of range", _whole(file, text, head),
                               label="at most 1000000 s")
        return Moment(kind="time", seconds=seconds), None
    if head.text == "recovery":
        gen, problem = _integer(words[1] if len(words) > 1 else None, "a generation number", file, text, 1)
        if problem:
            return None, problem
        if len(words) > 2:
            return None, error("E560", f"unexpected `{words[2].text}` after `recovery {gen}`",
                               _whole(file, text, words[2]), label="expected `:`", hint=_SYNTAX)
        return Moment(kind="recovery", generation=gen), None
    if head.text != "iteration":
        hint = did_you_mean(head.text, ("iteration", "recovery"))
        return None, error("E560", f"unknown moment `{head.text}`", _whole(file, text, head),
                           label=hint or "expected `iteration`, `recovery` or a time", hint=_SYNTAX)
    it, problem = _integer(words[1] if len(words) > 1 else None, "an iteration number", file, text)
    if problem:
        return None, problem
    if len(words) == 2:
        return Moment(kind="iteration", iteration=it), None
    phase = words[2]
    if phase.text not in ("during", "after"):
        hint = did_you_mean(phase.text, ("during", "after"))
        return None, error("E560", f"unexpected `{phase.text}` after `iteration {it}`", _whole(file, text, phase),
                           label=hint or "expected `during`, `after` or `:`", hint=_SYNTAX)
    if len(words) < 4:
        return None, error("E560", f"`{phase.text}` needs an op kind", _whole(file, text, phase),
                           label="expected F, B, W or O", hint=_SYNTAX)
    op_word = words[3]
    op = _OP_NAMES.get(op_word.text) or _OP_NAMES.get(op_word.text.lower())
    if op is None:
        return None, error("E560", f"unknown op kind `{op_word.text}`", _whole(file, text, op_word),
                           label="expected F, B, W or O",
                           hint="F forward, B backward (input), W backward (weights), O optimizer step")
    mb = None
    if len(words) > 4:
        if op == "O":
            return None, error("E560", "the optimizer step O belongs to no microbatch", _whole(file, text, words[4]),
                               label="remove the microbatch", hint=_SYNTAX)
        mb, problem = _integer(words[4], "a microbatch number", file, text)
        if problem:
            return None, problem
    if len(words) > 5:
        return None, error("E560", f"unexpected `{words[5].text}`", _whole(file, text, words[5]),
                           label="expected `:`", hint=_SYNTAX)
    return Moment(kind="iteration", iteration=it, phase=phase.text, op=op, mb=mb), None  # type: ignore[arg-type]


_UNTIL = re.compile(r"\s+until\s+iteration\s+(\S+)\s*$")
_LINK = re.compile(r"slow\s+link\s+(?:gpu\(\s*dp\s*=\s*(\d+)\s*,\s*pp\s*=\s*(\d+)\s*\)|rank\s+(\d+))"
                   r"\s+delay\s*=\s*([0-9]+(?:\.[0-9]*)?)\s*(us|ms|s)\s*$")


@dataclass(frozen=True)
class _Parsed:
    moment: Moment
    action: str
    failure: Failure  # the target (a link's as `fail gpu` / `fail rank`)
    spans: dict[str, Span]
    speed: float | None = None
    delay: float | None = None
    until: int | None = None


def parse_injection(text: str, index: int) -> _Parsed:
    """One injection, parsed; `SpecError` on bad syntax (file ``<inject N>``).

    `spans` locates the moment's words (``iteration``, ``op``, ``mb``), the
    event (``event``) and ``until``'s iteration, for checks against the plan."""
    file = f"<inject {index + 1}>"
    sources = {file: text}
    if "\n" in text or "\r" in text:
        raise SpecError([error("E560", "an injection is one line", _span(file, 1, 1),
                               hint="pass each injection as its own --inject option")], sources)
    colon = text.find(":")
    head = [_Word(m.group(), m.start() + 1) for m in re.finditer(r"[^\s:]+", text[:colon if colon >= 0 else None])]
    if not head or head[0].text != "at":
        where = _whole(file, text, head[0] if head else None)
        raise SpecError([error("E560", "an injection starts with `at`", where, label="expected `at`",
                               hint=_SYNTAX)], sources)
    if colon < 0:
        raise SpecError([error("E560", "missing `:` between the moment and the event",
                               _whole(file, text, head[-1]), label="expected `:` after this", hint=_SYNTAX)],
                        sources)
    moment, problem = _moment(head[1:], file, text)
    if problem:
        raise SpecError([problem], sources)
    spans = {}
    if moment.kind == "iteration":
        named = dict(zip(("iteration", "phase", "op", "mb"), head[2:]))
        spans = {k: _whole(file, text, w) for k, w in named.items()}
    body = text[colon + 1:]
    verb = re.match(r"\s*(\w+)", body)
    if verb is None:
        raise SpecError([error("E560", "the injection has no event after `:`", _span(file, colon + 1, 1),
                               label="expected an event", hint="e.g. `fail gpu(dp=1, pp=2)` or `hang rank 3`")],
                        sources)
    word = verb.group(1)
    start = colon + 1 + verb.start(1)  # 0-based column of the verb
    if word not in ACTIONS:
        hint = did_you_mean(word, ACTIONS)
        raise SpecError([error("E560", f"cannot inject `{word}`", _span(file, start + 1, len(word)),
                               label=hint or "expected fail, hang, slow or recover",
                               hint="`fail ...` kills the target's processes (SIGKILL), `hang ...` stops them "
                                    "(SIGSTOP), `slow ...` slows a GPU or link down, `recover gpu(...)` "
                                    "brings a failed GPU back")], sources)
    action = ACTIONS[word]
    event_end = len(text)
    until = None
    m = _UNTIL.search(text, start)
    if m:
        if action not in ("slow",):
            raise SpecError([error("E560", "only `slow` takes `until iteration B`", _span(file, m.start() + 2,
                                   m.end() - m.start() - 1), label="remove this")], sources)
        word_until = _Word(m.group(1), m.start(1) + 1)
        spans["until"] = _whole(file, text, word_until)
        until, problem = _integer(word_until, "an iteration number", file, text)
        if problem:
            raise SpecError([problem], sources)
        event_end = m.start()
    spans["event"] = _span(file, start + 1, event_end - start)
    if action in ("slow", "rejoin") and not (moment.kind == "time" or moment.phase == "start"):
        raise SpecError([error("E560", f"`{word}` starts at an iteration's start or at a time, not during an op",
                               spans.get("phase"), label="remove this",
                               hint=f"write `at iteration I: {word} ...`")], sources)
    if action == "rejoin" and (moment.kind == "recovery" or (moment.kind == "iteration" and moment.iteration == 0)):
        raise SpecError([error("E560", "`recover` starts at the start of an iteration after the first, or at a time",
                               spans["event"], hint="write `at iteration I: recover gpu(...)` with I >= 1, or "
                                                    "`at 2.5s: recover gpu(...)`")], sources)
    if action == "slow" and moment.kind != "iteration":
        raise SpecError([error("E560", "`slow` starts at an iteration's start", spans["event"],
                               hint="write `at iteration I: slow ...` (and `until iteration B`)")], sources)
    link = _LINK.match(text[start:event_end].strip())
    if action == "slow" and re.match(r"slow\s+link\b", text[start:]):
        if link is None:
            raise SpecError([error("E560", "a slow link is `slow link gpu(dp=D, pp=S) delay = T` "
                                           "(or `rank R`)", spans["event"], label="not understood",
                                   hint="e.g. `slow link gpu(dp=1, pp=0) delay = 5ms until iteration 9`")],
                            sources)
        dp, pp, rank, amount, unit = link.groups()
        failure = (Failure(kind="fail_gpu", dp=int(dp), pp=int(pp), span=spans["event"]) if rank is None
                   else Failure(kind="fail_rank", rank=int(rank), span=spans["event"]))
        delay = float(amount) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]
        return _Parsed(moment, "slow_link", failure, spans, delay=delay, until=until)
    # The spec parser reads the event, its columns kept: the moment (and `until ...`) become
    # blanks, and `hang` (as long as `fail`) is read as `fail`.
    verb_text = "fail" if word == "hang" else word
    event_text = " " * start + verb_text + text[start + len(word):event_end]
    try:
        statements = parse_statements(event_text, file)
    except SpecError as exc:
        raise SpecError(exc.diagnostics, sources) from None  # show the injection as written
    if len(statements) != 1:
        raise SpecError([error("E560", "an injection has exactly one event", spans["event"],
                               hint="pass each event as its own --inject option")], sources)
    failure, problems = failure_from_statement(statements[0], allow_recover=True)
    if problems:
        raise SpecError(problems, sources)
    assert failure is not None
    return _Parsed(moment, action, failure, spans, speed=failure.speed, until=until)


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
    return _span(f"<inject {index + 1}>", colon + 2 + (len(text[colon + 1:]) - len(text[colon + 1:].lstrip())),
                 len(text[colon + 1:].strip()))


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
