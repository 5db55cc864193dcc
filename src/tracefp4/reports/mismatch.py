"""The mismatch report: how far the trainer's FP4 numbers are from the rollout's, and what TRACE costs.

``tracefp4 mismatch`` builds a tiny Qwen3-MoE (or loads a local checkpoint), samples B ragged prompts,
runs the rollout engine in four modes and the trainer on each mode's own completions, and reports
the metrics of ``docs/contracts.md`` section 5:

* **FP4 code mismatch rate** per site kind and layer, trainer vs rollout, for vanilla QAT and for the
  trainer guided by ``lsb`` hints on the deeper half / by full hints on every layer; and the share of
  QAT mismatches exactly one codeword apart (what makes a 1-bit hint sufficient).
* **Router flip rate without replay**: the share of (token, MoE layer) pairs whose top-k expert set
  differs between the rollout and a trainer that follows its own router.
* **Log-prob gap** per arm (rollout / trainer): bf16/bf16, fp4/qat, fp4+lsb/trace, fp4+full/trace:
  mean and max |delta logp| and k3 KL over completion tokens (:func:`tracefp4.pipeline.metrics.logprob_gap`).
* **Guidance bytes per generated token**, full information on all layers vs the compact default (lsb
  on the deeper half), through the record store's own accounting (:func:`tracefp4.guidance.store.bytes_per_token`).

``tracefp4 mismatch --plan fp8`` measures the same for W8A8 FP8 rollouts (E4M3 codes at every site,
:meth:`~tracefp4.engines.plan.PrecisionPlan.fp8`); its lsb arm guides every layer (see
:func:`report_guidance`), and the code tables count E4M3 codes (one apart: adjacent E4M3 codewords).

``tracefp4 mismatch --sweep [--modes M1,M2] [--json PATH] [--plot PATH]`` measures instead every
guidance mode of :mod:`tracefp4.guidance.compact` against bytes per token (:mod:`tracefp4.reports.sweep`;
the command line joins the two in :mod:`tracefp4.reports.commands`).

Decisions (and why)
    * **Each arm compares its own rollout with its own trainer.** The bf16 rollout samples different
      tokens than the FP4 ones; that is fine, nothing is compared across arms except the summary
      figures. The trace arms' trainer consumes exactly the records of the matching rollout.
    * **Records go through the store.** Both trace rollouts' records are written with
      :class:`~tracefp4.guidance.store.StoreWriter`, sealed, read back with :class:`~tracefp4.guidance.store.StoreReader`
      (checksums verified) and *those* tensors feed the trace trainers and the code comparison, so the
      report exercises the full rollout -> store -> trainer path, and the byte figures are the store's.
    * **Codes of the lsb rollout.** An lsb record keeps one bit per element, so the codes the trace-lsb
      trainer is compared against are those of the full-hint rollout. That is sound only because the
      FP4 rollouts are numerically identical (recording changes nothing the model computes and the
      sampler's seed is the same): the report *checks* it (same tokens, same routing, and at every
      lsb-guided site the low bits, block scales and global amax of the full record equal the lsb
      record) and refuses to report otherwise.
    * **Vanilla QAT codes** are captured by a QAT trainer run over the full-hint records (capture needs
      named sites; the QAT trainer ignores hints). Its log-prob gap is measured separately, on the
      vanilla ``fp4`` rollout and its own (routing-only) records.
    * **Routing replay (R3) is on** for every log-prob and code-mismatch arm, the trainer's default;
      the router flip rate is measured by a separate trainer forward with replay off, reading the
      top-k indices its routers choose with a forward hook. The trainer's own ``router_flips``
      (computed under replay, i.e. conditional on replayed upstream layers) is reported next to it.
    * **Mismatch rates are compared at comparable sites**: QAT at all sites and at the deeper-half
      sites (where the lsb arm is guided); the lsb arm at its guided sites; the full arm at all sites.
    * Shares with an empty denominator (no mismatches at all) are ``null`` in the JSON, not 0 or NaN.
    * The ``*_deeper_half`` totals are taken at the lsb arm's guided layers: the deeper half, or every
      layer under ``--plan fp8`` (then equal to the all-sites totals).
    * The ratio of full to compact bytes depends on the dims: each row (token, token x expert, token x
      KV head) carries a 4-byte global amax in both, which dominates at hidden size 64. The report also
      gives the ratio without the amax (``ratio_without_amax``: 4.5 / 1.5 bits x layer share = 6 for
      the deeper half), the paper's asymptotic figure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from tracefp4.engines.model import (TinyDenseSpec, TinyMoESpec, from_config, load_model, model_layers, moe_layers,
                                    tiny_config)
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutOutput, SamplingParams
from tracefp4.engines.trainer import SiteMismatch, TrainerOutput, TrainerSpec, code_mismatch, forward_logprobs
from tracefp4.formats.constants import HintMode
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.hints import lsb_of_codes, record_format
from tracefp4.guidance.names import Site, layer_tag, record_prefix, routing_key
from tracefp4.pipeline.factory import EngineKind
from tracefp4.pipeline.metrics import Name, at_sites, mismatch_by, mismatch_summary
from tracefp4.pipeline.measure import (
    ArmRun,
    config_signature,
    gap,
    mlp_text,
    model_section,
    run_arms,
    same_rollout,
    store_bytes,
    store_root,
)
from tracefp4.pipeline import arms as arm_table
from tracefp4.pipeline.arms import RUN_PLAN, Arm, make_arm, rollout_guidance
from tracefp4.reports.publish import publish

__all__ = [
    "DEFAULTS",
    "MODEL_DIMS",
    "make_prompts",
    "build_model",
    "mismatch_report",
    "format_report",
    "add_arguments",
    "run_cli",
]

#: Defaults of the command: a model small enough that the whole report takes seconds on 2 cores
#: (the README's figures are measured with them).
DEFAULTS: dict[str, Any] = dict(
    # the tiny MoE's dims, with this report's own expert dim, vocabulary and (peaked) init
    **dataclasses.asdict(TinyMoESpec(moe_intermediate=32, vocab=64, init_std=0.1)),
    batch=8,
    new_tokens=32,
    prompt_len=12,
    temperature=1.0,
    seed=0,
)
#: The keys of :data:`DEFAULTS` that shape the model (arguments of :func:`tracefp4.engines.model.tiny_config`).
MODEL_DIMS = (
    "layers", "experts", "top_k", "hidden", "moe_intermediate", "heads", "kv_heads", "head_dim", "vocab", "init_std",
)  # fmt: skip

_SITES = tuple(s.value for s in Site)


# --- inputs ---------------------------------------------------------------------------------------


def make_prompts(batch: int, vocab: int, max_len: int, seed: int) -> list[torch.Tensor]:
    """``batch`` ragged prompts of random token ids, lengths in ``[max(1, max_len // 2), max_len]``;
    deterministic in ``seed`` (own generator, the global RNG is untouched)."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"need batch >= 1 and prompt length >= 1, got {batch}, {max_len}")
    g = torch.Generator().manual_seed(seed)
    lo = max(1, max_len // 2)
    lengths = torch.randint(lo, max_len + 1, (batch,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def build_model(checkpoint: str | os.PathLike[str] | None = None, seed: int = 0, dense: bool = False, **dims: Any):
    """A prepared model: loaded from a local folder, or a fresh tiny Qwen3-MoE whose dims not given
    take this report's :data:`DEFAULTS`; ``dense``: that MoE's dense twin of the same active size
    instead (a Qwen3 whose MLP is ``top_k x moe_intermediate`` wide, :meth:`TinyDenseSpec.active_twin`)."""
    if checkpoint is not None:
        return load_model(checkpoint)
    moe = TinyMoESpec(**{**{k: DEFAULTS[k] for k in MODEL_DIMS}, **dims})
    if dense:
        return from_config(TinyDenseSpec.active_twin(moe).config(), seed=seed)
    return from_config(tiny_config(**dataclasses.asdict(moe)), seed=seed)


# --- measurements of this report ------------------------------------------------------------------


class _Phases:
    """Named, timed steps of the report, announced through ``progress``."""

    def __init__(self, progress: Callable[[str], None] | None) -> None:
        self.say = progress or (lambda msg: None)
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.say(f"{name} ...")
        t0 = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - t0
        self.say(f"{name}: {self.seconds[name]:.1f}s")


@contextlib.contextmanager
def _capture_routing(model) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Top-k indices each MoE router hands to the experts (after tracefp4's own hook), per layer."""
    captured: dict[int, list[torch.Tensor]] = {}
    handles = []
    for m in moe_layers(model):

        def hook(module, args, output, layer=m.index):
            captured.setdefault(layer, []).append(output[2].detach().cpu())

        handles.append(m.router.register_forward_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def _router_flips_without_replay(model, rollout: RolloutOutput, mode: str) -> dict[str, Any]:
    """Trainer forward with ``replay_routing=False``; share of (token, layer) whose top-k set differs
    from the rollout's recorded one, over every position (prompt and completion)."""
    with _capture_routing(model) as captured, torch.no_grad():
        forward_logprobs(
            model, rollout.token_ids, rollout.prompt_lens, None, TrainerSpec(mode, rollout.plan, replay_routing=False)
        )
    per_layer: dict[str, float] = {}
    flips = total = 0
    for layer in model_layers(model)[1]:
        if len(captured.get(layer, ())) != 1:
            raise RuntimeError(f"expected one router call at layer {layer}, got {len(captured.get(layer, ()))}")
        own = captured[layer][0].long().sort(dim=-1).values
        rec = torch.cat([r[routing_key(layer)] for r in rollout.records]).long().sort(dim=-1).values
        if own.shape != rec.shape:
            raise RuntimeError(f"{layer_tag(layer)}: trainer routed {tuple(own.shape)}, rollout recorded {tuple(rec.shape)}")
        differ = int((own != rec).any(dim=-1).sum())
        per_layer[layer_tag(layer)] = differ / own.shape[0]
        flips, total = flips + differ, total + own.shape[0]
    # a dense model has no router: no rate (None), not a rate of 0
    return {"rate": flips / total if total else None, "flips": flips, "token_layers": total, "per_layer": per_layer}


def _check_lsb_matches_full(
    lsb: Sequence[Mapping[str, torch.Tensor]], full: Sequence[Mapping[str, torch.Tensor]]
) -> None:
    """At every lsb-guided site, the full record names the same codes' low bits, scales and amax."""
    for b, (rl, rf) in enumerate(zip(lsb, full)):
        for name, bits in rl.items():
            if not name.endswith(".bits"):
                continue
            prefix = name[: -len(".bits")]
            fmt = record_format(rf[f"{prefix}.scales"], f"trajectory {b}, {prefix}")
            same = torch.equal(lsb_of_codes(rf[f"{prefix}.codes"], fmt), bits)
            for fld in ("scales", "global_amax"):
                if f"{prefix}.{fld}" in rl:
                    x, y = rl[f"{prefix}.{fld}"], rf[f"{prefix}.{fld}"]
                    same = same and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            if not same:
                raise RuntimeError(
                    f"trajectory {b}, {prefix}: the lsb and full-hint rollouts quantized differently; "
                    "the trace-lsb code mismatch cannot be measured against the full record"
                )


@dataclasses.dataclass
class _Stored:
    """The trace rollouts' records as read back from the store, and the store's byte accounting."""

    full_records: list[dict[str, torch.Tensor]]
    lsb_records: list[dict[str, torch.Tensor]]
    bytes_full: dict[str, Any]
    bytes_compact: dict[str, Any]


# --- the report, step by step ---------------------------------------------------------------------


#: The plans the report measures under (``--plan``; names of :meth:`PrecisionPlan.named`).
REPORT_PLANS = ("nvfp4", "fp8")


def report_guidance(plan_name: str) -> str:
    """The lsb guidance the report's trace arm records under ``plan_name``: that of the arm table's
    plain lsb-guided TRACE arm of the plan (``trace`` under the run's NVFP4 plan: the deeper half;
    ``trace-fp8``: every layer, since E4M3's step is small beside the drift unguided FP8 layers pass on)."""
    want = RUN_PLAN if plan_name == "nvfp4" else plan_name
    for name, spec in arm_table.ARMS.items():
        mode = rollout_guidance(spec)
        if (spec.plan == want and "<n>" not in name and spec.loss is arm_table.PolicyLoss.GRPO and mode is not None
                and GuidedMode.parse(mode).mode is HintMode.LSB):
            return mode
    raise ValueError(f"plan {plan_name!r}: the arm table has no lsb-guided arm for it")


def arm_descriptions(plan_name: str = "nvfp4") -> dict[str, tuple[str, str]]:
    """The report's arms under a plan of :data:`REPORT_PLANS`: key -> (rollout description, trainer mode)."""
    label = "fp4" if plan_name == "nvfp4" else plan_name
    out = {}
    for name in arm_table.report_arms("mismatch"):
        spec = arm_table.ARMS[name]
        mode = rollout_guidance(spec)
        if mode == arm_table.DEFAULT_GUIDANCE:
            mode = report_guidance(plan_name)
        if spec.plan is None:
            rollout = "bf16"
        elif mode is None:
            rollout = label
        else:
            g = GuidedMode.parse(mode)
            rollout = f"{label} + {g.mode.value} hints, {'all layers' if g.layers == 'all' else 'deeper half'}"
        out[name] = (rollout, spec.trainer.value)
    return out


def report_arms(plan_name: str, n_layers: int) -> dict[str, Arm]:
    """The report's arms (the arm table's ``bf16``, ``qat``, ``trace`` and ``trace-full``) under a plan of :data:`REPORT_PLANS`, whose lsb mode the trace arm records
    (:func:`report_guidance`)."""
    plan, lsb = PrecisionPlan.named(plan_name), report_guidance(plan_name)
    return {name: make_arm(name, guidance=lsb, n_layers=n_layers, plan=plan) for name in arm_table.report_arms("mismatch")}


def _fp4_rollouts_identical(rollouts: Mapping[str, RolloutOutput]) -> bool:
    """Whether every FP4 rollout sampled the same tokens and routing; the two trace ones must."""
    if not same_rollout(rollouts["trace"], rollouts["trace-full"]):
        raise RuntimeError(
            "the lsb and full-hint FP4 rollouts sampled different tokens or routing: recording changed the "
            "numerics, so the trace-lsb code mismatch cannot be measured"
        )
    return same_rollout(rollouts["qat"], rollouts["trace"]) and same_rollout(
        rollouts["qat"], rollouts["trace-full"]
    )


def _stored(root, runs: Mapping[str, ArmRun], signature: str) -> _Stored:
    """Both trace rollouts' records as read back from the store, checked against each other, and the
    store's bytes of each."""
    full, lsb = runs["trace-full"], runs["trace"]
    _check_lsb_matches_full(lsb.rollout.records, full.rollout.records)
    return _Stored(full.rollout.records, lsb.rollout.records, store_bytes(root, full.step, signature),
                   store_bytes(root, lsb.step, signature))


def _qat_codes(model, roll_full: RolloutOutput, phase: _Phases) -> TrainerOutput:
    """A QAT trainer's codes at every layer, over the full-hint rollout (the QAT trainer ignores the
    hints; the codes are compared with the full record's)."""
    every = roll_full.guidance.layer_indices(model_layers(model)[0])
    with phase("trainer qat, capturing codes at all sites"), torch.no_grad():
        return forward_logprobs(model, roll_full.token_ids, roll_full.prompt_lens, roll_full.records,
                                TrainerSpec("qat", roll_full.plan, capture_codes=every))


def _code_stats(
    qat_codes: TrainerOutput, trainers: Mapping[str, TrainerOutput], full_records
) -> dict[str, dict[str, SiteMismatch]]:
    """Per arm and site, the trainer's codes against the full-hint rollout's (see the module docstring)."""
    return {
        "qat": code_mismatch(qat_codes.codes, full_records),
        "trace": code_mismatch(trainers["trace"].codes, full_records),
        "trace-full": code_mismatch(trainers["trace-full"].codes, full_records),
    }


def _aggregates(stats: Mapping[str, Mapping[str, SiteMismatch]], compact_layers) -> dict[str, dict[str, Any]]:
    """Totals at comparable sites: QAT everywhere and on the deeper half, each trace arm at its guided sites."""
    deeper = lambda layer, site: layer in compact_layers  # noqa: E731
    return {
        "qat": mismatch_summary(stats["qat"].values()),
        "qat_deeper_half": mismatch_summary(at_sites(stats["qat"], deeper)),
        "trace": mismatch_summary(stats["trace"].values()),  # its guided sites = the deeper half
        "trace-full": mismatch_summary(stats["trace-full"].values()),
        "trace-full_deeper_half": mismatch_summary(at_sites(stats["trace-full"], deeper)),
    }


def _per_site_table(
    stats: Mapping[str, Mapping[str, SiteMismatch]], stored: _Stored, n_layers: int
) -> dict[str, dict[str, Any]]:
    """site -> layer -> elements, mismatch rate and adjacent share per arm, bytes per token full/compact."""
    per_site: dict[str, dict[str, Any]] = {}
    by_site = {arm: mismatch_by(s) for arm, s in stats.items()}
    for site in _SITES:
        for layer in range(n_layers):
            name = record_prefix(layer, site)
            if name not in stats["qat"]:
                continue  # no quantized site of this layer (a dense layer)
            row: dict[str, Any] = {"elements": stats["qat"][name].total}
            for figure in (Name.CODE_MISMATCH, Name.ONE_APART):
                row[figure] = {arm: s[name][figure] if name in s else None for arm, s in by_site.items()}
            key = layer_tag(layer)
            row["bytes_per_token"] = {
                "full": stored.bytes_full["by_site_layer"].get(site, {}).get(key, 0.0),
                "compact": stored.bytes_compact["by_site_layer"].get(site, {}).get(key, 0.0),
            }
            per_site.setdefault(site, {})[key] = row
    return per_site


# --- the report's sections ------------------------------------------------------------------------


def _config_section(model, prompts, sampling: SamplingParams, plan, compact_layers) -> dict[str, Any]:
    return {
        **model_section(model),
        "batch": len(prompts),
        "prompt_lens": [int(p.numel()) for p in prompts],
        "new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "seed": sampling.seed,
        "plan": {k: plan.to_dict()[k] for k in ("weights", "activations", "kv_cache")},
        "compact_layers": sorted(compact_layers),
        "routing_replay": True,
    }


def _router_flip_section(flips: Mapping[str, dict[str, Any]], trainers: Mapping[str, TrainerOutput]) -> dict:
    return {
        "qat": flips["qat"],
        "bf16": flips["bf16"],
        # The trainer's own figure: under replay, its router's choice given replayed upstream layers.
        "under_replay": {
            arm: {
                "mean": sum(t.router_flips.values()) / len(t.router_flips) if t.router_flips else None,
                "per_layer": {layer_tag(k): v for k, v in sorted(t.router_flips.items())},
            }
            for arm, t in trainers.items()
        },
    }


def _bytes_section(stored: _Stored) -> dict[str, Any]:
    full, compact = stored.bytes_full, stored.bytes_compact
    amax_full = full["by_field"].get("global_amax", 0.0)
    amax_compact = compact["by_field"].get("global_amax", 0.0)
    return {
        "full_all_layers": full["guidance"],
        "compact_default": compact["guidance"],
        "ratio": full["guidance"] / compact["guidance"],
        "ratio_without_amax": (full["guidance"] - amax_full) / (compact["guidance"] - amax_compact),
        "routing": full["routing"],
        "full_detail": full,
        "compact_detail": compact,
    }


def mismatch_report(
    model,
    prompts: Sequence[torch.Tensor],
    sampling: SamplingParams,
    *,
    store_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
    engine=None,
    plan_name: str = "nvfp4",
) -> dict[str, Any]:
    """Run the four rollouts and their trainers; return the report as a JSON-ready dict.
    ``engine``: the rollout engine (None: ours on ``model``; e.g. a ``VLLMEngine`` over the same weights);
    ``plan_name``: a key of :data:`REPORT_PLANS` (NVFP4 W4A4, or W8A8 FP8)."""
    if plan_name not in REPORT_PLANS:
        raise ValueError(f"plan {plan_name!r}: expected one of {sorted(REPORT_PLANS)}")
    arms = arm_descriptions(plan_name)
    t_start = time.perf_counter()
    phase = _Phases(progress)
    n_layers, _ = model_layers(model)
    compact_layers = GuidedMode.parse(report_guidance(plan_name)).layer_indices(n_layers)
    signature = config_signature("mismatch", model.config)
    with store_root(store_dir, "tracefp4-mismatch-") as root:
        runs = run_arms(model, prompts, sampling, report_arms(plan_name, n_layers), root, signature, engine=engine,
                        phase=phase)
        stored = _stored(root, runs, signature)
    rollouts = {arm: r.rollout for arm, r in runs.items()}
    trainers = {arm: r.trainer for arm, r in runs.items()}
    fp4_identical = _fp4_rollouts_identical(rollouts)
    qat_codes = _qat_codes(model, rollouts["trace-full"], phase)
    with phase("router flips without replay (qat, bf16)"):
        flips = {arm: _router_flips_without_replay(model, rollouts[arm], arms[arm][1]) for arm in ("qat", "bf16")}
    stats = _code_stats(qat_codes, trainers, stored.full_records)
    agg = _aggregates(stats, compact_layers)
    roll_full = rollouts["trace-full"]
    return {
        "engine": EngineKind.HOME.value if engine is None else engine.name,
        "plan_name": plan_name,
        "arms": {arm: list(v) for arm, v in arms.items()},
        "config": _config_section(model, prompts, sampling, roll_full.plan, compact_layers),
        "tokens": {
            "positions": sum(t.numel() for t in roll_full.token_ids),
            "generated": stored.bytes_full["generated_tokens"],
            "generated_bf16": sum(lp.numel() for lp in rollouts["bf16"].logprobs),
        },
        "fp4_rollouts_identical": fp4_identical,
        Name.CODE_MISMATCH: {k: v[Name.CODE_MISMATCH] for k, v in agg.items()},
        Name.ONE_APART: {k: v[Name.ONE_APART] for k, v in agg.items()},
        "mismatch_counts": {k: {f: v[f] for f in ("mismatched", "one_apart", "total")} for k, v in agg.items()},
        Name.ROUTER_FLIPS: flips["qat"]["rate"],
        "router_flip": _router_flip_section(flips, trainers),
        "logprob_gap": {arm: gap(rollouts[arm], trainers[arm]) for arm in arms},
        "bytes_per_token": _bytes_section(stored),
        "per_site": _per_site_table(stats, stored, n_layers),
        "seconds": {**phase.seconds, "total": time.perf_counter() - t_start},
    }


# --- presentation ---------------------------------------------------------------------------------


def _pct(x: float | None, width: int = 10) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.3%}"


def _guided_span(rep: dict[str, Any]) -> str:
    compact = rep["config"]["compact_layers"]
    return f"{layer_tag(compact[0])}-{layer_tag(compact[-1])}" if compact else "none"


def _header_lines(rep: dict[str, Any]) -> list[str]:
    c, tok = rep["config"], rep["tokens"]
    mlp = mlp_text(c)
    return [
        f"mismatch report: {c['model_type']} {c['layers']} layers, {mlp}, hidden {c['hidden']}, "
        f"{c['kv_heads']} KV heads x {c['head_dim']}",
        f"  batch {c['batch']} ragged prompts ({min(c['prompt_lens'])}-{max(c['prompt_lens'])} tokens), "
        f"{c['new_tokens']} new tokens, seed {c['seed']}: {tok['generated']} generated tokens, "
        f"{tok['positions']} positions; {_kind(rep)} rollouts identical across modes: {rep['fp4_rollouts_identical']}",
        f"  rollout engine: {rep['engine']}",
        "",
    ]


def _lsb_rows_label(rep: dict[str, Any]) -> str:
    """What the ``*_deeper_half`` aggregates cover: the lsb arm's guided layers."""
    return "deeper half" if rep.get("plan_name", "nvfp4") == "nvfp4" else "lsb layers"


def _kind(rep: dict[str, Any]) -> str:
    return "FP8" if rep.get("plan_name") == "fp8" else "FP4"


def _code_table_lines(rep: dict[str, Any]) -> list[str]:
    lines = [
        f"{_kind(rep)} code mismatch rate, trainer vs rollout (routing replayed; lsb hints on {_guided_span(rep)})",
        f"{'site':<11}{'layer':<6}{'elements':>9}{'qat':>10}{'1-apart':>10}{'trace':>11}{'trace-full':>11}"
        f"{'full B/tok':>12}{'lsb B/tok':>11}",
    ]
    for site, layers in rep["per_site"].items():
        for key, row in layers.items():
            mr = row[Name.CODE_MISMATCH]
            bt = row["bytes_per_token"]
            lines.append(
                f"{site:<11}{key:<6}{row['elements']:>9}{_pct(mr['qat'])}{_pct(row[Name.ONE_APART]['qat'])}"
                f"{_pct(mr['trace'], 11)}{_pct(mr['trace-full'], 11)}{bt['full']:>12.1f}{bt['compact']:>11.1f}"
            )
    mr, adj = rep[Name.CODE_MISMATCH], rep[Name.ONE_APART]
    return lines + [
        f"{'all sites':<17}{rep['mismatch_counts']['qat']['total']:>9}{_pct(mr['qat'])}{_pct(adj['qat'])}"
        f"{'-':>11}{_pct(mr['trace-full'], 11)}",
        f"{_lsb_rows_label(rep):<17}{rep['mismatch_counts']['qat_deeper_half']['total']:>9}{_pct(mr['qat_deeper_half'])}"
        f"{_pct(adj['qat_deeper_half'])}{_pct(mr['trace'], 11)}{_pct(mr['trace-full_deeper_half'], 11)}",
        "",
    ]


def _router_flip_lines(rep: dict[str, Any]) -> list[str]:
    fl = rep["router_flip"]
    if fl["qat"]["rate"] is None:
        return ["router flips: none (a dense model: no router)", ""]
    per_layer = "  ".join(f"{k} {v:.1%}" for k, v in fl["qat"]["per_layer"].items())
    return [
        f"router flips without replay (token x MoE layer, top-k set differs): {_kind(rep).lower()}/qat "
        f"{rep[Name.ROUTER_FLIPS]:.2%} "
        f"({fl['qat']['flips']}/{fl['qat']['token_layers']}; {per_layer}),  bf16/bf16 {fl['bf16']['rate']:.2%}",
        "  under replay (trainer's router_flips, given replayed upstream layers): "
        + ",  ".join(f"{arm} {v['mean']:.2%}" for arm, v in fl["under_replay"].items() if v["mean"] is not None),
        "",
    ]


def _gap_lines(rep: dict[str, Any]) -> list[str]:
    lines = [
        "log-prob gap over completion tokens",
        f"{'arm':<12}{'rollout':<31}{'trainer':<9}{'mean|dlogp|':>13}{'max|dlogp|':>12}{'k3 KL':>12}",
    ]
    for arm, (roll, train) in rep.get("arms", arm_descriptions()).items():
        g = rep["logprob_gap"][arm]
        lines.append(f"{arm:<12}{roll:<31}{train:<9}{g[Name.GAP_MEAN]:>13.5f}{g[Name.GAP_MAX]:>12.5f}{g[Name.K3_KL]:>12.2e}")
    return lines


def _bytes_lines(rep: dict[str, Any]) -> list[str]:
    b = rep["bytes_per_token"]
    return [
        "",
        "guidance bytes per generated token (store accounting, routing excluded)",
        f"  full information, all layers: {b['full_all_layers']:10.1f}",
        f"  compact default (lsb, {_guided_span(rep)}): {b['compact_default']:8.1f}",
        f"  ratio: {b['ratio']:.2f}x   " + (
            f"(without the 4-byte per-row global amax: {b['ratio_without_amax']:.2f}x; paper: about 6x)"
            if _kind(rep) == "FP4" else "(FP8: 8-bit codes vs 1-bit hints, a 4-byte scale per row in both)"),
        f"  routing records (separate): {b['routing']:.1f} bytes per generated token",
    ]


def format_report(rep: dict[str, Any]) -> str:
    sections = (_header_lines, _code_table_lines, _router_flip_lines, _gap_lines, _bytes_lines)
    return "\n".join(line for section in sections for line in section(rep))


# --- command line (the ``mismatch`` command is assembled in tracefp4.reports.commands) ------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The report's options on the ``mismatch`` parser: the model, the batch, the store, the output."""
    m = p.add_argument_group("model (ignored with --checkpoint)")
    m.add_argument("--layers", type=int, default=None, help=f"decoder layers (default {DEFAULTS['layers']})")
    m.add_argument("--experts", type=int, default=None, help=f"routed experts (default {DEFAULTS['experts']})")
    m.add_argument("--top-k", type=int, default=None, help=f"experts per token (default {DEFAULTS['top_k']})")
    m.add_argument("--hidden", type=int, default=None, help=f"hidden size (default {DEFAULTS['hidden']})")
    m.add_argument("--moe-intermediate", type=int, default=None,
                   help=f"expert intermediate size (default {DEFAULTS['moe_intermediate']})")  # fmt: skip
    m.add_argument("--heads", type=int, default=None, help=f"attention heads (default {DEFAULTS['heads']})")
    m.add_argument("--kv-heads", type=int, default=None, help=f"KV heads (default {DEFAULTS['kv_heads']})")
    m.add_argument("--head-dim", type=int, default=None, help=f"head dim (default {DEFAULTS['head_dim']})")
    m.add_argument("--vocab", type=int, default=None, help=f"vocabulary (default {DEFAULTS['vocab']})")
    m.add_argument("--init-std", type=float, default=None,
                   help=f"initializer range (default {DEFAULTS['init_std']})")  # fmt: skip
    m.add_argument("--dense", action="store_true",
                   help="the tiny MoE's dense twin instead: a Qwen3 whose MLP is top-k x moe-intermediate wide")
    m.add_argument(
        "--checkpoint", metavar="DIR", help="load a local checkpoint folder instead (config.json + safetensors)"
    )
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="number of prompts")
    p.add_argument("--new-tokens", type=int, default=DEFAULTS["new_tokens"], help="tokens sampled per prompt")
    p.add_argument("--prompt-len", type=int, default=DEFAULTS["prompt_len"],
                   help="longest prompt; lengths are drawn from [len/2, len]")  # fmt: skip
    p.add_argument("--temperature", type=float, default=DEFAULTS["temperature"])
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="model init, prompts and sampling")
    p.add_argument("--store-dir", metavar="DIR", help="keep the guidance store here (default: a temp dir, removed)")
    p.add_argument("--json", metavar="PATH", help="also write the report (or the sweep) as JSON (atomically)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--plan", choices=REPORT_PLANS, default="nvfp4",
                   help="the rollout's precision plan: NVFP4 W4A4 (default) or W8A8 FP8 (E4M3 codes; lsb on all layers)")
    p.add_argument("--device", default="cpu",
                   help="where our engine and the trainer run: cpu, or cuda (the Triton kernels; scripts/gpu_check.py)")
    p.add_argument("--engine", choices=EngineKind.names(serving=True), default=EngineKind.HOME.value,
                   help="rollout engine: ours, or vLLM with the tracefp4 plugin (needs vLLM; head_dim >= 32 on CPU)")  # fmt: skip
    p.add_argument("--kv-store", choices=("packed", "values"), default="packed",
                   help="--engine vllm: the FP4 arms' KV cache holds packed FP4 rows (one engine per plan) or the "
                        "dequantized values (one engine for every arm)")  # fmt: skip


def run_cli(
    args: argparse.Namespace,
    model,
    prompts: Sequence[torch.Tensor],
    sampling: SamplingParams,
    say: Callable[[str], None],
    engine=None,
) -> int:
    """Run the report on prepared inputs; print it, and write it as JSON with ``--json``."""
    rep = mismatch_report(model, prompts, sampling, store_dir=args.store_dir, progress=say, engine=engine,
                          plan_name=getattr(args, "plan", "nvfp4"))
    publish(rep, format_report(rep), args.json)
    return 0
