"""The trainer's forward: teacher-forced log-probs with QAT fake quantization, guided by the rollout.

One forward over whole sequences (prompt + completion), with the same precision plan and the same
sites as the rollout engine, quantized with a straight-through gradient:

* ``bf16``: no quantization.
* ``qat``: round-to-nearest on the trainer's own scales at every site (vanilla QAT).
* ``trace``: at every site the rollout recorded, round toward the rollout's codeword on the rollout's
  grid (:func:`tracefp4.guidance.guided_quantize`); round-to-nearest elsewhere.

In every mode the rollout's routing is replayed by default (R3): each MoE layer uses the recorded
top-k experts, with probabilities recomputed from the trainer's own router logits (softmax, gathered
at the replayed experts, renormalised as the model's router does), so the router still learns.

Decisions
    * **Packed sequences.** The batch is one row of concatenated trajectories with per-trajectory
      ``position_ids`` (restarting at 0) and a block-diagonal causal mask built by transformers'
      ``create_causal_mask``; no padding, so every row of every site is a real token and the
      trajectories' records concatenate into the batch's guidance directly (as verl's remove-padding
      path and Megatron's packed THD layout do).
    * **Strict records.** Every disagreement between records and batch (unknown name, site set
      differing between trajectories, leading dim != number of tokens, format not the plan's, routing
      missing while replay is on, trace mode without guidance) raises ``ValueError``; nothing falls
      back silently.
    * Log-probs are ``log_softmax(logits / temperature)`` in float32 at each completion token: the
      rollout's definition (see :mod:`tracefp4.engines.rollout`). Only the completion rows go through lm_head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask

from tracefp4.engines.guidance import TrainerGuidance
from tracefp4.engines.model import CACHE_KWARG, FP4KVCache, forward_state, model_layers
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutOutput
from tracefp4.formats.numerics import code_positions
from tracefp4.guidance.compact import CompactRecord, read_record, record_cat
from tracefp4.guidance.hints import Hint, record_format
from tracefp4.guidance.names import Site, parse_name, record_prefix, routing_key

__all__ = [
    "TrainerMode",
    "TrainerOutput",
    "SiteMismatch",
    "forward_logprobs",
    "forward_rollout",
    "code_mismatch",
]

TrainerMode = Literal["bf16", "qat", "trace"]


@dataclasses.dataclass
class TrainerOutput:
    """logprobs[b]: ``[T_b - P_b]`` log-probs of the completion tokens, differentiable.

    codes[b]: this path's packed FP4 codes at the ``capture_codes`` layers, per guidable site
        (``record_prefix(layer, site)`` -> uint8 ``[T_b, ..., K//2]``; ``{}`` without capture).
    grids[b]: the grid of those codes per site: (block scales, global amax or None), leading dim
        ``T_b`` (a compact record's codes are only right on the right grid).
    router_flips: under replay, layer -> share of tokens whose own top-k set differs from the
        replayed one (the router flip rate before replay).
    decode_failures: compact-record blocks that did not decode (rounded to nearest instead).
    logprob_rows[b]: float32 ``[T_b - P_b, V]``, the whole ``log_softmax(logits / temperature)`` row at
        each completion position (differentiable; what a loss over more than the sampled token reads,
        e.g. Score Centering's, :mod:`tracefp4.rl.score_centering`).
    """

    logprobs: list[torch.Tensor]
    codes: list[dict[str, torch.Tensor]]
    grids: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]]
    router_flips: dict[int, float]
    decode_failures: int = 0
    logprob_rows: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def padded(self, value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(``[B, C_max]`` log-probs right-padded with ``value``, bool mask of real tokens)."""
        width = max((lp.numel() for lp in self.logprobs), default=0)
        out = self.logprobs[0].new_full((len(self.logprobs), width), value) if self.logprobs else torch.empty(0, 0)
        mask = torch.zeros(out.shape, dtype=torch.bool, device=out.device)
        for b, lp in enumerate(self.logprobs):
            out[b, : lp.numel()] = lp
            mask[b, : lp.numel()] = True
        return out, mask


def _parse_records(
    records: Sequence[Mapping[str, torch.Tensor]], lengths: Sequence[int]
) -> tuple[set[tuple[int, Site]], set[int]]:
    """Validate the batch's records; return (guided (layer, site) pairs, layers with routing)."""
    signature: frozenset[str] | None = None
    for b, (rec, length) in enumerate(zip(records, lengths)):
        for name, t in rec.items():
            try:
                parse_name(name)
            except ValueError as e:
                raise ValueError(f"trajectory {b}: unknown record name {name!r}: {e}") from None
            if t.dim() < 1 or t.shape[0] != length:
                raise ValueError(
                    f"trajectory {b}: record {name!r} has leading dim {tuple(t.shape)[:1]} but the "
                    f"trajectory has {length} tokens"
                )
        sig = frozenset(rec)
        if signature is None:
            signature = sig
        elif sig != signature:
            raise ValueError(f"trajectory {b}: its records name different tensors than trajectory 0's: "
                             f"{sorted(signature ^ sig)}")
    guided: set[tuple[int, Site]] = set()
    routed: set[int] = set()
    for name in records[0] if records else ():
        parsed = parse_name(name)
        if parsed.is_routing:
            routed.add(parsed.layer)
        else:
            guided.add((parsed.layer, Site(parsed.site)))
    return guided, routed


def _check_batch(
    model: PreTrainedModel,
    lengths: Sequence[int],
    prompt_lens: Sequence[int],
    records: Sequence[Mapping[str, torch.Tensor]] | None,
    mode: TrainerMode,
    plan: PrecisionPlan,
    replay_routing: bool,
    capture_codes: frozenset[int],
) -> set[tuple[int, Site]]:
    """Every way the batch and its records can disagree is an error; return the guided sites."""
    if mode not in ("bf16", "qat", "trace"):
        raise ValueError(f"mode must be 'bf16', 'qat' or 'trace', got {mode!r}")
    if len(lengths) != len(prompt_lens) or not lengths:
        raise ValueError(f"{len(lengths)} sequences but {len(prompt_lens)} prompt lengths")
    for b, (length, p) in enumerate(zip(lengths, prompt_lens)):
        if not 1 <= p <= length:
            raise ValueError(f"trajectory {b}: prompt length {p} not in [1, {length}]")
    n_layers, moe = model_layers(model)
    if capture_codes and mode == "bf16":
        raise ValueError("capture_codes needs a quantized mode ('qat', 'trace'): BF16 has no codes")
    if any(not 0 <= i < n_layers for i in capture_codes):
        raise ValueError(f"capture_codes {sorted(capture_codes)} outside [0, {n_layers})")
    if records is None:
        if replay_routing or mode == "trace":
            raise ValueError(f"mode {mode!r} with replay_routing={replay_routing} needs the rollout's records")
        return set()
    if len(records) != len(lengths):
        raise ValueError(f"{len(records)} records for {len(lengths)} sequences")
    guided, routed = _parse_records(records, lengths)
    if replay_routing and routed != set(moe):
        raise ValueError(
            f"routing replay needs the routing of MoE layers {sorted(moe)}, records have {sorted(routed)}"
        )
    if mode == "trace" and not guided:
        raise ValueError("trace mode needs guidance records (was the rollout run in 'trace' mode?)")
    if mode == "trace" and not replay_routing and any(site is Site.EXPERT_MID for _, site in guided):
        # expert_mid hints are per (token, top-k slot): without replay the slots may hold other experts.
        raise ValueError("trace mode with expert_mid guidance needs replay_routing=True")
    if any(not 0 <= layer < n_layers for layer, _ in guided):
        raise ValueError(f"records name layers outside [0, {n_layers}): {sorted({i for i, _ in guided})}")
    for layer, site in sorted(guided):
        name, want = record_prefix(layer, site), plan.site_format(site)
        fmt = read_record(records[0], name).fmt.value
        if fmt != want:
            raise ValueError(f"{name}: the records are {fmt} but the precision plan says {want}")
    return guided


def forward_logprobs(
    model: PreTrainedModel,
    token_ids: Sequence[torch.Tensor],
    prompt_lens: Sequence[int],
    records: Sequence[Mapping[str, torch.Tensor]] | None = None,
    *,
    mode: TrainerMode = "trace",
    plan: PrecisionPlan | None = None,
    temperature: float = 1.0,
    replay_routing: bool = True,
    capture_codes: frozenset[int] = frozenset(),
) -> TrainerOutput:
    """Teacher-forced log-probs of the completions ``token_ids[b][prompt_lens[b]:]``.

    ``records[b]`` is trajectory b's rollout record (see :class:`tracefp4.engines.rollout.RolloutOutput`).
    ``plan`` must be the rollout's (None: the default plan in ``qat``/``trace``). ``capture_codes``: the
    layers whose codes this path picks are returned (whatever the records hold). Gradients flow to every parameter (straight-through at the FP4
    sites, through the recomputed router probabilities under replay).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    plan = None if mode == "bf16" else (plan if plan is not None else PrecisionPlan())
    capture_codes = frozenset(int(i) for i in capture_codes)
    ids = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for t in token_ids]
    lengths = [t.numel() for t in ids]
    guided = _check_batch(
        model, lengths, prompt_lens, records, mode, plan or PrecisionPlan(), replay_routing, capture_codes
    )
    device = model.device

    hints: dict[str, Hint | CompactRecord] = {}
    if mode == "trace":
        assert records is not None
        names = [record_prefix(layer, site) for layer, site in sorted(guided)]
        hints = {name: record_cat([read_record(rec, name) for rec in records]) for name in names}
    replay = None
    if replay_routing:
        assert records is not None
        replay = {
            layer: torch.cat([rec[routing_key(layer)] for rec in records]).to(device, torch.long)
            for layer in model_layers(model)[1]
        }
    path = TrainerGuidance(hints, replay, capture_codes)

    # Packed: one row of all trajectories, positions restarting at 0 for each.
    input_ids = torch.cat(ids).to(device)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    # Row i predicts token i+1: completion tokens P..T-1 of trajectory b come from rows
    # offsets[b] + P-1 .. offsets[b] + T-2; only those go through lm_head.
    rows = torch.cat([torch.arange(o + p - 1, o + n - 1) for o, p, n in zip(offsets, prompt_lens, lengths)])
    targets = input_ids[0, rows + 1]
    # Built here, without a cache: transformers detects packed sequences only when there is none.
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=torch.empty((1, input_ids.shape[1], 0), dtype=model.dtype, device=device),
        attention_mask=None,
        **{CACHE_KWARG: None},
        position_ids=position_ids,
    )
    with forward_state(model, plan, path):
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            **{CACHE_KWARG: FP4KVCache(model)},  # the k/v sites: attention reads FP4 K/V as in the rollout
            use_cache=True,
            logits_to_keep=rows.to(device),
        )
    logp = torch.log_softmax(out.logits[0].to(torch.float32) / temperature, dim=-1)
    token_logp = logp.gather(-1, targets[:, None]).squeeze(-1)
    counts = [n - p for p, n in zip(prompt_lens, lengths)]
    spans = list(zip(offsets[:-1], offsets[1:]))
    codes = [{k: v[o:e] for k, v in path.codes.items()} for o, e in spans]
    grids = [{k: (sc[o:e], None if a is None else a[o:e]) for k, (sc, a) in path.grids.items()} for o, e in spans]
    flips = {layer: f / max(t, 1) for layer, (f, t) in path.router_flips.items()}
    return TrainerOutput(list(token_logp.split(counts)), codes, grids, flips, path.decode_failures,
                         list(logp.split(counts)))


def forward_rollout(
    model: PreTrainedModel,
    rollout: RolloutOutput,
    *,
    mode: TrainerMode = "trace",
    temperature: float = 1.0,
    replay_routing: bool = True,
    capture_codes: frozenset[int] = frozenset(),
) -> TrainerOutput:
    """:func:`forward_logprobs` over a rollout's trajectories, records and precision plan."""
    return forward_logprobs(
        model,
        rollout.token_ids,
        rollout.prompt_lens,
        rollout.records,
        mode=mode,
        plan=rollout.plan,
        temperature=temperature,
        replay_routing=replay_routing,
        capture_codes=capture_codes,
    )


# --- code mismatch (metrics) ---------------------------------------------------------------------


@dataclasses.dataclass
class SiteMismatch:
    """Elements whose codeword differs between the trainer and the rollout at one site."""

    mismatched: int
    total: int
    one_apart: int

    @property
    def rate(self) -> float:
        return self.mismatched / self.total if self.total else 0.0


def code_mismatch(
    trainer_codes: Sequence[Mapping[str, torch.Tensor]], diagnostics: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, SiteMismatch]:
    """Per site, how many codewords the trainer (``TrainerOutput.codes``) picked differently from the
    rollout (its full codes, ``RolloutOutput.diagnostics`` or full-mode records: ``{prefix}.codes``),
    and how many of those are one apart."""
    if len(trainer_codes) != len(diagnostics):
        raise ValueError(f"{len(trainer_codes)} trajectories of codes for {len(diagnostics)} of the rollout's")
    out: dict[str, SiteMismatch] = {}
    for b, (mine, rec) in enumerate(zip(trainer_codes, diagnostics)):
        for name, packed in mine.items():
            key = f"{name}.codes"
            if key not in rec:
                raise ValueError(
                    f"trajectory {b}: the rollout kept no full codes {key!r} (run it with this layer in diagnostics)"
                )
            if rec[key].shape != packed.shape:
                raise ValueError(
                    f"trajectory {b}, {name}: codes {tuple(packed.shape)} vs record {tuple(rec[key].shape)}"
                )
            # Compared on the signed line (+0 and -0 are one codeword); FP4 or FP8 by the record's grid.
            fmt = record_format(rec[f"{name}.scales"], f"trajectory {b}, {name}")
            diff = (code_positions(packed.cpu(), fmt) - code_positions(rec[key].cpu(), fmt)).abs()
            s = out.setdefault(name, SiteMismatch(0, 0, 0))
            s.mismatched += int((diff != 0).sum())
            s.one_apart += int((diff == 1).sum())
            s.total += diff.numel()
    return out
