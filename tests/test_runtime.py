"""Runtime pieces without processes: tags, binding, partition, keys, the shipped models."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from schedc.codegen import write_programs
from schedc.diagnostics import RunError
from schedc.instance import make_instance
from schedc.models import gpt, mlp
from schedc.runtime.manifest import build_model, even_partition, load_callable, load_manifest, stage_layer_keys
from schedc.runtime.transport import _short_reason, message_tag
from test_runtime_support import list_schedule, spec_for


def _manifest(tmp_path, **kw):
    inst = make_instance(2, 3, 3)
    write_programs(spec_for(inst, **kw), list_schedule(inst), tmp_path)
    return load_manifest(tmp_path)


def test_tags_are_unique_per_message(tmp_path):
    m = _manifest(tmp_path)
    keys = [(it, kind, d, mb, b) for it in range(3) for kind in (0, 1) for d in range(m.dp)
            for mb in range(m.microbatches) for b in range(m.pp)]
    tags = [message_tag(*k, m) for k in keys]
    assert len(set(tags)) == len(tags)
    assert min(tags) >= 0


@given(st.integers(1, 40), st.integers(1, 8))
def test_even_partition_covers_every_layer_once(n, pp):
    if n < pp:
        with pytest.raises(RunError):
            even_partition(n, pp)
        return
    parts = even_partition(n, pp)
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(a < b for a, b in parts) and all(parts[i][1] == parts[i + 1][0] for i in range(pp - 1))
    assert max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1


def test_stage_keys_are_the_full_sequential_keys(tmp_path):
    m = _manifest(tmp_path, source="schedc.models.gpt:build")
    layers, _, partition = build_model(m)
    full = list(torch.nn.Sequential(*layers).state_dict())
    assert [f for s in range(m.pp) for _, f in stage_layer_keys(layers, partition, s)] == full


@pytest.mark.parametrize("ref, code", [("nomodule", "E510"), ("schedc.models.mlp:nothing", "E510"),
                                       ("no.such.module:build", "E510")])
def test_bad_bindings_are_diagnostics(ref, code):
    with pytest.raises(RunError) as exc:
        load_callable(ref, "model.source")
    assert exc.value.codes == [code]


def test_a_loss_that_cannot_be_called_is_a_diagnostic():
    from schedc.runtime.manifest import build_layers

    with pytest.raises(RunError) as exc:
        build_layers("live_data:mlp_with_a_loss_that_is_no_function", {}, None, 2)
    assert exc.value.codes == ["E512"] and "cannot be called" in exc.value.diagnostics[0].message
    assert exc.value.diagnostics[0].hint


def test_source_returning_a_list_and_a_partition_that_does_not_fit(tmp_path):
    m = _manifest(tmp_path, source="schedc.models.mlp:build", partition=((0, 2), (2, 4), (4, 9)))
    with pytest.raises(RunError) as exc:
        build_model(m)
    assert exc.value.codes == ["E513"]


@pytest.mark.parametrize("model", [mlp, gpt])
def test_models_are_seeded_and_data_deterministic(model):
    a, b = model.build()[0].state_dict(), model.build()[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    x1, y1 = model.batch(3, 1, 2)
    x2, y2 = model.batch(3, 1, 2)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(model.batch(3, 1, 2)[0], model.batch(3, 2, 1)[0])


def test_gloo_errors_read_short():
    exc = RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:38830. "
                       "This is typically caused by a remote worker crashing.")
    assert _short_reason(exc) == "connection closed by peer"


def test_importing_the_runtime_and_the_run_command_does_not_import_torch():
    code = "import sys, schedc.runtime, schedc.cli.run, schedc.codegen; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
