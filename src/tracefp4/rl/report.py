"""The plots and summary table of a run folder."""

from __future__ import annotations

from pathlib import Path

from tracefp4.pipeline.metrics import Name, label
from tracefp4.rl import runlog

#: (metric, column title) of the summary table: means over the last 5 steps of each arm.
SUMMARY_KEYS = [
    ("reward_mean", "reward"),
    *((name, label(name)) for name in (Name.GAP_MEAN, Name.GAP_MAX, Name.K3_KL, Name.CODE_MISMATCH, Name.GUIDANCE_BYTES)),
    ("time/rollout_s", "rollout s"),
    ("time/train_s", "train s"),
]


def write_report(run_dir: Path) -> str:
    """Plots and the summary table of a run folder (also usable on a finished or partial run);
    returns the table."""
    metrics = runlog.read_metrics(run_dir)
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    runlog.plot_metric(metrics, Name.GAP_MAX, plots / "logprob_gap_max.png",
                       title="max |Δlogp| (trainer vs rollout) per step", ylabel="max |Δlogp|", logy=True)
    runlog.plot_metric(metrics, Name.GAP_MEAN, plots / "logprob_gap_mean.png",
                       title="mean |Δlogp| (trainer vs rollout) per step", ylabel="mean |Δlogp|", logy=True)
    runlog.plot_metric(metrics, "reward_mean", plots / "reward.png", title="training reward", ylabel="mean reward")
    runlog.plot_metric(metrics, "eval_accuracy", plots / "eval_accuracy.png", title="held-out greedy accuracy",
                       ylabel="accuracy", kind="eval")
    rows = runlog.summary_rows(metrics, SUMMARY_KEYS)
    columns = [("arm", "arm"), ("steps", "steps"), *SUMMARY_KEYS, ("eval_accuracy_first", "eval acc (start)"),
               ("eval_accuracy", "eval acc (end)")]
    table = runlog.markdown_table(rows, columns)
    (run_dir / "summary.md").write_text(
        f"# GRPO run `{run_dir.name}`\n\nMeans over the last 5 steps of each arm.\n\n{table}\n\n"
        "![max gap](plots/logprob_gap_max.png)\n![reward](plots/reward.png)\n"
        "![eval](plots/eval_accuracy.png)\n"
    )
    return table
