"""The state-transfer seam (`schedc.live.transfer`): both ways through it carry a stage's whole
state bit for bit, and a lost peer ends a direct transfer with an error, never a hang.

The direct transfer runs between two real processes (spawned, one thread each); every wait here
is bounded, so a broken transfer fails the test instead of hanging it.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from schedc.live.catchup import Donor, Joiner
from schedc.live.membership import BLOB_CHUNK, JobStore
from schedc.live.transfer import DirectTransfer, StoreTransfer, TransferClosed, TransferError, _chunks

#: Bounds of the waits below: far above what a healthy transfer needs on a loaded machine.
WAIT = 120.0
SMALL_CHUNK = 64 << 10  # direct: many chunks per object, tensors cut across chunks and packed together


def _adam_stage() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def sample(big: int) -> dict:
    """A stage's state and then some: Adam's state (exp_avg, exp_avg_sq, step tensors), tensors of
    many dtypes and shapes (empty, 0-d, non-contiguous, nan/inf/-0.0), None, tuples, int keys, and
    a tensor of `big` float32 values."""
    model, opt = _adam_stage()
    for _ in range(2):
        model(torch.ones(3, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    g = torch.Generator().manual_seed(1)
    return {
        "steps": 2,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "dtypes": {
            "f16": torch.randn(5, 3, generator=g).half(), "bf16": torch.randn(7, generator=g).bfloat16(),
            "f64": torch.randn(2, 2, 2, generator=g, dtype=torch.float64), "i32": torch.arange(-5, 6, dtype=torch.int32),
            "i64": torch.tensor([2**62, -1]), "u8": torch.arange(250, 256, dtype=torch.uint8),
            "bool": torch.tensor([[True, False], [False, True]]), "c64": torch.randn(3, generator=g, dtype=torch.complex64),
            "scalar": torch.tensor(7.5), "empty": torch.empty(0, 5), "odd": torch.tensor([math.nan, math.inf, -0.0]),
            "transposed": torch.arange(12.0).reshape(3, 4).t(),
        },
        "none": None,
        "betas": (0.9, 0.999),
        1: [True, None, "text", 3, -2.5, math.inf, b"\x00\xff"],
        "big": torch.randn(big, generator=g),
    }


def same(a, b) -> bool:
    """Equal in type, structure and every bit (nan included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return (list(a) == list(b) and all(same(a[k], b[k]) for k in a)
                and same(getattr(a, "_metadata", None), getattr(b, "_metadata", None)))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


# -- two processes -----------------------------------------------------------------------------------

def _child_setup() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _echo(port: int, keys: list[str], ready) -> None:
    """Receive `keys` on session "there", send each back on session "back"."""
    _child_setup()
    job = JobStore.connect("127.0.0.1", port, timeout=WAIT)
    inbound = DirectTransfer(job, "there", sending=False, timeout=WAIT, chunk_bytes=SMALL_CHUNK)
    outbound = DirectTransfer(job, "back", sending=True, timeout=WAIT, chunk_bytes=SMALL_CHUNK)
    ready.set()
    for key in keys:
        obj = inbound.recv(key, timeout=WAIT)
        assert obj is not None, key
        outbound.send(key, obj)
    assert inbound.join(WAIT)  # the parent closes "there" once all came back
    outbound.close()
    assert outbound.join(WAIT)
    os._exit(0)


def _receive_one_then_wait(port: int, ready, got) -> None:
    _child_setup()
    job = JobStore.connect("127.0.0.1", port, timeout=WAIT)
    inbound = DirectTransfer(job, "s", sending=False, timeout=WAIT, chunk_bytes=SMALL_CHUNK)
    ready.set()
    if inbound.recv("first", timeout=WAIT) is not None:
        got.set()
    inbound.join(WAIT)  # killed before


def _send_one_then_wait(port: int, ready) -> None:
    _child_setup()
    job = JobStore.connect("127.0.0.1", port, timeout=WAIT)
    outbound = DirectTransfer(job, "s", sending=True, timeout=WAIT, chunk_bytes=SMALL_CHUNK)
    ready.set()
    outbound.send("first", {"x": torch.ones(3)})
    outbound.join(WAIT)  # killed before


class Child:
    """A spawned process running `target(port, *events)`, killed by its PID at the end if still there."""

    def __init__(self, target, job: JobStore, *args, events: int = 1):
        ctx = mp.get_context("spawn")
        self.events = [ctx.Event() for _ in range(events)]
        self.process = ctx.Process(target=target, args=(job.port, *args, *self.events), daemon=True)
        self.process.start()

    def wait(self, i: int = 0) -> None:
        assert self.events[i].wait(WAIT), "the child process did not get there"

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(WAIT)

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc) -> None:
        if self.process.is_alive():
            self.kill()
        self.process.join(WAIT)  # reaped, not left a zombie of the test process


@pytest.fixture
def job():
    return JobStore.serve(timeout=WAIT)


def test_direct_round_trips_a_stage_state_between_two_processes(job):
    objects = {"state": sample(big=100_000), "grad/2": {"grad": torch.randn(70_000)}, "grad/3": {"grad": None},
               "tiny": [torch.tensor(1, dtype=torch.int8)]}
    with Child(_echo, job, list(objects)) as child:
        child.wait()
        out = DirectTransfer(job, "there", sending=True, timeout=WAIT, chunk_bytes=SMALL_CHUNK)
        back = DirectTransfer(job, "back", sending=False, timeout=WAIT, chunk_bytes=SMALL_CHUNK)
        for key, obj in objects.items():
            out.send(key, obj)
        got = {key: back.recv(key, timeout=WAIT) for key in objects}
        out.close()
        child.process.join(WAIT)
        assert child.process.exitcode == 0
    for key in objects:
        assert same(got[key], objects[key]), key
    assert back.received > 4 * 100_000  # what was handed out, headers included
    with pytest.raises(TransferClosed):  # the child closed its sending end: nothing more comes
        back.recv("more", timeout=WAIT)
    assert out.join(WAIT) and back.join(WAIT)


def test_direct_fails_at_once_when_the_receiver_is_killed(job):
    with Child(_receive_one_then_wait, job, events=2) as child:
        child.wait(0)
        out = DirectTransfer(job, "s", sending=True, timeout=600.0, chunk_bytes=SMALL_CHUNK)
        out.send("first", {"x": torch.ones(3)})
        child.wait(1)
        child.kill()
        out.send("second", sample(big=1_000_000))
        assert out.join(WAIT)  # well before its 600 s timeout: the connection closed
    with pytest.raises(TransferError, match="receiving end was lost"):
        out.send("third", {"x": torch.ones(1)})


def test_direct_fails_at_once_when_the_sender_is_killed(job):
    inbound = DirectTransfer(job, "s", sending=False, timeout=600.0, chunk_bytes=SMALL_CHUNK)
    with Child(_send_one_then_wait, job) as child:
        child.wait(0)
        assert same(inbound.recv("first", timeout=WAIT), {"x": torch.ones(3)})
        child.kill()
        with pytest.raises(TransferError, match="sending end was lost"):
            inbound.recv("second", timeout=WAIT)  # inside its 600 s: the connection closed


@pytest.mark.parametrize("sending", [True, False])
def test_direct_fails_within_its_timeout_when_the_peer_never_joins(job, sending):
    end = DirectTransfer(job, "nobody", sending=sending, timeout=1.0)
    if sending:
        end.send("state", {"x": torch.ones(2)})
        assert end.join(WAIT)
        with pytest.raises(TransferError, match="did not join within 1 s"):
            end.send("grad/0", {"grad": None})
    else:
        with pytest.raises(TransferError, match="did not join within 1 s"):
            end.recv("state", timeout=WAIT)
        assert end.join(WAIT)


def test_closing_the_receiving_end_ends_both_threads(job):
    # Both ends in this process (gloo does not mind): the receiver closes while its thread waits
    # inside a gloo receive for the next object; the sender answers, and both threads end.
    out = DirectTransfer(job, "c", sending=True, timeout=600.0)
    inbound = DirectTransfer(job, "c", sending=False, timeout=600.0)
    out.send("a", {"v": 1})
    assert inbound.recv("a", timeout=WAIT) == {"v": 1}
    inbound.close()
    assert inbound.join(WAIT) and out.join(WAIT)
    with pytest.raises(TransferClosed):
        out.send("b", {"v": 2})


def test_a_direct_end_refuses_what_it_cannot_carry(job):
    out = DirectTransfer(job, "r", sending=True, timeout=1.0)
    with pytest.raises(ValueError):
        out.send("k", None)  # recv's "not here"
    with pytest.raises(TypeError):
        out.send("k", {"x": object()})
    with pytest.raises(TransferError):
        out.recv("k")
    out.close()
    assert out.join(WAIT)  # (its group never forms: it gives up after 1 s)


@given(st.lists(st.integers(0, 50), max_size=8), st.integers(1, 40))
def test_chunks_cover_the_stream_once_in_order(sizes, chunk):
    stream = [(i, b) for i, n in enumerate(sizes) for b in range(n)]
    cut = []
    for length, pieces in _chunks(sizes, chunk):
        assert 0 < length <= chunk and sum(b - a for _, a, b in pieces) == length
        cut += [(i, b) for i, a, e in pieces for b in range(a, e)]
    assert cut == stream


# -- through the store ----------------------------------------------------------------------------

def test_the_store_round_trips_a_stage_state_and_frees_its_keys(job):
    obj = sample(big=BLOB_CHUNK // 4 + 1000)  # over one store value
    out, inbound = StoreTransfer(job, "cu/7"), StoreTransfer(job.clone(), "cu/7")
    assert inbound.recv("state", timeout=0.05) is None  # bounded: the store cannot tell a lost peer
    out.send("state", obj)
    out.send("unread", {"grad": None})
    assert same(inbound.recv("state", timeout=WAIT), obj) and inbound.received > BLOB_CHUNK
    assert not job.store.check(["cu/7/state"])  # the reader frees it
    out.close()  # the sender what nobody read
    assert not job.store.check(["cu/7/unread"]) and not job.store.check(["cu/7/unread/0"])


def test_a_store_blob_freed_while_it_is_read_is_a_transfer_error(job):
    # The donor's session ends (a failure elsewhere) while the joiner reads a blob of several
    # pieces: its keys are deleted under the reader. A TransferError (the joiner waits for another
    # session), not the store's RuntimeError, which stopped the whole run as a worker's own error.
    out, inbound = StoreTransfer(job, "cu/8"), StoreTransfer(job.clone(), "cu/8")
    out.send("state", sample(big=BLOB_CHUNK // 4 + 1000))
    real = inbound.job.store

    class FreedAfterItsFirstPiece:  # the store as the reader sees it once the sender freed the rest
        def __getattr__(self, name):
            return getattr(real, name)

        def get(self, key):
            if key.endswith("/1"):
                raise RuntimeError("Wait timeout: the key was deleted")  # (what torch raises after its wait)
            return real.get(key)

    inbound.job.store = FreedAfterItsFirstPiece()
    with pytest.raises(TransferError, match="`state` went away while it was read"):
        inbound.recv("state", timeout=WAIT)
    inbound.job.store = real
    out.close()
    assert inbound.recv("state", timeout=0.05) is None  # freed: nothing to read, and no wait for it


# -- catch-up over either ------------------------------------------------------------------------------

class _Stage:
    """The part of a `schedc.runtime.Runtime` that a donor and a joiner use, on a real Adam stage."""

    def __init__(self):
        self.module, self.optimizer = _adam_stage()
        self.params = list(self.module.parameters())
        self.steps_done = 0
        self.keep_step_grad = False
        self.last_step_grad = None

    def train_step(self, seed: int) -> None:
        flat = torch.randn(sum(p.numel() for p in self.params), generator=torch.Generator().manual_seed(seed))
        self.last_step_grad = flat if self.keep_step_grad else None
        self.apply_step(flat)

    def apply_step(self, flat) -> None:
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()
        self.steps_done += 1

    def stage_state(self) -> dict:
        import copy

        return {"steps": self.steps_done, "model": {k: v.clone() for k, v in self.module.state_dict().items()},
                "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_stage_state(self, state: dict) -> None:
        self.steps_done = state["steps"]
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


@pytest.mark.parametrize("kind", ["direct", "store"])
def test_a_joiner_replays_its_donor_bit_for_bit(job, kind):
    donor_rt, joiner_rt = _Stage(), _Stage()
    for step in range(3):  # the donor has trained; the joiner is fresh
        donor_rt.train_step(step)
    side = ThreadPoolExecutor(1)
    donor = Donor(job.clone(), lambda: side, transfer=kind, timeout=WAIT)
    joiner = Joiner(job, transfer=kind, timeout=WAIT)
    directive = {"session": 1}
    donor.boundary(donor_rt, {**directive, "role": "donate"})
    for step in range(3, 7):
        donor_rt.train_step(step)
        donor.after_step(donor_rt)
    deadline = time.monotonic() + WAIT
    while joiner.steps != donor_rt.steps_done and time.monotonic() < deadline:
        if not joiner.follow(joiner_rt, {**directive, "role": "join"}):
            time.sleep(0.005)  # the standby loop's pace
    assert joiner.steps == donor_rt.steps_done, "the joiner did not catch up"
    assert joiner.session == 1 and joiner.received > 0
    assert same(joiner_rt.stage_state(), donor_rt.stage_state())
    donor.boundary(donor_rt, None)
    joiner.follow(joiner_rt, None)
    side.shutdown(wait=True)
