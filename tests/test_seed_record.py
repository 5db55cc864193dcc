"""Seed records: an experiment's finished seeds kept in the results tree, read back when the run
folders are gone (a move to a new machine), verified before use; partial summaries marked as such."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tracefp4.cli import main
from tracefp4.rl.experiment import ExperimentConfig, archive_seed, read_seed, write_results
from tracefp4.rl.runfolder import record_environment
from tracefp4.rl.seedrecord import MANIFEST_NAME, SeedRecordError, read_seed_record, record_dir
from rl_tiny import EXPERIMENT_RUN as RUN

SRC = str(Path(__file__).resolve().parent.parent / "src")


def _experiment(tmp_path: Path, seeds=(0, 1), **run) -> ExperimentConfig:
    # steps = 0: an arm is its step-0 evaluation, so a finished run folder is written here in full
    # without training (the slow test below runs real steps)
    return ExperimentConfig(name="e", seeds=list(seeds), out=str(tmp_path / "runs"),
                            run={"steps": 0, "arms": ["bf16", "trace"], "threads": 1, **run})


def _finish_seed(cfg: ExperimentConfig, seed: int) -> Path:
    """A finished seed's run folder, as the loop leaves one with 0 steps: config, environment, each
    arm's evaluation row (values chosen per seed and arm, exact in binary)."""
    from tracefp4.rl.loop import open_run_folder

    run_dir = open_run_folder(cfg.run_config(seed))
    record_environment(run_dir, {"cpu_model": "test CPU", "torch_threads": 1})
    for i, arm in enumerate(cfg.run["arms"]):
        row = {"kind": "eval", "step": 0, "eval_accuracy": 0.25 * (seed + i), "eval_reward": 0.5 + 0.125 * i}
        (run_dir / "metrics" / f"{arm}.jsonl").write_text(json.dumps(row, sort_keys=True) + "\n")
    return run_dir


def _without_source(summary: dict) -> dict:
    out = json.loads(json.dumps(summary))
    for p in out["provenance"]["per_seed"].values():
        p.pop("from_record")
    return out


def test_a_finished_seed_is_recorded_whole_and_read_back_when_its_run_folder_is_gone(tmp_path):
    cfg = _experiment(tmp_path)
    res = tmp_path / "res"
    run_dir = _finish_seed(cfg, 0)
    assert archive_seed(cfg, 1, res) is None  # no run folder: nothing to record
    path = archive_seed(cfg, 0, res)
    assert path == record_dir(res, "e", 0) == res / "records" / "e" / "seed-0"
    for name in ("config.json", "environment.json", "metrics/bf16.jsonl", "metrics/trace.jsonl"):
        assert (path / name).read_bytes() == (run_dir / name).read_bytes(), name
    rec = read_seed_record(path, experiment="e", seed=0)
    assert sorted(rec.metrics) == ["bf16", "trace"] and rec.steps == 0
    assert rec.warm_start == {"weights_sha256": None, "source": None}  # no warm start saved in this folder
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == {"config.json", "environment.json", "warm_start.json", "metrics/bf16.jsonl",
                                      "metrics/trace.jsonl"}
    assert sorted(p.name for p in path.parent.iterdir()) == ["seed-0"]  # no temp folder left
    before = (path / MANIFEST_NAME).stat().st_mtime_ns
    assert archive_seed(cfg, 0, res) == path and (path / MANIFEST_NAME).stat().st_mtime_ns == before  # identical: kept

    _finish_seed(cfg, 1)
    full = write_results(cfg, res, tmp_path / "img")
    assert "partial" not in full and full["arms"]["trace"]["final_eval_accuracy_per_seed"] == [0.25, 0.5]
    assert [p["from_record"] for p in full["provenance"]["per_seed"].values()] == [False, False]
    shutil.rmtree(tmp_path / "runs")  # the move to a new machine
    again = write_results(cfg, res, tmp_path / "img")
    assert not (tmp_path / "runs").exists()
    assert [p["from_record"] for p in again["provenance"]["per_seed"].values()] == [True, True]
    assert _without_source(again) == _without_source(full)
    assert json.loads((res / "e.json").read_text()) == again


def test_a_partial_summary_names_its_missing_seeds_and_the_plain_one_is_refused(tmp_path):
    cfg = _experiment(tmp_path, seeds=(0, 1, 2))
    res = tmp_path / "res"
    with pytest.raises(ValueError, match=r"no seed is finished"):
        write_results(cfg, res, tmp_path / "img", partial=True)
    _finish_seed(cfg, 1)
    with pytest.raises(ValueError, match=r"seeds \[0, 2\] are not finished .*--summary-only writes a partial one"):
        write_results(cfg, res, tmp_path / "img")
    assert not (res / "e.json").exists()
    out = write_results(cfg, res, tmp_path / "img", partial=True)
    assert out["partial"] is True and out["seeds_missing"] == [0, 2]
    assert out["arms"]["bf16"]["seeds"] == [1] and list(out["provenance"]["per_seed"]) == ["1"]
    assert json.loads((res / "e.json").read_text()) == out
    assert (res / "records" / "e" / "seed-1" / MANIFEST_NAME).is_file()  # recorded on the way
    from tracefp4.rl.experiment import format_summary

    assert format_summary(out).startswith("PARTIAL: seeds 0, 2 not finished")


def test_summary_only_command(tmp_path, capsys):
    cfg = _experiment(tmp_path)
    _finish_seed(cfg, 0)
    file = tmp_path / "e.json"
    file.write_text(json.dumps({"name": cfg.name, "seeds": cfg.seeds, "out": cfg.out, "run": cfg.run}))
    argv = ["experiment", "--config", str(file), "--results", str(tmp_path / "res"), "--plots", str(tmp_path / "img")]
    assert main([*argv, "--summary-only"]) == 0
    assert "PARTIAL: seeds 1 not finished" in capsys.readouterr().out
    assert json.loads((tmp_path / "res" / "e.json").read_text())["seeds_missing"] == [1]
    assert main([*argv, "--summary-only", "--workers", "2"]) == 2
    assert "--summary-only runs nothing" in capsys.readouterr().err


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: (p / "metrics" / "trace.jsonl").unlink(), r"metrics/trace.jsonl: missing \(listed in MANIFEST.json\)"),
    (lambda p: (p / "metrics" / "bf16.jsonl").write_text('{"kind": "eval", "step": 0, "eval_accuracy": 1.0}\n'),
     r"metrics/bf16.jsonl: .*(bytes, MANIFEST.json lists|differs from MANIFEST.json)"),
    (lambda p: (p / "environment.json").write_bytes((p / "environment.json").read_bytes().replace(b"test", b"TEST")),
     r"environment.json: sha256 [0-9a-f]{64} differs from MANIFEST.json's"),
    (lambda p: (p / MANIFEST_NAME).unlink(), r"MANIFEST.json: missing; .* is not a complete seed record"),
    (lambda p: (p / "metrics" / "qat.jsonl").write_text("{}\n"), r"metrics/qat.jsonl: not listed in MANIFEST.json"),
])
def test_a_torn_or_edited_record_is_refused_naming_the_file(tmp_path, damage, message):
    cfg = _experiment(tmp_path, seeds=(0,))
    _finish_seed(cfg, 0)
    path = archive_seed(cfg, 0, tmp_path / "res")
    shutil.rmtree(tmp_path / "runs")
    damage(path)
    with pytest.raises(SeedRecordError, match=message):
        read_seed(cfg, 0, tmp_path / "res")
    with pytest.raises(SeedRecordError, match=message):  # before anything runs: no run folder is made
        from tracefp4.rl.experiment import run_experiment

        run_experiment(cfg, tmp_path / "res", tmp_path / "img")
    assert not (tmp_path / "runs").exists()


def test_a_record_of_another_configuration_is_refused(tmp_path):
    cfg = _experiment(tmp_path, seeds=(0,))
    _finish_seed(cfg, 0)
    archive_seed(cfg, 0, tmp_path / "res")
    shutil.rmtree(tmp_path / "runs")
    res = tmp_path / "res"
    with pytest.raises(ValueError, match=r"seed-0/config.json: this seed was run with another configuration .*lr: "):
        read_seed(_experiment(tmp_path, seeds=(0,), lr=0.5), 0, res)
    with pytest.raises(ValueError, match=r"record of 0 steps per arm, the experiment asks 3 .*cannot be extended"):
        read_seed(_experiment(tmp_path, seeds=(0,), steps=3), 0, res)
    with pytest.raises(ValueError, match=r"the record has no arm \['qat'\] .*own warm start"):
        read_seed(_experiment(tmp_path, seeds=(0,), arms=["bf16", "qat"]), 0, res)
    other = ExperimentConfig(name="f", seeds=[0], out=cfg.out, run=cfg.run)
    shutil.copytree(res / "records" / "e", res / "records" / "f")
    with pytest.raises(SeedRecordError, match=r"the record of seed 0 of experiment 'e', expected seed 0 of 'f'"):
        read_seed(other, 0, res)
    fewer = _experiment(tmp_path, seeds=(0,), arms=["trace"])  # a subset of the recorded arms is fine
    assert list(read_seed(fewer, 0, res).metrics) == ["bf16", "trace"]


@pytest.mark.subprocess
@pytest.mark.parametrize("point", ["record-files", "record-aside"])
def test_a_record_write_killed_at_any_moment_is_never_read_as_complete(tmp_path, point):
    """SIGKILL while the files are written (no record yet), and while an older record is replaced (the
    old one hidden, the new one not in place): neither leaves a readable record; the next write
    clears the leftovers and writes it whole."""
    cfg = _experiment(tmp_path, seeds=(0,))
    run_dir = _finish_seed(cfg, 0)
    res = tmp_path / "res"
    dest = record_dir(res, "e", 0)
    if point == "record-aside":  # an older record to replace: the same seed before its environment grew
        archive_seed(cfg, 0, res)
        record_environment(run_dir, {"cpu_model": "test CPU", "torch_threads": 1})
    code = ("import sys; from tracefp4.rl.seedrecord import write_seed_record; "
            "write_seed_record(sys.argv[1], sys.argv[2], experiment='e', seed=0, arms=['bf16', 'trace'], steps=0)")
    env = {**os.environ, "PYTHONPATH": SRC, "TRACEFP4_CRASH_AT": f"{point}:1"}
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir), str(dest)], env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    left = [p.name for p in dest.parent.iterdir()]
    assert not dest.exists() and left and all(n.startswith(".seed-0.") for n in left), left
    assert read_seed(cfg, 0, res) is not None  # the run folder is still there: read from it
    shutil.move(run_dir, tmp_path / "moved")
    assert read_seed(cfg, 0, res) is None  # no record: the seed is not finished as far as the results tree knows
    shutil.move(tmp_path / "moved", run_dir)
    assert archive_seed(cfg, 0, res) == dest
    assert sorted(p.name for p in dest.parent.iterdir()) == ["seed-0"]
    assert read_seed_record(dest, experiment="e", seed=0).environment == json.loads(
        (run_dir / "environment.json").read_text())




@pytest.mark.slow
def test_experiment_reruns_nothing_of_a_recorded_seed_after_the_move(tmp_path, monkeypatch):
    """A real seed (warm start, one GRPO step per arm): recorded when it finishes, with its warm start's
    digest; with runs/ deleted, the experiment reads it from its record without training (no run folder
    is made, the loop is never entered) and writes the same summary; the same experiment with a second
    seed, --summary-only, writes a partial summary naming it."""
    import tracefp4.rl.loop as loop

    one = tmp_path / "one.toml"
    one.write_text(f'name = "tiny"\nseeds = [0]\nout = "{tmp_path / "runs"}"\n' + RUN)
    argv = ["--results", str(tmp_path / "res"), "--plots", str(tmp_path / "img")]
    assert main(["experiment", "--config", str(one), *argv]) == 0
    first = json.loads((tmp_path / "res" / "tiny.json").read_text())
    rec = read_seed_record(tmp_path / "res" / "records" / "tiny" / "seed-0", experiment="tiny", seed=0)
    assert rec.steps == 1 and rec.warm_start == first["provenance"]["per_seed"]["0"]["warm_start"]
    assert len(rec.warm_start["weights_sha256"]) == 16 and rec.warm_start["warm_start_steps"] == 1
    for arm in ("bf16", "trace"):
        assert (tmp_path / "res" / "records" / "tiny" / "seed-0" / "metrics" / f"{arm}.jsonl").read_bytes() == (
            tmp_path / "runs" / "tiny" / "seed-0" / "metrics" / f"{arm}.jsonl").read_bytes()

    shutil.rmtree(tmp_path / "runs")
    trained = []
    monkeypatch.setattr(loop, "run", lambda cfg: trained.append(cfg))
    assert main(["experiment", "--config", str(one), *argv]) == 0
    assert trained == [] and not (tmp_path / "runs").exists()
    again = json.loads((tmp_path / "res" / "tiny.json").read_text())
    assert again["provenance"]["per_seed"]["0"]["from_record"] is True
    assert _without_source(again) == _without_source(first)

    two = tmp_path / "two.toml"
    two.write_text(f'name = "tiny"\nseeds = [0, 1]\nout = "{tmp_path / "runs"}"\n' + RUN)
    assert main(["experiment", "--config", str(two), "--summary-only", *argv]) == 0
    partial = json.loads((tmp_path / "res" / "tiny.json").read_text())
    assert partial["partial"] is True and partial["seeds_missing"] == [1]
    assert {k: v for k, v in partial.items() if k not in ("partial", "seeds_missing")} == again


def test_a_concurrent_writers_temp_folder_is_left_alone(tmp_path):
    """Leftovers of a killed write are removed, but not the temp folder of a live process (a
    --summary-only recording the same seed beside the running experiment)."""
    cfg = _experiment(tmp_path, seeds=(0,))
    _finish_seed(cfg, 0)
    dest = record_dir(tmp_path / "res", "e", 0)
    dest.parent.mkdir(parents=True)
    live = dest.parent / f".seed-0.tmp-{os.getppid()}-0000"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = dest.parent / f".seed-0.old-{int(dead.stdout)}-0000"
    for p in (live, gone):
        (p / "metrics").mkdir(parents=True)
    assert archive_seed(cfg, 0, tmp_path / "res") == dest
    assert sorted(p.name for p in dest.parent.iterdir()) == sorted([live.name, "seed-0"])


def test_a_record_is_never_replaced_by_another_run_of_its_seed(tmp_path):
    """The same seed continued (its environment grew) replaces its record; the seed run again from
    other warm-start weights (another machine) is refused, naming both digests; a recorded seed has
    no --job to run."""
    from tracefp4.rl.experiment import run_job

    cfg = _experiment(tmp_path, seeds=(0,))
    run_dir = _finish_seed(cfg, 0)
    res = tmp_path / "res"
    dest = archive_seed(cfg, 0, res)
    record_environment(run_dir, {"cpu_model": "test CPU", "torch_threads": 1})
    assert archive_seed(cfg, 0, res) == dest
    assert len(read_seed_record(dest, experiment="e", seed=0).environment["resumes"]) == 1
    warm = json.loads((dest / "warm_start.json").read_text())
    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    other = json.dumps({**warm, "weights_sha256": "0123456789abcdef"}, indent=2) + "\n"
    (dest / "warm_start.json").write_text(other)  # as if recorded from a run of other weights
    import hashlib

    manifest["files"]["warm_start.json"] = {"size": len(other), "sha256": hashlib.sha256(other.encode()).hexdigest()}
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(SeedRecordError, match=r"records seed 0 from warm start 0123456789abcdef, the run folder .* "
                                              r"holds one from None: another run of the seed"):
        archive_seed(cfg, 0, res)
    shutil.rmtree(tmp_path / "runs")
    with pytest.raises(ValueError, match=r"--job '0:bf16': seed 0 is finished and recorded in .*seed-0; nothing"):
        run_job(cfg, "0:bf16", res)
    assert not (tmp_path / "runs").exists()


def test_records_are_not_ignored_by_git(tmp_path):
    """A record exists to be committed: the repository's ignore rules (which drop run folders) must
    not cover the records' folder."""
    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    path = record_dir(root / "docs" / "results", "e", 0) / "metrics" / "bf16.jsonl"
    proc = subprocess.run(["git", "check-ignore", "-v", str(path)], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 1, f"{path} is ignored by {proc.stdout.strip()}"
