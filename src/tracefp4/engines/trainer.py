"""The trainer's forward: teacher-forced log-probs with QAT fake quantization, guided by the rollout.

One forward over whole sequences (prompt + completion), with the same precision plan and the same
sites as the rollout engine, quantized with a straight-through gradient, in the
:class:`TrainerMode` of a :class:`TrainerSpec`:

* ``bf16``: no quantization.
* ``qat``: round-to-nearest on the trainer's own scales at every site (vanilla QAT).
* ``trace``: at every site the rollout recorded, round toward the rollout's codeword on the rollout's
  grid (:func:`tracefp4.guidance.hints.guided_quantize`); round-to-nearest elsewhere.

In every mode the rollout's routing is replayed by default (R3): each MoE layer uses the recorded
top-k experts, with probabilities recomputed from the trainer's own router logits (softmax, gathered
at the replayed experts, renormalised as the model's router does), so the router still learns. A
dense model has no router: its records hold no routing, and replay has nothing to do.

Two levels:

* :func:`trainer_forward`, the public trainer-side API for any trainer: a context manager in which the
  caller runs its own forward of a prepared model on its own batch layout, described by a
  :class:`~tracefp4.engines.rows.RowMap` (packed, padded, remove-padding), with the trajectories'
  records; it yields a :class:`TrainerForward` whose :meth:`~TrainerForward.report` gives the codes,
  router flips and decode failures. The K/V sites are quantized whether the caller passes a cache or
  not (``use_cache=False``).
* :func:`forward_logprobs` (and :func:`forward_rollout`): our packed forward on top of it.

Decisions
    * **Packed sequences** (:func:`forward_logprobs`). The batch is one row of concatenated
      trajectories with per-trajectory ``position_ids`` (restarting at 0); no padding (as verl's
      remove-padding path and Megatron's packed THD layout do). Attention: up to
      :data:`DENSE_MASK_MAX_TOKENS` tokens, one call with the block-diagonal causal mask transformers'
      ``create_causal_mask`` builds (what short-answer runs have always computed); above, one causal
      call per trajectory (:mod:`tracefp4.engines.segments`), so a step of long answers costs
      sum(T^2), not (sum T)^2. The two agree up to float32 addition order in the attention core only
      (:class:`PackedAttention`).
    * **Strict records.** Every disagreement between records and batch (unknown name, site set
      differing between trajectories, leading dim != the trajectory's length, format not the plan's,
      routing missing while replay is on, trace mode without guidance) raises ``ValueError``; nothing
      falls back silently.
    * Log-probs are ``log_softmax(logits / temperature)`` in float32 at each completion token: the
      rollout's definition (see :mod:`tracefp4.engines.rollout`), :func:`token_logprobs`. Only the
      completion rows go through lm_head.
    * **Guidance knows its lag.** Given each record row's policy version (``versions``: the rollout
      engine's stamps, :meth:`tracefp4.guidance.store.StoreReader.versions`) and the trainer's own
      (``policy_version``), a row whose lag ``policy_version - version`` exceeds the spec's
      ``guidance_max_lag`` is rounded to nearest on the trainer's own grid at every guided site (plain
      QAT: a record computed by weights that far behind names codewords the trainer's values may have
      left) and counted (``ForwardReport.stale_rows``); a row newer than the trainer is an error.
      Without versions every row counts as the trainer's own (lag 0), and a forward in which no row is
      stale computes exactly what it computed before versions existed. Compact records decode over all
      their rows (a record read from the store decodes per whole trajectory), so their decode reports
      include the stale rows.

    The API a trainer calls (the asynchronous loop among them)::

        with trainer_forward(model, rows, records, TrainerSpec(mode, plan, guidance_max_lag=k),
                             versions=[reader.versions(t) for t in ids], policy_version=v) as fwd:
            logits = model(...)
        fwd.report().stale_rows  # record rows (token positions) that took round-to-nearest
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask

from tracefp4.engines.guidance import TrainerGuidance
from tracefp4.engines.model import CACHE_KWARG, forward_state, model_layers
from tracefp4.engines.plan import PrecisionPlan, check_supported
from tracefp4.engines.protocol import RolloutOutput
from tracefp4.engines.rows import RowMap
from tracefp4.engines.segments import SEGMENTS_KWARG, Segments
from tracefp4.formats import code_positions
from tracefp4.guidance.compact import CompactRecord, read_record, record_cat
from tracefp4.guidance.hints import record_format
from tracefp4.guidance.names import Site, layer_tag, parse_name, record_prefix, routing_key
from tracefp4.guidance.record import SiteRecord
from tracefp4.guidance.report import DecodeReport

__all__ = [
    "DENSE_MASK_MAX_TOKENS",
    "PackedAttention",
    "TrainerMode",
    "TrainerSpec",
    "TrainerForward",
    "ForwardReport",
    "TrainerOutput",
    "SiteMismatch",
    "MismatchKey",
    "RowMap",
    "trainer_forward",
    "token_logprobs",
    "logprob_rows",
    "forward_logprobs",
    "forward_rollout",
    "code_mismatch",
]


#: Above this many tokens in the packed row, :attr:`PackedAttention.AUTO` attends per sequence: a dense
#: mask over N rows costs N^2 query-key pairs per head and layer (2048 tokens: 4 M, a few ms), and every
#: short-answer run of this repository (32-64 trajectories of tens of tokens, at most ~1,500 tokens a
#: step) keeps the one-row masked attention it has always had, bit for bit.
DENSE_MASK_MAX_TOKENS = 2048


class PackedAttention(str, enum.Enum):
    """How :func:`forward_logprobs`' packed row attends (the row, the sites and the records are the same)."""

    AUTO = "auto"
    """:attr:`MASK` up to :data:`DENSE_MASK_MAX_TOKENS` tokens in the row, :attr:`SEGMENTS` above."""
    MASK = "mask"
    """One attention call over the whole row with a dense block-diagonal causal mask: (sum T)^2 pairs."""
    SEGMENTS = "segments"
    """One causal attention call per trajectory (:mod:`tracefp4.engines.segments`): sum T^2 / 2 pairs."""

    def per_sequence(self, tokens: int) -> bool:
        """Whether a packed row of ``tokens`` tokens attends per sequence."""
        return self is PackedAttention.SEGMENTS or (self is PackedAttention.AUTO and tokens > DENSE_MASK_MAX_TOKENS)


class TrainerMode(str, enum.Enum):
    """How the trainer's forward quantizes each site ``x`` (quantizer ``Q`` of the plan, straight-through)."""

    BF16 = "bf16"
    """``x``: no quantization (the model's own numerics)."""

    QAT = "qat"
    """``Q_rtn(x)``: round to nearest on the trainer's own grid (vanilla QAT)."""

    TRACE = "trace"
    """``Q_guided(x; rollout record)`` on the rollout's grid where a record exists, ``Q_rtn(x)`` elsewhere."""


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """How a trainer forward computes: the one object every caller passes.

    mode: a :class:`TrainerMode` (or its name).
    plan: the rollout's precision plan (None: the default NVFP4 W4A4 plan; unused in ``bf16``).
    temperature: log-probs are ``log_softmax(logits / temperature)`` (the rollout's temperature).
    replay_routing: use the rollout's recorded experts at every MoE layer (R3).
    capture_codes: layers whose FP4 codes this forward picks are reported (whatever the records hold).
    guidance_max_lag: in ``trace`` mode, the largest lag (trainer's policy version minus a record row's)
        at which a row is still rounded toward the rollout's record; rows further behind round to
        nearest (see the module docstring). 0: only rows of the trainer's own weights are guided.
    capture_values: at the ``capture_codes`` layers, also report each site's values before quantization
        (what the trainer's bracket is computed from: :func:`tracefp4.pipeline.metrics.bracket_miss`).
    packed_attention: how :func:`forward_logprobs`' packed row attends (:class:`PackedAttention`; the
        default picks by the row's length). Unused by :func:`trainer_forward`, whose caller runs the forward.
    """

    mode: TrainerMode = TrainerMode.TRACE
    plan: PrecisionPlan | None = None
    temperature: float = 1.0
    replay_routing: bool = True
    capture_codes: frozenset[int] = frozenset()
    guidance_max_lag: int = 0
    capture_values: bool = False
    packed_attention: PackedAttention = PackedAttention.AUTO

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", TrainerMode(self.mode))
        except ValueError:
            raise ValueError(f"mode must be 'bf16', 'qat' or 'trace', got {self.mode!r}") from None
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for log-probs, got {self.temperature}")
        try:
            object.__setattr__(self, "packed_attention", PackedAttention(self.packed_attention))
        except ValueError:
            raise ValueError(f"packed_attention must be 'auto', 'mask' or 'segments', got {self.packed_attention!r}"
                             ) from None
        object.__setattr__(self, "capture_codes", frozenset(int(i) for i in self.capture_codes))
        if self.capture_codes and self.mode is TrainerMode.BF16:
            raise ValueError("capture_codes needs a quantized mode ('qat', 'trace'): BF16 has no codes")
        if not isinstance(self.guidance_max_lag, int) or isinstance(self.guidance_max_lag, bool) \
                or self.guidance_max_lag < 0:
            raise ValueError(f"guidance_max_lag must be an int >= 0, got {self.guidance_max_lag!r}")
        if self.capture_values and not self.capture_codes:
            raise ValueError("capture_values reports the values at the capture_codes layers: name some")

    @classmethod
    def of(cls, spec: TrainerSpec | None = None, **fields) -> TrainerSpec:
        """``spec`` (default: the default spec) with ``fields`` replaced."""
        return dataclasses.replace(spec if spec is not None else cls(), **fields)

    @property
    def forward_plan(self) -> PrecisionPlan | None:
        """The plan the forward runs (None: BF16)."""
        if self.mode is TrainerMode.BF16:
            return None
        return self.plan if self.plan is not None else PrecisionPlan()


@dataclasses.dataclass
class ForwardReport:
    """What one trainer forward reports, per trajectory where it is per trajectory.

    codes[t]: this path's packed FP4 codes at the spec's ``capture_codes`` layers, per guidable site
        (``record_prefix(layer, site)`` -> uint8 ``[n_t, ..., K//2]`` over the trajectory's covered
        positions in order; ``{}`` without capture).
    grids[t]: the grid of those codes per site: (block scales, global amax or None), same rows
        (a compact record's codes are only right on the right grid).
    router_flips: under replay, layer -> share of real tokens whose own top-k set differs from the
        replayed one (the router flip rate before replay).
    decode: the forward's decode reports summed: its failed blocks (``decode.failed_blocks``: compact-record
        blocks that did not decode, rounded to nearest instead), and the ``mod4`` records' elements
        checked against the trainer's bracket and the misses detected there (``bracket_miss_rate``).
    stale_rows: in ``trace`` mode, the record rows (token positions the forward covers, each counted
        once) whose lag exceeded the spec's ``guidance_max_lag``: rounded to nearest at every guided site.
    values[t]: with the spec's ``capture_values``, the values each captured site quantized (same names
        and rows as ``codes``, unquantized shape ``[n_t, ..., K]``); ``{}`` without.
    """

    codes: list[dict[str, torch.Tensor]]
    grids: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]]
    router_flips: dict[int, float]
    decode: DecodeReport = dataclasses.field(default_factory=DecodeReport)
    stale_rows: int = 0
    values: list[dict[str, torch.Tensor]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TrainerOutput:
    """logprobs[b]: ``[T_b - P_b]`` log-probs of the completion tokens, differentiable; codes, grids,
    router_flips, decode, stale_rows and values as :class:`ForwardReport`.

    logprob_rows[b]: float32 ``[T_b - P_b, V]``, the whole ``log_softmax(logits / temperature)`` row at
        each completion position (differentiable; what a loss over more than the sampled token reads,
        e.g. Score Centering's, :mod:`tracefp4.rl.score_centering`).
    """

    logprobs: list[torch.Tensor]
    codes: list[dict[str, torch.Tensor]]
    grids: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]]
    router_flips: dict[int, float]
    logprob_rows: list[torch.Tensor] = dataclasses.field(default_factory=list)
    decode: DecodeReport = dataclasses.field(default_factory=DecodeReport)
    stale_rows: int = 0
    values: list[dict[str, torch.Tensor]] = dataclasses.field(default_factory=list)

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


def _check_records(
    model: PreTrainedModel,
    lengths: Sequence[int],
    records: Sequence[Mapping[str, torch.Tensor]] | None,
    spec: TrainerSpec,
) -> set[tuple[int, Site]]:
    """Every way the records can disagree with the batch and the spec is an error; return the guided sites."""
    n_layers, moe = model_layers(model)
    if any(not 0 <= i < n_layers for i in spec.capture_codes):
        raise ValueError(f"capture_codes {sorted(spec.capture_codes)} outside [0, {n_layers})")
    mode = spec.mode.value
    if records is None:
        # a dense model has no routing to replay: replay_routing then asks for nothing
        if (spec.replay_routing and moe) or spec.mode is TrainerMode.TRACE:
            raise ValueError(f"mode {mode!r} with replay_routing={spec.replay_routing} needs the rollout's records")
        return set()
    if len(records) != len(lengths):
        raise ValueError(f"{len(records)} records for {len(lengths)} sequences")
    guided, routed = _parse_records(records, lengths)
    if spec.replay_routing and routed != set(moe):
        raise ValueError(
            f"routing replay needs the routing of MoE layers {sorted(moe)}, records have {sorted(routed)}"
        )
    if spec.mode is TrainerMode.TRACE and not guided:
        raise ValueError("trace mode needs guidance records (was the rollout run in 'trace' mode?)")
    if spec.mode is TrainerMode.TRACE and not spec.replay_routing and any(site is Site.EXPERT_MID for _, site in guided):
        # expert_mid hints are per (token, top-k slot): without replay the slots may hold other experts.
        raise ValueError("trace mode with expert_mid guidance needs replay_routing=True")
    if any(not 0 <= layer < n_layers for layer, _ in guided):
        raise ValueError(f"records name layers outside [0, {n_layers}): {sorted({i for i, _ in guided})}")
    plan = spec.forward_plan or PrecisionPlan()
    for layer, site in sorted(guided):
        name, want = record_prefix(layer, site), plan.site_format(site)
        record = read_record(records[0], name)
        if record.fmt.value != want:
            raise ValueError(f"{name}: the records are {record.fmt.value} but the precision plan says {want}")
        if spec.mode is TrainerMode.TRACE:
            # records from another writer (a store, another engine) reach here unchecked by a generate
            check_supported(plan, record.spec if isinstance(record, CompactRecord) else record.mode,
                            field=f"{name}'s recorded guidance")
    return guided


def _in_record_order(record: SiteRecord | torch.Tensor, rows: RowMap, name: str):
    """The batch's concatenated record of one site (or routing) at the positions the forward covers."""
    if rows.complete:
        return record
    index = rows.index
    if isinstance(record, torch.Tensor):
        return record[index]
    try:
        return record.select(index)
    except ValueError as e:
        raise ValueError(f"{name}: the forward covers only some positions of the trajectories, and {e}") from None


@dataclasses.dataclass
class TrainerForward:
    """The handle :func:`trainer_forward` yields: the forward's path and row map."""

    path: TrainerGuidance
    rows: RowMap

    def report(self) -> ForwardReport:
        """Codes and grids per trajectory, router flips, decode failures of the forward that ran."""
        path, counts = self.path, list(self.rows.counts)
        codes, values = (
            [dict(zip(d, parts)) for parts in zip(*(v.split(counts) for v in d.values()))] if d else [{} for _ in counts]
            for d in (path.codes, path.values))
        grids: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]] = [{} for _ in counts]
        for name, (sc, amax) in path.grids.items():
            for t, (s_part, a_part) in enumerate(zip(sc.split(counts), [None] * len(counts) if amax is None
                                                     else amax.split(counts))):
                grids[t][name] = (s_part, a_part)
        flips = {layer: f / max(n, 1) for layer, (f, n) in path.router_flips.items()}
        stale = 0 if path.stale is None else int(path.stale.sum())
        return ForwardReport(codes, grids, flips, path.decode_report, stale, values)


@contextlib.contextmanager
def trainer_forward(
    model: PreTrainedModel,
    rows: RowMap,
    records: Sequence[Mapping[str, torch.Tensor]] | None = None,
    spec: TrainerSpec = TrainerSpec(),
    *,
    versions: Sequence[torch.Tensor] | None = None,
    policy_version: int | None = None,
) -> Iterator[TrainerForward]:
    """Run the enclosed model forward (exactly one) as the trainer's, under ``spec``.

    ``model``: prepared (:func:`tracefp4.engines.model.prepare_model`). ``rows``: the forward's rows
    (:class:`~tracefp4.engines.rows.RowMap`); run the forward at ``rows.position_ids``. ``records[t]``:
    trajectory t's rollout record (names ``L{layer:02d}.{site}.{field}`` and ``L{layer:02d}.routing``,
    leading dim ``rows.lengths[t]``; from the rollout engine or
    :meth:`tracefp4.guidance.store.StoreReader.batch`). Inside, call the model as usual (a cache or
    none, any attention mask); gradients flow to every parameter (straight-through at the FP4 sites,
    through the recomputed router probabilities under replay). Afterwards
    :meth:`TrainerForward.report` has the codes, router flips, decode failures and stale rows.

    ``versions[t]`` (integer ``[rows.lengths[t]]``) and ``policy_version``, given together: the policy
    version of the weights that computed each of trajectory t's record rows, and the trainer's own; in
    ``trace`` mode a row more than ``spec.guidance_max_lag`` versions behind is rounded to nearest (see
    the module docstring). A row newer than ``policy_version`` is a ValueError.
    """
    guided = _check_records(model, rows.lengths, records, spec)
    lag = _lags(versions, policy_version, rows)
    hints: dict[str, SiteRecord] = {}
    stale = None
    if spec.mode is TrainerMode.TRACE:
        assert records is not None
        for layer, site in sorted(guided):
            name = record_prefix(layer, site)
            hints[name] = _in_record_order(record_cat([read_record(rec, name) for rec in records]), rows, name)
        if lag is not None:
            stale = _in_record_order(lag, rows, "versions") > spec.guidance_max_lag
    replay = None
    if spec.replay_routing and records is not None:
        replay = {
            layer: _in_record_order(torch.cat([rec[routing_key(layer)] for rec in records]), rows, routing_key(layer))
            .to(model.device, torch.long)
            for layer in model_layers(model)[1]
        }
    path = TrainerGuidance(hints, replay, spec.capture_codes, rows, stale, spec.capture_values)
    with forward_state(model, spec.forward_plan, path):
        yield TrainerForward(path, rows)


def _lags(versions: Sequence[torch.Tensor] | None, policy_version: int | None, rows: RowMap) -> torch.Tensor | None:
    """int64 lag of every record row (trajectories concatenated), or None without versions; every way
    the versions can disagree with the batch is a ValueError naming the trajectory (and row)."""
    if versions is None and policy_version is None:
        return None
    if versions is None or policy_version is None:
        raise ValueError("versions and policy_version go together: the record rows' versions and the trainer's own")
    if not isinstance(policy_version, int) or isinstance(policy_version, bool) or policy_version < 0:
        raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
    if len(versions) != len(rows.lengths):
        raise ValueError(f"{len(versions)} version rows for {len(rows.lengths)} trajectories")
    for t, (v, n) in enumerate(zip(versions, rows.lengths)):
        if not isinstance(v, torch.Tensor) or v.is_floating_point() or v.is_complex() or tuple(v.shape) != (n,):
            got = f"{v.dtype} {list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"trajectory {t}: versions must be an integer tensor [{n}] (its record's rows), got {got}")
        newer = (v > policy_version).nonzero()
        if newer.numel():
            p = int(newer[0])
            raise ValueError(f"trajectory {t}, row {p}: computed by policy version {int(v[p])}, newer than the "
                             f"trainer's {policy_version}")
        older = (v < 0).nonzero()
        if older.numel():
            p = int(older[0])
            raise ValueError(f"trajectory {t}, row {p}: policy version {int(v[p])} (an engine that did not know "
                             "its weights' version: give it one with load_weights, or stamp the rows)")
    return policy_version - torch.cat([v.cpu().to(torch.int64) for v in versions])


def logprob_rows(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float32 ``log_softmax(logits / temperature)`` over the vocabulary (``logits [..., V]``)."""
    return torch.log_softmax(logits.to(torch.float32) / temperature, dim=-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` in float32 at ``targets`` (``logits [..., V]``,
    ``targets [...]``): the sampled-token log-prob as both engines define it."""
    return logprob_rows(logits, temperature).gather(-1, targets[..., None]).squeeze(-1)


def forward_logprobs(
    model: PreTrainedModel,
    token_ids: Sequence[torch.Tensor],
    prompt_lens: Sequence[int],
    records: Sequence[Mapping[str, torch.Tensor]] | None = None,
    spec: TrainerSpec | None = None,
    *,
    versions: Sequence[torch.Tensor] | None = None,
    policy_version: int | None = None,
    **fields,
) -> TrainerOutput:
    """Teacher-forced log-probs of the completions ``token_ids[b][prompt_lens[b]:]``, in one packed forward.

    ``records[b]`` is trajectory b's rollout record (see :class:`tracefp4.engines.rollout.RolloutOutput`).
    ``spec`` says how (:class:`TrainerSpec`; its plan must be the rollout's); ``fields`` replace the
    spec's (``mode="qat"``, ``capture_codes=...``). ``versions`` and ``policy_version``: the records'
    per-row versions and the trainer's own, as :func:`trainer_forward` takes them.
    """
    spec = TrainerSpec.of(spec, **fields)
    ids = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for t in token_ids]
    lengths = [t.numel() for t in ids]
    if len(lengths) != len(prompt_lens) or not lengths:
        raise ValueError(f"{len(lengths)} sequences but {len(prompt_lens)} prompt lengths")
    for b, (length, p) in enumerate(zip(lengths, prompt_lens)):
        if not 1 <= p <= length:
            raise ValueError(f"trajectory {b}: prompt length {p} not in [1, {length}]")
    device = model.device
    rows = RowMap.packed(lengths)
    input_ids = torch.cat(ids).to(device)[None]
    position_ids = rows.position_ids.to(device)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    # Row i predicts token i+1: completion tokens P..T-1 of trajectory b come from rows
    # offsets[b] + P-1 .. offsets[b] + T-2; only those go through lm_head.
    keep = torch.cat([torch.arange(o + p - 1, o + n - 1) for o, p, n in zip(offsets, prompt_lens, lengths)])
    targets = input_ids[0, keep + 1]
    segments = Segments.of(lengths) if spec.packed_attention.per_sequence(sum(lengths)) else None
    if segments is not None:
        # never read (each sequence attends causally on its own rows); empty, so that an attention that
        # did not take the segments fails on it instead of attending over the whole row
        mask, extra = torch.zeros((1, 1, 0, 0), dtype=torch.bool, device=device), {SEGMENTS_KWARG: segments}
    else:
        # Built here, without a cache: transformers detects packed sequences only when there is none.
        mask, extra = create_causal_mask(
            config=model.config,
            inputs_embeds=torch.empty((1, input_ids.shape[1], 0), dtype=model.dtype, device=device),
            attention_mask=None,
            **{CACHE_KWARG: None},
            position_ids=position_ids,
        ), {}
    with trainer_forward(model, rows, records, spec, versions=versions, policy_version=policy_version) as fwd:
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False,
                    logits_to_keep=keep.to(device), **extra)
    if segments is not None:
        segments.check_engaged(model_layers(model)[0])
    rows_logp = logprob_rows(out.logits[0], spec.temperature)
    token_logp = rows_logp.gather(-1, targets[:, None]).squeeze(-1)
    report = fwd.report()
    counts = [n - p for p, n in zip(prompt_lens, lengths)]
    return TrainerOutput(list(token_logp.split(counts)), report.codes, report.grids, report.router_flips,
                         list(rows_logp.split(counts)), report.decode, report.stale_rows,
                         report.values)


def forward_rollout(model: PreTrainedModel, rollout: RolloutOutput, spec: TrainerSpec | None = None,
                    **fields) -> TrainerOutput:
    """:func:`forward_logprobs` over a rollout's trajectories, records and precision plan."""
    spec = TrainerSpec.of(spec, **fields)
    return forward_logprobs(model, rollout.token_ids, rollout.prompt_lens, rollout.records,
                            dataclasses.replace(spec, plan=rollout.plan))


# --- code mismatch (metrics) ---------------------------------------------------------------------


@dataclasses.dataclass
class SiteMismatch:
    """Elements whose codeword differs between the trainer and the rollout at one site."""

    mismatched: int
    total: int
    one_apart: int

    def add(self, diff: torch.Tensor) -> None:
        """Count codewords at distance ``diff`` on the signed line (0: the same codeword)."""
        self.mismatched += int((diff != 0).sum())
        self.one_apart += int((diff == 1).sum())
        self.total += diff.numel()


class MismatchKey(enum.Enum):
    """What :func:`code_mismatch` groups its counts by."""

    SITE = "site"  # the site's record prefix, ``L07.k``
    LAYER = "layer"  # the layer's tag, ``L07`` (every site of the layer)
    POSITION = "position"  # a key of the row's position, given by the caller (e.g. a completion bucket)


#: A position's key for ``by="position"``: (row index in the trajectory, the trajectory's prompt length) -> key.
PositionKey = Callable[[int, int], str]


def code_mismatch(
    trainer_codes: Sequence[Mapping[str, torch.Tensor]],
    diagnostics: Sequence[Mapping[str, torch.Tensor]],
    by: str | tuple[str, ...] = "site",
    *,
    prompt_lens: Sequence[int] | None = None,
    position_key: PositionKey | None = None,
) -> dict[str, SiteMismatch] | dict[str, dict[str, SiteMismatch]]:
    """How many codewords the trainer (``TrainerOutput.codes``) picked differently from the rollout (its
    full codes, ``RolloutOutput.diagnostics`` or full-mode records: ``{prefix}.codes``), and how many of
    those are one apart, grouped by one :class:`MismatchKey` (``by="site"``, the default:
    ``{site: counts}``) or by several at once (``by=("layer", "position")``: ``{"layer": {...},
    "position": {...}}``). Grouping by position needs each trajectory's ``prompt_lens`` and a
    ``position_key``; a site's rows are its positions."""
    keys = [MismatchKey(g) for g in ((by,) if isinstance(by, str) else by)]
    if MismatchKey.POSITION in keys and (prompt_lens is None or position_key is None):
        raise ValueError("code_mismatch by position needs prompt_lens and position_key")
    out: dict[MismatchKey, dict[str, SiteMismatch]] = {k: {} for k in keys}
    for b, name, diff in _code_diffs(trainer_codes, diagnostics):
        for k in keys:
            if k is MismatchKey.POSITION:
                _count_positions(out[k], diff, prompt_lens[b], position_key)
            else:
                group = name if k is MismatchKey.SITE else layer_tag(parse_name(f"{name}.codes").layer)
                out[k].setdefault(group, SiteMismatch(0, 0, 0)).add(diff)
    return out[keys[0]] if isinstance(by, str) else {k.value: out[k] for k in keys}


def _code_diffs(trainer_codes: Sequence[Mapping[str, torch.Tensor]], diagnostics: Sequence[Mapping[str, torch.Tensor]]
                ) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(trajectory, site prefix, distance on the signed line of each codeword) for every captured site."""
    if len(trainer_codes) != len(diagnostics):
        raise ValueError(f"{len(trainer_codes)} trajectories of codes for {len(diagnostics)} of the rollout's")
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
            yield b, name, (code_positions(packed.cpu(), fmt) - code_positions(rec[key].cpu(), fmt)).abs()


def _count_positions(out: dict[str, SiteMismatch], diff: torch.Tensor, prompt_len: int, key: PositionKey) -> None:
    rows = diff.reshape(diff.shape[0], -1)
    mis, one = (rows != 0).sum(1), (rows == 1).sum(1)
    for pos in range(rows.shape[0]):
        s = out.setdefault(key(pos, prompt_len), SiteMismatch(0, 0, 0))
        s.mismatched += int(mis[pos])
        s.one_apart += int(one[pos])
        s.total += rows.shape[1]
