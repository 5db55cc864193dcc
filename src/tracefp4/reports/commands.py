"""The ``tracefp4 mismatch`` command: the mismatch report, or with ``--sweep`` the guidance sweep.

Both measure the same model on the same prompts, so they share one parser and one way of building
their inputs; this module is the only one that knows both (the report and the sweep never import
each other, and nothing under ``tracefp4.reports`` imports the package CLI).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

import torch

from tracefp4.engines.protocol import SamplingParams
from tracefp4.pipeline.factory import EngineKind, make_engine
from tracefp4.reports import mismatch, replay, sweep

__all__ = ["add_mismatch_parser", "run_mismatch"]


def add_mismatch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``mismatch`` subcommand (report and ``--sweep``) to a ``tracefp4`` subparsers object."""
    p = subparsers.add_parser(
        "mismatch",
        help="train-rollout mismatch report: FP4 code mismatches, router flips, log-prob gap, guidance bytes",
        description="Run a tiny Qwen3-MoE (or a local checkpoint) through the rollout engine in bf16, fp4, "
        "trace (lsb hints, deeper half) and trace (full hints, all layers), and the trainer on each mode's "
        "completions; print code mismatch rates per site and layer, router flips without replay, the log-prob "
        "gap per arm and the guidance bytes per generated token. With --sweep: every guidance mode's bytes "
        "against its agreement; with --lag: a lag-k replay of a short GRPO run (rollouts k versions behind).",
    )
    mismatch.add_arguments(p)
    sweep.add_arguments(p)
    replay.add_arguments(p)
    p.set_defaults(func=run_mismatch)
    return p


#: The report's options that the replay takes from its run config instead, with their defaults.
_RUN_FIXED = {"batch": mismatch.DEFAULTS["batch"], "new_tokens": mismatch.DEFAULTS["new_tokens"],
              "prompt_len": mismatch.DEFAULTS["prompt_len"], "temperature": mismatch.DEFAULTS["temperature"],
              "seed": mismatch.DEFAULTS["seed"], "plan": "nvfp4", "device": "cpu", "engine": EngineKind.HOME.value}


def _check_replay_args(args: argparse.Namespace, dims: dict[str, object]) -> None:
    """``--lag`` takes its model, batch and sampling from the run config: exits on an option that
    would be ignored, naming it."""
    if args.sweep:
        raise SystemExit("tracefp4 mismatch: --lag and --sweep are two different measurements; give one")
    given = sorted(f"--{k.replace('_', '-')}" for k in dims)
    given += [f"--{k.replace('_', '-')}" for k, default in _RUN_FIXED.items()
              if getattr(args, k, default) != default]
    given += ["--checkpoint"] * (args.checkpoint is not None) + ["--modes"] * (args.modes is not None)
    given += ["--dense"] * bool(getattr(args, "dense", False))  # the run config's [model] dense = true builds it
    if given:
        raise SystemExit(f"tracefp4 mismatch --lag: {', '.join(given)} set what the run config sets (model, batch, "
                         "sampling, plan: NVFP4 on our engine); give those in --config")


def _check_args(args: argparse.Namespace) -> dict[str, object]:
    """The model dims given on the command line; exits on a combination that cannot run."""
    dims = {k: getattr(args, k) for k in mismatch.MODEL_DIMS if getattr(args, k, None) is not None}
    if getattr(args, "lag", None) is not None:
        _check_replay_args(args, dims)
        return dims
    stray = [opt for opt, value, default in (("--config", args.config, None), ("--lrs", args.lrs, None),
                                             ("--steps", args.steps, None), ("--train-arm", args.train_arm, "trace-full"))
             if value != default]
    if stray:
        raise SystemExit(f"tracefp4 mismatch: {', '.join(stray)} go with --lag")
    if args.checkpoint is not None and (dims or getattr(args, "dense", False)):
        raise SystemExit(f"tracefp4 mismatch: --checkpoint fixes the model; drop {sorted(dims) or ['dense']}")
    if args.batch < 1 or args.new_tokens < 1 or args.prompt_len < 1:
        raise SystemExit("tracefp4 mismatch: --batch, --new-tokens and --prompt-len must be >= 1")
    if not args.sweep and args.modes:
        raise SystemExit("tracefp4 mismatch: --modes goes with --sweep")
    if not args.sweep and args.plot:
        raise SystemExit("tracefp4 mismatch: --plot goes with --sweep or --lag")
    if args.sweep and getattr(args, "plan", "nvfp4") != "nvfp4":
        raise SystemExit("tracefp4 mismatch: --sweep measures the FP4 guidance modes; --plan fp8 goes without it")
    return dims


def _progress(quiet: bool) -> Callable[[str], None]:
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        if not quiet:
            print(f"[mismatch {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return say


def _inputs(
    args: argparse.Namespace, dims: dict[str, object], say: Callable[[str], None]
) -> tuple[object, Sequence[torch.Tensor], SamplingParams]:
    """The model (checkpoint, or the tiny default with ``dims``), the prompts and the sampling parameters."""
    device = torch.device(getattr(args, "device", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"tracefp4 mismatch: --device {device}: no CUDA device here (torch.cuda.is_available() is False)")
    try:
        model = mismatch.build_model(args.checkpoint, seed=args.seed, dense=getattr(args, "dense", False), **dims).to(device)
    except ValueError as e:
        raise SystemExit(f"tracefp4 mismatch: {e}") from None
    built = "tiny dense Qwen3 from config" if getattr(args, "dense", False) else "tiny Qwen3-MoE from config"
    say(f"model ready ({'checkpoint ' + args.checkpoint if args.checkpoint else built})")
    prompts = mismatch.make_prompts(args.batch, model.config.vocab_size, args.prompt_len, args.seed)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, seed=args.seed)
    return model, prompts, sampling


#: head_dim of the tiny model when vLLM runs it: vLLM's CPU attention supports 32, 64, 80, ... (not
#: the tiny default's 16); a --head-dim given on the command line is kept (and checked by vLLM).
VLLM_TINY_HEAD_DIM = 32


def run_mismatch(args: argparse.Namespace) -> int:
    dims = _check_args(args)
    say = _progress(args.quiet)
    if args.lag is not None:
        try:
            return replay.run_cli(args, say)
        except ValueError as e:
            raise SystemExit(f"tracefp4 mismatch: {e}") from None
    kind = EngineKind.parse(getattr(args, "engine", EngineKind.HOME.value), "--engine")
    if kind is EngineKind.VLLM and args.checkpoint is None and "head_dim" not in dims:
        dims["head_dim"] = VLLM_TINY_HEAD_DIM
        say(f"--engine vllm: head_dim {VLLM_TINY_HEAD_DIM} (vLLM's CPU attention has no kernel for the default 16)")
    model, prompts, sampling = _inputs(args, dims, say)
    if kind is EngineKind.VLLM:
        if getattr(args, "device", "cpu") != "cpu":
            raise SystemExit("tracefp4 mismatch: --device is our engine's; vLLM picks its own device")
        if args.sweep:
            raise SystemExit("tracefp4 mismatch: --engine vllm goes without --sweep")
        say(f"starting vLLM (tracefp4 plugin, {args.kv_store} K/V cache)")
        max_len = args.prompt_len + args.new_tokens + 2
        try:
            if args.kv_store == "packed":
                # packed K/V serves its plan's K/V format only: one engine per plan (BF16 arm, then the FP4 arms)
                engine = make_engine(EngineKind.VLLM_PER_PLAN, model, checkpoint=args.checkpoint, max_len=max_len)
            else:
                engine = make_engine(kind, model, checkpoint=args.checkpoint, max_len=max_len, keep_bf16=True)
        except ValueError as e:
            raise SystemExit(f"tracefp4 mismatch: {e}") from None
        with engine:
            return mismatch.run_cli(args, model, prompts, sampling, say, engine=engine)
    run = sweep.run_cli if args.sweep else mismatch.run_cli
    return run(args, model, prompts, sampling, say)
