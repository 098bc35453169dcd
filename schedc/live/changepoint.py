"""Online change-point detection on a GPU's speed: when did it go slow, and how slow is it?

Every iteration each rank reports the time its compute ops took (measured
from the moment their inputs arrived, so waiting for a slow peer or a slow
link is not counted) and the time the plan gave them. The supervisor turns
that into one number per rank and iteration, the log of the GPU's speed
relative to the plan's cost model, log(planned x planned speed /
measured), taken against its peers' in the same iteration (and its
heartbeat rate against theirs: `schedc.live.slowness`), y, and feeds it
to a `SpeedTracker`.

The tracker runs Bayesian online change-point detection (Adams & MacKay
2007, as FALCON does) over y: a posterior over the *run length* (iterations
since the last change), with a Normal-Gamma model of each run (unknown
mean and variance; the predictive is a Student t, so one noisy iteration
does not look like a new regime) and a constant hazard. The first `warmup`
iterations set the healthy level (their median) and the GPU's own noise
(their median absolute deviation, the prior scale of every new run: a GPU
whose op times jitter by 30% is judged against 30%, not a fixed guess). The
most probable run tells where the current regime began. Its speed is the
median of its observations against the healthy level:
medians, because a loaded machine gives single slow iterations that a
mean would smear into a regime. A `Shift` ("slow since iteration i", "back
to normal since iteration i") is reported when both the regime and the last
`confirm` iterations on their own are at least `min_change` (0.12: 88% of
the speed or less is slow) away from what was last reported: a blip shorter
than about half of `confirm` is never reported. A loaded host makes the
noise many times larger (a CPU rank's millisecond ops catch other
processes' time slices: 35-45% per iteration among two busy loops), so the
bar follows it: the noise is re-measured over the last `spread`
iterations (from successive differences: a change of level moves one), a
regime must also differ by `z` standard errors of its median's difference
from the level (1.25 x noise x sqrt(1/its length + 1/the level's)) and
more than `wander` times the spread of the healthy level's `block`-iteration
medians (a loaded host moves a rank's level against its peers' by
spells), and it must last `confirm` x noise / `quiet` iterations when the
noise is above `quiet`. The healthy level is the
median of the last `healthy` iterations while the GPU is reported
healthy, not of the first few alone (8 noisy iterations put it 20% off),
leaving out the newest confirmation's worth. Speeds are capped at 1: a
GPU is never faster than when it was healthy, and noise that says so is
noise. Written here rather than taken from a
library: the algorithm is forty lines, has no dependencies, costs O(window)
per iteration, and the libraries that offer it are offline or unmaintained.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Shift:
    """A confirmed change of a GPU's speed."""

    speed: float  # relative to the baseline (1.0: as fast as when it was healthy)
    since: int  # the first iteration at the new speed
    confirmed_at: int  # the iteration whose report confirmed it


#: A new run's prior (see `SpeedTracker.update`): kappa 0.1, alpha 1 (a Student t with 2 degrees
#: of freedom); its mean and beta are the tracker's.
PRIOR_KAPPA, PRIOR_ALPHA = 0.1, 1.0


class _RunShapes:
    """What the Normal-Gamma posterior of a run holding n observations has that does not depend on
    the observations: kappa and alpha grow by 1 and 1/2 per observation whatever they are, so the
    Student t's degrees of freedom and log-gamma terms are the same for every run of that length.
    Computed once per length (grown by the same additions the posterior's update makes, so every
    number is bit for bit what the update would compute), they leave each run's predictive and
    update to a few multiplications and two logarithms: the supervisor runs three trackers per
    rank and iteration over up to `SpeedTracker.window` runs each."""

    def __init__(self):
        self.kappa: list[float] = []  # index i: a run of i + 1 observations
        self.alpha: list[float] = []
        self._grow(PRIOR_KAPPA, PRIOR_ALPHA)

    def _grow(self, kappa: float, alpha: float) -> None:
        self.kappa.append(kappa + 1)
        self.alpha.append(alpha + 0.5)

    def upto(self, n: int) -> None:
        while len(self.kappa) < n:
            self._grow(self.kappa[-1], self.alpha[-1])

    @staticmethod
    def terms(kappa: float, alpha: float) -> tuple[float, ...]:
        """(kappa + 1, alpha x kappa, nu, nu x pi, the log-gamma terms, (nu + 1) / 2) of a run."""
        nu = 2 * alpha
        return (kappa + 1, alpha * kappa, nu, nu * math.pi, math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2),
                (nu + 1) / 2)


_SHAPES = _RunShapes()
_TERMS: list[tuple[float, ...]] = []  # `_RunShapes.terms` by run index
_PRIOR_TERMS = _RunShapes.terms(PRIOR_KAPPA, PRIOR_ALPHA)


def _terms_upto(n: int) -> list[tuple[float, ...]]:
    _SHAPES.upto(n)
    while len(_TERMS) < n:
        i = len(_TERMS)
        _TERMS.append(_RunShapes.terms(_SHAPES.kappa[i], _SHAPES.alpha[i]))
    return _TERMS


def _log_pred(y: float, mu: float, beta: float, terms: tuple[float, ...]) -> float:
    """Log of the Student-t predictive density of y under a run's posterior (mean `mu`, `beta`)."""
    kp1, ak, nu, nupi, lg, half = terms
    scale2 = beta * kp1 / ak
    z = (y - mu) ** 2 / (nu * scale2)
    return lg - 0.5 * math.log(nupi * scale2) - half * math.log1p(z)


@dataclass
class SpeedTracker:
    """BOCPD over one GPU's log speed (see the module docstring)."""

    hazard: float = 1 / 200  # prior probability of a change at any iteration
    confirm: int = 5  # iterations a new regime must last before it counts (shorter: a blip)
    min_change: float = 0.12  # relative speed change worth reporting
    warmup: int = 8  # first iterations: their median is the healthy level, their spread the noise
    window: int = 300  # run lengths kept (longer ones are merged into the longest)
    noise: float = 0.03  # least scale of the iteration-to-iteration noise of log speed
    z: float = 5.0  # how many standard errors of its median a regime must differ by to count
    quiet: float = 0.15  # noise (of log speed) up to which `confirm` iterations confirm a regime
    spread: int = 50  # last observations whose spread is the noise now
    healthy: int = 100  # last observations, while reported healthy, whose median is the healthy level
    block: int = 20  # observations per block whose medians show how the healthy level wanders
    wander: float = 2.0  # how many times that wander a change must exceed
    _log_r: list[float] = field(default_factory=list)  # log posterior over run length 0..len-1
    _mu: list[float] = field(default_factory=list)  # each run's posterior mean (index i: i + 1 observations)
    _beta: list[float] = field(default_factory=list)  # ... and beta (its kappa and alpha: `_RunShapes`)
    _ys: list[float] = field(default_factory=list)  # the last `window` observations
    _t: int = 0  # observations so far
    _baseline: float | None = None
    _noise: float = 0.03  # this GPU's noise, measured over the warm-up
    _reported: float = 1.0  # the last speed reported
    _last_change: int = 0  # the observation index where the current regime began
    _healthy: list[float] = field(default_factory=list)  # observations while reported healthy

    def update(self, y: float, iteration: int) -> Shift | None:
        """Feed this iteration's log speed; a confirmed `Shift` when the speed changed."""
        self._ys = (self._ys + [y])[-self.window:]
        if self._baseline is None:  # the first `warmup` observations: the healthy level and noise
            if len(self._ys) >= self.warmup:
                self._baseline = statistics.median(self._ys)
                mad = statistics.median(abs(v - self._baseline) for v in self._ys)
                self._noise = max(self.noise, 1.4826 * mad)
                self._healthy = list(self._ys)
            return None
        if self._reported >= 1.0:  # healthy as far as reported: the level follows, but only from
            # observations older than a confirmation (a change not yet confirmed, which on a noisy
            # host takes many iterations, must not become the level it is judged against)
            lag = int(self._confirm_span()) + self.confirm
            self._healthy = (self._healthy + [y])[-(self.healthy + lag):]
            settled = self._healthy[:-lag]
            if len(settled) >= self.warmup:
                self._baseline = statistics.median(settled[-self.healthy:])
        if len(self._ys) >= self.warmup:  # the noise now (a loaded host's is many times an idle one's),
            # from successive differences: a change of level moves one of them, not their median
            last = self._ys[-self.spread:]
            steps = [abs(b - a) for a, b in zip(last, last[1:])]
            self._noise = max(self.noise, 1.4826 * statistics.median(steps) / math.sqrt(2))
        # A new run's prior: centred on the baseline (weakly: kappa 0.1), with this GPU's own
        # noise; heavy-tailed (alpha 1: a Student t with 2 degrees of freedom).
        mu0, beta0 = self._baseline, self._noise ** 2
        k0 = PRIOR_KAPPA + 1  # the prior updated with y: a run of one observation
        first_mu, first_beta = (PRIOR_KAPPA * mu0 + y) / k0, beta0 + PRIOR_KAPPA * (y - mu0) ** 2 / (2 * k0)
        if not self._mu:  # index i of the posterior is a run holding the last i+1 observations
            self._log_r, self._mu, self._beta, self._t = [0.0], [first_mu], [first_beta], 1
            return None
        log_h, log_1h = math.log(self.hazard), math.log1p(-self.hazard)
        n = len(self._mu)
        terms = _terms_upto(n + 1)
        kappa = _SHAPES.kappa
        mus, betas = self._mu, self._beta
        # A run that begins with y: y is predicted by the prior (the new regime), not by the runs
        # before it; with the old regime's prediction the regime that explained y best was the one
        # begun an observation earlier, and every change was reported one iteration early.
        change = log_h + _log_pred(y, mu0, beta0, _PRIOR_TERMS)  # (the posterior `_log_r` sums to 1)
        log, log1p = math.log, math.log1p  # (`_log_pred` written out: a call per run is a third of the time)
        new_log_r = [change] + [lr + (lg - 0.5 * log(nupi * (scale2 := b * kp1 / ak))
                                      - half * log1p((y - m) ** 2 / (nu * scale2))) + log_1h
                                for lr, m, b, (kp1, ak, nu, nupi, lg, half) in zip(self._log_r, mus, betas, terms)]
        new_mu = [first_mu] + [(kappa[i] * mus[i] + y) / kappa[i + 1] for i in range(n)]
        new_beta = [first_beta] + [betas[i] + kappa[i] * (y - mus[i]) ** 2 / (2 * kappa[i + 1]) for i in range(n)]
        if len(new_log_r) > self.window:  # merge the tail into the longest kept run length
            tail = _logsumexp(new_log_r[self.window - 1:])
            new_log_r = new_log_r[:self.window - 1] + [tail]
            new_mu, new_beta = new_mu[:self.window], new_beta[:self.window]
        norm = _logsumexp(new_log_r)
        self._log_r = [lr - norm for lr in new_log_r]
        self._mu, self._beta = new_mu, new_beta
        self._t += 1
        best = max(range(len(self._log_r)), key=self._log_r.__getitem__)  # the most probable run
        held = best + 1  # observations in it
        start = self._t - held  # the observation where it began
        # A noisy GPU (a loaded host) must hold a new regime longer: `confirm` iterations at a
        # noise of `quiet`, proportionally more above it.
        if held < self._confirm_span() or start <= self._last_change:
            return None
        held = min(held, len(self._ys))
        speed = min(1.0, math.exp(statistics.median(self._ys[-held:]) - self._baseline))
        recent = min(1.0, math.exp(statistics.median(self._ys[-self.confirm:]) - self._baseline))
        bar = self.min_change * self._reported
        if abs(speed - self._reported) < bar or abs(recent - self._reported) < bar \
                or (speed < self._reported) != (recent < self._reported):
            return None
        # ... and by more than noise: z standard errors of the difference between the regime's median
        # and the level's (1.25 x noise x sqrt(1/n + 1/m), m the observations the level is made of:
        # a long regime is known no better than the level it is compared with; without m, a regime
        # of 300 iterations on a loaded host, whose level wanders by 25% over 50 iterations, passed
        # as a slowdown of 15%).
        if abs(math.log(speed / self._reported)) < self.z * 1.2533 * self._noise * math.sqrt(
                1 / held + 1 / self._level_size()):
            return None
        # ... and by more than the level itself wanders while healthy (`wander` x the spread of
        # its `block`-iteration medians): under four busy loops a rank's level against its peers'
        # moved by 1.6x between 25-iteration spells, with nothing wrong, and a 50-iteration spell
        # at 0.64 was reported and switched for.
        if abs(math.log(speed / self._reported)) < self.wander * self._wander():
            return None
        # A regime that began after the current one has lasted `confirm` iterations, and differs.
        self._last_change = start
        self._reported = speed
        return Shift(speed=speed, since=iteration - held + 1, confirmed_at=iteration)

    def _wander(self) -> float:
        """How much the healthy level moves from block to block: 1.48 x the median absolute
        deviation of the medians of the settled healthy observations' `block`-iteration blocks
        (0 until there are four blocks)."""
        lag = int(self._confirm_span()) + self.confirm
        settled = self._healthy[:-lag]
        blocks = [statistics.median(settled[i:i + self.block])
                  for i in range(len(settled) % self.block, len(settled), self.block)]
        if len(blocks) < 4:
            return 0.0
        mid = statistics.median(blocks)
        return 1.4826 * statistics.median(abs(b - mid) for b in blocks)

    def _level_size(self) -> int:
        """How many observations the healthy level is the median of."""
        lag = int(self._confirm_span()) + self.confirm
        return max(self.warmup, min(self.healthy, len(self._healthy) - lag))

    def _confirm_span(self) -> float:
        return self.confirm * max(1.0, self._noise / self.quiet)

    def expect(self, speed: float) -> None:
        """The plan now assumes `speed`: report changes from it (the baseline stays)."""
        self._reported = speed
        self._last_change = self._t

    @property
    def level(self) -> float | None:
        """The healthy level observations are judged against (None until the warm-up is done)."""
        return self._baseline

    @property
    def speed(self) -> float:
        """The last speed reported (1.0 until a change)."""
        return self._reported


def _logsumexp(xs: list[float]) -> float:
    m = max(xs)
    if m == -math.inf:
        return m
    return m + math.log(sum(math.exp(x - m) for x in xs))
