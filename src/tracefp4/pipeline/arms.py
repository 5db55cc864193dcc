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
  n between 1 and the model's layers. E.g. ``trace-L1``.
* ``trace-all``: ``lsb`` guidance on every layer (``lsb@all``), diagnostics there: ``trace-L<n>`` with n
  the model's depth, under one name at every depth (the scaling report's grid varies the depth).
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
  (``loss``: :attr:`PolicyLoss.SCORE_CENTERING`) on the sampler's top-k log-probs.
* ``trace-sc``: TRACE (the run's guidance mode) with the Score Centering loss: the two act on
  different causes of the gap (the trainer's codes vs the sampler's drift term).
* ``qat-fp8``: W8A8 FP8 rollout (``PrecisionPlan.fp8()``: E4M3 weights with a scale per output
  channel, activations per row, KV cache per token and KV head) with a vanilla FP8 QAT trainer.
* ``trace-fp8``: the same with ``lsb`` hints on the E4M3 grid on **all** layers (``lsb@all``): the
  E4M3 step (1/8-1/16 relative) is small beside the drift that unguided FP8 layers pass on, so
  guiding the deeper half alone leaves 4-7% of its codes apart (``tracefp4 mismatch --plan fp8``).

Routing replay is on in every arm: the routing of every MoE layer always reaches the store.

Each row also carries what the outputs show of it (its label, one line of description, its plot style)
and its role (the paper's arm, a baseline, an ablation); a report's arms are a query over the rows
(:func:`report_arms`: the rows that name that report), not a table of their own. Plans are named by
:meth:`~tracefp4.engines.plan.PrecisionPlan.named`.

One name per arm: every output (the RL loop's files, the experiment summaries, the mismatch and scaling
reports' JSON, the rollout benchmarks' modes) writes an arm under its name in :data:`ARMS` (``trace``,
``trace-full``, ``trace-ldpc``, ``trace-all``; no second spelling). The benchmarks' modes that are no
arm's rollout name the engine's precision instead (``bf16``, ``fp4``: FP4 without guidance, the ``qat``
arm's rollout, since a benchmark has no trainer; ``fp8kv``: vLLM's FP8 K/V engine), see
:data:`ROLLOUT_MODES`.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from typing import Any, Literal

from tracefp4.engines.plan import PrecisionPlan, check_supported
from tracefp4.engines.trainer import TrainerMode
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.names import deeper_half

LayerSet = Literal["deeper", "guided", "all"]

#: In :data:`ARMS`, the guidance mode the run config names (``RLConfig.guidance``).
CONFIGURED = "<configured>"
#: The guidance mode :data:`CONFIGURED` stands for where no run names one (the reports, the benchmarks).
DEFAULT_GUIDANCE = "lsb"
#: In :data:`ARMS`, the run's precision plan (NVFP4 W4A4 unless a caller gives another).
RUN_PLAN = "run"


class PolicyLoss(str, enum.Enum):
    """The policy-gradient loss an arm's trainer minimises, per generated token t of trajectory b
    (advantage ``A_b``; ``w_t`` the detached importance weight of :class:`~tracefp4.rl.grpo.ISMode`, by default
    ``min(pi_old / pi_rollout, cap)``)."""

    GRPO = "grpo"
    """``-w_t * min(r_t A_b, clip(r_t, 1 - clip_low, 1 + clip_high) A_b)`` with ``r_t = pi / pi_old`` and
    ``cap = is_cap`` (:func:`tracefp4.rl.grpo.grpo_loss`)."""

    SCORE_CENTERING = "score-centering"
    """Score Centering (arXiv 2609.20807): REINFORCE with the sampler-expected score subtracted,
    ``-w_t * A_b * (log p(y_t) - c_t)`` with ``c_t = sum_{v in K_t} q_v log p_v + (1 - Q_t) log(1 - P_t)``
    over the sampler's top-k tokens ``K_t`` (``q`` the sampler's probabilities, ``Q_t``/``P_t`` the
    sampler's and the trainer's mass on ``K_t``, the tail outside ``K_t`` modelled as ``p`` rescaled to
    the sampler's tail mass), no ratio clip, ``cap = sc_is_cap`` (default 2)
    (:func:`tracefp4.rl.score_centering.score_centering_loss`). The gradient of ``c_t`` is
    ``E_q[grad log p]`` (exactly so when ``q`` is ``p`` on the tail), the drift term of a mismatched
    sampler, which the centering removes; only ``Cov_q(A, grad log p)`` is left."""


class Role(enum.Flag):
    """What an arm is in the comparison (one flag per row; the docs and charts group by it)."""

    PAPER = enum.auto()  # the paper's arms: solid lines
    BASELINE = enum.auto()  # what others do instead: dotted or dash-dot lines
    ABLATION = enum.auto()  # TRACE variants: dashed lines


#: The reports whose arms are rows of the table (:func:`report_arms`): the mismatch report, the scaling
#: report and the rollout benchmarks' modes.
Report = Literal["mismatch", "scaling", "rollout"]


@dataclasses.dataclass(frozen=True)
class ArmSpec:
    """One row of the arm table, before a run's guidance mode and model depth are known."""

    plan: str | None  # the rollout's plan: RUN_PLAN, a PrecisionPlan.named name, or None (BF16)
    guidance: str | None  # a GuidedMode name, CONFIGURED, or None (routing only); "<n>" from the arm name
    diagnostics: LayerSet | None  # layers whose full codes the rollout keeps, or None
    trainer: TrainerMode
    role: Role
    label: str  # the arm in a table column or a legend
    description: str  # one line: what the rollout and the trainer do
    style: tuple[str, str]  # plot (color, linestyle)
    trainer_plan: str | None = None  # the trainer's plan where it differs from the rollout's (QUADS)
    loss: PolicyLoss = PolicyLoss.GRPO
    # the reports that run this arm (under its name)
    reports: frozenset[str] = frozenset()
    # a family's members that have a plot style of their own: the number in the name -> (color, linestyle)
    member_styles: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "trainer", TrainerMode(self.trainer))


def _row(plan, guidance, diagnostics, trainer, role, label, description, style, **more) -> ArmSpec:
    return ArmSpec(plan, guidance, diagnostics, TrainerMode(trainer), role, label, description, style, **more)


_P, _B, _A = Role.PAPER, Role.BASELINE, Role.ABLATION

#: The arm table. A name with ``<n>`` is a family (``trace-L<n>``: ``trace-L1``, ``trace-L2``, ...);
#: the number of the arm's name replaces ``<n>`` in its guidance. Its order is the order of every
#: summary and chart.
ARMS: dict[str, ArmSpec] = {
    "bf16": _row(None, None, None, "bf16", _P, "bf16", "BF16 rollout, BF16 trainer", ("black", "-"),
                 reports=frozenset({"mismatch", "scaling", "rollout"})),
    "qat": _row(RUN_PLAN, None, "deeper", "qat", _P, "qat", "FP4 rollout, round-to-nearest QAT trainer",
                ("tab:red", "-"), reports=frozenset({"mismatch", "scaling", "rollout"})),
    "trace": _row(RUN_PLAN, CONFIGURED, "guided", "trace", _P, "trace",
                  "FP4 rollout recording the run's guidance, guided trainer", ("tab:blue", "-"),
                  reports=frozenset({"mismatch", "scaling", "rollout"})),
    # full@all: the layers are named, as the scaling report's metadata writes them ("full" is on all layers)
    "trace-full": _row(RUN_PLAN, "full@all", "all", "trace", _P, "trace-full",
                       "FP4 rollout recording full codes on all layers, guided trainer", ("tab:green", "--"),
                       reports=frozenset({"mismatch", "scaling", "rollout"})),
    # baselines
    "fp4-rollout": _row(RUN_PLAN, None, None, "bf16", _B, "fp4-rollout",
                        "FP4 rollout, BF16 trainer (verl / FlashRL)", ("tab:gray", ":")),
    "qat-4over6": _row("4over6", None, "deeper", "qat", _B, "qat-4over6", "qat with Four over Six block scales",
                       ("tab:orange", "-.")),
    "qat-mxfp4": _row("mxfp4", None, "deeper", "qat", _B, "qat-mxfp4", "qat in MXFP4", ("tab:brown", "-.")),
    "qat-w4a8": _row("w4a8", None, "deeper", "qat", _B, "qat-w4a8", "qat in W4A8", ("tab:pink", "-.")),
    # ablations
    "trace-4over6": _row("4over6", "lsb", "guided", "trace", _A, "trace-4over6",
                         "lsb guidance under Four over Six scales", ("tab:orange", "--")),
    "trace-mxfp4": _row("mxfp4", "lsb", "guided", "trace", _A, "trace-mxfp4", "lsb guidance in MXFP4",
                        ("tab:brown", "--")),
    "trace-w4a8": _row("w4a8", "lsb", "guided", "trace", _A, "trace-w4a8", "lsb guidance in W4A8", ("tab:pink", "--")),
    "trace-ldpc": _row(RUN_PLAN, "ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all", "guided", "trace", _A, "trace-ldpc",
                       "the compact LDPC record on all layers", ("tab:purple", "--"), reports=frozenset({"scaling"})),
    "trace-L<n>": _row(RUN_PLAN, "lsb@last<n>", "guided", "trace", _A, "trace-L<n>", "lsb guidance on the last n layers",
                       ("tab:cyan", "--"), member_styles={"1": ("tab:cyan", "--"), "2": ("tab:olive", "--")}),
    # trace-L<n> at n = the depth, one name at every depth (the scaling report's grid varies it)
    "trace-all": _row(RUN_PLAN, "lsb@all", "guided", "trace", _A, "trace-all", "lsb guidance on every layer",
                      ("tab:cyan", "--"), reports=frozenset({"scaling"})),
    # the paper's two closest baselines, and FP8 rollouts
    "quads": _row("quads", None, None, "qat", _B, "quads",
                  "QUADS: W4A4 rollout with residual compensation, W4A16 QAT trainer", ("goldenrod", ":"),
                  trainer_plan="w4a16"),
    "score-centering": _row(RUN_PLAN, None, "deeper", "qat", _B, "score-centering",
                            "FP4 rollout, QAT trainer with the Score Centering loss", ("darkviolet", ":"),
                            loss=PolicyLoss.SCORE_CENTERING),
    "trace-sc": _row(RUN_PLAN, CONFIGURED, "guided", "trace", _A, "trace-sc", "trace with the Score Centering loss",
                     ("darkviolet", "--"), loss=PolicyLoss.SCORE_CENTERING),
    # qat-fp8 keeps full codes on every layer: trace-fp8 guides them all, and the two compare there
    "qat-fp8": _row("fp8", None, "all", "qat", _B, "qat-fp8", "W8A8 FP8 rollout, FP8 QAT trainer", ("teal", "-.")),
    "trace-fp8": _row("fp8", "lsb@all", "guided", "trace", _A, "trace-fp8", "lsb guidance on the E4M3 grid, all layers",
                      ("teal", "--")),
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "trainer", TrainerMode(self.trainer))

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
            "trainer": self.trainer.value,
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
            trainer=TrainerMode(d["trainer"]),
            trainer_plan=None if d.get("trainer_plan") is None else PrecisionPlan(**d["trainer_plan"]),
            loss=PolicyLoss(d.get("loss", PolicyLoss.GRPO.value)),
        )


def _plan(name: str, run: PrecisionPlan | None, quads_fraction: float) -> PrecisionPlan:
    if name == RUN_PLAN:
        return run if run is not None else PrecisionPlan()
    return PrecisionPlan.named(name, quads_fraction=quads_fraction)


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
    arm_plan = None if spec.plan is None else _plan(spec.plan, plan, quads_fraction)
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
    trainer_plan = None if spec.trainer_plan is None else _plan(spec.trainer_plan, plan, quads_fraction)
    return Arm(name, arm_plan, mode, diagnostics, spec.trainer, trainer_plan, spec.loss)


# --- the views the reports, the charts and the integrations take of the table ----------------------


def report_arms(report: Report) -> tuple[str, ...]:
    """The arms ``report`` runs, in table order."""
    return tuple(name for name, spec in ARMS.items() if report in spec.reports)


def rollout_guidance(spec: ArmSpec, n: str | None = None) -> str | None:
    """The guidance mode name a row's rollout records where no run configures one (:data:`CONFIGURED`:
    :data:`DEFAULT_GUIDANCE`), with a family's ``<n>`` replaced by ``n``."""
    if spec.guidance is None:
        return None
    mode = DEFAULT_GUIDANCE if spec.guidance == CONFIGURED else spec.guidance
    return mode if n is None else mode.replace("<n>", n)


#: The scaling report's columns: least recorded first, the full-code reference every other arm's codes
#: are compared with last.
_SCALING_COLUMNS = ("bf16", "qat", "trace", "trace-all", "trace-ldpc", "trace-full")
#: The scaling report's arms: name -> the guidance mode of its FP4 rollout and trainer (None: vanilla
#: QAT; ``bf16``: no FP4 at all).
SCALING_ARMS: dict[str, str | None] = {
    name: "bf16" if ARMS[name].plan is None else rollout_guidance(ARMS[name])
    for name in sorted(report_arms("scaling"), key=_SCALING_COLUMNS.index)
}


def rollout_mode(name: str) -> str:
    """The rollout benchmarks' mode of arm ``name``: the arm's name where its rollout records guidance,
    else its rollout's precision (``bf16``, ``fp4``): a benchmark runs no trainer, so an unguided FP4
    rollout is not ``qat``'s more than any other FP4 arm's."""
    spec = ARMS[name]
    if spec.guidance is not None:
        return name
    return "bf16" if spec.plan is None else "fp4"


#: The rollout benchmarks' modes: mode (:func:`rollout_mode`) -> (an FP4 plan?, the guidance mode name or None).
ROLLOUT_MODES: dict[str, tuple[bool, str | None]] = {
    rollout_mode(name): (ARMS[name].plan is not None, rollout_guidance(ARMS[name])) for name in report_arms("rollout")
}


def arm_style(name: str) -> dict[str, str] | None:
    """The plot style (``color``, ``linestyle``) of arm ``name`` (an arm, or a family member with a style
    of its own); None for a name the table does not style."""
    try:
        spec, number = arm_spec(name)
    except ValueError:
        return None
    style = spec.style if number is None else spec.member_styles.get(str(number))
    return None if style is None else dict(color=style[0], linestyle=style[1])


#: The arms every chart and summary lists first, in this order (the rest follow by name): the plain rows
#: in table order, each styled family member at its family's place.
CHART_ORDER: tuple[str, ...] = tuple(
    member for name, spec in ARMS.items()
    for member in ([name] if "<n>" not in name else [name.replace("<n>", n) for n in spec.member_styles])
)


# --- a single-arm integration (TRL) --------------------------------------------------------------

#: The trainer modes a single-arm integration offers (TRL's ``trace_mode``): the FP4 ones and the BF16 reference.
INTEGRATION_MODES: tuple[str, ...] = tuple(m.value for m in TrainerMode)
#: The diagnostics layer sets an integration may name (TRL's ``trace_diagnostics``); ``none``: no codes kept.
DIAGNOSTICS_CHOICES: tuple[str, ...] = ("all", "deeper", "guided", "none")


def integration_rollout(plan_name: str, trainer: str, guidance: str) -> tuple[PrecisionPlan, GuidedMode | None]:
    """The precision plan and the recorded guidance (``trace`` mode only; ``qat`` and ``bf16`` record
    routing alone) of a single-arm integration (TRL's ``trace_plan``, ``trace_mode`` and
    ``trace_guidance``); a ValueError naming the field for a bad value, and naming ``trace_plan``,
    ``trace_guidance`` and the knob where the plan cannot carry the guidance
    (:func:`~tracefp4.engines.plan.check_supported`)."""
    try:
        plan = PrecisionPlan.named(plan_name)
    except ValueError as e:
        raise ValueError(f"trace_plan = {plan_name!r}: {str(e).split(': ', 1)[1]}") from None
    if trainer not in INTEGRATION_MODES:
        raise ValueError(f"trace_mode = {trainer!r}: expected one of {', '.join(INTEGRATION_MODES)}")
    mode = GuidedMode.parse(guidance) if trainer == TrainerMode.TRACE else None
    try:
        check_supported(plan, mode, field="trace_guidance")
    except ValueError as e:
        raise ValueError(f"trace_plan = {plan_name!r}: {e}") from None
    return plan, mode


def integration_arm(plan_name: str, trainer: str, guidance: str, diagnostics: str, n_layers: int) -> Arm:
    """The one arm of a single-arm integration (TRL's ``trace_plan``, ``trace_mode``, ``trace_guidance``
    and ``trace_diagnostics``): the plan and guidance of :func:`integration_rollout`, full codes kept at
    the :data:`DIAGNOSTICS_CHOICES` layers. Named ``<plan>-<trainer>``, e.g. ``nvfp4-trace``; ``bf16``
    is the table's ``bf16`` arm (BF16 rollout and trainer, the reference)."""
    plan, mode = integration_rollout(plan_name, trainer, guidance)
    if diagnostics not in DIAGNOSTICS_CHOICES:
        raise ValueError(f"trace_diagnostics = {diagnostics!r}: expected one of {', '.join(DIAGNOSTICS_CHOICES)}")
    if trainer == TrainerMode.BF16:
        return make_arm("bf16", guidance=guidance, n_layers=n_layers)
    guided = mode.layer_indices(n_layers) if mode is not None else frozenset()
    return Arm(f"{plan_name}-{trainer}", plan, mode, diagnostics_layers(diagnostics, n_layers, guided),
               TrainerMode(trainer))
