"""A live member's speed probes (`SpeedProbe`, a mixin of `schedc.live.member.LiveWorker`).

A rank that computes nothing (on standby, or a member whose plan gives it no
work: an excluded slow GPU) would never show that its GPU is healthy again,
so while `_probing` is set it times one forward of its stage on a fixed input
(`_probe_op`, in eval mode under no_grad: nothing changes) every
`PROBE_EVERY` seconds and reports its speed against the same measured at
start-up; emulated, a sleep of `PROBE_US`. The fail-slow policy
(`schedc.live.slowness`) judges the probes."""

from __future__ import annotations

import time

from schedc.live.protocol import Probe

#: Seconds between two probes of a standby rank's speed (an excluded slow GPU: is it healthy again?).
PROBE_EVERY = 0.25
#: Planned duration of an emulated probe, seconds.
PROBE_US = 5000


class SpeedProbe:
    """The speed probes of a `LiveWorker` (the module docstring)."""

    def _probe_loop(self) -> None:
        """While `_probing` is set (on standby, or a member whose plan gives it no compute), report
        this GPU's speed every PROBE_EVERY seconds: nothing else would show it is healthy again."""
        job = self.job.clone()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(self.device))  # (the current device is per thread)
        while not self.heartbeat.stopped:
            if not self._probing.wait(0.2) or self.rt is None:
                continue
            try:
                job.report(Probe(rank=self.rank, speed=self._probe(), t=time.time()))
            except Exception:  # the store went away: the heartbeat thread handles that
                return
            time.sleep(PROBE_EVERY)

    def _probe(self) -> float:
        """This GPU's speed now, against its healthy speed: a planned-length sleep when emulating,
        else one forward of its stage on a fixed input against the same measured at start-up."""
        slowdown = self.trigger.slowdown(max(self.heartbeat.progress + 1, 0))  # the GPU's true speed
        started = time.perf_counter()
        if self.config.emulate:
            time.sleep(PROBE_US / 1e6 * slowdown)
            return min(1.0, PROBE_US / 1e6 / (time.perf_counter() - started))
        took = self._clock.timed(self._probe_op)  # (on a GPU: its kernels, waited for)
        started = time.perf_counter() - took
        until = started + took * slowdown
        while time.perf_counter() < until:
            pass
        return min(1.0, self._probe_base / (time.perf_counter() - started))

    def _probe_op(self) -> None:
        """One forward of this rank's stage that changes nothing: no autograd, eval mode (no
        BatchNorm statistics updated, no dropout drawn from the random state)."""
        import torch

        module = self.rt.module
        training = module.training
        module.eval()
        try:
            with torch.no_grad():
                module(self._probe_input)
        finally:
            module.train(training)
