"""Where each rank computes and how ranks talk: `--device` and `--backend` resolved.

- `cpu` (the default): every rank on the CPU, gloo.
- `cuda`: local rank i on GPU ``i % (GPUs on this machine)`` (torchrun: its
  LOCAL_RANK). The backend is NCCL when every rank has a GPU of its own
  (NCCL refuses two ranks on one GPU), else gloo, which carries the GPU's
  tensors through the CPU; `--backend` forces one.
- `cuda:N`: every rank on GPU N (gloo).

With NCCL, messages are matched by their order in the sender's program,
which the ranks read from `schedule.json` (`schedc.runtime.channels`).
This module imports torch only when asked about GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedc.diagnostics import RunError, error

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Placement:
    devices: tuple[str, ...]  # per torch rank (index into the manifest's live ranks)
    backend: str  # "gloo" or "nccl"

    @property
    def ordered(self) -> bool:
        """Whether messages are matched by program order (NCCL has no tags)."""
        return self.backend == "nccl"

    def describe(self) -> str:
        kinds = sorted(set(self.devices))
        where = "CPU" if kinds == ["cpu"] else ", ".join(kinds)
        return f"{len(self.devices)} ranks on {where}, {self.backend}"


def place(device: str, backend: str, ranks: int) -> Placement:
    """The placement of `ranks` local ranks for `--device` and `--backend` (E580/E581 when impossible)."""
    if backend not in BACKENDS:
        raise RunError([error("E581", f"unknown backend `{backend}`", hint="use auto, gloo or nccl")])
    if device == "cpu":
        if backend == "nccl":
            raise RunError([error("E581", "the nccl backend needs GPUs", hint="use --device cuda, or --backend gloo")])
        return Placement(("cpu",) * ranks, "gloo")
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise RunError([error("E580", f"unknown device `{device}`", hint="use cpu, cuda or cuda:N")])
    count = gpu_count()
    if count == 0:
        raise RunError([error("E580", f"--device {device}, but this torch sees no CUDA GPU",
                              hint="run on a machine with a GPU and a CUDA build of torch, or use --device cpu")])
    if index:
        if int(index) >= count:
            raise RunError([error("E580", f"--device {device}: this machine has {count} GPU(s)",
                                  hint=f"give cuda:0 to cuda:{count - 1}, or cuda (rank i on GPU i mod {count})")])
        devices = (device,) * ranks
    else:
        devices = tuple(f"cuda:{i % count}" for i in range(ranks))
    own_gpu = len(set(devices)) == ranks
    if backend == "nccl" and not own_gpu:
        raise RunError([error("E581", f"nccl needs one GPU per rank: {ranks} ranks, {len(set(devices))} GPU(s) used",
                              hint="run on more GPUs (torchrun across nodes), or use --backend gloo")])
    if backend == "auto":
        backend = "nccl" if own_gpu and nccl_available() else "gloo"
    return Placement(devices, backend)


def place_live(device: str, backend: str, ranks: int) -> Placement:
    """The placement of a live run's `ranks` workers on one host (`schedc train --device/--backend`).

    A live run talks over gloo whatever the device: its recovery aborts a generation by dropping
    its groups, which gloo supports and NCCL does not in the same way (a communicator blocked on a
    dead peer must be aborted, and rebuilt for the next generation). CUDA tensors then go through
    host memory. `--backend nccl` is refused with the reason (E581), once the device is
    checked (E580 first where there is no such device)."""
    if backend == "nccl":
        place(device, "gloo", ranks)
        raise RunError([error("E581", "schedc train recovers over gloo only: it does not abort and rebuild NCCL "
                                      "communicators after a failure yet",
                              hint="leave out --backend (or give --backend gloo): ranks on GPUs then exchange "
                                   "tensors through host memory")])
    return place(device, "gloo" if backend == "auto" else backend, ranks)


def rank_device(device: str, index: int) -> str:
    """The device of rank `index` under `--device` (`cuda`: GPU index mod this host's GPUs; a host's
    ranks are consecutive, so they spread over its GPUs)."""
    if device != "cuda":
        return device
    count = gpu_count()
    return f"cuda:{index % count}" if count else "cuda"


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_available() -> bool:
    import torch.distributed as dist

    return dist.is_nccl_available()


def own_device(device: str, rank: int, gpu: int | None = None) -> str:
    """A live worker's device under `--device`, made current (a CUDA context is made here, in the
    worker: the forkserver it came from never touched CUDA, `schedc.runtime.warmup`). `gpu`: the
    job's rank of the GPU it runs on, when it differs from `rank` (a re-partitioned layout's rank
    runs on the GPU of a survivor, `Generation.physical`)."""
    mine = rank_device(device, rank if gpu is None else gpu)
    if mine.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RunError([error("E580", f"rank {rank}: --device {device}, but this host's torch sees no CUDA GPU",
                                  hint="run the workers on hosts with GPUs and a CUDA build of torch, or leave "
                                       "out --device")])
        index = torch.device(mine).index or 0
        if index >= torch.cuda.device_count():  # (the supervisor checked its own host only)
            raise RunError([error("E580", f"rank {rank}: --device {mine}, but this host has "
                                          f"{torch.cuda.device_count()} GPU(s)",
                                  hint="give --device cuda (rank i on GPU i mod each host's GPUs) or a GPU "
                                       "every host has")])
        torch.cuda.set_device(torch.device(mine))
    return mine
