"""The ``tracefp4`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
    os.replace(tmp, path)  # a reader never sees a half-written file
    print(f"wrote {path}")


def cmd_demo(args: argparse.Namespace) -> int:
    from .synthetic import format_report, run_two_path

    rep = run_two_path(rows=args.rows, k=args.cols, inner=args.inner, seed=args.seed)
    print(format_report(rep))
    return 0


def cmd_bench_numerics(args: argparse.Namespace) -> int:
    from .bench import bench_numerics, format_numerics

    res = bench_numerics(rows=args.rows, cols=args.cols, repeats=args.repeats)
    print(format_numerics(res))
    _write_json(args.json, res)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tracefp4", description="TRACE: rollout-guided FP4 rounding for RL of MoE LLMs")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser(
        "demo",
        help="the main job (for now: the synthetic two-engine demonstration)",
        description="Two engines compute the same bf16 activation in different reduction orders; count FP4 "
        "code disagreements under round-to-nearest and under rollout-guided rounding.",
    )
    d.add_argument("--rows", type=int, default=512, help="activation rows (tokens)")
    d.add_argument("--cols", type=int, default=1024, help="activation width, a multiple of 16")
    d.add_argument("--inner", type=int, default=1024, help="reduction length of the matmul")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one process)")
    bsub = b.add_subparsers(dest="bench", required=True)
    bn = bsub.add_parser(
        "numerics",
        help="quantize / dequantize / hints / guided rounding vs a tensor copy and torchao",
        description="Times the FP4 numerics on one bf16 tensor in one process and prints ratios.",
    )
    bn.add_argument("--rows", type=int, default=4096)
    bn.add_argument("--cols", type=int, default=4096)
    bn.add_argument("--repeats", type=int, default=5)
    bn.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    bn.set_defaults(func=cmd_bench_numerics)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
