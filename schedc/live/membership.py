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
| ``gen/N/file/F`` | supervisor | the text of program file F of generation N (a rank's, or a class's) |
| ``abort`` | supervisor | the highest aborted generation (text; -1: none) |
| ``dir/E/R`` | supervisor | rank R's (of epoch E) role in a catch-up: ``{"role": "donate"|"join", "session", ...}`` |
| ``cu/S/state``, ``cu/S/grad/K`` | donor | catch-up session S: the stage's state, then each step's summed gradient |
| ``stop`` | supervisor | the run is over (text: why) |
| ``progress`` | supervisor | the newest iteration completed (text) |
| ``hb/E/R`` | worker R (of epoch E) | heartbeat: ``"gen iteration ops state"``, rewritten every interval |
| ``epoch``, ``rename/E`` | supervisor | the newest epoch (a count); epoch E's ranks of the survivors of epoch E-1 (`put_rename`) |
| ``agent/H/beats`` | agent of host H | a count it adds 1 to every `AGENT_BEAT` seconds while it runs |
| ``agent/H/lease`` | agent of host H | the one agent process that holds host H (text: its pid, host name, a nonce) |
| ``join/N/R`` | worker R | R is ready to build generation N's process groups |
| ``result/N/S`` | worker | stage S's weights after the last iteration (torch.save bytes) |

Queues (`queue_push`/`queue_pop`) carry the typed messages of
`schedc.live.protocol`: ``reports`` (workers to the supervisor), ``events``
(agents to the supervisor), ``agent/H/cmd`` (to the agent of host H).

A generation is one membership with one plan. Generation N's process groups
live under the store prefix ``gN/`` (torchft's way of rebuilding groups), so
nothing of an aborted generation can meet the next one. A generation with
`start_at` = k is a planned switch: the members of the one before finish
iteration k-1 and leave it in order (no abort, no rollback).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

from schedc.live.protocol import RunConfig, decode, encode
from schedc.runtime.rendezvous import connect_store, serve_store

#: Seconds a worker goes on without reaching the store before it exits: its supervisor is gone.
ORPHAN_TIMEOUT = 10.0
#: Seconds between a remote worker's reads of its host's agent lease (`Heartbeat`): one store read
#: each, not one per beat (at 20 beats a second, 1,000 workers would add 20,000 reads a second);
#: a worker also reads it before it takes part in a generation, whatever the time.
LEASE_CHECK = 0.5


@dataclass(frozen=True)
class Generation:
    """One membership of the run, with the plan its members execute."""

    number: int
    members: tuple[int, ...]  # live schedule ranks, ascending; dist rank i is members[i]
    manifest: dict  # the programs.json of this generation's plan
    restore: str | None = None  # None: roll back in memory; "initial": model.source's weights; else a checkpoint
    injections: tuple[dict, ...] = ()  # armed injections (`Injection.to_json`)
    reason: str = ""
    start_at: int | None = None  # a planned switch: the generation before runs iterations < start_at
    speeds: dict[int, float] | None = None  # member -> the speed the plan assumes for it (1.0 if absent)
    dump: bool = False  # the members only save their state (own stages and shadows) as a checkpoint
    # rank -> the GPU it runs on (the job's rank for it at the start) where they differ (after a
    # re-partition): which GPU of the host a worker takes (`schedc.runtime.placement.rank_device`)
    physical: dict[int, int] | None = None
    # rank -> (dp, pp) of every GPU of the plan, live or not, where its ranks are not the job's
    # own (a re-partitioned layout): the stage a rank on standby holds (None: the job's coords)
    coords: dict[int, tuple[int, int]] | None = None
    # --shadow: whether this generation's plan keeps shadows (it has the memory for them:
    # `schedc.live.shadow.room_problem`); a worker that held one drops it otherwise
    shadow: bool = True
    # The epoch its ranks are numbered in (`JobStore.put_rename`): a process that knew an older
    # one follows the renames up to it before it reads anything else of the generation.
    epoch: int = 0
    # An in-place re-partition (`schedc.live.relayout`): the layout its members ran before, as
    # ``{"pp": P, "stage": {member: its stage then}}``; the
    # members move the layers among themselves before the first iteration (`schedc.live.move`)
    moved: dict | None = None

    def gpu(self, rank: int) -> int:
        return (self.physical or {}).get(rank, rank)

    def coords_of(self, rank: int, initial: dict[str, tuple[int, int]]) -> tuple[int, int]:
        """(dp, pp) of `rank` in this generation's plan (`initial`: the job's, by rank as text)."""
        return tuple(self.coords[rank]) if self.coords and rank in self.coords else tuple(initial[str(rank)])

    def speed(self, rank: int) -> float:
        return (self.speeds or {}).get(rank, 1.0)

    def to_json(self) -> dict:
        return {"number": self.number, "members": list(self.members), "manifest": self.manifest,
                "restore": self.restore, "injections": list(self.injections), "reason": self.reason,
                "start_at": self.start_at, "speeds": {str(r): v for r, v in (self.speeds or {}).items()},
                "dump": self.dump, "physical": {str(r): p for r, p in (self.physical or {}).items()},
                "coords": {str(r): list(c) for r, c in (self.coords or {}).items()}, "shadow": self.shadow,
                "epoch": self.epoch, "moved": self.moved}

    @classmethod
    def from_json(cls, obj: dict) -> "Generation":
        return cls(number=obj["number"], members=tuple(obj["members"]), manifest=obj["manifest"],
                   restore=obj["restore"], injections=tuple(obj["injections"]), reason=obj["reason"],
                   start_at=obj.get("start_at"),
                   speeds={int(r): v for r, v in obj["speeds"].items()} if obj.get("speeds") else None,
                   dump=bool(obj.get("dump", False)),
                   physical={int(r): p for r, p in obj["physical"].items()} if obj.get("physical") else None,
                   coords={int(r): tuple(c) for r, c in obj["coords"].items()} if obj.get("coords") else None,
                   shadow=bool(obj.get("shadow", True)), epoch=int(obj.get("epoch", 0)),
                   moved=None if not obj.get("moved") else {**obj["moved"], "stage": {
                       int(r): s for r, s in obj["moved"]["stage"].items()}})


#: Bytes per store value of a blob (the libuv store server refuses values over 8 MiB).
BLOB_CHUNK = 4 << 20


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class JobStore:
    """The job's keys and queues over a c10d store (see the module docstring)."""

    def __init__(self, store: dist.Store, host: str, port: int):
        self.store = store
        self.host = host
        self.port = port
        # The epoch whose rank numbers this connection's per-rank keys (heartbeats, directives)
        # use: a layout re-partitioned in place renames its survivors (`put_rename`), so that a
        # rank number of one epoch never reads or writes the keys of the same number before.
        self.epoch = 0

    @classmethod
    def serve(cls, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> "JobStore":
        """Host the store (the supervisor); port 0 picks a free one."""
        store = serve_store(host, port, timeout)  # (see schedc.runtime.rendezvous: why not torch's default)
        return cls.hosting(store, host, store.port)

    @classmethod
    def hosting(cls, store, host: str, port: int) -> "JobStore":
        """The job's keys over `store`, which this process serves: no generation announced or aborted yet."""
        job = cls(store, host, port)
        job.store.set("abort", "-1")
        job.store.set("gen", "-1")
        return job

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 30.0) -> "JobStore":
        return cls(connect_store(f"{host}:{port}", timeout), host, port)

    def clone(self) -> "JobStore":
        """A second connection (for another thread: one connection is not shared between threads)."""
        job = JobStore(self.store.clone(), self.host, self.port)
        job.epoch = self.epoch
        return job

    # -- the run -----------------------------------------------------------------

    def put_config(self, config: RunConfig) -> None:
        self.store.set("config", config.encode())

    def config(self) -> RunConfig:
        return RunConfig.decode(self.store.get("config"))

    def stop(self, reason: str) -> None:
        self.store.set("stop", reason)

    def stopped(self) -> bool:
        return self.store.check(["stop"])

    # -- generations --------------------------------------------------------------

    def announce(self, gen: Generation, files: dict[str, str]) -> None:
        """Publish generation `gen`: its program files first (those its manifest names), the
        announcement, then its number (the commit)."""
        n = gen.number
        names = sorted(set(gen.manifest["programs"].values()))
        if names:
            self.store.multi_set([f"gen/{n}/file/{name}" for name in names], [files[name] for name in names])
        self.store.set(f"gen/{n}", _dumps(gen.to_json()))
        self.store.set("gen", str(n))

    def set_progress(self, iteration: int, generation: int) -> None:
        """The newest iteration done, and the generation that did it (standby ranks follow slowdown
        windows by it; a member whose move began at an iteration knows when it ran everywhere)."""
        self.store.set("progress", f"{iteration} {generation}")

    def progress(self) -> int:
        return self.progress_of()[0]

    def progress_of(self) -> tuple[int, int]:
        """(the newest iteration done, the generation that did it); (-1, -1) before any. The iteration
        alone can be stale for a new generation: one restored from an older checkpoint runs again
        iterations the run had done."""
        if not self.store.check(["progress"]):
            return -1, -1
        iteration, generation = bytes(self.store.get("progress")).decode().split()
        return int(iteration), int(generation)

    def latest_generation(self) -> int:
        return int(self.store.get("gen"))

    def generation(self, number: int) -> Generation:
        return Generation.from_json(json.loads(self.store.get(f"gen/{number}")))

    def program_file(self, number: int, name: str) -> str:
        """The text of program file `name` of generation `number`."""
        return self.store.get(f"gen/{number}/file/{name}").decode()

    def abort(self, number: int) -> None:
        self.store.set("abort", str(number))

    def aborted(self) -> int:
        return int(self.store.get("abort"))

    # -- epochs: the ranks of a layout whose survivors were renamed in place ---------------

    def epoch_now(self) -> int:
        """The newest epoch (0 until the first in-place re-partition): a process started now has
        its rank in that epoch's numbering."""
        return self.store.add("epoch", 0)

    def put_rename(self, epoch: int, renamed: dict[int, int]) -> None:
        """Epoch `epoch` begins: the process of rank r (of the epoch before) is rank `renamed[r]`
        now; one not named has no place. Written before the epoch count is raised."""
        self.store.set(f"rename/{epoch}", _dumps({str(r): n for r, n in renamed.items()}))
        self.store.add("epoch", 1)

    def rename(self, epoch: int) -> dict[int, int]:
        return {int(r): n for r, n in json.loads(self.store.get(f"rename/{epoch}")).items()}

    def direct(self, rank: int, directive: dict | None) -> None:
        """Give rank `rank` a catch-up role (None: none)."""
        self.store.set(f"dir/{self.epoch}/{rank}", _dumps(directive))

    def directive(self, rank: int) -> dict | None:
        key = f"dir/{self.epoch}/{rank}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def put_blob(self, key: str, blob: bytes) -> None:
        """Store bytes of any size: the store's server refuses values over 8 MiB, so in chunks
        (``key/0``, ``key/1``, ...), then ``key`` itself, the chunk count: written last, it commits."""
        chunks = [blob[i:i + BLOB_CHUNK] for i in range(0, len(blob), BLOB_CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            self.store.set(f"{key}/{i}", chunk)
        self.store.set(key, str(len(chunks)))

    def blob(self, key: str) -> bytes | None:
        """The bytes `put_blob` stored under `key`, or None while they are not all there."""
        if not self.store.check([key]):
            return None
        n = int(self.store.get(key))
        pieces = [f"{key}/{i}" for i in range(n)]
        if not self.store.check(pieces):  # (freed by its sender meanwhile: a `get` would wait out the timeout)
            return None
        return b"".join(self.store.get(p) for p in pieces)

    def drop_blob(self, key: str) -> None:
        """Free a blob's memory in the store (its reader is done with it)."""
        if self.store.check([key]):
            n = int(self.store.get(key))
            self.store.delete_key(key)
            for i in range(n):
                self.store.delete_key(f"{key}/{i}")

    def join(self, number: int, rank: int) -> None:
        self.store.set(f"join/{number}/{rank}", "1")

    def all_joined(self, number: int, ranks) -> bool:
        return self.store.check([f"join/{number}/{r}" for r in ranks])

    # -- heartbeats -----------------------------------------------------------------

    def beat(self, rank: int, payload: str) -> None:
        self.store.set(f"hb/{self.epoch}/{rank}", payload)

    def agent_beat(self, host: int) -> None:
        """Another host's agent is alive (`schedc.live.agent.Agent.serve`, every AGENT_BEAT seconds)."""
        self.store.add(f"agent/{host}/beats", 1)

    def claim_agent(self, host: int, expected: str, token: str) -> str:
        """Host `host`'s agent lease: set to `token` if it holds `expected` ("": nobody); returns
        its holder after the attempt (`token` when it was taken)."""
        return self.store.compare_set(f"agent/{host}/lease", expected, token).decode()

    def agent_lease(self, host: int) -> str:
        return self.store.get(f"agent/{host}/lease").decode()

    def agent_beats(self, host: int) -> int:
        """How many beats host `host`'s agent has sent (a count that stops when the host is gone)."""
        return self.store.add(f"agent/{host}/beats", 0)

    def forget_heartbeat(self, rank: int) -> None:
        self.store.delete_key(f"hb/{self.epoch}/{rank}")

    def heartbeats(self, ranks) -> dict[int, str]:
        """The last heartbeat of each rank that has sent one."""
        ranks = [r for r in ranks if self.store.check([f"hb/{self.epoch}/{r}"])]
        if not ranks:
            return {}
        values = self.store.multi_get([f"hb/{self.epoch}/{r}" for r in ranks])
        return {r: v.decode() for r, v in zip(ranks, values)}

    # -- queues (typed messages: `schedc.live.protocol`) ------------------------------

    def report(self, msg) -> None:
        self.store.queue_push("reports", encode(msg))

    def reports(self) -> list:
        return self._drain("reports")

    def event(self, msg) -> None:
        self.store.queue_push("events", encode(msg))

    def events(self) -> list:
        return self._drain("events")

    def command(self, host: int, msg) -> None:
        self.store.queue_push(f"agent/{host}/cmd", encode(msg))

    def commands(self, host: int) -> list:
        return self._drain(f"agent/{host}/cmd")

    def _drain(self, key: str) -> list:
        n = self.store.queue_len(key)
        return [decode(self.store.queue_pop(key, False)) for _ in range(n)]

    # -- results ----------------------------------------------------------------------

    def put_weights(self, number: int, stage: int, blob: bytes) -> None:
        """A stage's final weights (`torch.save` bytes): a blob, as a stage may hold more than a
        store value may (a re-partitioned job's stages are larger than the spec's)."""
        self.put_blob(f"result/{number}/{stage}", blob)

    def weights(self, number: int, stage: int) -> bytes | None:
        return self.blob(f"result/{number}/{stage}")


@dataclass
class Heartbeat:
    """A worker's heartbeat thread: writes ``hb/R`` every `interval` and reads ``abort``/``stop``.

    The main thread reads `aborted` (the highest aborted generation) and
    `stopped` without touching the store. `payload()` gives the text to
    write (generation, iteration, ops done, state). If the store cannot be
    reached for `ORPHAN_TIMEOUT` seconds the supervisor is gone, and
    `on_orphaned` is called (the worker exits rather than live on alone).

    A worker of another host than 0 also reads its host's agent lease before
    its first beat and then every LEASE_CHECK seconds: once an agent other
    than the one that started it (`starter`: its host and lease) holds it
    (that agent died and a new one registered), nobody can signal this
    process or report its exit, and the supervisor counts it lost
    (`schedc.live.hosts`), so `on_replaced` is called (the worker exits). The
    worker reads it too before it takes part in a generation (`check_agent`).
    """

    job: JobStore  # a connection of its own
    rank: int
    interval: float
    payload: Callable[[], str]
    starter: tuple[int, str] = (0, "")  # the host and lease of the agent that started it ("": none)
    on_orphaned: Callable[[], None] = field(default=lambda: os._exit(3))
    on_replaced: Callable[[str], None] = field(default=lambda why: _leave(why))
    aborted: int = -1
    stopped: bool = False
    latest: int = -1  # the newest announced generation
    directive: dict | None = None  # this rank's catch-up role
    progress: int = -1  # the newest iteration the run completed
    progress_generation: int = -1  # ... and the generation that completed it

    def __post_init__(self) -> None:
        self._halt = threading.Event()
        self._renaming = threading.Lock()  # the rank and its epoch change together (`rename`)
        self._thread = threading.Thread(target=self._run, name=f"schedc-heartbeat-{self.rank}", daemon=True)

    def rename(self, epoch: int, rank: int) -> None:
        """This process is rank `rank` of epoch `epoch` from now on (an in-place re-partition)."""
        with self._renaming:
            self.job.epoch, self.rank = epoch, rank
            self.directive = None

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def halt(self) -> None:
        self._halt.set()
        self._thread.join(timeout=2 * self.interval + 1.0)

    def _run(self) -> None:
        last_ok, checked = time.monotonic(), -math.inf  # (the lease is read before the first beat)
        while not self._halt.is_set():
            try:
                if time.monotonic() - checked >= LEASE_CHECK:
                    why = self._agent_replaced(self.job)
                    if why:
                        self.on_replaced(why)
                        return
                    checked = time.monotonic()
                with self._renaming:
                    self.job.beat(self.rank, self.payload())
                    self.directive = self.job.directive(self.rank)
                self.aborted = self.job.aborted()
                self.stopped = self.stopped or self.job.stopped()
                self.latest = self.job.latest_generation()
                self.progress, self.progress_generation = self.job.progress_of()
                last_ok = time.monotonic()
            except Exception:  # the store is unreachable: the supervisor died or the network broke
                if time.monotonic() - last_ok > ORPHAN_TIMEOUT:
                    self.on_orphaned()
                    return
            self._halt.wait(self.interval)

    def check_agent(self, job: JobStore) -> None:
        """`on_replaced` now if another agent holds this host's lease (read through `job`, the
        caller's connection): called before a worker takes part in a generation it found itself."""
        why = self._agent_replaced(job)
        if why:
            self.on_replaced(why)

    def _agent_replaced(self, job: JobStore) -> str | None:
        """Why this worker must stop, if an agent other than its starter holds its host's lease."""
        host, agent = self.starter
        if host == 0 or not agent:
            return None
        holder = job.agent_lease(host)
        if holder == agent:
            return None
        return (f"schedc train: rank {self.rank}: host {host} has a new agent ({holder.split(' #')[0]}); "
                "the one that started this process is gone, so it stops\n")


def _leave(why: str) -> None:
    """A worker out of its agent's reach ends now, with one line on stderr (one write: workers share it)."""
    try:
        os.write(2, why.encode())
    except OSError:
        pass
    os._exit(3)
