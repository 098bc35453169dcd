"""Round trip with torch: a fault-free `zb-h1` schedule, exported as torch's CSV, runs under
torch.distributed.pipelining's `_PipelineScheduleRuntime` (gloo) and gives the same weights
after one SGD step as our generated programs."""

from __future__ import annotations

import io
import queue

import pytest
import torch

from schedc.codegen import write_programs
from schedc.instance import make_instance
from schedc.runtime import launch
from schedc.runtime.launcher import free_port
from schedc.runtime.processes import forkserver_context
from schedc.runtime.manifest import even_partition
from test_runtime_support import max_weight_diff, schedule_for, spec_for

pytestmark = pytest.mark.e2e
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

LR = 0.05


def _torch_rank(rank: int, world: int, init: str, csv_path: str, microbatches: int, out) -> None:
    """One rank of torch's own pipeline runtime, executing our CSV; sends back its stage's weights."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from schedc.models import mlp

    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        layers, loss_fn = mlp.build()
        layers = list(layers.children())
        a, b = even_partition(len(layers), world)[rank]
        module = nn.Sequential(*layers[a:b])
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        sched = _PipelineScheduleRuntime([stage], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
        sched._load_csv(csv_path)
        data = [mlp.batch(0, 0, m) for m in range(microbatches)]
        x = torch.cat([d[0] for d in data])
        y = torch.cat([d[1] for d in data])
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        torch.optim.SGD(module.parameters(), lr=LR).step()
        state = {f"{int(k.split('.', 1)[0]) + a}.{k.split('.', 1)[1]}": v for k, v in module.state_dict().items()}
        buf = io.BytesIO()
        torch.save(state, buf)
        out.put((rank, buf.getvalue()))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the test, which fails with it
        out.put((rank, f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("pp", [2, 3])
def test_zb_h1_csv_runs_under_torch_with_the_same_result(tmp_path, pp):
    from schedc.export import write_torch_csvs

    microbatches = 4
    inst = make_instance(1, pp, microbatches)
    sched = schedule_for(inst, "zb-h1")
    (csv_path,) = write_torch_csvs(tmp_path, sched)
    write_programs(spec_for(inst, optimizer="sgd", lr=LR), sched, tmp_path / "ours")
    ours = launch(tmp_path / "ours", iterations=1, want_weights=True, timeout=30).state_dict

    ctx = forkserver_context()
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_torch_rank, args=(r, pp, init, str(csv_path), microbatches, results))
             for r in range(pp)]
    for p in procs:
        p.start()
    theirs: dict = {}
    try:
        for _ in range(pp):
            rank, blob = results.get(timeout=60)
            assert isinstance(blob, bytes), f"torch rank {rank} failed: {blob}"
            theirs.update(torch.load(io.BytesIO(blob), weights_only=True))
    except queue.Empty:
        pytest.fail("torch's pipeline runtime did not finish within 60 s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.kill()
    theirs = {k: theirs[k] for k in ours}
    assert max_weight_diff(ours, theirs) <= 1e-5
    from schedc.models import mlp

    assert max_weight_diff(dict(mlp.build()[0].state_dict()), theirs) > 1e-4  # both really trained
