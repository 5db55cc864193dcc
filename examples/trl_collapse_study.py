"""The collapse study through TRL, short form: vanilla QAT against TRACE (full codes) and the BF16 reference,
under TRL's own importance-correction knobs, a few seeds.

Each run is ``examples/trl_grpo_trace.py`` in its own process (a fresh in-process vLLM engine each),
writing ``<out>/<setting>/<arm>-s<seed>.json``; a run whose file exists is skipped, so a killed study
resumes where it stopped. Settings: ``off`` (``vllm_importance_sampling_correction = False``) and
``sequence`` (``importance_sampling_level = "sequence"``). Then the summary
(:mod:`tracefp4.reports.trl_study`) goes to ``--results`` and ``make docs`` renders its page.

    python examples/trl_collapse_study.py --seeds 0 1 2 --max-steps 120 --results docs/results/collapse-trl.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = {"off": ["--no-is-correction"], "sequence": ["--is-level", "sequence"]}
ARMS = {"bf16": ["--mode", "bf16"], "qat": ["--mode", "qat"], "trace-full": ["--mode", "trace", "--guidance", "full"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--max-steps", type=int, default=120)
    p.add_argument("--warm-start-steps", type=int, default=100,
                   help="supervised steps of each seed's model (default 100: the reverse task's reward starts "
                        "near 0.4, room to learn or to fall)")
    p.add_argument("--task", default="reverse")
    p.add_argument("--out", default="runs/trl-collapse", help="run folder (one JSON per run)")
    p.add_argument("--results", default=None, help="write the summary JSON here (e.g. docs/results/collapse-trl.json)")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = p.parse_args(argv)

    out = Path(args.out)
    jobs = [(s, a, seed) for seed in args.seeds for s in args.settings for a in args.arms]
    for i, (setting, arm, seed) in enumerate(jobs, 1):
        dest = out / setting / f"{arm}-s{seed}.json"
        if dest.exists():
            continue
        cmd = [sys.executable, str(HERE / "trl_grpo_trace.py"), *ARMS[arm], *SETTINGS[setting],
               "--task", args.task, "--seed", str(seed), "--max-steps", str(args.max_steps),
               "--warm-start-steps", str(args.warm_start_steps),
               "--model-dir", str(out / f"model-{args.task}-w{args.warm_start_steps}-s{seed}"),
               "--output-dir", str(out / setting / f"{arm}-s{seed}"), "--json", str(dest)]
        t0 = time.perf_counter()
        print(f"[{i}/{len(jobs)}] {setting} {arm} seed {seed}", file=sys.stderr, flush=True)
        log = out / setting / f"{arm}-s{seed}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            print(f"  failed (exit {rc}); see {log}", file=sys.stderr)
            return rc
        print(f"  done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    from tracefp4.files import atomic_write_json
    from tracefp4.provenance import environment
    from tracefp4.reports.trl_study import format_trl_study, load_runs, summarise_runs

    paths = [out / s / f"{a}-s{seed}.json" for s, a, seed in jobs]
    summary = summarise_runs(load_runs(paths), environment=environment())
    print(format_trl_study(summary))
    if args.results:
        atomic_write_json(args.results, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
