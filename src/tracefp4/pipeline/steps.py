"""The steps of the pipeline: a rollout through the store, the trainer's forward spec, and weight sync.

Every caller (the RL loop's collect, update, evaluate and rollout workers, the TRL integration, the
reports through :func:`tracefp4.pipeline.measure.run_arms`) states what it wants in the terms of an
:class:`~tracefp4.pipeline.arms.Arm` (precision plan, guidance mode, diagnostics layers), or of a plan
and a guidance mode alone, and calls the functions here. The rollout of one store step
(:func:`rollout_step`: discard, generate, seal, read back) is the store's whole life cycle in one call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedModel

from tracefp4.engines.contract import quantizer_contract
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutEngine, RolloutOutput, SamplingParams, StoreTarget
from tracefp4.engines.trainer import TrainerMode, TrainerOutput, TrainerSpec, code_mismatch, forward_logprobs
from tracefp4.faults import crash_point
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.store import StoreReader, discard_step, seal_step
from tracefp4.pipeline.arms import Arm
from tracefp4.pipeline.factory import EngineKind, make_engine
from tracefp4.pipeline.metrics import Name, mismatch_summary
from tracefp4.seeds import TrajectoryIds, trajectory_ids

Records = list[dict[str, torch.Tensor]]


def model_signature(model: PreTrainedModel, plan: PrecisionPlan | None) -> str:
    """What the store checks that writer and reader agree on: the model config and precision plan."""
    cfg = json.dumps(model.config.to_diff_dict(), sort_keys=True, default=str)
    return hashlib.sha256(f"{cfg}|{plan}".encode()).hexdigest()[:16]


def serving_engine(kind: EngineKind, model: PreTrainedModel, *, max_len: int, **vllm_kwargs) -> RolloutEngine:
    """The run's rollout engine (:func:`~tracefp4.pipeline.factory.make_engine`). A vLLM engine keeps its
    BF16 expert weights beside the prepared FP4 ones unless told otherwise, since one engine serves
    every arm, BF16 ones included."""
    if kind is EngineKind.VLLM:
        vllm_kwargs.setdefault("keep_bf16", True)
    return make_engine(kind, model, max_len=max_len, **vllm_kwargs)


def sync(serving: RolloutEngine, model: PreTrainedModel, key: tuple[str, int]) -> None:
    """Give ``serving`` the trainer's current weights as policy version ``key[1]`` (``key``: the arm's
    name and the version), unless it serves the trainer's own model object (whose rows then take the
    store target's version, :mod:`tracefp4.engines.sink`) or already holds the weights of ``key``."""
    if getattr(serving, "model", None) is model or getattr(serving, "synced", None) == key:
        return
    serving.load_weights({k: v.detach() for k, v in model.state_dict().items()}, key[1])
    serving.synced = key


def rollout(serving: RolloutEngine, prompts: Sequence[Sequence[int]], sampling: SamplingParams, arm: Arm,
            *, store: StoreTarget | None = None) -> tuple[RolloutOutput, Records | None]:
    """Sample completions on the arm's serving path. The records hold the routing of every MoE layer
    plus the arm's guidance at its guided layers (nothing else: what an arm does not use is never
    recorded); with ``store`` the engine writes them into the store itself and the rollout comes back
    without them. Returns the rollout and the full-code diagnostics of each trajectory at the arm's
    diagnostics layers (in memory only; None where there are none, or where the engine kept them in
    other processes)."""
    roll = serving.generate(prompts, sampling, plan=arm.plan, guidance=arm.guidance, diagnostics=arm.diagnostics,
                            store=store)
    return roll, (roll.diagnostics if arm.diagnostics and roll.diagnostics else None)


@dataclasses.dataclass
class StepRollout:
    """One rollout written to the store as one sealed step, and what came back."""

    rollout: RolloutOutput  # without records: they went to the store
    diagnostics: Records | None  # the rollout's full codes at the arm's diagnostics layers (in memory)
    records: Records | None  # as read back from the store (None: not read back)
    timings: dict[str, float]  # time/rollout_s, time/store_write_s (sealing included), time/store_read_s
    # each record's per-row policy versions as read back (int64 [T]; None: not read back)
    versions: list[torch.Tensor] | None = None


#: The writer, model signature and policy version of a store step that :func:`rollout_step` is given as
#: a folder (one process writing one step of its own model).
LOCAL_WRITER, LOCAL_SIGNATURE, LOCAL_POLICY_VERSION = "w0", "local", 0


def step_arm(plan: PrecisionPlan | None, guidance: GuidedMode | str | None,
             diagnostics: frozenset[int] = frozenset()) -> Arm:
    """The arm of a rollout named by its plan and guidance alone (its trainer: guided where the rollout
    records guidance, round to nearest under a plan, BF16 without one)."""
    mode = GuidedMode.parse(guidance) if isinstance(guidance, str) else guidance
    trainer = TrainerMode.TRACE if mode is not None else TrainerMode.QAT if plan is not None else TrainerMode.BF16
    return Arm("custom", plan, mode, frozenset(diagnostics), trainer)


def rollout_step(serving: RolloutEngine, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 arm: Arm | None = None, target: StoreTarget | str | os.PathLike[str] | None = None, *,
                 plan: PrecisionPlan | None = None, guidance: GuidedMode | str | None = None,
                 diagnostics: frozenset[int] = frozenset(), read_back: bool = True) -> StepRollout:
    """The rollout of one store step: discard what an interrupted run may have left of the step,
    generate on the arm's serving path with the engine writing the records, seal the step, and read
    the records back (signature, policy version and the arm's quantizer contract checked) with their
    per-row versions unless ``read_back`` is off (a caller that reads rows lazily). ``serving`` may write under several writers (a pool of worker processes,
    :meth:`~tracefp4.rl.workers.RolloutPool.writer_ids`); the step is sealed with all of them.

    The rollout is an ``arm``, or (no arm) the ``plan``, ``guidance`` and ``diagnostics`` layers
    themselves (:func:`step_arm`). ``target`` is a store writer, or a store folder: step 0 of that
    folder, written by one writer (:data:`LOCAL_WRITER`) for :data:`LOCAL_SIGNATURE`."""
    if arm is None:
        arm = step_arm(plan, guidance, diagnostics)
    elif plan is not None or guidance is not None or diagnostics:
        raise ValueError(f"rollout_step: arm {arm.name!r} names its plan, guidance and diagnostics; pass one or the other")
    if target is None:
        raise ValueError("rollout_step: the records need a store target (a StoreTarget or a store folder)")
    if not isinstance(target, StoreTarget):
        ids = trajectory_ids(TrajectoryIds.REPORT, len(prompts))
        target = StoreTarget(os.fspath(target), 0, LOCAL_WRITER, ids, LOCAL_SIGNATURE, LOCAL_POLICY_VERSION)
    root, step = target.root, target.step
    discard_step(root, step)
    t0 = time.perf_counter()
    roll, diagnostics_out = rollout(serving, prompts, sampling, arm, store=target)
    elapsed = time.perf_counter() - t0
    timings = {"time/store_write_s": roll.timings.get("store_write_s", 0.0)}
    timings["time/rollout_s"] = roll.timings.get("generate_s", elapsed - timings["time/store_write_s"])
    t0 = time.perf_counter()
    writer_ids = getattr(serving, "writer_ids", None)  # a pool names its workers' writers
    seal_step(root, step, writer_ids(target) if writer_ids is not None else [target.writer_id])
    crash_point("sealed")  # the step is sealed, not yet consumed
    timings["time/store_write_s"] += time.perf_counter() - t0
    records = versions = None
    if read_back:
        t0 = time.perf_counter()
        with StoreReader(root, step, model_signature=target.model_signature, policy_version=target.policy_version,
                         contract=quantizer_contract(arm.plan, arm.guidance)) as r:
            records = r.batch(list(target.traj_ids), [t.numel() for t in roll.token_ids])
            versions = [r.versions(t) for t in target.traj_ids]
        timings["time/store_read_s"] = time.perf_counter() - t0
    return StepRollout(roll, diagnostics_out, records, timings, versions)


def greedy(serving: RolloutEngine, prompts: Sequence[Sequence[int]], arm: Arm, *, max_new_tokens: int,
           stop_token_ids: Sequence[int]) -> RolloutOutput:
    """Greedy decoding on the arm's serving path, recording nothing but routing (evaluation)."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=tuple(stop_token_ids))
    return serving.generate(prompts, sampling, plan=arm.plan, guidance=None)


def trainer_logprobs(model: PreTrainedModel, token_ids: Sequence[torch.Tensor], prompt_lens: Sequence[int],
                     records: Sequence[Mapping[str, torch.Tensor]], arm: Arm, *, temperature: float,
                     diagnostics: Records | None = None) -> TrainerOutput:
    """The trainer's log-probs of the completions, reading ``records`` (what reached the store) in the
    arm's trainer mode. With the rollout's ``diagnostics``, the trainer also reports its own codes at
    the arm's diagnostics layers (for :func:`code_mismatch_metrics`)."""
    return forward_logprobs(model, token_ids, prompt_lens, records,
                            trainer_spec(arm, temperature=temperature, capture=diagnostics is not None))


def trainer_spec(arm: Arm, *, temperature: float, capture: bool = False) -> TrainerSpec:
    """The arm's trainer forward: its mode and plan (:attr:`~tracefp4.pipeline.arms.Arm.trainer_precision`:
    QUADS' trainer runs W4A16 beside its W4A4 rollout), and (``capture``) its codes at the arm's
    diagnostics layers."""
    return TrainerSpec(arm.trainer, arm.trainer_precision, temperature,
                       capture_codes=arm.diagnostics if capture else frozenset())


def code_mismatch_metrics(out: TrainerOutput, diagnostics: Records) -> dict[str, float]:
    """Share of FP4 codes at the diagnostics sites that the trainer picked differently from the
    rollout, and the share of those that are one codeword apart."""
    # the loop's records keep 0 and 1 for an empty denominator
    s = mismatch_summary(code_mismatch(out.codes, diagnostics).values(), empty_rate=0.0, empty_share=1.0)
    return {name: s[name] for name in (Name.CODE_MISMATCH, Name.ONE_APART)}


def decode_failures(out: TrainerOutput) -> int:
    """Guidance blocks the trainer could not decode (rounded to nearest on the rollout's grid instead)."""
    return out.decode_failures
