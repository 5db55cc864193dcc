"""The mismatch report: how far the trainer's FP4 numbers are from the rollout's, and what TRACE costs.

``tracefp4 mismatch`` builds a tiny Qwen3-MoE (or loads a local checkpoint), samples B ragged prompts,
runs the rollout engine in four modes and the trainer on each mode's own completions, and reports
:

* **FP4 code mismatch rate** per site kind and layer, trainer vs rollout, for vanilla QAT and for the
  trainer guided by ``lsb`` hints on the deeper half / by full hints on every layer; and the share of
  QAT mismatches exactly one codeword apart (what makes a 1-bit hint sufficient).
* **Router flip rate without replay**: the share of (token, MoE layer) pairs whose top-k expert set
  differs between the rollout and a trainer that follows its own router.
* **Log-prob gap** per arm (rollout / trainer): bf16/bf16, fp4/qat, fp4+lsb/trace, fp4+full/trace:
  mean and max |delta logp| and k3 KL over completion tokens (:func:`tracefp4.rl.grpo.mismatch_metrics`).
* **Guidance bytes per generated token**, full information on all layers vs the compact default (lsb
  on the deeper half), through the record store's own accounting (:func:`tracefp4.guidance.store.bytes_per_token`).

``tracefp4 mismatch --sweep [--modes M1,M2] [--json PATH] [--plot PATH]`` measures instead every
guidance mode of :mod:`tracefp4.guidance.compact` against bytes per token (:mod:`tracefp4.reports.sweep`).

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
    * The ratio of full to compact bytes depends on the dims: each row (token, token x expert, token x
      KV head) carries a 4-byte global amax in both, which dominates at hidden size 64. The report also
      gives the ratio without the amax (``ratio_without_amax``: 4.5 / 1.5 bits x layer share = 6 for
      the deeper half), the paper's asymptotic figure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutOutput, SamplingParams
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.names import Site, deeper_half, layer_tag, record_prefix, routing_key
from tracefp4.files import atomic_write_json
from tracefp4.rl.grpo import mismatch_metrics
from tracefp4.formats.numerics import lsb_bits
from tracefp4.engines.model import TinyMoESpec, from_config, load_model, model_layers, moe_layers
from tracefp4.engines.rollout import generate
from tracefp4.guidance.store import StoreReader, StoreWriter, bytes_per_token, parse_name, seal_step
from tracefp4.engines.trainer import SiteMismatch, TrainerOutput, code_mismatch, forward_logprobs, forward_rollout

__all__ = [
    "DEFAULTS",
    "ARMS",
    "tiny_config",
    "make_prompts",
    "build_model",
    "mismatch_report",
    "format_report",
    "add_parser",
    "run_cli",
    "main",
]

#: Defaults of the command: a model small enough that the whole report takes seconds on 2 cores.
DEFAULTS: dict[str, Any] = dict(
    # the tiny MoE's dims, with this report's own expert dim, vocabulary and (peaked) init
    **dataclasses.asdict(TinyMoESpec(moe_intermediate=32, vocab=64, init_std=0.1)),
    batch=8,
    new_tokens=32,
    prompt_len=12,
    temperature=1.0,
    seed=0,
)
_MODEL_DIMS = (
    "layers", "experts", "top_k", "hidden", "moe_intermediate", "heads", "kv_heads", "head_dim", "vocab", "init_std",
)  # fmt: skip

#: arm -> (rollout description, trainer mode)
ARMS: dict[str, tuple[str, str]] = {
    "bf16": ("bf16", "bf16"),
    "qat": ("fp4", "qat"),
    "trace_lsb": ("fp4 + lsb hints, deeper half", "trace"),
    "trace_full": ("fp4 + full hints, all layers", "trace"),
}
_SITES = tuple(s.value for s in Site)
_POLICY_VERSION = 0
_WRITER = "mismatch-report"
_STEP_FULL, _STEP_COMPACT = 0, 1


# --- inputs --------------------------------------------------------------------------------------


def tiny_config(**dims):
    """A small Qwen3-MoE config: :func:`tracefp4.engines.model.tiny_config` with this report's defaults."""
    from tracefp4.engines.model import tiny_config as _tiny

    return _tiny(**{k: dims.get(k, DEFAULTS[k]) for k in DEFAULTS}, **{k: v for k, v in dims.items() if k not in DEFAULTS})


def make_prompts(batch: int, vocab: int, max_len: int, seed: int) -> list[torch.Tensor]:
    """``batch`` ragged prompts of random token ids, lengths in ``[max(1, max_len // 2), max_len]``;
    deterministic in ``seed`` (own generator, the global RNG is untouched)."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"need batch >= 1 and prompt length >= 1, got {batch}, {max_len}")
    g = torch.Generator().manual_seed(seed)
    lo = max(1, max_len // 2)
    lengths = torch.randint(lo, max_len + 1, (batch,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def build_model(checkpoint: str | os.PathLike[str] | None = None, seed: int = 0, **dims: Any):
    """A prepared model: loaded from a local folder, or freshly initialised from :func:`tiny_config`."""
    if checkpoint is not None:
        return load_model(checkpoint)
    return from_config(tiny_config(**dims), seed=seed)


# --- helpers -------------------------------------------------------------------------------------


def _padded(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(s.numel() for s in seqs)
    out = torch.zeros(len(seqs), width, dtype=torch.float32)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, s in enumerate(seqs):
        out[b, : s.numel()] = s.detach().float()
        mask[b, : s.numel()] = True
    return out, mask


def _gap(rollout: RolloutOutput, trainer: TrainerOutput) -> dict[str, float]:
    lr, mask = _padded(rollout.logprobs)
    lt, mask_t = trainer.padded()
    if not torch.equal(mask, mask_t):
        raise RuntimeError("trainer and rollout disagree on the completion lengths")
    m = mismatch_metrics(lr, lt.detach().float(), mask)
    return {
        "mean_abs": m["train_rollout_logprob_abs_diff"],
        "max_abs": m["train_rollout_logprob_abs_diff_max"],
        "k3_kl": m["rollout_corr/k3_kl"],
        "kl": m["rollout_corr/kl"],
        "log_ppl_diff": m["rollout_corr/log_ppl_diff"],
        "tokens": int(mask.sum()),
    }


def _share(num: int, den: int) -> float | None:
    return num / den if den else None


def _aggregate(stats: Mapping[str, SiteMismatch], keep: Callable[[int, str], bool]) -> dict[str, Any]:
    mis = one = tot = 0
    for name, s in stats.items():
        layer, site, _ = parse_name(name + ".codes")
        if keep(layer, site):
            mis, one, tot = mis + s.mismatched, one + s.one_apart, tot + s.total
    return {
        "mismatched": mis,
        "one_apart": one,
        "total": tot,
        "rate": mis / tot if tot else None,
        "adjacent_share": _share(one, mis),
    }


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
            model, rollout.token_ids, rollout.prompt_lens, None, mode=mode, plan=rollout.plan, replay_routing=False
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
    return {"rate": flips / total, "flips": flips, "token_layers": total, "per_layer": per_layer}


def _store_records(root: Path, step: int, rollout: RolloutOutput, signature: str) -> list[dict[str, torch.Tensor]]:
    """Write the rollout's records as one sealed store step, read them back (verified)."""
    ids = [f"traj-{b:05d}" for b in range(len(rollout.token_ids))]
    with StoreWriter(root, step, _WRITER, model_signature=signature, policy_version=_POLICY_VERSION) as w:
        for tid, rec, p in zip(ids, rollout.records, rollout.prompt_lens):
            w.add(tid, rec, prompt_len=p)
    seal_step(root, step, [_WRITER])
    with StoreReader(root, step, model_signature=signature, policy_version=_POLICY_VERSION) as r:
        r.verify()
        # clone: the reader's handles are memory-mapped and closed on exit
        return [{k: v.clone() for k, v in rec.items()} for rec in r.batch(ids, [t.numel() for t in rollout.token_ids])]


def _store_bytes(root: Path, step: int, signature: str) -> dict[str, Any]:
    """The store's accounting, plus guidance bytes per token split by (site, layer) and by field."""
    with StoreReader(root, step, model_signature=signature, policy_version=_POLICY_VERSION) as r:
        acc = bytes_per_token(r)
        by_site_layer: dict[str, dict[str, int]] = {}
        by_field: dict[str, int] = {}
        for m in r.manifests:
            for t in m.trajectories.values():
                for name, tm in t.tensors.items():
                    layer, site, fld = parse_name(name)
                    if site == "routing":
                        continue
                    d = by_site_layer.setdefault(site, {})
                    d[layer_tag(layer)] = d.get(layer_tag(layer), 0) + tm.nbytes
                    by_field[fld] = by_field.get(fld, 0) + tm.nbytes
    gen = acc["generated_tokens"]
    if sum(sum(d.values()) for d in by_site_layer.values()) != acc["guidance_bytes"]:
        raise RuntimeError("store accounting: the (site, layer) split does not add up to the guidance bytes")
    acc["by_site_layer"] = {s: {k: b / gen for k, b in sorted(d.items())} for s, d in sorted(by_site_layer.items())}
    acc["by_field"] = {f: b / gen for f, b in sorted(by_field.items())}
    acc["by_layer"] = {layer_tag(k): v for k, v in acc["by_layer"].items()}
    acc["routing_by_layer"] = {layer_tag(k): v for k, v in acc["routing_by_layer"].items()}
    return acc


def _same_rollout(a: RolloutOutput, b: RolloutOutput) -> bool:
    """Same tokens and same routing records (what the trainer's replay consumes)."""
    return all(torch.equal(x, y) for x, y in zip(a.token_ids, b.token_ids)) and all(
        torch.equal(x[k], y[k]) for x, y in zip(a.records, b.records) for k in x if k.endswith(".routing")
    )


def _check_lsb_matches_full(
    lsb: Sequence[Mapping[str, torch.Tensor]], full: Sequence[Mapping[str, torch.Tensor]]
) -> None:
    """At every lsb-guided site, the full record names the same codes' low bits, scales and amax."""
    for b, (rl, rf) in enumerate(zip(lsb, full)):
        for name, bits in rl.items():
            if not name.endswith(".bits"):
                continue
            prefix = name[: -len(".bits")]
            same = torch.equal(lsb_bits(rf[f"{prefix}.codes"]), bits)
            for fld in ("scales", "global_amax"):
                if f"{prefix}.{fld}" in rl:
                    x, y = rl[f"{prefix}.{fld}"], rf[f"{prefix}.{fld}"]
                    same = same and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            if not same:
                raise RuntimeError(
                    f"trajectory {b}, {prefix}: the lsb and full-hint rollouts quantized differently; "
                    "the trace-lsb code mismatch cannot be measured against the full record"
                )


# --- the report ----------------------------------------------------------------------------------


def mismatch_report(
    model,
    prompts: Sequence[torch.Tensor],
    sampling: SamplingParams,
    *,
    store_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the four rollouts and their trainers; return the report as a JSON-ready dict."""
    say = progress or (lambda msg: None)
    t_start = time.perf_counter()
    seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        say(f"{name} ...")
        t0 = time.perf_counter()
        yield
        seconds[name] = time.perf_counter() - t0
        say(f"{name}: {seconds[name]:.1f}s")

    n_layers, moe = model_layers(model)
    compact_layers = deeper_half(n_layers)
    all_layers = frozenset(range(n_layers))
    cfg = model.config
    signature = "mismatch:" + hashlib.sha256(cfg.to_json_string(use_diff=False).encode()).hexdigest()[:16]

    rollouts: dict[str, RolloutOutput] = {}
    plan = PrecisionPlan()
    for arm, kwargs in (
        ("bf16", dict(plan=None)),
        ("qat", dict(plan=plan)),
        ("trace_lsb", dict(plan=plan, guidance=GuidedMode.parse("lsb"))),
        ("trace_full", dict(plan=plan, guidance=GuidedMode.parse("full"))),
    ):
        with phase(f"rollout {arm} ({ARMS[arm][0]})"):
            rollouts[arm] = generate(model, prompts, sampling, **kwargs)

    fp4_identical = _same_rollout(rollouts["qat"], rollouts["trace_lsb"]) and _same_rollout(
        rollouts["qat"], rollouts["trace_full"]
    )
    if not _same_rollout(rollouts["trace_lsb"], rollouts["trace_full"]):
        raise RuntimeError(
            "the lsb and full-hint FP4 rollouts sampled different tokens or routing: recording changed the "
            "numerics, so the trace-lsb code mismatch cannot be measured"
        )

    tmp = None
    if store_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="tracefp4-mismatch-")
        root = Path(tmp.name)
    else:
        root = Path(store_dir)
    try:
        with phase("store: write, seal, read back"):
            full_records = _store_records(root, _STEP_FULL, rollouts["trace_full"], signature)
            lsb_records = _store_records(root, _STEP_COMPACT, rollouts["trace_lsb"], signature)
            _check_lsb_matches_full(lsb_records, full_records)
            bytes_full = _store_bytes(root, _STEP_FULL, signature)
            bytes_compact = _store_bytes(root, _STEP_COMPACT, signature)
    finally:
        if tmp is not None:
            tmp.cleanup()

    roll_full, roll_lsb = rollouts["trace_full"], rollouts["trace_lsb"]
    trainers: dict[str, TrainerOutput] = {}
    with torch.no_grad():
        for arm in ("bf16", "qat"):
            with phase(f"trainer {arm} ({ARMS[arm][1]}, routing replay)"):
                trainers[arm] = forward_rollout(model, rollouts[arm], mode=ARMS[arm][1])
        with phase("trainer qat, capturing codes at all sites"):
            qat_codes = forward_logprobs(
                model, roll_full.token_ids, roll_full.prompt_lens, full_records,
                mode="qat", plan=roll_full.plan, capture_codes=all_layers,
            )  # fmt: skip
        with phase("trainer trace_lsb (lsb hints, deeper half)"):
            trainers["trace_lsb"] = forward_logprobs(
                model, roll_lsb.token_ids, roll_lsb.prompt_lens, lsb_records,
                mode="trace", plan=roll_lsb.plan, capture_codes=compact_layers,
            )  # fmt: skip
        with phase("trainer trace_full (full hints, all layers)"):
            trainers["trace_full"] = forward_logprobs(
                model, roll_full.token_ids, roll_full.prompt_lens, full_records,
                mode="trace", plan=roll_full.plan, capture_codes=all_layers,
            )  # fmt: skip
    with phase("router flips without replay (qat, bf16)"):
        flips = {arm: _router_flips_without_replay(model, rollouts[arm], ARMS[arm][1]) for arm in ("qat", "bf16")}

    stats = {
        "qat": code_mismatch(qat_codes.codes, full_records),
        "trace_lsb": code_mismatch(trainers["trace_lsb"].codes, full_records),
        "trace_full": code_mismatch(trainers["trace_full"].codes, full_records),
    }
    everywhere = lambda layer, site: True  # noqa: E731
    deeper = lambda layer, site: layer in compact_layers  # noqa: E731
    agg = {
        "qat": _aggregate(stats["qat"], everywhere),
        "qat_deeper_half": _aggregate(stats["qat"], deeper),
        "trace_lsb": _aggregate(stats["trace_lsb"], everywhere),  # its guided sites = the deeper half
        "trace_full": _aggregate(stats["trace_full"], everywhere),
        "trace_full_deeper_half": _aggregate(stats["trace_full"], deeper),
    }

    per_site: dict[str, dict[str, Any]] = {}
    gen = bytes_full["generated_tokens"]
    for site in _SITES:
        for layer in range(n_layers):
            name = record_prefix(layer, site)
            if name not in stats["qat"]:
                continue  # not an FP4 site in this model (dense layer, FP8 activations)
            row: dict[str, Any] = {"elements": stats["qat"][name].total}
            row["mismatch_rate"] = {arm: stats[arm][name].rate if name in stats[arm] else None for arm in stats}
            row["adjacent_share"] = {
                arm: _share(stats[arm][name].one_apart, stats[arm][name].mismatched) if name in stats[arm] else None
                for arm in stats
            }
            key = layer_tag(layer)
            row["bytes_per_token"] = {
                "full": bytes_full["by_site_layer"].get(site, {}).get(key, 0.0),
                "compact": bytes_compact["by_site_layer"].get(site, {}).get(key, 0.0),
            }
            per_site.setdefault(site, {})[key] = row

    amax_full = bytes_full["by_field"].get("global_amax", 0.0)
    amax_compact = bytes_compact["by_field"].get("global_amax", 0.0)
    report: dict[str, Any] = {
        "config": {
            "model_type": cfg.model_type,
            "layers": n_layers,
            "moe_layers": list(moe),
            "experts": getattr(cfg, "num_experts", getattr(cfg, "num_local_experts", None)),
            "top_k": cfg.num_experts_per_tok,
            "hidden": cfg.hidden_size,
            "moe_intermediate": getattr(cfg, "moe_intermediate_size", None),
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
            "vocab": cfg.vocab_size,
            "batch": len(prompts),
            "prompt_lens": [int(p.numel()) for p in prompts],
            "new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "seed": sampling.seed,
            "plan": {"weights": roll_full.plan.weights.value, "activations": roll_full.plan.activations,
                     "kv_cache": roll_full.plan.kv_cache.value},  # fmt: skip
            "compact_layers": sorted(compact_layers),
            "routing_replay": True,
        },
        "tokens": {
            "positions": sum(t.numel() for t in roll_full.token_ids),
            "generated": gen,
            "generated_bf16": sum(lp.numel() for lp in rollouts["bf16"].logprobs),
        },
        "fp4_rollouts_identical": fp4_identical,
        "mismatch_rate": {k: v["rate"] for k, v in agg.items()},
        "adjacent_share": {k: v["adjacent_share"] for k, v in agg.items()},
        "mismatch_counts": {k: {f: v[f] for f in ("mismatched", "one_apart", "total")} for k, v in agg.items()},
        "router_flip_rate": flips["qat"]["rate"],
        "router_flip": {
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
        },
        "logprob_gap": {arm: _gap(rollouts[arm], trainers[arm]) for arm in ARMS},
        "bytes_per_token": {
            "full_all_layers": bytes_full["guidance"],
            "compact_default": bytes_compact["guidance"],
            "ratio": bytes_full["guidance"] / bytes_compact["guidance"],
            "ratio_without_amax": (bytes_full["guidance"] - amax_full) / (bytes_compact["guidance"] - amax_compact),
            "routing": bytes_full["routing"],
            "full_detail": bytes_full,
            "compact_detail": bytes_compact,
        },
        "per_site": per_site,
        "seconds": {**seconds, "total": time.perf_counter() - t_start},
    }
    return report


# --- presentation --------------------------------------------------------------------------------


def _pct(x: float | None, width: int = 10) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.3%}"


def format_report(rep: dict[str, Any]) -> str:
    c, tok = rep["config"], rep["tokens"]
    compact = c["compact_layers"]
    guided = f"{layer_tag(compact[0])}-{layer_tag(compact[-1])}" if compact else "none"
    lines = [
        f"mismatch report: {c['model_type']} {c['layers']} layers, {c['experts']} experts top-{c['top_k']}, "
        f"hidden {c['hidden']}, expert dim {c['moe_intermediate']}, {c['kv_heads']} KV heads x {c['head_dim']}",
        f"  batch {c['batch']} ragged prompts ({min(c['prompt_lens'])}-{max(c['prompt_lens'])} tokens), "
        f"{c['new_tokens']} new tokens, seed {c['seed']}: {tok['generated']} generated tokens, "
        f"{tok['positions']} positions; FP4 rollouts identical across modes: {rep['fp4_rollouts_identical']}",
        "",
        f"FP4 code mismatch rate, trainer vs rollout (routing replayed; lsb hints on {guided})",
        f"{'site':<11}{'layer':<6}{'elements':>9}{'qat':>10}{'1-apart':>10}{'trace-lsb':>11}{'trace-full':>11}"
        f"{'full B/tok':>12}{'lsb B/tok':>11}",
    ]
    for site, layers in rep["per_site"].items():
        for key, row in layers.items():
            mr = row["mismatch_rate"]
            bt = row["bytes_per_token"]
            lines.append(
                f"{site:<11}{key:<6}{row['elements']:>9}{_pct(mr['qat'])}{_pct(row['adjacent_share']['qat'])}"
                f"{_pct(mr['trace_lsb'], 11)}{_pct(mr['trace_full'], 11)}{bt['full']:>12.1f}{bt['compact']:>11.1f}"
            )
    mr, adj = rep["mismatch_rate"], rep["adjacent_share"]
    lines += [
        f"{'all sites':<17}{rep['mismatch_counts']['qat']['total']:>9}{_pct(mr['qat'])}{_pct(adj['qat'])}"
        f"{'-':>11}{_pct(mr['trace_full'], 11)}",
        f"{'deeper half':<17}{rep['mismatch_counts']['qat_deeper_half']['total']:>9}{_pct(mr['qat_deeper_half'])}"
        f"{_pct(adj['qat_deeper_half'])}{_pct(mr['trace_lsb'], 11)}{_pct(mr['trace_full_deeper_half'], 11)}",
        "",
    ]
    fl = rep["router_flip"]
    per_layer = "  ".join(f"{k} {v:.1%}" for k, v in fl["qat"]["per_layer"].items())
    lines += [
        f"router flips without replay (token x MoE layer, top-k set differs): fp4/qat {rep['router_flip_rate']:.2%} "
        f"({fl['qat']['flips']}/{fl['qat']['token_layers']}; {per_layer}),  bf16/bf16 {fl['bf16']['rate']:.2%}",
        "  under replay (trainer's router_flips, given replayed upstream layers): "
        + ",  ".join(f"{arm} {v['mean']:.2%}" for arm, v in fl["under_replay"].items() if v["mean"] is not None),
        "",
        "log-prob gap over completion tokens",
        f"{'arm':<12}{'rollout':<31}{'trainer':<9}{'mean|dlogp|':>13}{'max|dlogp|':>12}{'k3 KL':>12}",
    ]
    for arm, (roll, train) in ARMS.items():
        g = rep["logprob_gap"][arm]
        lines.append(f"{arm:<12}{roll:<31}{train:<9}{g['mean_abs']:>13.5f}{g['max_abs']:>12.5f}{g['k3_kl']:>12.2e}")
    b = rep["bytes_per_token"]
    lines += [
        "",
        "guidance bytes per generated token (store accounting, routing excluded)",
        f"  full information, all layers: {b['full_all_layers']:10.1f}",
        f"  compact default (lsb, {guided}): {b['compact_default']:8.1f}",
        f"  ratio: {b['ratio']:.2f}x   (without the 4-byte per-row global amax: {b['ratio_without_amax']:.2f}x; "
        "paper: about 6x)",
        f"  routing records (separate): {b['routing']:.1f} bytes per generated token",
    ]
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``mismatch`` subcommand to a ``tracefp4`` subparsers object."""
    p = subparsers.add_parser(
        "mismatch",
        help="train-rollout mismatch report: FP4 code mismatches, router flips, log-prob gap, guidance bytes",
        description="Run a tiny Qwen3-MoE (or a local checkpoint) through the rollout engine in bf16, fp4, "
        "trace (lsb hints, deeper half) and trace (full hints, all layers), and the trainer on each mode's "
        "completions; print code mismatch rates per site and layer, router flips without replay, the log-prob "
        "gap per arm and the guidance bytes per generated token.",
    )
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
    from . import sweep  # sweep builds on this module's helpers

    sweep.add_arguments(p)
    p.set_defaults(func=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    dims = {k: getattr(args, k) for k in _MODEL_DIMS if getattr(args, k, None) is not None}
    if args.checkpoint is not None and dims:
        raise SystemExit(f"tracefp4 mismatch: --checkpoint fixes the model; drop {sorted(dims)}")
    if args.batch < 1 or args.new_tokens < 1 or args.prompt_len < 1:
        raise SystemExit("tracefp4 mismatch: --batch, --new-tokens and --prompt-len must be >= 1")
    sweeping = getattr(args, "sweep", False)
    if not sweeping and (getattr(args, "plot", None) or getattr(args, "modes", None)):
        raise SystemExit("tracefp4 mismatch: --plot and --modes go with --sweep")
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[mismatch {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    try:
        model = build_model(args.checkpoint, seed=args.seed, **{**{k: DEFAULTS[k] for k in _MODEL_DIMS}, **dims})
    except ValueError as e:
        raise SystemExit(f"tracefp4 mismatch: {e}") from None
    say(f"model ready ({'checkpoint ' + args.checkpoint if args.checkpoint else 'tiny Qwen3-MoE from config'})")
    prompts = make_prompts(args.batch, model.config.vocab_size, args.prompt_len, args.seed)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, seed=args.seed)
    if sweeping:
        from tracefp4.reports import sweep

        return sweep.run_cli(args, model, prompts, sampling, say)
    rep = mismatch_report(model, prompts, sampling, store_dir=args.store_dir, progress=say)
    print(format_report(rep))
    if args.json:
        atomic_write_json(args.json, rep, sort_keys=False)
        print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``tracefp4 mismatch ...`` on its own (the package CLI adds it with :func:`add_parser`)."""
    from tracefp4.cli import run_subcommand

    return run_subcommand(add_parser, "mismatch", argv)


if __name__ == "__main__":
    sys.exit(main())
