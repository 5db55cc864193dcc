"""The arm table's rows, the views the reports, the charts and the TRL integration take of it, and the
one vocabulary of plan names."""

from __future__ import annotations

import pytest

from tracefp4.engines.plan import PLAN_NAMES, PrecisionPlan
from tracefp4.engines.trainer import TrainerMode
from tracefp4.pipeline.arms import (
    ARM_ALIASES,
    ARMS,
    CHART_ORDER,
    ROLLOUT_MODES,
    SCALING_ARMS,
    Role,
    arm_style,
    canonical_arm,
    make_arm,
    report_arms,
)


def test_one_full_arm_three_spellings() -> None:
    assert {canonical_arm(n) for n in ("trace-full", "trace_full", "full")} == {"trace-full"}
    assert all(target in ARMS for target in ARM_ALIASES.values())
    assert canonical_arm("qat") == "qat"


def test_every_row_says_what_it_is() -> None:
    for name, spec in ARMS.items():
        assert spec.label and spec.description and len(spec.style) == 2, name
        assert spec.role in (Role.PAPER, Role.BASELINE, Role.ABLATION) and isinstance(spec.trainer, TrainerMode)
    assert [n for n, s in ARMS.items() if s.role is Role.PAPER] == ["bf16", "qat", "trace", "trace-full"]


def test_report_views_name_arms_of_the_table() -> None:
    for report in ("mismatch", "scaling", "rollout"):
        assert all(name in ARMS for name in report_arms(report).values())
    assert list(report_arms("mismatch")) == ["bf16", "qat", "trace_lsb", "trace_full"]
    assert set(SCALING_ARMS) == set(report_arms("scaling"))
    assert SCALING_ARMS["ldpc@all"] == ARMS[canonical_arm("ldpc@all")].guidance
    assert SCALING_ARMS["lsb@all"] == "lsb@all" and SCALING_ARMS["qat"] is None and SCALING_ARMS["bf16"] == "bf16"
    assert ROLLOUT_MODES["fp4"] == (True, None) and ROLLOUT_MODES["trace_lsb"] == (True, "lsb")
    # the mismatch report's trace_full arm records what the table's trace-full arm does
    assert make_arm(canonical_arm("trace_full"), guidance="lsb", n_layers=2).guidance.name == "full"
    # every arm a report plots has its style in the one table, and a family member may have its own
    assert all(arm_style(name) is not None for name in SCALING_ARMS)
    assert arm_style("trace-L2") != arm_style("trace-L1") and arm_style("trace-L7") is None
    assert all(arm_style(name) is not None for name in CHART_ORDER)


def test_plans_are_named_once() -> None:
    assert PrecisionPlan.named("nvfp4") == PrecisionPlan()
    assert PrecisionPlan.named("fp8") == PrecisionPlan.fp8()
    assert PrecisionPlan.named("quads", quads_fraction=0.25) == PrecisionPlan.quads(0.25)
    assert PLAN_NAMES[0] == "nvfp4"
    assert {s.plan for s in ARMS.values()} - {None, "run"} <= set(PLAN_NAMES)
    with pytest.raises(ValueError, match="plan 'int3': expected one of nvfp4, "):
        PrecisionPlan.named("int3")
