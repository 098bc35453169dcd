"""`schedc.live.move.sources`: which survivor each member of an in-place re-partition takes each
old stage from (pure logic; the moves themselves run in tests/test_live_shadow.py)."""

from __future__ import annotations

import pytest

from schedc.diagnostics import RunError
from schedc.live.move import sources

# 2 x 3 before, stage 1 lost: the survivors 0, 2, 3, 5 (renamed 0-3 here) held stages 0, 2, 0, 2;
# stage 2's GPUs hold stage 1's shadow.
OLD = {0: 0, 1: 2, 2: 0, 3: 2}


def test_a_member_keeps_what_it_holds_and_takes_the_rest_from_own_gpus_first_in_turn():
    need = {0: [0], 1: [0, 1], 2: [1, 2], 3: [2]}  # (the 2 x 2 layout's stages 0 | 1-2, with shadows)
    ok = {0: True, 1: True, 2: True, 3: True}
    plan = sources([0, 1, 2, 3], OLD, 3, ok, need)
    assert plan[(0, 0)] == 0 and plan[(3, 2)] == 3  # its own old stage
    assert plan[(1, 1)] == 1  # its shadow of stage 1
    assert plan[(2, 1)] == 1  # stage 1 exists only as shadows: from the first holder of one
    assert plan[(1, 0)] == 0  # stage 0 from its own GPUs (0 and 2), the first receiver the first
    assert plan[(2, 2)] == 2  # rank 2 (old stage 0) holds stage 2's shadow itself
    assert plan == {(0, 0): 0, (1, 0): 0, (1, 1): 1, (2, 1): 1, (2, 2): 2, (3, 2): 3}


def test_only_exact_shadows_count():
    need = {0: [1], 1: [], 2: [1], 3: []}
    plan = sources([0, 1, 2, 3], OLD, 3, {0: True, 1: False, 2: True, 3: True}, need)
    assert plan == {(0, 1): 3, (2, 1): 3}  # rank 1's shadow is stale: rank 3 sends to both


def test_a_stage_nobody_holds_is_a_bug_said_so():
    with pytest.raises(RunError) as err:
        sources([0, 1, 2, 3], OLD, 3, {r: False for r in OLD}, {0: [1], 1: [], 2: [], 3: []})
    assert err.value.codes == ["E552"] and "no survivor holds stage 1" in err.value.diagnostics[0].message
