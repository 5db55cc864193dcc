"""``tracefp4 mismatch --sweep``: guidance bytes per generated token against agreement and log-prob gap.

For every named mode (:data:`tracefp4.guidance.compact.STANDARD_MODES` unless told otherwise: the paper's full
and compact references, each knob of :mod:`tracefp4.guidance.compact` on its own, and each new mode across its
knobs, on the deeper half and on all layers) the sweep runs the FP4 rollout recording that mode,
writes its records through the guidance store, reads them back and runs the guided trainer on them,
and reports per mode:

* ``bytes_per_token``: guidance bytes per generated token, the store's own accounting (tensor
  payload bytes, routing excluded, over ``sum(T - prompt_len)``), so padding and headers count;
* ``agreement``: share of FP4 codes at the mode's guided sites equal to the rollout's; also over
  every site (``agreement_all_sites``) and over the deeper half (``agreement_deeper_half``);
* ``train_rollout_logprob_abs_diff`` / ``..._max`` / ``rollout_corr/k3_kl`` (the registry's names,
  :mod:`tracefp4.pipeline.metrics`): trainer vs rollout over completion tokens.

Decisions (and why)
    * **One rollout per mode, all identical.** Recording never changes what the rollout computes, so
      every FP4 rollout samples the same tokens and routing; the sweep checks that against the
      full-information rollout and refuses to report otherwise. That is what makes the codes of the
      full-information rollout (every layer, 4-bit codes) the reference for every mode's agreement.
    * **Unguided layers.** Below a deeper-half mode's first guided layer the trainer rounds to
      nearest on its own scales, exactly as vanilla QAT does on identical inputs, so a deeper-half
      mode's agreement over all sites adds a QAT trainer's codes at those layers.
    * ``qat`` (no guidance, 0 bytes) is reported as a point of its own; its ``agreement`` is over all
      sites, as it guides none.
    * The target the issue sets (a mode with at most 1/4 of the compact mode's bytes at equal or better
      agreement and log-prob gap) is evaluated in ``target``, with agreement taken at each mode's own
      guided sites as defined above; ``target.met_by`` lists every mode that meets it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tracefp4.engines.model import model_layers
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutOutput, SamplingParams
from tracefp4.engines.trainer import SiteMismatch, TrainerSpec, code_mismatch, forward_logprobs
from tracefp4.guidance import compact
from tracefp4.guidance.compact import STANDARD_MODES, GuidedMode, read_record
from tracefp4.guidance.names import deeper_half
from tracefp4.guidance.store import parse_name
from tracefp4.pipeline.metrics import Name, at_sites, mismatch_summary
from tracefp4.pipeline.measure import (
    config_signature,
    gap,
    model_section,
    run_arms,
    same_rollout,
    store_bytes,
    store_root,
)
from tracefp4.pipeline.arms import make_arm
from tracefp4.reports.publish import publish

__all__ = ["COMPACT", "run_sweep", "format_sweep", "plot_sweep", "add_arguments", "run_cli"]

COMPACT = "lsb"  # the paper's compact cache: lsb hints on the deeper half
#: The issue's target (see ``target``): at most 1/_BUDGET_DIVISOR of the compact mode's bytes per token.
_BUDGET_DIVISOR = 4
_STEP_REFERENCE = 0


def _density(records: Sequence[dict[str, torch.Tensor]], prefixes: Sequence[str]) -> float | None:
    """Share of elements a sparse record keeps, over the given sites of every trajectory."""
    kept = total = 0
    for rec in records:
        for prefix in prefixes:
            counts = read_record(rec, prefix).kept_elements()
            if counts is None:
                return None
            kept += counts[0]
            total += counts[1]
    return kept / total if total else None


def _grid_agreement(
    grids: Sequence[dict[str, tuple[torch.Tensor, torch.Tensor | None]]], ref: Sequence[dict[str, torch.Tensor]]
) -> dict[str, float | None]:
    """Share of block scales, and of rows' global amax, equal to the rollout's (bit for bit)."""
    same_s = total_s = same_a = total_a = 0
    for mine, rec in zip(grids, ref):
        for name, (scales, amax) in mine.items():
            r = rec[f"{name}.scales"]
            same_s += int((scales.view(torch.uint8) == r.view(torch.uint8)).sum())
            total_s += scales.numel()
            if amax is not None and f"{name}.global_amax" in rec:
                same_a += int((amax.view(torch.int32) == rec[f"{name}.global_amax"].view(torch.int32)).sum())
                total_a += amax.numel()
    return {
        "scale_agreement": same_s / total_s if total_s else None,
        "amax_agreement": same_a / total_a if total_a else None,
    }


def _agreement(stats: Mapping[str, SiteMismatch], keep: Callable[[int, str], bool]) -> dict[str, Any]:
    s = mismatch_summary(at_sites(stats, keep))
    rate = s[Name.CODE_MISMATCH]
    counts = {k: s[k] for k in ("mismatched", "one_apart", "total")}
    return {**counts, "rate": rate, Name.ONE_APART: s[Name.ONE_APART],
            "agreement": None if rate is None else 1.0 - rate}


#: The log-prob gap metrics a sweep row carries, in its keys' order.
SWEEP_GAP_METRICS = (Name.GAP_MEAN, Name.GAP_MAX, Name.K3_KL)


def _gap_fields(g: dict[str, float]) -> dict[str, float]:
    """Three of :func:`~tracefp4.pipeline.measure.gap`'s metrics."""
    return {k: g[k] for k in SWEEP_GAP_METRICS}


def _everywhere(layer: int, site: str) -> bool:
    return True


@dataclasses.dataclass
class _Reference:
    """The full-information rollout (every layer, 4-bit codes) every mode is measured against."""

    rollout: RolloutOutput
    records: list[dict[str, torch.Tensor]]  # as read back from the store
    qat_stats: dict[str, SiteMismatch]  # a QAT trainer's codes against them
    n_layers: int
    deeper: frozenset[int]
    root: Path
    signature: str

    def in_deeper_half(self, layer: int, site: str) -> bool:
        return layer in self.deeper


def _parse_modes(modes: Sequence[str]) -> list[GuidedMode]:
    parsed = [GuidedMode.parse(m) for m in modes]
    names = [g.name for g in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate modes in the sweep: {names}")
    return parsed


def _reference_and_qat(model, prompts, sampling: SamplingParams, root: Path) -> tuple[_Reference, dict[str, Any]]:
    """The reference rollout through the store, and the ``qat`` row (no guidance, 0 bytes)."""
    n_layers, _ = model_layers(model)
    every = frozenset(range(n_layers))
    deeper = deeper_half(n_layers)
    signature = config_signature("sweep", model.config)
    full = make_arm("trace-full", guidance=COMPACT, n_layers=n_layers, plan=PrecisionPlan())
    reference = run_arms(model, prompts, sampling, {"reference": full}, root, signature, first_step=_STEP_REFERENCE,
                         trainers=False)["reference"].rollout
    ref_records = reference.records
    with torch.no_grad():
        qat = forward_logprobs(
            model, reference.token_ids, reference.prompt_lens, ref_records,
            TrainerSpec("qat", reference.plan, capture_codes=every),
        )  # fmt: skip
    qat_stats = code_mismatch(qat.codes, ref_records)
    ref = _Reference(reference, ref_records, qat_stats, n_layers, deeper, root, signature)
    qat_all = _agreement(qat_stats, _everywhere)
    row = {
        "name": "qat",
        "layers": "none",
        "bytes_per_token": 0.0,
        "agreement": qat_all["agreement"],
        "agreement_all_sites": qat_all["agreement"],
        "agreement_deeper_half": _agreement(qat_stats, ref.in_deeper_half)["agreement"],
        "mismatched": qat_all["mismatched"],
        "elements": qat_all["total"],
        **_grid_agreement(qat.grids or [], ref_records),
        **_gap_fields(gap(reference, qat)),
    }
    return ref, row


def _mode_row(model, prompts, sampling: SamplingParams, g: GuidedMode, step: int, ref: _Reference) -> dict[str, Any]:
    """One mode: its rollout through the store, the guided trainer on what the store returns."""
    t0 = time.perf_counter()
    layers = g.layer_indices(ref.n_layers)
    arm = dataclasses.replace(make_arm("trace", guidance=g.name, n_layers=ref.n_layers, plan=ref.rollout.plan),
                              name=g.name)
    run = run_arms(model, prompts, sampling, {g.name: arm}, ref.root, ref.signature, first_step=step)[g.name]
    roll, records, out = run.rollout, run.rollout.records, run.trainer
    if not same_rollout(roll, ref.rollout):
        raise RuntimeError(f"{g.name}: the rollout sampled other tokens or routing than the reference")
    acc = store_bytes(ref.root, step, ref.signature)
    stats = code_mismatch(out.codes, ref.records)
    guided = _agreement(stats, _everywhere)
    # below the first guided layer the trainer is vanilla QAT on identical inputs
    merged = {**{k: v for k, v in ref.qat_stats.items() if parse_name(k + ".codes")[0] not in layers}, **stats}
    prefixes = sorted(out.codes[0]) if out.codes else []
    return {
        "name": g.name,
        "mode": compact.mode_name(g.mode),
        "layers": g.layers,
        "guided_layers": sorted(layers),
        "bytes_per_token": acc["guidance"],
        "bytes_per_position": acc["guidance_bytes"] / sum(t.numel() for t in roll.token_ids),
        "bytes_by_field": acc["by_field"],
        "agreement": guided["agreement"],
        "agreement_all_sites": _agreement(merged, _everywhere)["agreement"],
        "agreement_deeper_half": _agreement(merged, ref.in_deeper_half)["agreement"],
        "mismatched": guided["mismatched"],
        "elements": guided["total"],
        **_grid_agreement(out.grids or [], ref.records),
        "density": _density(records, prefixes),
        Name.DECODE_FAILURES: out.decode.failed_blocks,
        **_gap_fields(gap(roll, out)),
        "seconds": time.perf_counter() - t0,
    }


def _sweep_config(model, prompts, sampling: SamplingParams) -> dict[str, Any]:
    return {
        **model_section(model),
        "batch": len(prompts),
        "new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "seed": sampling.seed,
        "element_prior": list(compact.ELEMENT_PRIOR),
        "scale_prior": list(compact.SCALE_PRIOR),
        "ldpc_block": compact.LDPC_BLOCK,
    }


def run_sweep(
    model,
    prompts: Sequence[torch.Tensor],
    sampling: SamplingParams,
    *,
    modes: Sequence[str] = STANDARD_MODES,
    store_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every mode; return the sweep as a JSON-ready dict (see the module docstring)."""
    say = progress or (lambda msg: None)
    t_start = time.perf_counter()
    parsed = _parse_modes(modes)
    with store_root(store_dir, "tracefp4-sweep-") as root:
        say("reference: full-information rollout on every layer, and vanilla QAT")
        ref, qat_row = _reference_and_qat(model, prompts, sampling, root)
        rows = [qat_row]
        for i, g in enumerate(parsed):
            row = _mode_row(model, prompts, sampling, g, _STEP_REFERENCE + 1 + i, ref)
            rows.append(row)
            say(
                f"[{i + 1}/{len(parsed)}] {g.name}: {row['bytes_per_token']:.1f} B/token, agreement "
                f"{row['agreement']:.5%}, mean|dlogp| {row[Name.GAP_MEAN]:.5f}"
            )
    reference = ref.rollout
    rep: dict[str, Any] = {
        "config": _sweep_config(model, prompts, sampling),
        "tokens": {
            "generated": sum(lp.numel() for lp in reference.logprobs),
            "positions": sum(t.numel() for t in reference.token_ids),
        },
        "modes": rows,
        "seconds": time.perf_counter() - t_start,
    }
    by_name = {r["name"]: r for r in rows}
    if COMPACT in by_name:
        rep["target"] = _target(rows, by_name[COMPACT])
    return rep


def _target(rows: list[dict[str, Any]], ref: dict[str, Any]) -> dict[str, Any]:
    budget = ref["bytes_per_token"] / _BUDGET_DIVISOR
    met = [
        r
        for r in rows
        if r["name"] != ref["name"]
        and r["bytes_per_token"] <= budget
        and r["agreement"] >= ref["agreement"]
        and r[Name.GAP_MEAN] <= ref[Name.GAP_MEAN]
    ]
    best = min(met, key=lambda r: r["bytes_per_token"]) if met else None
    exact = [r for r in met if r.get("scale_agreement") == 1.0 and r.get("amax_agreement") in (1.0, None)]
    best_exact = min(exact, key=lambda r: r["bytes_per_token"]) if exact else None
    return {
        "compact": ref["name"],
        "compact_bytes_per_token": ref["bytes_per_token"],
        "budget_bytes_per_token": budget,
        "compact_agreement": ref["agreement"],
        "compact_" + Name.GAP_MEAN: ref[Name.GAP_MEAN],
        "met_by": [r["name"] for r in met],
        "best": None if best is None else best["name"],
        "best_ratio": None if best is None else best["bytes_per_token"] / ref["bytes_per_token"],
        # the codes agree, but are they on the rollout's grid (every block scale and amax exact)?
        "met_by_exact_grid": [r["name"] for r in exact],
        "best_exact_grid": None if best_exact is None else best_exact["name"],
        "best_exact_grid_ratio": None if best_exact is None else best_exact["bytes_per_token"] / ref["bytes_per_token"],
    }


# --- presentation ---------------------------------------------------------------------------------


def format_sweep(rep: dict[str, Any]) -> str:
    c, tok = rep["config"], rep["tokens"]
    lines = [
        f"guidance sweep: {c['model_type']} {c['layers']} layers, hidden {c['hidden']}, expert dim "
        f"{c['moe_intermediate']} top-{c['top_k']}, {c['kv_heads']} KV heads x {c['head_dim']}; batch {c['batch']}, "
        f"{c['new_tokens']} new tokens, seed {c['seed']}: {tok['generated']} generated tokens",
        "",
        f"{'mode':<48}{'B/token':>9}{'x lsb':>7}{'agreement':>12}{'all sites':>12}{'scales':>9}{'amax':>9}"
        f"{'mean|dlogp|':>13}{'max|dlogp|':>12}{'density':>9}",
    ]
    ref = next((r for r in rep["modes"] if r["name"] == COMPACT), None)
    for r in rep["modes"]:
        ratio = f"{r['bytes_per_token'] / ref['bytes_per_token']:.3f}" if ref else "-"
        dens = f"{r['density']:.2%}" if r.get("density") is not None else "-"
        grid = "".join(
            f"{r[k]:>9.3%}" if r.get(k) is not None else f"{'-':>9}" for k in ("scale_agreement", "amax_agreement")
        )
        lines.append(
            f"{r['name']:<48}{r['bytes_per_token']:>9.1f}{ratio:>7}{r['agreement']:>12.5%}"
            f"{r['agreement_all_sites']:>12.5%}{grid}{r[Name.GAP_MEAN]:>13.5f}"
            f"{r[Name.GAP_MAX]:>12.5f}{dens:>9}"
        )
    t = rep.get("target")
    if t:
        lines += [
            "",
            f"target: <= {t['budget_bytes_per_token']:.1f} B/token (1/4 of {t['compact']}'s "
            f"{t['compact_bytes_per_token']:.1f}) at agreement >= {t['compact_agreement']:.5%} and mean|dlogp| <= "
            f"{t['compact_' + Name.GAP_MEAN]:.5f}:",
            f"  met by {len(t['met_by'])} mode(s)"
            + (f"; smallest: {t['best']} ({t['best_ratio']:.3f} x {t['compact']})" if t["best"] else ""),
            f"  with every block scale and amax also exact: {len(t['met_by_exact_grid'])} mode(s)"
            + (
                f"; smallest: {t['best_exact_grid']} ({t['best_exact_grid_ratio']:.3f} x {t['compact']})"
                if t["best_exact_grid"]
                else ""
            ),
        ]
    return "\n".join(lines)


def _family(name: str) -> str:
    if name == "qat":
        return "qat"
    return compact.elements_knob(GuidedMode.parse(name).mode)


#: Marker colour of each mode family in the plot.
_COLORS = {"full": "tab:blue", "lsb": "tab:orange", "sparse": "tab:green", "ldpc": "tab:red", "qat": "black"}


def _draw_panel(ax, rep: dict[str, Any], key: str, label: str, floor: float) -> None:
    """One panel: every mode at (bytes per token, ``key``); the reference modes and the best exact-grid
    mode are named, the target's byte budget is a dashed line."""
    for r in rep["modes"]:
        x = max(r["bytes_per_token"], 1.0)
        y = max(1.0 - r[key], floor) if key == "agreement" else r[key]
        fam = _family(r["name"])
        filled = r["layers"] in ("all", "none")
        ax.scatter(
            [x], [y], s=36, marker="o" if fam != "qat" else "x", color=_COLORS[fam],
            facecolors=_COLORS[fam] if filled else "none", linewidths=1.2,
        )  # fmt: skip
        if r["name"] in ("full", "lsb", "qat"):
            ax.annotate(r["name"], (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
        elif r["name"] == rep.get("target", {}).get("best_exact_grid"):
            ax.annotate(r["name"], (x, y), fontsize=7, xytext=(-6, 14), textcoords="offset points", ha="right",
                        arrowprops={"arrowstyle": "-", "lw": 0.5})  # fmt: skip
    t = rep.get("target")
    if t:
        ax.axvline(t["budget_bytes_per_token"], color="gray", ls="--", lw=0.8)
        ax.text(t["budget_bytes_per_token"], ax.get_ylim()[1], " 1/4 of lsb", fontsize=7, va="top", color="gray")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("guidance bytes per generated token (store accounting; qat drawn at 1)")
    ax.set_ylabel(label)
    ax.grid(True, which="both", alpha=0.3)


def _legend_handles(plt) -> list:
    return [
        plt.Line2D([], [], marker="o", ls="", color=c, label=f) for f, c in _COLORS.items() if f != "qat"
    ] + [
        plt.Line2D([], [], marker="o", ls="", color="gray", label="all layers"),
        plt.Line2D([], [], marker="o", ls="", color="gray", markerfacecolor="none", label="deeper half"),
        plt.Line2D([], [], marker="x", ls="", color="black", label="qat (no guidance)"),
    ]


def plot_sweep(rep: dict[str, Any], path: str | Path) -> None:
    """Two panels: bytes per generated token against code mismatch (1 - agreement) and against the
    mean log-prob gap. Filled markers guide every layer, hollow ones the deeper half."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rep["modes"]
    floor = 0.5 / max(r["elements"] for r in rows)  # where a mode without a single mismatch is drawn
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    _draw_panel(axes[0], rep, "agreement", "code mismatch at guided sites (1 - agreement)", floor)
    _draw_panel(axes[1], rep, Name.GAP_MEAN, "mean |logp_train - logp_rollout|", floor)
    axes[0].axhline(floor, color="gray", lw=0.5, ls=":")
    axes[0].text(axes[0].get_xlim()[0], floor, " no mismatch", fontsize=7, va="bottom", color="gray")
    axes[1].legend(handles=_legend_handles(plt), fontsize=8, loc="best")
    c = rep["config"]
    fig.suptitle(
        f"guidance bytes vs agreement and log-prob gap ({c['layers']} layers, hidden {c['hidden']}, "
        f"{rep['tokens']['generated']} generated tokens)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --- command line (``tracefp4 mismatch --sweep``, assembled in tracefp4.reports.commands) ---------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The sweep's options on the ``mismatch`` parser."""
    g = p.add_argument_group("guidance sweep")
    g.add_argument(
        "--sweep", action="store_true",
        help="instead of the report: guidance bytes per token vs agreement and log-prob gap for every mode",
    )  # fmt: skip
    g.add_argument("--plot", metavar="PATH", help="with --sweep or --lag: write the plot as a PNG")
    g.add_argument(
        "--modes", metavar="M1,M2", help="with --sweep: comma-separated modes (default: the standard sweep; "
        "names as in tracefp4.guidance.compact, e.g. 'lsb,ldpc(1/16)+parity+amax:lo3@all')",
    )  # fmt: skip


def run_cli(
    args: argparse.Namespace,
    model,
    prompts: Sequence[torch.Tensor],
    sampling: SamplingParams,
    say: Callable[[str], None],
) -> int:
    modes = [m for m in args.modes.split(",") if m.strip()] if args.modes else list(STANDARD_MODES)
    try:
        for m in modes:
            GuidedMode.parse(m)
    except ValueError as e:
        raise SystemExit(f"tracefp4 mismatch --sweep: {e}") from None
    rep = run_sweep(model, prompts, sampling, modes=modes, store_dir=args.store_dir, progress=say)
    publish(rep, format_sweep(rep), args.json, args.plot, plot_sweep)
    return 0
