"""The rollout engine: batched autoregressive sampling with FP4 experts and an FP4 KV cache.

It runs the prepared transformers model (:mod:`tracefp4.engines.model`) the way an inference engine does: one
prefill over the prompts, then one token per sequence per step against the KV cache. This is the
path whose numbers differ from the trainer's full-sequence forward (different attention shapes and
reduction order, a batch that shrinks as sequences finish); that drift is real and is what TRACE has
to survive.

Decisions
    * **Ragged prompts: left padding.** Prompts are left-padded to the longest one; pad positions are
      masked out of attention, and ``position_ids`` count real tokens only, so every sequence sees
      positions ``0..L-1`` exactly as the trainer does. Pad rows still flow through the experts (and
      are quantized); because activation and KV scales are per row, they change nothing in the real
      rows, and they are never recorded.
    * **Ragged completions: the batch shrinks.** A sequence that samples a stop token or reaches
      ``max_new_tokens`` is dropped from the batch (``Cache.batch_select_indices``) after its last
      token has been through the model.
    * **Records cover every position, the last token included.** Each record tensor has leading dim
      ``T = len(token_ids)`` (prompt + completion), which the trainer's teacher-forced forward over the
      same tokens consumes row for row. The last sampled token therefore goes through the model once
      more (in the next step, or in a final flush step) although its logits are never used.
    * **Log-probs.** ``logprob = log_softmax(logits / temperature)[token]`` in float32, from the same
      logits the token was sampled from: the temperature-scaled distribution, read at temperature 1,
      *before* top-p truncation (a trainer divides its logits by the same temperature and cannot know
      the truncation; verl does the same). With ``temperature == 0`` sampling is greedy and the
      log-prob is taken at temperature 1.
    * **Routing** of every MoE layer is recorded in every mode (routing replay needs it also when the
      rollout ran in BF16).
    * Everything runs under ``torch.no_grad``; quantized expert weights are cached across steps, keyed
      on each parameter's version (an optimizer step invalidates them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch
from transformers import PreTrainedModel

from tracefp4.guidance.compact import GuidanceSpec, parse_hint_mode, record_cat
from tracefp4.formats.constants import HintMode
from tracefp4.guidance.hints import encode_hint
from tracefp4.formats.numerics import MXFP4, NVFP4
from tracefp4.engines.model import (
    FP4KVCache,
    PrecisionPlan,
    QuantContext,
    QuantMode,
    Recorder,
    default_guided_layers,
    model_layers,
    moe_layers,
    quant_context,
    routing_key,
)

__all__ = ["RolloutMode", "SamplingParams", "RolloutOutput", "generate", "sample"]

RolloutMode = Literal["bf16", "fp4", "trace"]
"""``bf16``: reference, no quantization. ``fp4``: FP4 round-to-nearest, no guidance recorded (vanilla).
``fp4`` + records = ``trace``: the same numerics as ``fp4`` plus guidance records."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass
class RolloutOutput:
    """One batch of trajectories.

    token_ids[b]: int64 ``[T_b]``, prompt then completion.
    prompt_lens[b]: prompt length ``P_b``.
    logprobs[b]: float32 ``[T_b - P_b]``, log-prob of each sampled token (see module docstring).
    finish_reasons[b]: ``"stop"`` (sampled a stop token, which is kept) or ``"length"``.
    records[b]: the trajectory's record, ``{name: Tensor [T_b, ...]}`` with names
        ``L{layer:02d}.routing`` (every MoE layer) and, in ``trace`` mode,
        ``L{layer:02d}.{site}.{field}`` for the guided layers (fields from ``Hint.to_tensors``, or from
        ``CompactRecord.to_tensors`` for a compact ``hint_mode``, see :mod:`tracefp4.guidance.compact`).
    """

    token_ids: list[torch.Tensor]
    prompt_lens: list[int]
    logprobs: list[torch.Tensor]
    finish_reasons: list[str]
    records: list[dict[str, torch.Tensor]]
    mode: RolloutMode
    plan: PrecisionPlan
    hint_mode: HintMode | GuidanceSpec
    guided_layers: frozenset[int]

    def completion(self, b: int) -> torch.Tensor:
        return self.token_ids[b][self.prompt_lens[b] :]

    def guidance_bytes(self) -> int:
        """Bytes of guidance (routing excluded) over the whole batch."""
        return sum(t.nbytes for rec in self.records for k, t in rec.items() if not k.endswith(".routing"))


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of float32 ``logits [N, V]``; return (tokens, their log-probs)."""
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = logp.exp()
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token once the mass before it already reaches top_p (the top token always stays).
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= params.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@dataclasses.dataclass
class _Step:
    """Records of one forward, restricted to the rows that belong to trajectories."""

    rows: torch.Tensor  # which flattened rows of the forward are real tokens
    traj: torch.Tensor  # their trajectory index
    record: Recorder


def _check_prompts(prompts: Sequence[Sequence[int] | torch.Tensor], vocab: int) -> list[torch.Tensor]:
    out = []
    for b, p in enumerate(prompts):
        t = torch.as_tensor(p, dtype=torch.long).reshape(-1)
        if t.numel() == 0:
            raise ValueError(f"prompt {b} is empty")
        if int(t.min()) < 0 or int(t.max()) >= vocab:
            raise ValueError(f"prompt {b}: token ids outside [0, {vocab})")
        out.append(t)
    if not out:
        raise ValueError("no prompts given")
    return out


def generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    sampling: SamplingParams = SamplingParams(),
    *,
    mode: RolloutMode = "trace",
    plan: PrecisionPlan | None = None,
    guided_layers: Sequence[int] | None = None,
    hint_mode: HintMode | GuidanceSpec | str = HintMode.LSB,
    pad_token_id: int | None = None,
) -> RolloutOutput:
    """Sample completions for ``prompts`` on a model prepared with :func:`tracefp4.engines.model.prepare_model`.

    ``guided_layers`` defaults to the deeper half of the layers; it only matters in ``trace`` mode.
    ``sampling.max_new_tokens == 0`` runs the prompts through one full-sequence prefill and records
    them (no sampling): the engine's scoring mode. The model runs in eval mode (no dropout, no router
    jitter) and is put back in the mode it was in.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _generate(model, prompts, sampling, mode, plan, guided_layers, hint_mode, pad_token_id)
    finally:
        model.train(was_training)


def _generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    sampling: SamplingParams,
    mode: RolloutMode,
    plan: PrecisionPlan | None,
    guided_layers: Sequence[int] | None,
    hint_mode: HintMode | GuidanceSpec | str,
    pad_token_id: int | None,
) -> RolloutOutput:
    if mode not in ("bf16", "fp4", "trace"):
        raise ValueError(f"mode must be 'bf16', 'fp4' or 'trace', got {mode!r}")
    plan = plan if plan is not None else PrecisionPlan()
    hint_mode = parse_hint_mode(hint_mode)
    n_layers, _ = model_layers(model)
    guided = frozenset(guided_layers) if guided_layers is not None else default_guided_layers(n_layers)
    if any(not 0 <= i < n_layers for i in guided):
        raise ValueError(f"guided_layers {sorted(guided)} outside [0, {n_layers})")
    device = model.device
    prompt_ids = _check_prompts(prompts, model.config.vocab_size)
    pad = pad_token_id if pad_token_id is not None else (model.config.pad_token_id or 0)

    ctx = QuantContext(
        mode=QuantMode.BF16 if mode == "bf16" else QuantMode.RTN,
        plan=plan,
        guided_layers=guided if mode == "trace" else frozenset(),
        hint_mode=hint_mode,
        record=Recorder(),
        reuse_quantized_weights=True,
    )
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    stop = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=device)
    n = len(prompt_ids)
    prompt_lens = [int(p.numel()) for p in prompt_ids]
    width = max(prompt_lens)

    # Prefill: left-padded prompts.
    input_ids = torch.full((n, width), pad, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    for b, p in enumerate(prompt_ids):
        input_ids[b, width - p.numel() :] = p
        attention[b, width - p.numel() :] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    cache = FP4KVCache(model)
    steps: list[_Step] = []

    def forward(ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, traj: torch.Tensor) -> torch.Tensor:
        with quant_context(model, ctx):
            out = model(
                input_ids=ids,
                attention_mask=attention,
                position_ids=pos,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        steps.append(_Step(rows, traj, ctx.record.take()))
        return out.logits[:, -1, :].to(torch.float32)

    real = attention.reshape(-1).nonzero().squeeze(-1)
    logits = forward(input_ids, positions, real, real // width)

    completions: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    finish = ["length"] * n
    active = torch.arange(n, device=device)  # trajectory of each batch row
    while sampling.max_new_tokens > 0:
        tokens, lps = sample(logits, sampling, generator)
        done = torch.isin(tokens, stop)
        for row, b in enumerate(active.tolist()):
            completions[b].append(int(tokens[row]))
            logprobs[b].append(float(lps[row]))
            if bool(done[row]):
                finish[b] = "stop"
        full = [len(completions[b]) >= sampling.max_new_tokens for b in active.tolist()]
        done |= torch.tensor(full, device=device)
        # Every sampled token goes through the model once, so that records cover all T positions.
        attention = torch.cat([attention, attention.new_ones(len(active), 1)], dim=1)
        step_pos = torch.tensor([prompt_lens[b] + len(completions[b]) - 1 for b in active.tolist()], device=device)
        rows = torch.arange(len(active), device=device)
        logits = forward(tokens[:, None], step_pos[:, None], rows, active.clone())
        keep = (~done).nonzero().squeeze(-1)
        if keep.numel() == 0:
            break
        if keep.numel() < len(active):
            cache.batch_select_indices(keep)
            attention, logits, active = attention[keep], logits[keep], active[keep]

    token_ids = [torch.cat([prompt_ids[b], torch.tensor(completions[b], dtype=torch.long)]) for b in range(n)]
    n_experts = max(m.experts.gate_up_proj.shape[0] for m in moe_layers(model))
    records = _assemble_records(steps, [t.numel() for t in token_ids], n_experts, hint_mode)
    return RolloutOutput(
        token_ids=token_ids,
        prompt_lens=prompt_lens,
        logprobs=[torch.tensor(lp, dtype=torch.float32) for lp in logprobs],
        finish_reasons=finish,
        records=records,
        mode=mode,
        plan=plan,
        hint_mode=hint_mode,
        guided_layers=guided if mode == "trace" else frozenset(),
    )


def _select_rows(q: NVFP4 | MXFP4, rows: torch.Tensor) -> NVFP4 | MXFP4:
    if isinstance(q, NVFP4):
        return NVFP4(q.codes[rows], q.scales[rows], q.global_amax[rows])
    return MXFP4(q.codes[rows], q.scales[rows])


def _cat_quantized(parts: list[NVFP4 | MXFP4]) -> NVFP4 | MXFP4:
    codes = torch.cat([p.codes for p in parts])
    scales = torch.cat([p.scales for p in parts])
    if isinstance(parts[0], NVFP4):
        return NVFP4(codes, scales, torch.cat([p.global_amax for p in parts]))
    return MXFP4(codes, scales)


def _assemble_records(
    steps: list[_Step], lengths: list[int], n_experts: int, hint_mode: HintMode | GuidanceSpec
) -> list[dict[str, torch.Tensor]]:
    """Per-trajectory records, rows in position order (steps are chronological, prefill rows in order)."""
    n = len(lengths)
    traj = torch.cat([s.traj for s in steps]).cpu()
    counts = torch.bincount(traj, minlength=n).tolist()
    for b in range(n):
        if counts[b] != lengths[b]:
            raise RuntimeError(f"trajectory {b}: {counts[b]} recorded positions for {lengths[b]} tokens")
    # rows grouped by trajectory, chronological within each: one gather, then views per trajectory
    order = torch.argsort(traj, stable=True)
    records: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for name in steps[0].record.hints:
        parts = [s.record.hints[name] for s in steps]
        if isinstance(parts[0], (NVFP4, MXFP4)):  # full/lsb: encode the whole rollout's codes at once
            q = _cat_quantized([_select_rows(p, s.rows.cpu()) for p, s in zip(parts, steps)])
            tensors = encode_hint(_select_rows(q, order), hint_mode).to_tensors(name)
            for key, t in tensors.items():
                for b, piece in enumerate(t.split(counts)):
                    records[b][key] = piece
        else:
            record = record_cat([p.select(s.rows.cpu()) for p, s in zip(parts, steps)]).select(order)
            start = 0
            for b in range(n):
                records[b].update(record.select(slice(start, start + counts[b])).to_tensors(name))
                start += counts[b]
    dtype = torch.uint8 if n_experts <= 256 else torch.int32
    for layer in steps[0].record.routing:
        routing = torch.cat([s.record.routing[layer][s.rows].cpu() for s in steps]).to(dtype)[order]
        for b, piece in enumerate(routing.split(counts)):
            records[b][routing_key(layer)] = piece
    return records
