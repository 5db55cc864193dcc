"""The arm table's aliases and the views the reports and the TRL integration take from it."""

from __future__ import annotations

import pytest

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.rl.arms import (
    ARM_ALIASES,
    ARM_STYLE,
    ARMS,
    MISMATCH_ARMS,
    PLAN_NAMES,
    ROLLOUT_MODES,
    SCALING_ARMS,
    canonical_arm,
    make_arm,
    plan_by_name,
)


def test_one_full_arm_three_spellings() -> None:
    assert {canonical_arm(n) for n in ("trace-full", "trace_full", "full")} == {"trace-full"}
    assert all(target in ARMS for target in ARM_ALIASES.values())
    assert canonical_arm("qat") == "qat"


def test_report_views_name_arms_of_the_table() -> None:
    for table in (MISMATCH_ARMS, SCALING_ARMS, ROLLOUT_MODES):
        for name in table:
            assert canonical_arm(name) in ARMS or name in ("fp4", "lsb@all"), name
    assert SCALING_ARMS["ldpc@all"] == ARMS[canonical_arm("ldpc@all")].guidance
    # the mismatch report's trace_full arm records what the table's trace-full arm does
    assert make_arm(canonical_arm("trace_full"), guidance="lsb", n_layers=2).guidance.name == "full"
    assert set(ARM_STYLE) <= {*ARMS, "trace-L1", "trace-L2", "lsb@all"}
    # every arm a report plots has its style in the one table
    assert all(canonical_arm(name) in ARM_STYLE for name in SCALING_ARMS)


def test_plan_by_name() -> None:
    assert plan_by_name("nvfp4") == PrecisionPlan()
    assert plan_by_name("fp8") == PrecisionPlan.fp8()
    assert PLAN_NAMES[0] == "nvfp4"
    with pytest.raises(ValueError, match="trace_plan = 'int3'"):
        plan_by_name("int3")
