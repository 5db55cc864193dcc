"""The arms compared side by side, and what each one records: every baseline and ablation is a row.

An arm records only what it uses. Each states its rollout's precision ``plan`` (None: a BF16 rollout;
``run``: the run's plan, NVFP4 W4A4 unless a caller gives another; or a fixed preset), the
``guidance`` its rollout records for the trainer (a :class:`GuidedMode` name; None: routing only), the
``diagnostics`` layers whose full FP4 codes the rollout keeps in memory to measure the code mismatch
(never stored, never given to the trainer), and the trainer's forward mode (and, where they differ
from the defaults, the trainer's own precision plan and its loss). Every trainer corrects the
train-rollout mismatch with a token-level truncated importance weight (``is_cap``; ``sc_is_cap`` in
Score Centering's loss).

The paper's arms:

* ``bf16``: BF16 rollout (plan None), no guidance, no diagnostics; BF16 trainer. Its evaluations
  also report the same policy served in FP4 after the fact: ``eval_accuracy_fp4`` (greedy decoding
  under vanilla NVFP4, ``PrecisionPlan()``) and ``eval_accuracy_fp4_4over6`` (under Four over Six).
* ``qat``: FP4 rollout, no guidance (routing only), diagnostics on the deeper half; the trainer
  rounds to nearest (vanilla QAT).
* ``trace``: FP4 rollout recording the run's ``guidance`` mode (default ``lsb``: the low bit of each
  code on the deeper half), diagnostics on its guided layers; guided trainer.
* ``trace-full``: FP4 rollout recording ``full`` codes on all layers, diagnostics on all layers;
  guided trainer.

Baselines:

* ``fp4-rollout``: FP4 rollout, BF16 trainer (no fake quantization): the low-precision-rollout
  recipe of verl / FlashRL, where only the truncated importance weight absorbs the FP4-vs-BF16 gap.
  No guidance, no diagnostics (a BF16 trainer has no codes to compare).
* ``qat-4over6``: as ``qat`` with "Four over Six" NVFP4 block scales on both paths
  (``PrecisionPlan.four_over_six()``: per block of 16, the E4M3 scale mapping the block maximum to 4
  or to 6, whichever has the smaller squared error, ties to 6).
* ``qat-mxfp4``: as ``qat`` in MXFP4 (``PrecisionPlan.mxfp4()``: MXFP4 W4A4 and KV cache).
* ``qat-w4a8``: as ``qat`` in W4A8 (``PrecisionPlan.w4a8()``: FP8 E4M3 expert activations, NVFP4
  weights and KV cache).

Ablations (TRACE variants):

* ``trace-L<n>``: ``lsb`` guidance on the last n layers only (``lsb@last<n>``), diagnostics there;
  n between 1 and the model's layers (n = all layers is ``lsb@all``). E.g. ``trace-L1``.
* ``trace-ldpc``: the compact LDPC record ``ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all``.
* ``trace-4over6``: ``lsb`` guidance under Four over Six scales. The record already holds each
  block's E4M3 scale byte, and the trainer quantizes on the rollout's grid as every guided NVFP4 site
  does, so the block's 4-or-6 choice is implied by the recorded scale: no extra bit is needed.
* ``trace-mxfp4``: ``lsb`` guidance in MXFP4.
* ``trace-w4a8``: ``lsb`` guidance in W4A8: the FP8 expert activations and the NVFP4 KV cache of the
  guided layers (adjacent E4M3 codes alternate in their lowest bit as E2M1 codes do, so the same
  1-bit hint names the rollout's neighbour).

The paper's two closest baselines, and FP8 rollouts:

* ``quads``: QUADS (arXiv 2607.15810): the rollout runs NVFP4 W4A4 with residual activation
  compensation at the expert GEMM inputs (``PrecisionPlan.quads(quads_fraction)``); the trainer is
  asymmetric W4A16 QAT (``trainer_plan``: ``PrecisionPlan.w4a16()``, the routed-expert weights
  fake-quantized NVFP4, every activation and the KV cache BF16). No guidance; no diagnostics (a
  BF16-activation trainer has no activation codes to compare); the log-prob gap is reported as for
  every arm (its paper's metric is the per-step max |Δlogp|, ``train_rollout_logprob_abs_diff_max``).
* ``score-centering``: FP4 rollout as ``qat`` (vanilla QAT trainer), the loss Score Centering
  (``loss``: :attr:`~tracefp4.rl.grpo.PolicyLoss.SCORE_CENTERING`) on the sampler's top-k log-probs.
* ``trace-sc``: TRACE (the run's guidance mode) with the Score Centering loss: the two act on
  different causes of the gap (the trainer's codes vs the sampler's drift term).
* ``qat-fp8``: W8A8 FP8 rollout (``PrecisionPlan.fp8()``: E4M3 weights with a scale per output
  channel, activations per row, KV cache per token and KV head) with a vanilla FP8 QAT trainer.
* ``trace-fp8``: the same with ``lsb`` hints on the E4M3 grid on **all** layers (``lsb@all``): the
  E4M3 step (1/8-1/16 relative) is small beside the drift that unguided FP8 layers pass on, so
  guiding the deeper half alone leaves 4-7% of its codes apart (``tracefp4 mismatch --plan fp8``).

Routing replay is on in every arm: the routing of every MoE layer always reaches the store.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, Literal

from tracefp4.engines.plan import PrecisionPlan, check_supported
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.names import deeper_half
from tracefp4.rl.grpo import PolicyLoss

TrainerMode = Literal["bf16", "qat", "trace"]
LayerSet = Literal["deeper", "guided", "all"]
PlanName = Literal["run", "4over6", "mxfp4", "w4a8", "fp8", "quads", "w4a16"]

#: In :data:`ARMS`, the guidance mode the run config names (``RLConfig.guidance``).
CONFIGURED = "<configured>"

#: The fixed precision plans an arm may name instead of the run's (``"run"``); ``quads`` takes the
#: run's compensation fraction (``RLConfig.quads_fraction``).
PLANS = {"4over6": PrecisionPlan.four_over_six, "mxfp4": PrecisionPlan.mxfp4, "w4a8": PrecisionPlan.w4a8,
         "fp8": PrecisionPlan.fp8, "quads": PrecisionPlan.quads, "w4a16": PrecisionPlan.w4a16}


@dataclasses.dataclass(frozen=True)
class ArmSpec:
    """One row of the arm table, before a run's guidance mode and model depth are known."""

    plan: PlanName | None  # the rollout's precision plan: the run's, a fixed preset, or None (BF16)
    guidance: str | None  # a GuidedMode name, CONFIGURED, or None (routing only); "<n>" from the arm name
    diagnostics: LayerSet | None  # layers whose full codes the rollout keeps, or None
    trainer: TrainerMode
    trainer_plan: PlanName | None = None  # the trainer's plan where it differs from the rollout's (QUADS)
    loss: PolicyLoss = PolicyLoss.GRPO  # the policy-gradient loss (tracefp4.rl.grpo.PolicyLoss)


#: The arm table. A name with ``<n>`` is a family (``trace-L<n>``: ``trace-L1``, ``trace-L2``, ...);
#: the number of the arm's name replaces ``<n>`` in its guidance.
ARMS: dict[str, ArmSpec] = {
    "bf16": ArmSpec(plan=None, guidance=None, diagnostics=None, trainer="bf16"),
    "qat": ArmSpec(plan="run", guidance=None, diagnostics="deeper", trainer="qat"),
    "trace": ArmSpec(plan="run", guidance=CONFIGURED, diagnostics="guided", trainer="trace"),
    "trace-full": ArmSpec(plan="run", guidance="full", diagnostics="all", trainer="trace"),
    # baselines
    "fp4-rollout": ArmSpec(plan="run", guidance=None, diagnostics=None, trainer="bf16"),
    "qat-4over6": ArmSpec(plan="4over6", guidance=None, diagnostics="deeper", trainer="qat"),
    "qat-mxfp4": ArmSpec(plan="mxfp4", guidance=None, diagnostics="deeper", trainer="qat"),
    "qat-w4a8": ArmSpec(plan="w4a8", guidance=None, diagnostics="deeper", trainer="qat"),
    # ablations
    "trace-L<n>": ArmSpec(plan="run", guidance="lsb@last<n>", diagnostics="guided", trainer="trace"),
    "trace-ldpc": ArmSpec(plan="run", guidance="ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all", diagnostics="guided",
                          trainer="trace"),
    "trace-4over6": ArmSpec(plan="4over6", guidance="lsb", diagnostics="guided", trainer="trace"),
    "trace-mxfp4": ArmSpec(plan="mxfp4", guidance="lsb", diagnostics="guided", trainer="trace"),
    "trace-w4a8": ArmSpec(plan="w4a8", guidance="lsb", diagnostics="guided", trainer="trace"),
    # the paper's two closest baselines, and FP8 rollouts
    "quads": ArmSpec(plan="quads", guidance=None, diagnostics=None, trainer="qat", trainer_plan="w4a16"),
    "score-centering": ArmSpec(plan="run", guidance=None, diagnostics="deeper", trainer="qat",
                               loss=PolicyLoss.SCORE_CENTERING),
    "trace-sc": ArmSpec(plan="run", guidance=CONFIGURED, diagnostics="guided", trainer="trace",
                        loss=PolicyLoss.SCORE_CENTERING),
    # qat-fp8 keeps full codes on every layer: trace-fp8 guides them all, and the two compare there
    "qat-fp8": ArmSpec(plan="fp8", guidance=None, diagnostics="all", trainer="qat"),
    "trace-fp8": ArmSpec(plan="fp8", guidance="lsb@all", diagnostics="guided", trainer="trace"),
}


def arm_spec(name: str) -> tuple[ArmSpec, int | None]:
    """The table row of arm ``name`` and the number its name carries (None for a plain name); a
    ValueError naming the arm for an unknown name or a number below 1."""
    if name in ARMS and "<n>" not in name:
        return ARMS[name], None
    for key, spec in ARMS.items():
        if "<n>" in key:
            m = re.fullmatch(re.escape(key).replace("<n>", "([0-9]+)"), name)
            if m is not None:
                n = int(m.group(1))
                if n < 1 or m.group(1) != str(n):
                    raise ValueError(f"arm {name!r}: n = {m.group(1)} must be a whole number >= 1 (as in {key})")
                return spec, n
    raise ValueError(f"unknown arm {name!r}; available: {', '.join(ARMS)}")


@dataclasses.dataclass(frozen=True)
class Arm:
    """An arm resolved for one run: what its rollout and trainer are called with."""

    name: str
    plan: PrecisionPlan | None
    guidance: GuidedMode | None
    diagnostics: frozenset[int]
    trainer: TrainerMode
    trainer_plan: PrecisionPlan | None = None  # None: the rollout's plan
    loss: PolicyLoss = PolicyLoss.GRPO

    @property
    def trainer_precision(self) -> PrecisionPlan | None:
        """The plan the trainer's forward runs (the rollout's unless the arm names another)."""
        return self.trainer_plan if self.trainer_plan is not None else self.plan

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (what a trainer process of tracefp4.rl.distributed is sent)."""
        return {
            "name": self.name,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "guidance": None if self.guidance is None else self.guidance.name,
            "diagnostics": sorted(self.diagnostics),
            "trainer": self.trainer,
            "trainer_plan": None if self.trainer_plan is None else self.trainer_plan.to_dict(),
            "loss": self.loss.value,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Arm:
        return cls(
            name=d["name"],
            plan=None if d["plan"] is None else PrecisionPlan(**d["plan"]),
            guidance=None if d["guidance"] is None else GuidedMode.parse(d["guidance"]),
            diagnostics=frozenset(d["diagnostics"]),
            trainer=d["trainer"],
            trainer_plan=None if d.get("trainer_plan") is None else PrecisionPlan(**d["trainer_plan"]),
            loss=PolicyLoss(d.get("loss", PolicyLoss.GRPO.value)),
        )


def _preset(name: PlanName, run: PrecisionPlan | None, quads_fraction: float) -> PrecisionPlan:
    if name == "run":
        return run if run is not None else PrecisionPlan()
    if name == "quads":
        return PrecisionPlan.quads(quads_fraction)
    return PLANS[name]()


def diagnostics_layers(which: LayerSet | Literal["none"] | None, n_layers: int, guided: frozenset[int]
                       ) -> frozenset[int]:
    """The layers a :data:`LayerSet` names on an ``n_layers``-layer model whose guided layers are
    ``guided`` (None and ``none``: no layer)."""
    return {None: frozenset(), "none": frozenset(), "deeper": deeper_half(n_layers),
            "all": frozenset(range(n_layers)), "guided": guided}[which]


def arm_rollout(name: str, *, guidance: str, plan: PrecisionPlan | None = None, quads_fraction: float = 0.5
                ) -> tuple[PrecisionPlan | None, GuidedMode | None]:
    """The rollout's precision plan and guidance mode of arm ``name`` (arguments as :func:`make_arm`'s),
    before a model's depth is known; a ValueError naming the arm, the plan and the guidance knob
    where the plan cannot carry the guidance (:func:`~tracefp4.engines.plan.check_supported`)."""
    spec, n = arm_spec(name)
    mode_name = guidance if spec.guidance == CONFIGURED else spec.guidance
    if mode_name is not None and n is not None:
        mode_name = mode_name.replace("<n>", str(n))
    mode = None if mode_name is None else GuidedMode.parse(mode_name)
    arm_plan = None if spec.plan is None else _preset(spec.plan, plan, quads_fraction)
    try:
        check_supported(arm_plan, mode)
    except ValueError as e:
        raise ValueError(f"arm {name!r}: {e}") from None
    return arm_plan, mode


def make_arm(name: str, *, guidance: str, n_layers: int, plan: PrecisionPlan | None = None,
             quads_fraction: float = 0.5) -> Arm:
    """Arm ``name`` of :data:`ARMS` for a model of ``n_layers`` layers; ``guidance`` is the run's
    configured mode (used by the arms whose table entry says CONFIGURED), ``plan`` the run's precision
    plan (default NVFP4 W4A4; used by the arms whose entry says ``run``), ``quads_fraction`` the share
    of channels the ``quads`` rollout compensates. A ValueError names the arm when it does not fit the
    model (e.g. ``trace-L9`` on a 2-layer model) or its plan cannot carry its guidance (:func:`arm_rollout`)."""
    spec, _ = arm_spec(name)
    arm_plan, mode = arm_rollout(name, guidance=guidance, plan=plan, quads_fraction=quads_fraction)
    try:
        guided = mode.layer_indices(n_layers) if mode is not None else frozenset()
    except ValueError as e:
        raise ValueError(f"arm {name!r} on a {n_layers}-layer model: {e}") from None
    diagnostics = diagnostics_layers(spec.diagnostics, n_layers, guided)
    trainer_plan = None if spec.trainer_plan is None else _preset(spec.trainer_plan, plan, quads_fraction)
    return Arm(name, arm_plan, mode, diagnostics, spec.trainer, trainer_plan, spec.loss)


# --- the spellings and views other modules use of these arms -------------------------------------

#: User-facing spellings of an arm of :data:`ARMS` that must keep working: the reports' JSON keys
#: (``trace_lsb``, ``trace_full``) and the scaling report's ``full`` and ``ldpc@all``. The canonical name is the key of
#: :data:`ARMS`; :func:`canonical_arm` maps an alias onto it.
ARM_ALIASES: dict[str, str] = {"trace_lsb": "trace", "trace_full": "trace-full", "full": "trace-full",
                               "ldpc@all": "trace-ldpc"}


def canonical_arm(name: str) -> str:
    """The :data:`ARMS` name of ``name`` (itself unless it is one of :data:`ARM_ALIASES`)."""
    return ARM_ALIASES.get(name, name)


#: The trace_plan names of the TRL integration: ``nvfp4`` (the run's default plan) and :data:`PLANS`.
PLAN_NAMES = ("nvfp4", *PLANS)
#: The FP4 trainer modes (vanilla QAT and guided).
FP4_TRAINER_MODES: tuple[TrainerMode, ...] = ("qat", "trace")
#: The trainer modes a single-arm integration offers (TRL's ``trace_mode``): the FP4 ones and the BF16 reference.
INTEGRATION_MODES: tuple[TrainerMode, ...] = ("bf16", *FP4_TRAINER_MODES)
#: The diagnostics layer sets an integration may name (TRL's ``trace_diagnostics``); ``none``: no codes kept.
DIAGNOSTICS_CHOICES: tuple[str, ...] = ("all", "deeper", "guided", "none")


def integration_rollout(plan_name: str, trainer: TrainerMode, guidance: str) -> tuple[PrecisionPlan, GuidedMode | None]:
    """The precision plan and the recorded guidance (``trace`` mode only; ``qat`` and ``bf16`` record
    routing alone) of a single-arm integration (TRL's ``trace_plan``, ``trace_mode`` and
    ``trace_guidance``); a ValueError naming the field for a bad value, and naming ``trace_plan``,
    ``trace_guidance`` and the knob where the plan cannot carry the guidance
    (:func:`~tracefp4.engines.plan.check_supported`)."""
    plan = plan_by_name(plan_name)
    if trainer not in INTEGRATION_MODES:
        raise ValueError(f"trace_mode = {trainer!r}: expected one of {', '.join(INTEGRATION_MODES)}")
    mode = GuidedMode.parse(guidance) if trainer == "trace" else None
    try:
        check_supported(plan, mode, field="trace_guidance")
    except ValueError as e:
        raise ValueError(f"trace_plan = {plan_name!r}: {e}") from None
    return plan, mode


def integration_arm(plan_name: str, trainer: TrainerMode, guidance: str, diagnostics: str, n_layers: int) -> Arm:
    """The one arm of a single-arm integration (TRL's ``trace_plan``, ``trace_mode``, ``trace_guidance``
    and ``trace_diagnostics``): the plan and guidance of :func:`integration_rollout`, full codes kept at
    the :data:`DIAGNOSTICS_CHOICES` layers. Named ``<plan>-<trainer>``, e.g. ``nvfp4-trace``; ``bf16``
    is the table's ``bf16`` arm (BF16 rollout and trainer, the reference)."""
    plan, mode = integration_rollout(plan_name, trainer, guidance)
    if diagnostics not in DIAGNOSTICS_CHOICES:
        raise ValueError(f"trace_diagnostics = {diagnostics!r}: expected one of {', '.join(DIAGNOSTICS_CHOICES)}")
    if trainer == "bf16":
        return make_arm("bf16", guidance=guidance, n_layers=n_layers)
    guided = mode.layer_indices(n_layers) if mode is not None else frozenset()
    return Arm(f"{plan_name}-{trainer}", plan, mode, diagnostics_layers(diagnostics, n_layers, guided), trainer)


def plan_by_name(name: str) -> PrecisionPlan:
    """The plan a :data:`PLAN_NAMES` name stands for (``nvfp4``: NVFP4 W4A4 and KV cache); a ValueError
    naming TRL's ``trace_plan`` for any other name."""
    if name == "nvfp4":
        return PrecisionPlan()
    if name not in PLANS:
        raise ValueError(f"trace_plan = {name!r}: expected one of {', '.join(PLAN_NAMES)}")
    return PLANS[name]()


#: The mismatch report's arms (its JSON keys, aliases of :data:`ARMS`): arm -> (rollout description,
#: trainer mode) under NVFP4.
MISMATCH_ARMS: dict[str, tuple[str, TrainerMode]] = {
    "bf16": ("bf16", "bf16"),
    "qat": ("fp4", "qat"),
    "trace_lsb": ("fp4 + lsb hints, deeper half", "trace"),
    "trace_full": ("fp4 + full hints, all layers", "trace"),
}
#: The mismatch report's ``--plan``: the precision plan it measures and the guidance of its lsb arm. The
#: FP8 lsb arm guides every layer: E4M3's step (1/8 to 1/16 relative) is small beside the drift that
#: unguided FP8 layers pass on, so lsb hints on the deeper half alone leave several per cent of its
#: codes apart.
REPORT_PLANS: dict[str, tuple[Callable[[], PrecisionPlan], str]] = {
    "nvfp4": (PrecisionPlan.w4a4, "lsb"),
    "fp8": (PrecisionPlan.fp8, "lsb@all"),
}
#: The scaling report's arms: arm -> guidance mode of its FP4 rollout and trainer (None: vanilla QAT;
#: "bf16": no FP4 at all). ``trace`` is the paper's compact cache (1 mantissa bit + scales on the deeper
#: half), ``ldpc@all`` the trace-ldpc arm's record, ``full`` the trace-full arm.
SCALING_ARMS: dict[str, str | None] = {
    "bf16": "bf16",
    "qat": None,
    "trace": "lsb",
    "lsb@all": "lsb@all",
    "ldpc@all": ARMS["trace-ldpc"].guidance,
    "full": "full@all",
}
#: The rollout benchmark's modes: mode -> (FP4 plan?, guidance mode name or None). ``fp4`` is the FP4
#: rollout of ``qat``; ``trace_lsb`` and ``trace_full`` are :data:`ARM_ALIASES`.
ROLLOUT_MODES: dict[str, tuple[bool, str | None]] = {
    "bf16": (False, None),
    "fp4": (True, None),
    "trace_lsb": (True, "lsb"),
    "trace_full": (True, "full"),
}

#: Plot style of each arm (the experiment's charts, the summary plots, the scaling figures): the
#: paper's arms solid, baselines dotted or dash-dot, ablations dashed.
ARM_STYLE: dict[str, dict[str, str]] = {
    "bf16": dict(color="black", linestyle="-"),
    "qat": dict(color="tab:red", linestyle="-"),
    "trace": dict(color="tab:blue", linestyle="-"),
    "trace-full": dict(color="tab:green", linestyle="--"),
    # baselines (dotted, dash-dot) and ablations (dashed) of the arm table
    "fp4-rollout": dict(color="tab:gray", linestyle=":"),
    "qat-4over6": dict(color="tab:orange", linestyle="-."),
    "qat-mxfp4": dict(color="tab:brown", linestyle="-."),
    "qat-w4a8": dict(color="tab:pink", linestyle="-."),
    "trace-4over6": dict(color="tab:orange", linestyle="--"),
    "trace-mxfp4": dict(color="tab:brown", linestyle="--"),
    "trace-w4a8": dict(color="tab:pink", linestyle="--"),
    "trace-ldpc": dict(color="tab:purple", linestyle="--"),
    "trace-L1": dict(color="tab:cyan", linestyle="--"),
    "trace-L2": dict(color="tab:olive", linestyle="--"),
    # the scaling report's lsb hints on every layer (trace-L<n> with n the model's depth)
    "lsb@all": dict(color="tab:cyan", linestyle="--"),
    # the paper's closest baselines and the FP8 arms
    "quads": dict(color="goldenrod", linestyle=":"),
    "score-centering": dict(color="darkviolet", linestyle=":"),
    "trace-sc": dict(color="darkviolet", linestyle="--"),
    "qat-fp8": dict(color="teal", linestyle="-."),
    "trace-fp8": dict(color="teal", linestyle="--"),
}
