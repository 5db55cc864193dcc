"""What every report measures: arms run over one model and prompts (:func:`run_arms`: each arm's
rollout through the guidance store and its trainer on what the store returned), the log-prob gap of a
trainer against its rollout, and the store's byte accounting (code mismatch is summarised by
:func:`tracefp4.pipeline.metrics.mismatch_summary`).

The reports push their rollouts' records through the real store (written, sealed, read back with
checksums verified) so that the trainer consumes what a distributed run would hand it and the byte
figures are the store's own (``docs/contracts.md`` section 4).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tracefp4.engines.model import model_layers
from tracefp4.engines.plan import routed_expert_count
from tracefp4.engines.protocol import RolloutEngine, RolloutOutput, SamplingParams
from tracefp4.engines.sink import StoreTarget
from tracefp4.engines.trainer import TrainerOutput, forward_logprobs
from tracefp4.guidance.names import layer_tag
from tracefp4.guidance.store import StoreReader, bytes_per_token, parse_name
from tracefp4.pipeline.arms import Arm
from tracefp4.pipeline.factory import EngineKind, make_engine
from tracefp4.pipeline.metrics import Name, logprob_gap
from tracefp4.pipeline.steps import rollout_step, trainer_spec
from tracefp4.seeds import TrajectoryIds, trajectory_ids

__all__ = [
    "POLICY_VERSION",
    "WRITER",
    "config_signature",
    "store_root",
    "gap",
    "same_rollout",
    "ArmRun",
    "run_arms",
    "store_bytes",
    "model_section",
    "mlp_text",
]

#: The reports never update the weights: every record belongs to policy version 0.
POLICY_VERSION = 0
#: The one writer of every store step a report writes.
WRITER = "mismatch-report"


def config_signature(prefix: str, config) -> str:
    """A store model signature from the full model config (the store refuses records of another model)."""
    return f"{prefix}:" + hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16]


@contextlib.contextmanager
def store_root(store_dir: str | os.PathLike[str] | None, prefix: str) -> Iterator[Path]:
    """``store_dir`` as given (kept), or a temporary folder removed on exit."""
    if store_dir is not None:
        yield Path(store_dir)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


# --- log-prob gap --------------------------------------------------------------------------------

#: The log-prob gap metrics of :func:`gap`, in its keys' order.
GAP_METRICS = (Name.GAP_MEAN, Name.GAP_MAX, Name.K3_KL, Name.KL, Name.LOG_PPL_DIFF)


def _padded(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(s.numel() for s in seqs)
    out = torch.zeros(len(seqs), width, dtype=torch.float32)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, s in enumerate(seqs):
        out[b, : s.numel()] = s.detach().float()
        mask[b, : s.numel()] = True
    return out, mask


def gap(rollout: RolloutOutput, trainer: TrainerOutput) -> dict[str, float]:
    """Trainer vs rollout log-probs over the completion tokens (``docs/contracts.md`` section 5)."""
    lr, mask = _padded(rollout.logprobs)
    lt, mask_t = trainer.padded()
    if not torch.equal(mask, mask_t):
        raise RuntimeError("trainer and rollout disagree on the completion lengths")
    m = logprob_gap(lr, lt.detach().float(), mask)
    return {**{k: m[k] for k in GAP_METRICS}, "tokens": int(mask.sum())}


def same_rollout(a: RolloutOutput, b: RolloutOutput) -> bool:
    """Same tokens and same routing records (what the trainer's replay consumes)."""
    return all(torch.equal(x, y) for x, y in zip(a.token_ids, b.token_ids)) and all(
        torch.equal(x[k], y[k]) for x, y in zip(a.records, b.records) for k in x if k.endswith(".routing")
    )


# --- the store round trip ------------------------------------------------------------------------


@dataclasses.dataclass
class ArmRun:
    """One arm run over a report's prompts: its rollout through the store and its trainer."""

    arm: Arm
    step: int  # the store step its records went to (for :func:`store_bytes`)
    rollout: RolloutOutput  # ``records``: as read back from the store; ``diagnostics``: in memory
    trainer: TrainerOutput | None  # the arm's trainer on those records (None: not asked for)


def run_arms(model, prompts: Sequence[Sequence[int]], sampling: SamplingParams, arms: Mapping[str, Arm], root: Path,
             signature: str, *, engine: RolloutEngine | None = None, first_step: int = 0, trainers: bool = True,
             phase: Callable[[str], contextlib.AbstractContextManager] | None = None, trainer_model=None,
             values: bool = False) -> dict[str, ArmRun]:
    """Each arm of ``arms`` (report key -> arm, in order) over the same prompts and sampler seed: its
    rollout through the store (:func:`~tracefp4.pipeline.steps.rollout_step`, one sealed step each from
    ``first_step``, records read back with checksums verified) on ``engine`` (None: ours on ``model``),
    then (``trainers``) its trainer on what the store returned, in the arm's mode and plan at the
    sampler's temperature, capturing its codes (and with ``values`` the values it quantized) at the
    arm's diagnostics layers. The trainer runs ``trainer_model`` (None: ``model``; a lag replay gives
    it later weights of the same model). ``phase`` names and times each part (a context manager per name)."""
    serving = engine if engine is not None else make_engine(EngineKind.HOME, model)
    phase = phase or (lambda name: contextlib.nullcontext())
    ids = tuple(trajectory_ids(TrajectoryIds.REPORT, len(prompts)))
    runs: dict[str, ArmRun] = {}
    for step, (key, arm) in enumerate(arms.items(), start=first_step):
        with phase(f"rollout {key}"):
            out = rollout_step(serving, prompts, sampling, arm, StoreTarget(str(root), step, WRITER, ids, signature,
                                                                            POLICY_VERSION))
        roll = dataclasses.replace(out.rollout, records=out.records, diagnostics=out.diagnostics or [])
        runs[key] = ArmRun(arm, step, roll, None)
        if trainers:
            with phase(f"trainer {key} ({arm.trainer.value})"), torch.no_grad():
                # the engines report log-probs at temperature 1 for greedy sampling (SamplingParams)
                temperature = sampling.temperature if sampling.temperature > 0 else 1.0
                spec = dataclasses.replace(trainer_spec(arm, temperature=temperature, capture=True),
                                           capture_values=values and bool(arm.diagnostics))
                runs[key].trainer = forward_logprobs(model if trainer_model is None else trainer_model,
                                                     roll.token_ids, roll.prompt_lens, roll.records, spec)
    return runs


def _guidance_split(reader: StoreReader) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """Guidance bytes (routing excluded) by site then layer, and by field, from the manifests."""
    by_site_layer: dict[str, dict[str, int]] = {}
    by_field: dict[str, int] = {}
    for m in reader.manifests:
        for t in m.trajectories.values():
            for name, tm in t.tensors.items():
                layer, site, fld = parse_name(name)
                if site == "routing":
                    continue
                d = by_site_layer.setdefault(site, {})
                d[layer_tag(layer)] = d.get(layer_tag(layer), 0) + tm.nbytes
                by_field[fld] = by_field.get(fld, 0) + tm.nbytes
    return by_site_layer, by_field


def store_bytes(root: Path, step: int, signature: str) -> dict[str, Any]:
    """The store's accounting, plus guidance bytes per token split by (site, layer) and by field."""
    with StoreReader(root, step, model_signature=signature, policy_version=POLICY_VERSION) as r:
        acc = bytes_per_token(r)
        by_site_layer, by_field = _guidance_split(r)
    gen = acc["generated_tokens"]
    if sum(sum(d.values()) for d in by_site_layer.values()) != acc["guidance_bytes"]:
        raise RuntimeError("store accounting: the (site, layer) split does not add up to the guidance bytes")
    acc["by_site_layer"] = {s: {k: b / gen for k, b in sorted(d.items())} for s, d in sorted(by_site_layer.items())}
    acc["by_field"] = {f: b / gen for f, b in sorted(by_field.items())}
    acc["by_layer"] = {layer_tag(k): v for k, v in acc["by_layer"].items()}
    acc["routing_by_layer"] = {layer_tag(k): v for k, v in acc["routing_by_layer"].items()}
    return acc


def model_section(model) -> dict[str, Any]:
    """The model a report measured, as every report's JSON names it (MoE or dense)."""
    cfg = model.config
    n_layers, moe = model_layers(model)
    return {
        "model_type": cfg.model_type,
        "layers": n_layers,
        "moe_layers": list(moe),
        "experts": routed_expert_count(cfg) or None,
        "top_k": getattr(cfg, "num_experts_per_tok", None),
        "hidden": cfg.hidden_size,
        "moe_intermediate": getattr(cfg, "moe_intermediate_size", None),
        # a dense model's MLP width (None for a MoE, whose dense-layer MLPs stay BF16)
        "intermediate": None if moe else cfg.intermediate_size,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "vocab": cfg.vocab_size,
    }


def mlp_text(m: Mapping[str, Any]) -> str:
    """A :func:`model_section`'s MLP in words: the dense width, or the experts."""
    if m.get("intermediate") is not None:
        return f"dense, MLP dim {m['intermediate']}"
    return f"{m['experts']} experts top-{m['top_k']}, expert dim {m['moe_intermediate']}"
