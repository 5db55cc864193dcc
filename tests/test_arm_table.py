"""The arm table's rows, the views the reports, the charts and the TRL integration take of it, and the
one vocabulary of plan names."""

from __future__ import annotations

import dataclasses

import pytest

from tracefp4.engines.plan import PLAN_NAMES, PrecisionPlan
from tracefp4.engines.trainer import TrainerMode
from tracefp4.pipeline.arms import (
    ARMS,
    CHART_ORDER,
    ROLLOUT_MODES,
    SCALING_ARMS,
    Role,
    arm_spec,
    arm_style,
    make_arm,
    report_arms,
    rollout_mode,
)


def test_an_arm_has_one_name() -> None:
    # the reports' former spellings are no arm: every output writes the table's name
    for old in ("trace_lsb", "trace_full", "full", "ldpc@all", "lsb@all"):
        with pytest.raises(ValueError, match=f"unknown arm '{old}'"):
            arm_spec(old)


def test_every_row_says_what_it_is() -> None:
    for name, spec in ARMS.items():
        assert spec.label and spec.description and len(spec.style) == 2, name
        assert spec.role in (Role.PAPER, Role.BASELINE, Role.ABLATION) and isinstance(spec.trainer, TrainerMode)
    assert [n for n, s in ARMS.items() if s.role is Role.PAPER] == ["bf16", "qat", "trace", "trace-full"]


def test_report_views_name_arms_of_the_table() -> None:
    for report in ("mismatch", "scaling", "rollout"):
        assert all(name in ARMS for name in report_arms(report))
    assert report_arms("mismatch") == ("bf16", "qat", "trace", "trace-full")
    assert set(SCALING_ARMS) == set(report_arms("scaling"))
    assert list(SCALING_ARMS) == ["bf16", "qat", "trace", "trace-all", "trace-ldpc", "trace-full"]
    assert SCALING_ARMS["trace-ldpc"] == ARMS["trace-ldpc"].guidance
    assert SCALING_ARMS["trace-all"] == "lsb@all" and SCALING_ARMS["qat"] is None and SCALING_ARMS["bf16"] == "bf16"
    # trace-all is trace-L<n> at the model's depth, under one name at every depth
    every, last3 = (make_arm(n, guidance="lsb", n_layers=3) for n in ("trace-all", "trace-L3"))
    assert every.guidance.layer_indices(3) == last3.guidance.layer_indices(3) == every.diagnostics == last3.diagnostics
    assert dataclasses.replace(every, name="", guidance=None) == dataclasses.replace(last3, name="", guidance=None)
    # the benchmarks' modes: a recording arm by its name, an unguided rollout by its precision
    assert ROLLOUT_MODES == {"bf16": (False, None), "fp4": (True, None), "trace": (True, "lsb"),
                             "trace-full": (True, "full@all")}
    assert [rollout_mode(n) for n in report_arms("rollout")] == list(ROLLOUT_MODES)
    assert make_arm("trace-full", guidance="lsb", n_layers=2).guidance.name == "full"
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
