"""`schedc profile`: measured stage costs as the runtime incurs them, and the stash the runtime holds.

CPU only here (tests/test_gpu.py repeats the memory checks with CUDA's allocator where a GPU exists).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import schedc
from schedc.profile import profile, render, write_stages_block
from schedc.runtime.weightgrad import held_bytes

ROOT = Path(__file__).resolve().parent.parent
GPT_SPEC = """
model "tiny-gpt" {
    layers = 4  hidden = 32  heads = 2  seq_len = 16  vocab = 64
    microbatch_size = 2  precision = fp32
    source = "schedc.models.gpt:build"
}
cluster { dp = 2  pp = 2  gpus_per_node = 4
          gpu { memory = 1GiB  flops = 1TFLOPS  efficiency = 0.5 }
          link { latency = 10us  bandwidth = 10GB/s } }
train { microbatches = 2  optimizer = adam }
schedule { solver = greedy }
"""
USER_SPEC = """
model { source = "profile_model:build"  data = "profile_model:batch"  hidden = 24 }
cluster { dp = 1  pp = 2  gpus_per_node = 2  gpu { memory = 1GiB } }
stages { all { forward = 1ms  backward_input = 1ms  backward_weight = 1ms  optimizer = 1ms
               activation = 1MiB  stash = 1MiB  static = 1MiB  send = 1KiB } }
train { microbatches = 2 }
schedule { solver = greedy }
"""


class ThreadCpuClock:
    """Times ops by this thread's CPU time (`time.thread_time`): real figures that another job on
    the machine does not inflate (time it waits for a core is not counted), for the tests about
    what a profile offers and where it goes, not about noise. Ops that torch spreads over several
    threads read low; these models are too small for that to matter."""

    @staticmethod
    def start(op):
        return time.thread_time()

    @staticmethod
    def stop(t0):
        return (time.thread_time() - t0) * 1e6

    @staticmethod
    def resolve(v):
        return v


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The ops timed here run on one thread. With torch's intra-op pool, a thread waits for its
    helpers in a spinning barrier, and when another job has the cores (two busy loops) that spin
    counts as this thread's CPU time: a 1 ms forward read 12 ms of thread CPU time in one round."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class WholeMsThreadClock(ThreadCpuClock):
    """`ThreadCpuClock` rounded up to whole milliseconds: the MLPs' sub-millisecond ops all read
    1 ms, so that two busy loops on the machine (which still jitter a thread's CPU time by the
    caches they share) cannot make a median twice the fastest repeat, and `profile` offers the
    figures instead of refusing them as noisy (E585, right for a real measurement). For the
    tests about what a profile offers and where it goes; E585 itself is tested below."""

    @staticmethod
    def stop(t0):
        return math.ceil((time.thread_time() - t0) * 1e3) * 1000.0


def _gpt_stash_bytes(spec, stage: int) -> int:
    """The cost model's stash of a stage: 16sbh*4 per layer, plus sbh*4 + sbV*4 for the head (fp32)."""
    m = spec.model
    a, b = spec.partition[stage]
    sbh = m.microbatch_size * m.seq_len * m.hidden * 4
    head = (sbh + m.microbatch_size * m.seq_len * m.vocab * 4) if b == m.layers else 0
    return (b - a) * 16 * sbh + head


def test_shipped_mlp_profile_is_positive_and_plugs_into_compile(tmp_path):
    spec = schedc.load(ROOT / "specs" / "mlp-2x2.sched")
    p = profile(spec, repeats=3, warmup=1, clock=WholeMsThreadClock())
    assert [st.pp for st in p.stages] == [0, 1]
    for st in p.stage_costs():
        assert min(st.forward, st.backward_input, st.backward_weight, st.optimizer) >= 1
        assert st.static > 0 and 0 < st.stash <= st.activation
    assert p.stage_costs()[0].send == 4 * 32 * 4  # the MLP's boundary: 4 x 32 floats
    assert p.stage_costs()[1].send == 0
    text = write_stages_block("mlp.sched", (ROOT / "specs" / "mlp-2x2.sched").read_text(), p.stages_block())
    measured = schedc.load(text, name="mlp.sched")
    assert measured.stages == p.stage_costs()
    plan = schedc.compile(measured)
    assert plan.metrics.iteration_time > 0


def test_gpt_stash_is_what_the_cost_model_says_and_b_plus_w_is_the_backward():
    spec = schedc.load(GPT_SPEC)
    p = profile(spec, repeats=5, warmup=2)
    assert p.analytic is not None
    for s, st in enumerate(p.stages):
        assert st.stash == _gpt_stash_bytes(spec, s), f"stage {s}"
        assert st.split_layers == 4 * (st.layers[1] - st.layers[0]) + (1 if st.layers[1] == 4 else 0)
        # The quickest of the repeats (on a shared machine a median can catch another job).
        b_plus_w = st.backward_input.low + st.backward_weight.low
        assert 0.33 < b_plus_w / st.backward_full.low < 3
    ratios = p.ratios()
    assert all(r["stash"] == pytest.approx(1.0) for r in ratios)


def test_the_runtime_holds_exactly_the_profiled_stash_between_b_and_w(tmp_path):
    """A rank's program runs F and B of a microbatch; until W, its stash entry holds the bytes
    `schedc profile` reports (and nothing of the graph), and W leaves nothing behind."""
    from schedc.codegen import write_programs
    from schedc.runtime import load_manifest
    from schedc.runtime.primitives import Runtime

    spec = schedc.load(GPT_SPEC.replace("dp = 2  pp = 2", "dp = 1  pp = 1"))
    plan = schedc.compile(spec)
    write_programs(spec, plan.schedule, tmp_path)
    rt = Runtime(load_manifest(tmp_path), 0, transport=None)
    rt.begin_iteration = lambda it: None
    rt.forward(d=0, stage=0, mb=0, recv_from=None, send_to=None)
    rt.backward_input(d=0, stage=0, mb=0, recv_from=None, send_to=None)
    st = rt._stash[(0, 0)]
    assert st.inp is None and st.out is None and st.grad_out is None
    params = {p.untyped_storage().data_ptr() for p in rt.params}
    held = held_bytes([t for _, x, g in st.weight_grads for t in (x, g)], params)
    assert held == profile(spec, repeats=1, warmup=0).stages[0].stash == _gpt_stash_bytes(spec, 0)
    rt.backward_weight(d=0, stage=0, mb=0)
    assert not rt._stash


def test_decoupled_weight_gradients_equal_autograd():
    """B then W (deferred linear weight gradients) give the gradients of one plain backward."""
    from schedc.models import gpt
    from schedc.runtime.stagework import StageWork

    layers, loss_fn = gpt.build()
    plain, _ = gpt.build()
    x, y = gpt.batch(0, 0, 0)
    loss = loss_fn(plain(x), y) / 4
    loss.backward()
    work = StageWork(list(layers.children()), loss_fn, global_microbatches=4)
    out = work.forward(x, y)
    _, entries = work.backward(out, x, None, wants_input=False, defer_weights=True)
    assert entries and all(p.grad is None for layer, _, _ in entries for p in (layer.weight,))
    work.weight(entries)
    for (name, a), b in zip(plain.named_parameters(), work.module.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-5), name


def test_a_users_model_gets_its_declared_arguments_and_profiles(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    spec = schedc.load(USER_SPEC)
    p = profile(spec, repeats=2, warmup=1, clock=WholeMsThreadClock())
    assert p.stages[0].params == (8 * 24 + 24) + (24 * 24 * 3 + 24) + (24 * 24 + 24)  # hidden = 24 reached build()
    assert [st.split_layers for st in p.stages] == [2, 2]  # Linear + Mixer.proj | Mixer.proj + Linear
    for st in p.stage_costs():
        assert st.forward >= 1 and 0 < st.stash <= st.activation
    assert p.analytic is None and p.ratios() is None


def test_cli_writes_the_block_into_the_spec_and_compile_uses_it(tmp_path, monkeypatch, capsys):
    from schedc.cli import main

    monkeypatch.setattr("schedc.profile._CpuClock", ThreadCpuClock)  # (wall time can be noisy: E585)
    spec = tmp_path / "mlp.sched"
    spec.write_text((ROOT / "specs" / "mlp-2x2.sched").read_text())
    assert main(["profile", str(spec), "--repeats", "2", "--warmup", "0", "--write", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["written"] == str(spec)
    loaded = schedc.load(spec)
    assert [c.forward for c in loaded.stages] == [s["costs"]["forward"] for s in report["stages"]]
    assert "stage costs measured by" not in spec.read_text()  # replaced in place, not appended
    compiled = _schedc("compile", str(spec), "-o", str(tmp_path / "out"))
    assert compiled.returncode == 0, compiled.stderr


@pytest.mark.parametrize("args, code", [
    (["--repeats", "0"], "E582"),
    (["--repeats", "1000000000000"], "E582"),
    (["--warmup", "-1"], "E582"),
    (["--device", "tpu"], "E580"),
    (["--write"], "E583"),  # with the spec on stdin
])
def test_cli_bad_options_are_diagnostics(args, code):
    stdin = (ROOT / "specs" / "mlp-2x2.sched").read_text()
    out = _schedc("profile", "-", *args, input=stdin)
    assert out.returncode == 1 and f"error[{code}]" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_diagnostic():
    out = _schedc("profile", str(ROOT / "specs" / "mlp-2x2.sched"), "--device", "cuda")
    assert out.returncode == 1 and "error[E580]" in out.stderr and "no CUDA GPU" in out.stderr


def test_write_stages_block_appends_when_there_is_none():
    text = GPT_SPEC
    new = write_stages_block("g.sched", text, "stages {\n    all { forward = 1ms }\n}\n")
    assert new.startswith(text.rstrip("\n")) and new.rstrip().endswith("}")
    assert math.isfinite(len(new))


def test_a_spec_naming_no_model_is_refused_not_profiled_as_a_stand_in(tmp_path):
    """specs/example.sched declares a large model's costs and names no `model.source`: profiling
    schedc's stand-in MLP instead, and offering its block, would overwrite those costs with a toy's."""
    spec = tmp_path / "example.sched"
    spec.write_text((ROOT / "specs" / "example.sched").read_text())
    out = _schedc("profile", str(spec), "--write")
    assert out.returncode == 1 and "error[E584]" in out.stderr and "Traceback" not in out.stderr
    assert "names no model" in out.stderr and 'source = "schedc.models.mlp:build"' in out.stderr
    assert out.stdout == "" and spec.read_text() == (ROOT / "specs" / "example.sched").read_text()
    # A `model` block without `source`: the caret points at it.
    text = USER_SPEC.replace('source = "profile_model:build"  data = "profile_model:batch"  ', "")
    with pytest.raises(schedc.RunError) as exc:
        profile(schedc.load(text, name="m.sched"))
    assert exc.value.codes == ["E584"] and exc.value.diagnostics[0].span.line == 2


class ScriptedClock:
    """A clock whose readings are made up: every op takes `base` us, except the F calls that
    `slow(n)` picks (n counts F calls from 0), which take 79 ms, as under another job's load."""

    base = {"F": 130.0, "B": 150.0, "W": 100.0, "BW": 250.0, "O": 20.0}

    def __init__(self, slow):
        self.slow = slow
        self.f_calls = 0

    def start(self, op):
        return op

    def stop(self, op):
        if op != "F":
            return self.base[op]
        n, self.f_calls = self.f_calls, self.f_calls + 1
        return 79_000.0 if self.slow(n) else self.base["F"]

    def resolve(self, v):
        return v


def _profile_with(clock):
    return profile(schedc.load(ROOT / "specs" / "mlp-2x2.sched"), repeats=10, warmup=0, clock=clock)


def test_one_slow_repeat_does_not_move_the_median_and_is_not_remeasured():
    p = _profile_with(ScriptedClock(lambda n: n % 10 == 3))
    assert [st.passes for st in p.stages] == [1, 1] and p.noisy == ()
    assert p.stages[0].forward.spread > 100  # shown in the table, yet the median stands
    assert [c.forward for c in p.stage_costs()] == [130, 130]


def test_a_burst_of_load_is_remeasured_and_outvoted():
    p = _profile_with(ScriptedClock(lambda n: n < 7))  # 7 of stage 0's first 10 F rounds
    assert p.stages[0].passes == 2 and p.stages[1].passes == 1
    assert p.noisy == () and [c.forward for c in p.stage_costs()] == [130, 130]
    assert "forward = 130us" in p.stages_block()
    assert "re-measured" in render(p)


def test_figures_that_stay_noisy_are_not_offered():
    """F = 79 ms for a 0.13 ms op in most rounds of every pass: the figures are shown, marked,
    and refused as costs (E585 names the op and says what to do)."""
    from schedc.profile import MAX_PASSES

    p = _profile_with(ScriptedClock(lambda n: n % 10 < 7))
    assert [st.passes for st in p.stages] == [MAX_PASSES, MAX_PASSES]
    assert p.noisy == ((0, "forward"), (1, "forward"))
    for offer in (p.stage_costs, p.stages_block):
        with pytest.raises(schedc.RunError) as exc:
            offer()
        assert exc.value.codes == ["E585"]
    text = exc.value.render()
    assert "stage 0 forward: median 79.000 ms, fastest 0.130 ms" in text and "idle machine" in text
    shown = render(p)
    assert "NOISY: forward" in shown and "stages {" not in shown
    assert json.loads(json.dumps(p.to_json()))["stages"][0]["noisy"] == ["forward"]


def test_cli_with_noisy_figures_fails_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from schedc.cli import main

    monkeypatch.setattr("schedc.profile._CpuClock", lambda: ScriptedClock(lambda n: n % 10 < 7))
    spec = tmp_path / "mlp.sched"
    spec.write_text((ROOT / "specs" / "mlp-2x2.sched").read_text())
    assert main(["profile", str(spec), "--write"]) == 1
    out, err = capsys.readouterr()
    assert "NOISY: forward" in out and "stages {" not in out and "error[E585]" in err
    assert spec.read_text() == (ROOT / "specs" / "mlp-2x2.sched").read_text()
    assert main(["profile", str(spec), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["stages_block"] is None and report["diagnostics"][0]["code"] == "E585"


def _schedc(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    import os

    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "schedc", *args], capture_output=True, text=True,
                          input=input, env=env, timeout=120, cwd=str(Path(__file__).parent))
