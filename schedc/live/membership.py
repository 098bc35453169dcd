"""Membership: the job's rendezvous store, generations and heartbeats.

Every role of a live run (supervisor, per-host agents, rank workers) talks
only through one c10d `TCPStore`, the store torchrun's rendezvous uses, so
the same protocol works on one host or many. The supervisor hosts it.

Keys (values are JSON unless said otherwise):

| key | written by | meaning |
|---|---|---|
| ``config`` | supervisor | the run's settings (iterations, emulate, timeouts, injections) |
| ``gen`` | supervisor | number of the latest announced generation (text) |
| ``gen/N`` | supervisor | `Generation` N: members, plan manifest, how to restore |
| ``gen/N/program/R`` | supervisor | the program text of rank R in generation N |
| ``abort`` | supervisor | the highest aborted generation (text; -1: none) |
| ``stop`` | supervisor | the run is over (text: why) |
| ``hb/R`` | worker R | heartbeat: ``"gen iteration ops state"``, rewritten every interval |
| ``join/N/R`` | worker R | R is ready to build generation N's process groups |
| ``result/N/S`` | worker | stage S's weights after the last iteration (torch.save bytes) |

Queues (`queue_push`/`queue_pop`): ``reports`` (workers to the supervisor),
``events`` (agents to the supervisor), ``agent/H/cmd`` (to the agent of
host H: start, signal, inject, stop).

A generation is one membership with one plan. Generation N's process groups
live under the store prefix ``gN/`` (torchft's way of rebuilding groups), so
nothing of an aborted generation can meet the next one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

#: Seconds a worker goes on without reaching the store before it exits: its supervisor is gone.
ORPHAN_TIMEOUT = 10.0


@dataclass(frozen=True)
class Generation:
    """One membership of the run, with the plan its members execute."""

    number: int
    members: tuple[int, ...]  # live schedule ranks, ascending; dist rank i is members[i]
    manifest: dict  # the programs.json of this generation's plan
    restore: str | None = None  # None: roll back in memory; "initial": model.source's weights; else a checkpoint
    injections: tuple[dict, ...] = ()  # armed injections (`Injection.to_json`)
    reason: str = ""

    def to_json(self) -> dict:
        return {"number": self.number, "members": list(self.members), "manifest": self.manifest,
                "restore": self.restore, "injections": list(self.injections), "reason": self.reason}

    @classmethod
    def from_json(cls, obj: dict) -> "Generation":
        return cls(number=obj["number"], members=tuple(obj["members"]), manifest=obj["manifest"],
                   restore=obj["restore"], injections=tuple(obj["injections"]), reason=obj["reason"])


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class JobStore:
    """The job's keys and queues over a c10d store (see the module docstring)."""

    def __init__(self, store: dist.Store, host: str, port: int):
        self.store = store
        self.host = host
        self.port = port

    @classmethod
    def serve(cls, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> "JobStore":
        """Host the store (the supervisor); port 0 picks a free one."""
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        job = cls(store, host, store.port)
        job.store.set("abort", "-1")
        job.store.set("gen", "-1")
        return job

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 30.0) -> "JobStore":
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        return cls(store, host, port)

    def clone(self) -> "JobStore":
        """A second connection (for another thread: one connection is not shared between threads)."""
        return JobStore(self.store.clone(), self.host, self.port)

    # -- the run -----------------------------------------------------------------

    def put_config(self, config: dict) -> None:
        self.store.set("config", _dumps(config))

    def config(self) -> dict:
        return json.loads(self.store.get("config"))

    def stop(self, reason: str) -> None:
        self.store.set("stop", reason)

    def stopped(self) -> bool:
        return self.store.check(["stop"])

    # -- generations --------------------------------------------------------------

    def announce(self, gen: Generation, programs: dict[int, str]) -> None:
        """Publish generation `gen`: programs first, the announcement, then its number (the commit)."""
        n = gen.number
        if programs:
            self.store.multi_set([f"gen/{n}/program/{r}" for r in programs], list(programs.values()))
        self.store.set(f"gen/{n}", _dumps(gen.to_json()))
        self.store.set("gen", str(n))

    def latest_generation(self) -> int:
        return int(self.store.get("gen"))

    def generation(self, number: int) -> Generation:
        return Generation.from_json(json.loads(self.store.get(f"gen/{number}")))

    def program(self, number: int, rank: int) -> str:
        return self.store.get(f"gen/{number}/program/{rank}").decode()

    def abort(self, number: int) -> None:
        self.store.set("abort", str(number))

    def aborted(self) -> int:
        return int(self.store.get("abort"))

    def join(self, number: int, rank: int) -> None:
        self.store.set(f"join/{number}/{rank}", "1")

    def all_joined(self, number: int, ranks) -> bool:
        return self.store.check([f"join/{number}/{r}" for r in ranks])

    # -- heartbeats -----------------------------------------------------------------

    def beat(self, rank: int, payload: str) -> None:
        self.store.set(f"hb/{rank}", payload)

    def forget_heartbeat(self, rank: int) -> None:
        self.store.delete_key(f"hb/{rank}")

    def heartbeats(self, ranks) -> dict[int, str]:
        """The last heartbeat of each rank that has sent one."""
        ranks = [r for r in ranks if self.store.check([f"hb/{r}"])]
        if not ranks:
            return {}
        values = self.store.multi_get([f"hb/{r}" for r in ranks])
        return {r: v.decode() for r, v in zip(ranks, values)}

    # -- queues ---------------------------------------------------------------------

    def report(self, msg: dict) -> None:
        self.store.queue_push("reports", _dumps(msg))

    def reports(self) -> list[dict]:
        return self._drain("reports")

    def event(self, msg: dict) -> None:
        self.store.queue_push("events", _dumps(msg))

    def events(self) -> list[dict]:
        return self._drain("events")

    def command(self, host: int, msg: dict) -> None:
        self.store.queue_push(f"agent/{host}/cmd", _dumps(msg))

    def commands(self, host: int) -> list[dict]:
        return self._drain(f"agent/{host}/cmd")

    def _drain(self, key: str) -> list[dict]:
        n = self.store.queue_len(key)
        return [json.loads(self.store.queue_pop(key, False)) for _ in range(n)]

    # -- results ----------------------------------------------------------------------

    def put_weights(self, number: int, stage: int, blob: bytes) -> None:
        self.store.set(f"result/{number}/{stage}", blob)

    def weights(self, number: int, stage: int) -> bytes | None:
        key = f"result/{number}/{stage}"
        return self.store.get(key) if self.store.check([key]) else None


@dataclass
class Heartbeat:
    """A worker's heartbeat thread: writes ``hb/R`` every `interval` and reads ``abort``/``stop``.

    The main thread reads `aborted` (the highest aborted generation) and
    `stopped` without touching the store. `payload()` gives the text to
    write (generation, iteration, ops done, state). If the store cannot be
    reached for `ORPHAN_TIMEOUT` seconds the supervisor is gone, and
    `on_orphaned` is called (the worker exits rather than live on alone).
    """

    job: JobStore  # a connection of its own
    rank: int
    interval: float
    payload: Callable[[], str]
    on_orphaned: Callable[[], None] = field(default=lambda: os._exit(3))
    aborted: int = -1
    stopped: bool = False

    def __post_init__(self) -> None:
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"schedc-heartbeat-{self.rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def halt(self) -> None:
        self._halt.set()
        self._thread.join(timeout=2 * self.interval + 1.0)

    def _run(self) -> None:
        last_ok = time.monotonic()
        while not self._halt.is_set():
            try:
                self.job.beat(self.rank, self.payload())
                self.aborted = self.job.aborted()
                self.stopped = self.stopped or self.job.stopped()
                last_ok = time.monotonic()
            except Exception:  # the store is unreachable: the supervisor died or the network broke
                if time.monotonic() - last_ok > ORPHAN_TIMEOUT:
                    self.on_orphaned()
                    return
            self._halt.wait(self.interval)
