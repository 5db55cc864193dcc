"""The arms compared side by side, and what each one records.

An arm records only what it uses. Each states its rollout's precision ``plan`` (None: a BF16 rollout),
the ``guidance`` its rollout records for the trainer (a :class:`GuidedMode` name; None: routing only),
the ``diagnostics`` layers whose full FP4 codes the rollout keeps in memory to measure the code
mismatch (never stored, never given to the trainer), and the trainer's forward mode:

* ``bf16``: BF16 rollout (plan None), no guidance, no diagnostics; BF16 trainer.
* ``qat``: FP4 rollout, no guidance (routing only), diagnostics on the deeper half; the trainer
  rounds to nearest (vanilla QAT).
* ``trace``: FP4 rollout recording the run's ``guidance`` mode (default ``lsb``: the low bit of each
  code on the deeper half), diagnostics on its guided layers; guided trainer.
* ``trace-full``: FP4 rollout recording ``full`` codes on all layers, diagnostics on all layers;
  guided trainer.

Routing replay is on in every arm: the routing of every MoE layer always reaches the store.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.names import deeper_half

TrainerMode = Literal["bf16", "qat", "trace"]
LayerSet = Literal["deeper", "guided", "all"]

#: In :data:`ARMS`, the guidance mode the run config names (``RLConfig.guidance``).
CONFIGURED = "<configured>"


@dataclasses.dataclass(frozen=True)
class ArmSpec:
    """One row of the arm table, before a run's guidance mode and model depth are known."""

    fp4: bool  # FP4 rollout (the run's precision plan) or BF16
    guidance: str | None  # a GuidedMode name, CONFIGURED, or None (routing only)
    diagnostics: LayerSet | None  # layers whose full codes the rollout keeps, or None
    trainer: TrainerMode


ARMS: dict[str, ArmSpec] = {
    "bf16": ArmSpec(fp4=False, guidance=None, diagnostics=None, trainer="bf16"),
    "qat": ArmSpec(fp4=True, guidance=None, diagnostics="deeper", trainer="qat"),
    "trace": ArmSpec(fp4=True, guidance=CONFIGURED, diagnostics="guided", trainer="trace"),
    "trace-full": ArmSpec(fp4=True, guidance="full", diagnostics="all", trainer="trace"),
}


@dataclasses.dataclass(frozen=True)
class Arm:
    """An arm resolved for one run: what its rollout and trainer are called with."""

    name: str
    plan: PrecisionPlan | None
    guidance: GuidedMode | None
    diagnostics: frozenset[int]
    trainer: TrainerMode

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (what a rollout worker process is sent)."""
        return {
            "name": self.name,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "guidance": None if self.guidance is None else self.guidance.name,
            "diagnostics": sorted(self.diagnostics),
            "trainer": self.trainer,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Arm:
        return cls(
            name=d["name"],
            plan=None if d["plan"] is None else PrecisionPlan(**d["plan"]),
            guidance=None if d["guidance"] is None else GuidedMode.parse(d["guidance"]),
            diagnostics=frozenset(d["diagnostics"]),
            trainer=d["trainer"],
        )


def make_arm(name: str, *, guidance: str, n_layers: int, plan: PrecisionPlan | None = None) -> Arm:
    """Arm ``name`` of :data:`ARMS` for a model of ``n_layers`` layers; ``guidance`` is the run's
    configured mode (used by the arms whose table entry says CONFIGURED)."""
    if name not in ARMS:
        raise ValueError(f"unknown arm {name!r}; available: {sorted(ARMS)}")
    spec = ARMS[name]
    mode_name = guidance if spec.guidance == CONFIGURED else spec.guidance
    mode = None if mode_name is None else GuidedMode.parse(mode_name)
    diagnostics = {
        None: frozenset(),
        "deeper": deeper_half(n_layers),
        "all": frozenset(range(n_layers)),
        "guided": mode.layer_indices(n_layers) if mode is not None else frozenset(),
    }[spec.diagnostics]
    plan = (plan if plan is not None else PrecisionPlan()) if spec.fp4 else None
    return Arm(name, plan, mode, diagnostics, spec.trainer)
