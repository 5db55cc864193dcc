"""The ``tracefp4`` command line."""

from __future__ import annotations

import argparse
import sys


def cmd_twopath(args: argparse.Namespace) -> int:
    from tracefp4.reports.twopath import format_report, run_two_path

    rep = run_two_path(rows=args.rows, k=args.cols, inner=args.inner, seed=args.seed)
    print(format_report(rep))
    return 0


def _run_rl(cfg) -> int:
    import torch

    from tracefp4.rl.loop import run
    from tracefp4.rl.report import write_report

    cfg.validate()  # before touching the process: a bad value is reported with nothing done
    torch.set_num_threads(cfg.threads)  # the command owns the process; rl.loop.run leaves threads alone
    run_dir = run(cfg)
    print(f"\nrun folder: {run_dir}")
    print(write_report(run_dir))
    print(f"\nplots: {run_dir / 'plots'}   summary: {run_dir / 'summary.md'}")
    return 0


def guidance_mode(name: str) -> str:
    """argparse type of ``--guidance``: a GuidedMode name, checked, kept as written."""
    from tracefp4.guidance.compact import GuidedMode

    try:
        GuidedMode.parse(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{name!r} is not a guidance mode: {e}") from None
    return name


def cmd_demo(args: argparse.Namespace) -> int:
    from tracefp4.rl.config import RLConfig

    cfg = RLConfig(out=args.out, task=args.task, seed=args.seed, run_name=args.name)
    if args.steps is not None:
        cfg.steps = args.steps
    if args.arms:
        cfg.arms = tuple(args.arms.split(","))
    if args.guidance is not None:
        cfg.guidance = args.guidance
    cfg.eval_every = max(1, min(cfg.eval_every, cfg.steps))
    return _run_rl(cfg)


def cmd_train(args: argparse.Namespace) -> int:
    from tracefp4.rl.config import RLConfig

    cfg = RLConfig.from_file(args.config)
    if args.resume:
        cfg.resume = args.resume
    if args.guidance is not None:
        cfg.guidance = args.guidance
    return _run_rl(cfg)


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tracefp4.rl.report import write_report

    print(write_report(Path(args.run_dir)))
    return 0


GUIDANCE_HELP = ("the trace arm's guidance mode, <mode>[@all|@deeper]: lsb (default), lsb+parity+amax:lo3, "
                 "ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all, ... (trace-full stays full on all layers)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tracefp4", description="TRACE: rollout-guided FP4 rounding for RL of MoE LLMs")
    sub = p.add_subparsers(dest="command", required=True)
    from tracefp4.reports import capacity as plan
    from tracefp4.reports.commands import add_mismatch_parser

    add_mismatch_parser(sub)  # the report, and the guidance sweep with --sweep
    plan.add_parser(sub)

    d = sub.add_parser(
        "demo",
        help="the main job: GRPO with BF16, vanilla FP4 QAT and TRACE side by side",
        description="Warm-starts a tiny Qwen3-MoE on a synthetic task, then runs GRPO in every arm (bf16, qat, "
        "trace, trace-full) with the same seeds; writes metrics, checkpoints, plots and a summary to a run folder.",
    )
    d.add_argument("--steps", type=int, default=None, help="GRPO steps per arm (default: the config's)")
    d.add_argument("--out", default="runs", help="parent folder of the run folder")
    d.add_argument("--name", default=None, help="run folder name (default: a timestamp)")
    d.add_argument("--task", default="reverse", help="reverse or addition")
    d.add_argument("--arms", default=None, help="comma-separated subset of bf16,qat,trace,trace-full")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--guidance", type=guidance_mode, default=None, metavar="MODE", help=GUIDANCE_HELP)
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser(
        "train",
        help="GRPO from a config file (TOML, YAML or JSON)",
        description="Any arm, task, model config or local checkpoint; --resume continues a run folder.",
    )
    t.add_argument("--config", required=True, help="a .toml, .yaml/.yml or .json file of RLConfig fields")
    t.add_argument("--resume", default=None, help="a run folder to continue (its arm checkpoints)")
    t.add_argument("--guidance", type=guidance_mode, default=None, metavar="MODE",
                   help=GUIDANCE_HELP + " (overrides the config's guidance)")
    t.set_defaults(func=cmd_train)

    r = sub.add_parser("report", help="redraw the plots and summary table of a run folder",
                       description="Reads metrics/*.jsonl of a run folder and rewrites plots/ and summary.md.")
    r.add_argument("run_dir")
    r.set_defaults(func=cmd_report)

    tp = sub.add_parser(
        "twopath",
        help="the synthetic two-engine demonstration (no model)",
        description="Two engines compute the same bf16 activation in different reduction orders; count FP4 "
        "code disagreements under round-to-nearest and under rollout-guided rounding.",
    )
    tp.add_argument("--rows", type=int, default=512, help="activation rows (tokens)")
    tp.add_argument("--cols", type=int, default=1024, help="activation width, a multiple of 16")
    tp.add_argument("--inner", type=int, default=1024, help="reduction length of the matmul")
    tp.add_argument("--seed", type=int, default=0)
    tp.set_defaults(func=cmd_twopath)

    b = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one process)")
    bsub = b.add_subparsers(dest="bench", required=True)
    from tracefp4.reports.bench import add_bench_commands

    add_bench_commands(bsub)  # numerics (--memory, --threads) and all (every registered section)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
