"""One-off migration of the committed results to one name per concept (issue 47): every metric under its
registry name (tracefp4.pipeline.metrics), every arm under the arm table's name (tracefp4.pipeline.arms).

Run once from the repository root (``python scripts/migrate_names.py``); it renames keys and mode values
only, keeps every number and every key's place, and writes each file as it was formatted (indent 2, ASCII,
a final newline). The experiment plots named after a renamed curve move with it. The script is deleted
in the commit after the one that runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tracefp4.files import atomic_write_bytes
from tracefp4.pipeline.metrics import Name, gap_quantile

RESULTS = Path("docs/results")
IMG = Path("docs/img")

#: The experiment summaries' and the TRL study's spellings of the registry's metrics.
SUMMARY_METRICS = {"logprob_gap_mean": Name.GAP_MEAN, "logprob_gap_max": Name.GAP_MAX,
                   "code_mismatch": Name.CODE_MISMATCH}
#: The scaling report's spellings: in an arm's row, its buckets, its per-layer and per-bucket tables and
#: its fits.
SCALING_METRICS = {"mean_abs": Name.GAP_MEAN, "p99_abs": gap_quantile(0.99), "max_abs": Name.GAP_MAX,
                   "code_mismatch": Name.CODE_MISMATCH, "adjacent_share": Name.ONE_APART,
                   "code_mismatch_deeper_half": f"{Name.CODE_MISMATCH}_deeper_half",
                   "code_mismatch_guided": f"{Name.CODE_MISMATCH}_guided", "decode_failures": Name.DECODE_FAILURES,
                   "rate": Name.CODE_MISMATCH}
#: The scaling report's arm keys -> the arm table's names.
SCALING_ARMS = {"lsb@all": "trace-all", "ldpc@all": "trace-ldpc", "full": "trace-full"}
#: The rollout benchmarks' recording modes -> the arm table's names.
BENCH_MODES = {"trace_lsb": "trace", "trace_full": "trace-full"}


def renamed(d: dict, names: dict[str, str], where: str) -> dict:
    """``d`` with the keys of ``names`` renamed in place (order kept); a clash is an error naming ``where``."""
    out = {}
    for k, v in d.items():
        new = names.get(k, k)
        if new in out or (new != k and new in d):
            raise ValueError(f"{where}: renaming {k!r} to {new!r} clashes with a key already there")
        out[new] = v
    return out


def experiment(data: dict, path: Path) -> dict:
    for arm, entry in data["arms"].items():
        entry = renamed(entry, SUMMARY_METRICS, f"{path}: arm {arm}")
        entry["curves"] = renamed(entry["curves"], SUMMARY_METRICS, f"{path}: arm {arm}'s curves")
        data["arms"][arm] = entry
    return data


def trl_study(data: dict, path: Path) -> dict:
    for setting, arms in data["settings"].items():
        for arm in arms:
            arms[arm] = renamed(arms[arm], SUMMARY_METRICS, f"{path}: {setting}/{arm}")
    return data


def _scaling_row(row: dict, where: str) -> dict:
    row = renamed(row, SCALING_METRICS, where)
    for table in ("by_bucket", "code_by_layer", "code_by_bucket"):
        if table in row:
            row[table] = {k: renamed(v, SCALING_METRICS, f"{where} {table}.{k}") for k, v in row[table].items()}
    return row


def scaling(data: dict, path: Path) -> dict:
    data["grid"]["arms"] = renamed(data["grid"]["arms"], SCALING_ARMS, f"{path}: grid.arms")
    for point in data["points"]:
        arms = renamed(point["arms"], SCALING_ARMS, f"{path}: point {point['name']}")
        point["arms"] = {arm: _scaling_row(row, f"{path}: point {point['name']} arm {arm}") for arm, row in arms.items()}
    for weights, fits in data["fit"].items():
        fits = renamed(fits, SCALING_ARMS, f"{path}: fit.{weights}")
        data["fit"][weights] = {arm: renamed(f, SCALING_METRICS, f"{path}: fit.{weights}.{arm}") for arm, f in fits.items()}
    return data


def bench(text: str) -> str:
    """A benchmark file's modes and the target labels that name them: the JSON strings ``"trace_lsb"`` and
    ``"trace_full"``, and the words in a label (``vllm trace_lsb / vllm fp4``)."""
    for old, new in BENCH_MODES.items():
        text = text.replace(f'"{old}"', f'"{new}"').replace(f" {old} ", f" {new} ")
    return text


def write(path: Path, data: dict) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())


def main() -> int:
    experiments = [p for p in sorted(RESULTS.glob("*.json")) if "arms" in json.loads(p.read_text())]
    for path in experiments:
        write(path, experiment(json.loads(path.read_text()), path))
        stem = path.stem
        for old, new in (("logprob_gap_mean", Name.GAP_MEAN), ("logprob_gap_max", Name.GAP_MAX)):
            png = IMG / f"{stem}_{old}.png"
            if png.exists():
                subprocess.run(["git", "mv", str(png), str(IMG / f"{stem}_{new}.png")], check=True)
    write(RESULTS / "collapse-trl.json", trl_study(json.loads((RESULTS / "collapse-trl.json").read_text()),
                                                  RESULTS / "collapse-trl.json"))
    write(RESULTS / "scaling.json", scaling(json.loads((RESULTS / "scaling.json").read_text()), RESULTS / "scaling.json"))
    for path in sorted(RESULTS.glob("bench-*/*.json")):
        text = bench(path.read_text())
        json.loads(text)  # still JSON
        atomic_write_bytes(path, text.encode())
    print(f"migrated {len(experiments)} experiment summaries, collapse-trl.json, scaling.json and "
          f"{len(list(RESULTS.glob('bench-*/*.json')))} benchmark files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
