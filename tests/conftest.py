import os

import pytest
from hypothesis import HealthCheck, settings

# CI runs more examples; a local run stays quick. Select with HYPOTHESIS_PROFILE.
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

#: Test files whose tests run real multi-process jobs (training ranks over gloo, agents, a store,
#: forkservers) or act on what processes do in time (failure detection, fail-slow, deadlines,
#: kills, busy loops). Under pytest-xdist's `--dist loadgroup` (the README's test command) they
#: form one group, run on one worker one at a time as in a serial run, while the other workers
#: take the in-process tests: two live jobs at once on a 2-core machine would each see the
#: other's ranks as load. A new test file that starts processes belongs here (so does any test
#: marked `e2e`, wherever it is).
PROCESS_FILES = frozenset({
    "test_chaos.py", "test_cli_signals.py", "test_determinism.py", "test_device_paths.py",
    "test_e2e_exactness.py", "test_e2e_runs.py", "test_e2e_spec.py", "test_e2e_torch.py",
    "test_gpu.py", "test_live_cli.py", "test_live_exactness.py", "test_live_failslow.py",
    "test_live_injections.py", "test_live_policies.py", "test_live_programs.py",
    "test_live_repartition.py", "test_live_reshard.py", "test_live_rollback.py",
    "test_live_slowness.py", "test_live_transfer.py", "test_live_transport.py", "test_processes.py",
    "test_readme.py", "test_runtime_threads.py", "test_solver_sandbox.py", "test_symmetry.py",
})


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.path.name in PROCESS_FILES or item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.xdist_group("processes"))
