"""The rollout engine: batched autoregressive sampling with FP4 experts and an FP4 KV cache.

It runs the prepared transformers model (:mod:`tracefp4.engines.model`) the way an inference engine does: one
prefill over the prompts, then one token per sequence per step against the KV cache. This is the
path whose numbers differ from the trainer's full-sequence forward (different attention shapes and
reduction order, a batch that shrinks as sequences finish); that drift is real and is what TRACE has
to survive.

Decisions
    * **Ragged prompts: left padding.** Prompts are left-padded to the longest one; pad positions are
      masked out of attention (a quantized cache is told which tokens are real and never stores a
      pad), and ``position_ids`` count real tokens only, so every sequence sees positions ``0..L-1``
      exactly as the trainer does. Pad rows still flow through the experts (and
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
    * **Records hold what the arm uses.** Routing of every MoE layer always (routing replay needs it
      also after a BF16 rollout); guidance only in the requested mode at its layers; full codes
      at diagnostic layers go to ``RolloutOutput.diagnostics``, never to the records.
    * Everything runs under ``torch.no_grad``; quantized expert weights are cached across steps, keyed
      on each parameter's version (an optimizer step invalidates them).
    * **Every row carries its policy version.** Each forward reads the engine's version when it runs
      (``version``: an int, or a callable asked at every forward, so that weights loaded while a
      generation is under way are seen from the next forward on) and stamps it on the rows it computes;
      a row keeps the version of the forward that computed it, also when its K/V entry is attended to
      by later forwards under newer weights (:func:`row_versions`, ``RolloutOutput.versions``).

The loop is split the way gpt-fast splits it: :func:`prefill`, :func:`decode_one_token`,
:func:`decode_n_tokens`, then :func:`assemble_records`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from transformers import PreTrainedModel

from tracefp4.engines.capture import ForwardRecord, RolloutCapture, trajectory_tensors
from tracefp4.engines.model import CACHE_KWARG, FP4KVCache, forward_state, model_layers, moe_layers
from tracefp4.engines.plan import PrecisionPlan, check_supported
from tracefp4.engines.protocol import RolloutOutput, SamplingParams, check_prompts, check_top_logprobs
from tracefp4.engines.rows import take_rows
from tracefp4.engines.contract import quantizer_contract
from tracefp4.engines.sink import UNKNOWN_VERSION, StoreTarget, write_records
from tracefp4.guidance.compact import GuidedMode, record_cat
from tracefp4.guidance.names import routing_key

__all__ = [
    "HomeEngine",
    "generate",
    "sample",
    "sampler_logprobs",
    "prefill",
    "decode_one_token",
    "decode_n_tokens",
    "assemble_records",
    "row_versions",
]


def sampler_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 ``log_softmax(logits / temperature)`` (temperature 0: at temperature 1): the distribution
    a token is sampled from and whose log-probs are reported."""
    return torch.log_softmax(logits if params.temperature == 0 else logits / params.temperature, dim=-1)


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of float32 ``logits [N, V]``; return (tokens, their log-probs)."""
    logp = sampler_logprobs(logits, params)
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    probs = logp.exp()
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token once the mass before it already reaches top_p (the top token always stays).
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= params.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@dataclasses.dataclass
class ForwardStep:
    """Records of one forward, restricted to the rows that belong to trajectories."""

    rows: torch.Tensor  # which flattened rows of the forward are real tokens
    traj: torch.Tensor  # their trajectory index
    record: ForwardRecord
    version: int = UNKNOWN_VERSION  # the policy version of the weights this forward ran with


@dataclasses.dataclass
class _Decode:
    """The state of one batched decode: what the model and the sampler need between steps."""

    model: PreTrainedModel
    plan: PrecisionPlan | None
    capture: RolloutCapture
    cache: FP4KVCache
    attention: torch.Tensor  # [rows, width] of the batch still decoding
    active: torch.Tensor  # trajectory of each batch row
    prompt_lens: list[int]
    completions: list[list[int]]
    logprobs: list[list[float]]
    finish: list[str]
    version: Callable[[], int]  # the engine's policy version now (read at every forward)
    steps: list[ForwardStep] = dataclasses.field(default_factory=list)
    top: list[list[tuple[torch.Tensor, torch.Tensor]]] = dataclasses.field(default_factory=list)  # per trajectory


def _forward(
    st: _Decode, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, traj: torch.Tensor
) -> torch.Tensor:
    """One forward against the cache; keeps its records; returns the last position's float32 logits."""
    st.cache.begin_forward(st.attention[:, -ids.shape[1]:].bool())  # pads are neither stored nor attended to
    version = st.version()
    with forward_state(st.model, st.plan, st.capture):
        out = st.model(
            input_ids=ids,
            attention_mask=st.attention,
            position_ids=pos,
            **{CACHE_KWARG: st.cache},
            use_cache=True,
            logits_to_keep=1,
        )
    st.steps.append(ForwardStep(rows, traj, st.capture.take(), version))
    return out.logits[:, -1, :].to(torch.float32)


def prefill(
    model: PreTrainedModel, plan: PrecisionPlan | None, capture: RolloutCapture, prompt_ids: list[torch.Tensor], pad: int,
    version: int | Callable[[], int] = UNKNOWN_VERSION,
) -> tuple[_Decode, torch.Tensor]:
    """Left-padded prompts through the model once; returns the decode state and the next-token logits.
    ``version``: the policy version every forward stamps on its rows (a callable: asked per forward)."""
    device = model.device
    n = len(prompt_ids)
    prompt_lens = [int(p.numel()) for p in prompt_ids]
    width = max(prompt_lens)
    input_ids = torch.full((n, width), pad, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    for b, p in enumerate(prompt_ids):
        input_ids[b, width - p.numel() :] = p
        attention[b, width - p.numel() :] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    st = _Decode(
        model, plan, capture, FP4KVCache(model), attention, torch.arange(n, device=device), prompt_lens,
        [[] for _ in range(n)], [[] for _ in range(n)], ["length"] * n,
        version if callable(version) else (lambda: version),
    )
    real = attention.reshape(-1).nonzero().squeeze(-1)
    return st, _forward(st, input_ids, positions, real, real // width)


def decode_one_token(
    st: _Decode, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> torch.Tensor | None:
    """Sample a token for every active row, run it through the model (so that records cover it),
    drop the finished rows; returns the next logits, or None when every sequence has finished."""
    device = logits.device
    tokens, lps = sample(logits, sampling, generator)
    done = torch.isin(tokens, torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=device))
    active = st.active.tolist()
    if sampling.top_logprobs:
        top_lp, top_id = sampler_logprobs(logits, sampling).topk(sampling.top_logprobs, dim=-1)
        if not st.top:
            st.top = [[] for _ in st.completions]
        for row, b in enumerate(active):
            st.top[b].append((top_id[row].cpu(), top_lp[row].cpu()))
    for row, b in enumerate(active):
        st.completions[b].append(int(tokens[row]))
        st.logprobs[b].append(float(lps[row]))
        if bool(done[row]):
            st.finish[b] = "stop"
    done |= torch.tensor([len(st.completions[b]) >= sampling.max_new_tokens for b in active], device=device)
    st.attention = torch.cat([st.attention, st.attention.new_ones(len(active), 1)], dim=1)
    step_pos = torch.tensor([st.prompt_lens[b] + len(st.completions[b]) - 1 for b in active], device=device)
    rows = torch.arange(len(active), device=device)
    logits = _forward(st, tokens[:, None], step_pos[:, None], rows, st.active.clone())
    keep = (~done).nonzero().squeeze(-1)
    if keep.numel() == 0:
        return None
    if keep.numel() < len(active):
        st.cache.batch_select_indices(keep)
        st.attention, logits, st.active = st.attention[keep], logits[keep], st.active[keep]
    return logits


def decode_n_tokens(st: _Decode, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> None:
    """Decode until every sequence has sampled a stop token or ``max_new_tokens`` tokens."""
    next_logits: torch.Tensor | None = logits
    while sampling.max_new_tokens > 0 and next_logits is not None:
        next_logits = decode_one_token(st, next_logits, sampling, generator)


def _split(tensors: Mapping[str, torch.Tensor], counts: list[int], out: list[dict[str, torch.Tensor]]) -> None:
    """Rows grouped by trajectory -> each trajectory's views."""
    for key, t in tensors.items():
        for b, piece in enumerate(t.split(counts)):
            out[b][key] = piece


class _Gather:
    """Where each trajectory row sits in the concatenation of every step's whole forward: one gather
    per recorded tensor then picks every trajectory's rows in position order, where selecting each
    step's rows first costs a gather per step and field (a rollout has a step per new token)."""

    def __init__(self, steps: list[ForwardStep], order: torch.Tensor) -> None:
        self.rows = [s.rows.cpu() for s in steps]  # one host copy per step, shared by every site
        self.order = order
        self._index: dict[tuple[int, ...], torch.Tensor] = {}

    def index(self, sizes: list[int]) -> torch.Tensor:
        """The gather index for steps whose forwards recorded ``sizes`` rows each (the same for every
        site of a forward in practice, so it is computed once)."""
        key = tuple(sizes)
        if key not in self._index:
            starts = [0, *itertools.accumulate(sizes[:-1])]
            self._index[key] = take_rows(torch.cat([r + start for r, start in zip(self.rows, starts)]), self.order)
        return self._index[key]


def _site_records(steps: list[ForwardStep], field: str, gather: _Gather, counts: list[int]
                  ) -> list[dict[str, torch.Tensor]]:
    """The site records of each step's ``field`` (guidance or diagnostics) per trajectory, in position
    order: each site's records concatenated over the steps and gathered once, then cut per trajectory
    (:func:`~tracefp4.engines.capture.trajectory_tensors`)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in counts]
    for name in getattr(steps[0].record, field):
        parts = [getattr(s.record, field)[name] for s in steps]
        record = record_cat(parts).select(gather.index([p.rows for p in parts]))
        for rec, tensors in zip(out, trajectory_tensors(record, name, counts)):
            rec.update(tensors)
    return out


def _routing_records(
    steps: list[ForwardStep], gather: _Gather, counts: list[int], n_experts: int
) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{} for _ in counts]
    dtype = torch.uint8 if n_experts <= 256 else torch.int32
    for layer in steps[0].record.routing:
        parts = [s.record.routing[layer] for s in steps]
        routing = take_rows(torch.cat(parts).cpu(), gather.index([int(p.shape[0]) for p in parts])).to(dtype)
        _split({routing_key(layer): routing}, counts, out)
    return out


def assemble_records(
    steps: list[ForwardStep], lengths: list[int], n_experts: int, capture: RolloutCapture
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """(records, diagnostics) per trajectory, rows in position order (steps are chronological,
    prefill rows in order). First the checks the device kept during the rollout are read (raising for
    a NaN or Inf site input or an expert index out of range)."""
    capture.checks.raise_if_any()
    n = len(lengths)
    traj = torch.cat([s.traj for s in steps]).cpu()
    counts = torch.bincount(traj, minlength=n).tolist()
    for b in range(n):
        if counts[b] != lengths[b]:
            raise RuntimeError(f"trajectory {b}: {counts[b]} recorded positions for {lengths[b]} tokens")
    # rows grouped by trajectory, chronological within each: one gather, then views per trajectory
    gather = _Gather(steps, torch.argsort(traj, stable=True))
    records = _routing_records(steps, gather, counts, n_experts)
    for rec, g in zip(records, _site_records(steps, "guidance", gather, counts)):
        rec.update(g)
    return records, _site_records(steps, "diagnostics", gather, counts)


def row_versions(steps: list[ForwardStep], lengths: list[int]) -> list[torch.Tensor]:
    """int64 ``[T_b]`` per trajectory: the version each row's forward ran with, rows in position order
    (as :func:`assemble_records` orders the records: steps are chronological, rows within a step in
    order)."""
    traj = torch.cat([s.traj.cpu() for s in steps])
    stamped = torch.cat([torch.full((s.traj.numel(),), s.version, dtype=torch.int64) for s in steps])
    counts = torch.bincount(traj, minlength=len(lengths)).tolist()
    return list(stamped[torch.argsort(traj, stable=True)].split(counts))


def generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    sampling: SamplingParams = SamplingParams(),
    *,
    plan: PrecisionPlan | None = None,
    guidance: GuidedMode | None = None,
    diagnostics: frozenset[int] = frozenset(),
    pad_token_id: int | None = None,
    version: int | Callable[[], int] = UNKNOWN_VERSION,
) -> RolloutOutput:
    """Sample completions for ``prompts`` on a model prepared with
    :func:`tracefp4.engines.model.prepare_model`.

    ``plan`` None is a BF16 rollout (then neither guidance nor diagnostics exist). ``guidance`` picks
    what is recorded besides routing; ``diagnostics`` the layers whose full codes are kept in memory.
    ``sampling.max_new_tokens == 0`` runs the prompts through one prefill and records them (no
    sampling): the engine's scoring mode. The model runs in eval mode (no dropout, no router jitter)
    and is put back in the mode it was in. ``version``: the policy version of the model's weights,
    stamped on every row (``RolloutOutput.versions``); a callable is asked at every forward (weights
    that may be replaced during the generation).
    """
    if plan is None and (guidance is not None or diagnostics):
        raise ValueError("a BF16 rollout (plan=None) has no FP4 codes: no guidance or diagnostics")
    if guidance is not None and not isinstance(guidance, GuidedMode):
        raise ValueError(f"guidance must be a GuidedMode (GuidedMode.parse(name)), got {type(guidance).__name__}")
    check_supported(plan, guidance)
    n_layers, _ = model_layers(model)
    capture = RolloutCapture.of(guidance, frozenset(diagnostics), n_layers)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _generate(model, prompts, sampling, plan, guidance, capture, pad_token_id, version)
    finally:
        model.train(was_training)


def _generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    sampling: SamplingParams,
    plan: PrecisionPlan | None,
    guidance: GuidedMode | None,
    capture: RolloutCapture,
    pad_token_id: int | None,
    version: int | Callable[[], int],
) -> RolloutOutput:
    prompt_ids = check_prompts(prompts, model.config.vocab_size)
    check_top_logprobs(sampling, model.config.vocab_size)
    pad = pad_token_id if pad_token_id is not None else (model.config.pad_token_id or 0)
    generator = torch.Generator(device=model.device).manual_seed(sampling.seed)
    t0 = time.perf_counter()
    st, logits = prefill(model, plan, capture, prompt_ids, pad, version)
    t1 = time.perf_counter()
    decode_n_tokens(st, logits, sampling, generator)
    t2 = time.perf_counter()
    token_ids = [torch.cat([p, torch.tensor(c, dtype=torch.long)]) for p, c in zip(prompt_ids, st.completions)]
    n_experts = max((m.experts.gate_up_proj.shape[0] for m in moe_layers(model)), default=0)  # 0: dense, no routing
    lengths = [t.numel() for t in token_ids]
    records, diagnostics = assemble_records(st.steps, lengths, n_experts, capture)
    versions = row_versions(st.steps, lengths)
    t3 = time.perf_counter()
    return RolloutOutput(
        token_ids=token_ids,
        prompt_lens=st.prompt_lens,
        logprobs=[torch.tensor(lp, dtype=torch.float32) for lp in st.logprobs],
        finish_reasons=st.finish,
        records=records,
        diagnostics=diagnostics,
        plan=plan,
        guidance=guidance,
        timings={"prefill_s": t1 - t0, "decode_s": t2 - t1, "records_s": t3 - t2},
        **_top_tensors(st.top, sampling.top_logprobs, len(token_ids)),
        versions=versions,
    )


def _top_tensors(top: list[list[tuple[torch.Tensor, torch.Tensor]]], k: int, n: int) -> dict[str, list[torch.Tensor]]:
    """``top_ids``/``top_logprobs`` of :class:`RolloutOutput` from the per-step top-k of each trajectory."""
    if not k:
        return {}
    top = top or [[] for _ in range(n)]
    ids = [torch.stack([i for i, _ in t]) if t else torch.empty(0, k, dtype=torch.long) for t in top]
    lps = [torch.stack([lp for _, lp in t]) if t else torch.empty(0, k) for t in top]
    return {"top_ids": ids, "top_logprobs": lps}


class HomeEngine:
    """Our :class:`~tracefp4.engines.protocol.RolloutEngine` over a prepared transformers model.

    ``version``: the policy version of the model's weights, stamped on every row of every forward
    (:data:`~tracefp4.engines.sink.UNKNOWN_VERSION` until :meth:`load_weights` or the driver sets it: an
    engine on the trainer's own model object cannot know which version its weights are, and its rows
    go to the store at the target's ``policy_version``). Weights loaded while a generation runs (from
    another thread) are stamped from the next forward on.
    """

    name = "home"

    def __init__(self, model: PreTrainedModel, *, pad_token_id: int | None = None) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.version = UNKNOWN_VERSION

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        plan: PrecisionPlan | None,
        guidance: GuidedMode | None,
        diagnostics: frozenset[int] = frozenset(),
        store: StoreTarget | None = None,
    ) -> RolloutOutput:
        out = generate(
            self.model, prompts, sampling, plan=plan, guidance=guidance, diagnostics=diagnostics,
            pad_token_id=self.pad_token_id, version=lambda: self.version,
        )
        if store is None:
            return out
        t0 = time.perf_counter()
        write_records(store, out.records, out.prompt_lens, versions=out.versions,
                      contract=quantizer_contract(plan, guidance))
        timings = {**out.timings, "store_write_s": time.perf_counter() - t0}
        return dataclasses.replace(out, records=[], versions=[], stored=store, timings=timings)

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state`` into the model in place (bumping the version counters the quantized-weight
        cache keys on); every tensor must fit, none may be missing."""
        missing, unexpected = self.model.load_state_dict(dict(state), strict=False)
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
        self.version = version
