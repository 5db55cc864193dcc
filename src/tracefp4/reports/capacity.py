"""``tracefp4 plan``: how much guidance one RL step writes and reads, for each mode, from a model config.

Per token position, a guided layer records (the sites of ``docs/contracts.md`` section 3):

* MoE layers: ``expert_in`` (1 row of ``hidden_size``) and ``expert_mid`` (``num_experts_per_tok`` rows
  of ``moe_intermediate_size``); the dense-MLP layers of a MoE model have no FP4 sites (BF16, as its
  shared experts);
* every layer of a dense model (a config without routed experts): ``mlp_in`` (1 row of
  ``hidden_size``) and ``mlp_mid`` (1 row of ``intermediate_size``);
* layers with a KV cache: ``k`` and ``v`` (``num_key_value_heads`` rows of ``head_dim`` each); linear-
  attention layers (Gated DeltaNet, ``layer_types`` = ``linear_attention``) have none.

Each site costs :func:`tracefp4.guidance.compact.site_bytes_per_token` for the mode (exact for all but
``sparse``, whose stream size follows from the share of elements it records: from a sweep JSON with
``--sweep-json``, else :data:`DEFAULT_SPARSE_DENSITY`). A mode's guided layers are all of them
(``@all``, and ``full``) or the deeper half (``layers >= L // 2``), as in the sweep. One RL step is
``prompts x samples`` trajectories of ``tokens`` positions each (prompt + completion: every position
carries a record); the I/O time is one pass over the step's guidance (write, or read) at the given
bandwidth in GB/s (10^9 bytes per second).

Layer layout read from a Hugging Face ``config.json`` (or its ``text_config``): MoE layers are those
not in ``mlp_only_layers``, with ``(i + 1) % decoder_sparse_step == 0`` and ``i >= first_k_dense_replace``,
when the config has routed experts (``num_experts``/``num_local_experts``/``n_routed_experts``), else
every layer is a dense-MLP layer; KV
layers are those whose ``layer_types`` entry is an attention type other than ``linear_attention``
(else every ``full_attention_interval``-th layer, else every layer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tracefp4.engines.plan import routed_expert_count
from tracefp4.guidance.compact import STANDARD_MODES, GuidanceSpec, GuidedMode, site_bytes_per_token
from tracefp4.formats.constants import NVFP4_BLOCK
from tracefp4.guidance.names import Site
from tracefp4.reports.publish import publish

__all__ = [
    "PRESETS",
    "DEFAULT_SPARSE_DENSITY",
    "ModelDims",
    "sparse_density",
    "plan",
    "format_plan",
    "add_parser",
    "run_cli",
]

#: Hugging Face config fields of the presets (the transformers docs' values for each checkpoint).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    # Dense: every layer's gated MLP (12288 wide) in FP4, sites mlp_in and mlp_mid.
    "qwen3-8b": {
        "model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096, "intermediate_size": 12288,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    },
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "num_hidden_layers": 94, "hidden_size": 4096, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    # The paper's model: 3 Gated DeltaNet layers (no KV cache) per gated-attention layer.
    "qwen3.5-35b-a3b": {
        "model_type": "qwen3_5_moe_text", "num_hidden_layers": 40, "hidden_size": 2048, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
    },
}  # fmt: skip

#: Share of elements a ``sparse(delta)`` record keeps, measured by ``tracefp4 mismatch --sweep``
#: (tiny Qwen3-MoE, 16 prompts x 64 tokens, seed 0; it depends only on where the rollout's values
#: fall relative to the midpoints, about 2.9 x delta here). Other deltas interpolate linearly.
DEFAULT_SPARSE_DENSITY: dict[float, float] = {0.01: 0.0283, 0.02: 0.0563, 0.05: 0.1419, 0.1: 0.2854}

_NO_KV = ("linear_attention",)
_BYTES_PER_GB = 1e9  # bandwidth in GB/s, decimal


def sparse_density(delta: float, measured: Mapping[float, float] | None = None) -> float:
    """Density of ``sparse(delta)``: measured if given, else interpolated in :data:`DEFAULT_SPARSE_DENSITY`."""
    table = dict(DEFAULT_SPARSE_DENSITY)
    table.update(measured or {})
    if delta in table:
        return table[delta]
    xs = sorted(table)
    lo = max([x for x in xs if x < delta], default=0.0)
    hi = min([x for x in xs if x > delta], default=None)
    if hi is None:  # beyond the table: proportional to delta
        return min(1.0, table[lo] * delta / lo)
    y_lo = table.get(lo, 0.0)
    return y_lo + (table[hi] - y_lo) * (delta - lo) / (hi - lo)


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """What the planner needs of a model: its FP4 site shapes per layer (a dense model: ``top_k`` and
    ``moe_intermediate`` 0, no MoE layers, its MLP width ``intermediate`` at every ``dense_layers``)."""

    name: str
    layers: int
    hidden: int
    top_k: int
    moe_intermediate: int
    kv_heads: int
    head_dim: int
    moe_layers: tuple[int, ...]
    kv_layers: tuple[int, ...]
    intermediate: int = 0
    dense_layers: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str = "config") -> ModelDims:
        cfg = dict(config.get("text_config") or config)

        def need(*keys: str) -> int:
            for k in keys:
                if cfg.get(k) is not None:
                    return int(cfg[k])
            raise ValueError(f"{name}: the config has none of {list(keys)}")

        layers = need("num_hidden_layers")
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        experts = routed_expert_count(cfg)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if experts > 0:
            top_k = need("num_experts_per_tok")
            moe_intermediate = need("moe_intermediate_size", "intermediate_size")
            intermediate, dense_layers = 0, ()
            dense = set(cfg.get("mlp_only_layers") or [])
            step = int(cfg.get("decoder_sparse_step") or 1)
            first = int(cfg.get("first_k_dense_replace") or 0)
            moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first)
        else:  # a dense model: every layer's MLP is FP4
            top_k, moe_intermediate, moe = 0, 0, ()
            intermediate, dense_layers = need("intermediate_size"), tuple(range(layers))
        types = cfg.get("layer_types")
        if types:
            if len(types) != layers:
                raise ValueError(f"{name}: {len(types)} layer_types for {layers} layers")
            kv = tuple(i for i, t in enumerate(types) if "attention" in t and t not in _NO_KV)
        elif cfg.get("full_attention_interval"):
            every = int(cfg["full_attention_interval"])
            kv = tuple(i for i in range(layers) if (i + 1) % every == 0)
        else:
            kv = tuple(range(layers))
        for what, v in (("hidden_size", hidden), ("moe_intermediate_size", moe_intermediate),
                        ("intermediate_size", intermediate), ("head_dim", head_dim)):
            if v % NVFP4_BLOCK:
                raise ValueError(f"{name}: {what} {v} is not a multiple of the NVFP4 block ({NVFP4_BLOCK})")
        return cls(name, layers, hidden, top_k, moe_intermediate, kv_heads, head_dim, moe, kv, intermediate, dense_layers)

    def sites(self, layer: int) -> dict[Site, tuple[int, ...]]:
        """Per-token shape of each FP4 site of a layer."""
        out: dict[Site, tuple[int, ...]] = {}
        if layer in self.moe_layers:
            out[Site.EXPERT_IN] = (self.hidden,)
            out[Site.EXPERT_MID] = (self.top_k, self.moe_intermediate)
        if layer in self.dense_layers:
            out[Site.MLP_IN] = (self.hidden,)
            out[Site.MLP_MID] = (self.intermediate,)
        if layer in self.kv_layers:
            out[Site.K] = out[Site.V] = (self.kv_heads, self.head_dim)
        return out


def _mode_density(g: GuidedMode, measured: Mapping[str, float], by_delta: Mapping[float, float]) -> float | None:
    if not isinstance(g.mode, GuidanceSpec) or g.mode.delta is None:  # a delta: sparse elements
        return None
    if g.name in measured:
        return measured[g.name]
    assert g.mode.delta is not None
    return sparse_density(g.mode.delta, by_delta)


def _measured_densities(sweep: Mapping[str, Any] | None) -> tuple[dict[str, float], dict[float, float]]:
    """Densities a sweep measured: by mode name, and by ``sparse`` delta (for modes it did not run)."""
    measured: dict[str, float] = {}
    by_delta: dict[float, float] = {}
    for row in (sweep or {}).get("modes", []):
        if row.get("density") is not None:
            measured[row["name"]] = float(row["density"])
            spec = GuidedMode.parse(row["name"]).mode
            if isinstance(spec, GuidanceSpec) and spec.delta is not None:
                by_delta[spec.delta] = float(row["density"])
    return measured, by_delta


def _bytes_per_token(dims: ModelDims, g: GuidedMode, density: float | None) -> float:
    """Guidance bytes one token position costs over the mode's guided layers."""
    shapes = (shape for layer in sorted(g.layer_indices(dims.layers)) for shape in dims.sites(layer).values())
    return sum((site_bytes_per_token(g.mode, shape, density=density) for shape in shapes), 0.0)


def plan(
    dims: ModelDims,
    *,
    prompts: int,
    samples: int,
    tokens: int,
    bandwidth_gbps: float | None = None,
    modes: Sequence[str] = STANDARD_MODES,
    sweep: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Guidance bytes per token position and per RL step (and I/O seconds) for each mode."""
    if min(prompts, samples, tokens) < 1:
        raise ValueError("prompts, samples and tokens must be >= 1")
    if bandwidth_gbps is not None and not bandwidth_gbps > 0:
        raise ValueError(f"bandwidth must be > 0 GB/s, got {bandwidth_gbps}")
    measured, by_delta = _measured_densities(sweep)
    per_step_tokens = prompts * samples * tokens
    out: dict[str, Any] = {}
    for m in modes:
        g = GuidedMode.parse(m)
        density = _mode_density(g, measured, by_delta)
        per_token = _bytes_per_token(dims, g, density)
        row = {"layers": g.layers, "bytes_per_token": per_token, "bytes_per_step": per_token * per_step_tokens}
        if density is not None:
            row["density"] = density
        if bandwidth_gbps is not None:
            row["io_seconds"] = row["bytes_per_step"] / (bandwidth_gbps * _BYTES_PER_GB)
        out[g.name] = row
    for ref in ("full", "lsb"):
        if ref in out and out[ref]["bytes_per_token"]:
            for row in out.values():
                row[f"ratio_to_{ref}"] = row["bytes_per_token"] / out[ref]["bytes_per_token"]
    return {
        "model": dataclasses.asdict(dims),
        "batch": {"prompts": prompts, "samples": samples, "tokens": tokens, "tokens_per_step": per_step_tokens},
        "bandwidth_gbps": bandwidth_gbps,
        "modes": out,
    }


def _human(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_plan(p: dict[str, Any]) -> str:
    d, b = p["model"], p["batch"]
    mlp = (f"dense, MLP dim {d['intermediate']}" if d.get("dense_layers")
           else f"top-{d['top_k']} of experts with dim {d['moe_intermediate']}")
    lines = [
        f"guidance plan for {d['name']}: {d['layers']} layers ({len(d['moe_layers'])} MoE, "
        f"{len(d['kv_layers'])} with a KV cache), hidden {d['hidden']}, {mlp}, {d['kv_heads']} KV heads x "
        f"{d['head_dim']}",
        f"  step: {b['prompts']} prompts x {b['samples']} samples x {b['tokens']} tokens = {b['tokens_per_step']:,} "
        "token positions" + (f"; I/O at {p['bandwidth_gbps']:g} GB/s" if p["bandwidth_gbps"] else ""),
        "",
        f"{'mode':<48}{'B/token':>12}{'per step':>12}{'x full':>9}{'x lsb':>8}"
        + ("  I/O s" if p["bandwidth_gbps"] else ""),
    ]
    for name, r in p["modes"].items():
        io = f"{r['io_seconds']:>8.1f}" if "io_seconds" in r else ""
        lines.append(
            f"{name:<48}{r['bytes_per_token']:>12,.1f}{_human(r['bytes_per_step']):>12}"
            f"{r.get('ratio_to_full', math.nan):>9.4f}{r.get('ratio_to_lsb', math.nan):>8.3f}{io}"
        )
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to a ``tracefp4`` subparsers object."""
    p = subparsers.add_parser(
        "plan",
        help="guidance volume per RL step for each mode, from a model config",
        description="Bytes of guidance per token position and per RL step, and the I/O time at a given bandwidth, "
        "for every guidance mode of the sweep, from a Hugging Face config.json or a preset.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", metavar="CONFIG.json", help="a Hugging Face config.json (or a folder holding one)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a built-in model config")
    # The defaults are one GRPO step of a long-reasoning run (64 prompts x 8 samples x 4096 positions), so that
    # `tracefp4 plan --preset NAME` answers for a typical step without further options.
    p.add_argument("--prompts", type=int, default=64, help="prompts per RL step (default: %(default)s)")
    p.add_argument("--samples", type=int, default=8, help="samples (completions) per prompt (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=4096,
                   help="token positions per sample, prompt + completion (default: %(default)s)")
    p.add_argument("--bandwidth", type=float, metavar="GBPS", help="storage or network bandwidth, GB/s")
    p.add_argument(
        "--sweep-json", metavar="PATH", help="a 'tracefp4 mismatch --sweep --json' output: densities of sparse modes"
    )
    p.add_argument("--modes", metavar="M1,M2", help="comma-separated modes (default: those of the standard sweep)")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    p.set_defaults(func=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    try:
        if args.preset:
            dims = ModelDims.from_config(PRESETS[args.preset], args.preset)
        else:
            path = Path(args.config)
            path = path / "config.json" if path.is_dir() else path
            dims = ModelDims.from_config(json.loads(path.read_text()), str(path))
        sweep = json.loads(Path(args.sweep_json).read_text()) if args.sweep_json else None
        modes = [m for m in args.modes.split(",") if m.strip()] if args.modes else list(STANDARD_MODES)
        p = plan(
            dims, prompts=args.prompts, samples=args.samples, tokens=args.tokens,
            bandwidth_gbps=args.bandwidth, modes=modes, sweep=sweep,
        )  # fmt: skip
    except (OSError, ValueError) as e:
        raise SystemExit(f"tracefp4 plan: {e}") from None
    publish(p, format_plan(p), args.json)
    return 0
