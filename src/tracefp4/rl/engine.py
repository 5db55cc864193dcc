"""Every call the RL loop makes into ``tracefp4.engines``, in one place.

The loop (collect, update, evaluate, the rollout workers) states what it wants in the terms of an
:class:`Arm` (precision plan, guidance mode, diagnostics layers) and calls the functions here; only
this module knows how today's engine API spells that. Switching to the engine API of issue 9
(``generate(..., plan=, guidance=, diagnostics=)``, ``RolloutOutput.diagnostics``,
``forward_logprobs(..., capture_codes=frozenset)``, ``TrainerOutput.decode_failures``) is a change
to this file alone; the TODO(engine API) notes say what changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedModel

from tracefp4.engines.model import PrecisionPlan, model_layers
from tracefp4.engines.rollout import RolloutOutput, SamplingParams, generate
from tracefp4.engines.trainer import TrainerOutput, code_mismatch, forward_logprobs
from tracefp4.formats.constants import HintMode
from tracefp4.rl.arms import Arm

Records = list[dict[str, torch.Tensor]]


def rollout(model: PreTrainedModel, prompts: Sequence[Sequence[int]], sampling: SamplingParams, arm: Arm
            ) -> tuple[RolloutOutput, Records | None]:
    """Sample completions on the arm's serving path. Returns the rollout, whose ``records`` hold the
    routing of every MoE layer plus the arm's guidance at its guided layers, and the full-code
    diagnostics of each trajectory at the arm's diagnostics layers (None where there are none).

    TODO(engine API): ``roll = generate(model, prompts, sampling, plan=arm.plan, guidance=arm.guidance,
    diagnostics=arm.diagnostics)`` and return ``roll, (roll.diagnostics if arm.diagnostics else None)``.
    Until then: an arm with guidance records in its own mode (its diagnostics are the records only
    when that mode is ``full``: no code mismatch for the ``trace`` arm in a compact mode yet); an FP4
    arm without guidance (``qat``) records full codes at its diagnostics layers, which
    :func:`tracefp4.rl.arms.store_record` keeps out of the store.
    """
    n_layers, _ = model_layers(model)
    if arm.plan is None:
        return generate(model, prompts, sampling, mode="bf16", plan=PrecisionPlan()), None
    if arm.guidance is not None:
        layers, hint_mode = arm.guidance.layer_indices(n_layers), arm.guidance.mode
    else:
        layers, hint_mode = arm.diagnostics, HintMode.FULL
    roll = generate(model, prompts, sampling, mode="trace", plan=arm.plan, guided_layers=sorted(layers),
                    hint_mode=hint_mode)
    full_codes = roll.hint_mode is HintMode.FULL and bool(arm.diagnostics)
    return roll, (roll.records if full_codes else None)


def greedy(model: PreTrainedModel, prompts: Sequence[Sequence[int]], arm: Arm, *, max_new_tokens: int,
           stop_token_ids: Sequence[int]) -> RolloutOutput:
    """Greedy decoding on the arm's serving path, recording nothing but routing (evaluation).

    TODO(engine API): ``generate(model, prompts, sampling, plan=arm.plan, guidance=None)``."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=tuple(stop_token_ids))
    mode = "bf16" if arm.plan is None else "fp4"
    return generate(model, prompts, sampling, mode=mode, plan=arm.plan or PrecisionPlan())


def trainer_logprobs(model: PreTrainedModel, token_ids: Sequence[torch.Tensor], prompt_lens: Sequence[int],
                     records: Sequence[Mapping[str, torch.Tensor]], arm: Arm, *, temperature: float,
                     diagnostics: Records | None = None) -> TrainerOutput:
    """The trainer's log-probs of the completions, reading ``records`` (what reached the store) in the
    arm's trainer mode. With the rollout's ``diagnostics``, the trainer also reports its own codes at
    those layers (for :func:`code_mismatch_metrics`).

    TODO(engine API): ``forward_logprobs(model, token_ids, prompt_lens, records, mode=arm.trainer,
    plan=arm.plan, temperature=temperature, capture_codes=arm.diagnostics if diagnostics else frozenset())``.
    Until then codes are captured at the guided sites of the records the trainer is given, so the
    ``qat`` arm (whose stored records are routing only) is given the in-memory full records instead;
    it never reads their hints.
    """
    capture = diagnostics is not None
    given = diagnostics if capture and arm.trainer == "qat" else records
    return forward_logprobs(model, token_ids, prompt_lens, given, mode=arm.trainer,
                            plan=arm.plan or PrecisionPlan(), temperature=temperature, capture_codes=capture)


def code_mismatch_metrics(out: TrainerOutput, diagnostics: Records) -> dict[str, float]:
    """Share of FP4 codes at the diagnostics sites that the trainer picked differently from the
    rollout, and the share of those that are one codeword apart."""
    sites = code_mismatch(out.codes, diagnostics)
    total = sum(s.total for s in sites.values())
    mism = sum(s.mismatched for s in sites.values())
    one = sum(s.one_apart for s in sites.values())
    return {
        "code_mismatch_rate": mism / max(total, 1),
        "code_mismatch_one_apart_share": one / mism if mism else 1.0,
    }


def decode_failures(out: TrainerOutput) -> int:
    """Guidance records the trainer could not decode (rounded to nearest on the rollout's grid instead).

    TODO(engine API): ``out.decode_failures`` once TrainerOutput has it (0 until then)."""
    return int(getattr(out, "decode_failures", 0))
