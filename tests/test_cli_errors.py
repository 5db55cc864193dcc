"""User errors end in one line on stderr and exit code 2, never a traceback; bugs keep theirs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracefp4 import cli
from tracefp4.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")
GOOD = 'task = "reverse"\narms = ["bf16"]\nsteps = 2\n'


def tracefp4(*argv, cwd, env=None):
    """``python -m tracefp4.cli`` in a subprocess with this worktree's code."""
    environ = {k: v for k, v in os.environ.items() if k != "TRACEFP4_DEBUG"}
    environ.update({"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", **(env or {})})
    return subprocess.run([sys.executable, "-m", "tracefp4.cli", *argv], capture_output=True, text=True,
                          cwd=cwd, env=environ, timeout=300)


def assert_one_line(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tracefp4:")]
    assert len(lines) == 1 and lines[0].startswith("tracefp4: error: "), proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


# --- through a real process ----------------------------------------------------------------------


@pytest.mark.subprocess
def test_missing_config_file(tmp_path):
    proc = tracefp4("train", "--config", "missing.toml", cwd=tmp_path)
    assert_one_line(proc, "config file missing.toml not found")


@pytest.mark.subprocess
def test_bad_toml(tmp_path):
    (tmp_path / "bad.toml").write_text("steps = = 3\n")
    proc = tracefp4("train", "--config", "bad.toml", cwd=tmp_path)
    assert_one_line(proc, "bad.toml:", "line 1")


@pytest.mark.subprocess
def test_resume_of_a_missing_folder(tmp_path):
    (tmp_path / "good.toml").write_text(GOOD)
    proc = tracefp4("train", "--config", "good.toml", "--resume", "/nonexistent", cwd=tmp_path)
    assert_one_line(proc, "run folder /nonexistent to resume does not exist")


@pytest.mark.subprocess
def test_report_of_a_missing_folder(tmp_path):
    proc = tracefp4("report", "/nonexistent", cwd=tmp_path)
    assert_one_line(proc, "run folder /nonexistent not found")


@pytest.mark.subprocess
def test_debug_flag_shows_the_traceback(tmp_path):
    proc = tracefp4("--debug", "report", "/nonexistent", cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "RunFolderError" in proc.stderr


# --- in process (the same main, without the interpreter start-up) ---------------------------------


def run_main(argv, capsys, monkeypatch):
    monkeypatch.delenv("TRACEFP4_DEBUG", raising=False)
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("text, fragment", [
    ('nope = 1\n', "unknown config keys ['nope']"),
    ('arms = ["nope"]\n', "unknown arm 'nope'"),
    ('group_size = 1\n', "group_size = 1: expected a value >= 2"),
    ('model = { hidden = 32, bogus = 1 }\n', "unknown model keys ['bogus']"),
])
def test_invalid_config_values(tmp_path, capsys, monkeypatch, text, fragment):
    (tmp_path / "c.toml").write_text(text)
    code, err = run_main(["train", "--config", str(tmp_path / "c.toml")], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and err.startswith("tracefp4: error: ") and fragment in err


@pytest.mark.parametrize("name, text, fragment", [
    ("bad.json", '{"steps": ', "Expecting value"),
    ("bad.yaml", "steps: [1, 2\n", "config file"),
    ("c.ini", "steps = 1\n", "config must be .toml, .yaml/.yml or .json"),
])
def test_other_config_formats(tmp_path, capsys, monkeypatch, name, text, fragment):
    (tmp_path / name).write_text(text)
    code, err = run_main(["train", "--config", str(tmp_path / name)], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and fragment in err and name in err


def test_config_is_a_folder(tmp_path, capsys, monkeypatch):
    code, err = run_main(["train", "--config", str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and "is not a file" in err


def test_checkpoint_key_that_is_not_a_local_folder(tmp_path, capsys, monkeypatch):
    (tmp_path / "c.toml").write_text(GOOD + 'checkpoint = "Qwen/Qwen3-30B-A3B"\n')
    code, err = run_main(["train", "--config", str(tmp_path / "c.toml")], capsys, monkeypatch)
    assert code == 2 and "checkpoint folder Qwen/Qwen3-30B-A3B not found" in err and "Repo id" not in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "c.toml").write_text(GOOD + f'checkpoint = "{tmp_path / "empty"}"\n')
    code, err = run_main(["train", "--config", str(tmp_path / "c.toml")], capsys, monkeypatch)
    assert code == 2 and "has no config.json" in err


def test_mismatch_checkpoint_argument(tmp_path, capsys, monkeypatch):
    code, err = run_main(["mismatch", "--checkpoint", str(tmp_path / "nope")], capsys, monkeypatch)
    assert code == 2 and "--checkpoint folder" in err and "not found" in err


def test_resume_with_a_changed_config_is_refused(tmp_path, capsys, monkeypatch):
    from tracefp4.rl.runfolder import create_run_folder

    (tmp_path / "c.toml").write_text(GOOD + "lr = 0.001\n")
    run = create_run_folder(tmp_path, "r", {"task": "reverse", "lr": 1e-4})
    code, err = run_main(["train", "--config", str(tmp_path / "c.toml"), "--resume", str(run)], capsys, monkeypatch)
    assert code == 2 and "lr: 0.0001 -> 0.001" in err


def test_new_run_in_a_used_folder_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "config.json").write_text("{}")
    code, err = run_main(["demo", "--out", str(tmp_path / "runs"), "--name", "r"], capsys, monkeypatch)
    assert code == 2 and "without --resume is refused" in err
    (tmp_path / "c.toml").write_text(GOOD + f'out = "{tmp_path / "runs"}"\nrun_name = "r"\n')
    code, err = run_main(["train", "--config", str(tmp_path / "c.toml")], capsys, monkeypatch)
    assert code == 2 and "without --resume is refused" in err


def test_report_of_a_folder_that_is_not_a_run(tmp_path, capsys, monkeypatch):
    code, err = run_main(["report", str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and "is not a run folder" in err


def test_keyboard_interrupt_is_one_line_and_130(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_report", interrupted)
    code, err = run_main(["report", "x"], capsys, monkeypatch)
    assert code == 130 and err == "tracefp4: interrupted\n"


def test_bugs_keep_their_traceback(capsys, monkeypatch):
    def buggy(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "cmd_report", buggy)
    with pytest.raises(KeyError, match="a bug"):
        run_main(["report", "x"], capsys, monkeypatch)


def test_debug_reraises_user_errors(tmp_path, monkeypatch):
    from tracefp4.rl.runfolder import RunFolderError

    monkeypatch.delenv("TRACEFP4_DEBUG", raising=False)
    with pytest.raises(RunFolderError):
        main(["--debug", "report", str(tmp_path / "nope")])
    monkeypatch.setenv("TRACEFP4_DEBUG", "1")
    with pytest.raises(RunFolderError):
        main(["report", str(tmp_path / "nope")])
    monkeypatch.setenv("TRACEFP4_DEBUG", "0")
    assert main(["report", str(tmp_path / "nope")]) == 2


def test_os_error_names_the_path(capsys, monkeypatch):
    def denied(args):
        raise PermissionError(13, "Permission denied", "/root/secret")

    monkeypatch.setattr(cli, "cmd_report", denied)
    code, err = run_main(["report", "x"], capsys, monkeypatch)
    assert code == 2 and err == "tracefp4: error: /root/secret: Permission denied\n"


def test_negative_steps_is_an_error(tmp_path, capsys, monkeypatch):
    def ran(cfg):
        raise AssertionError("a config with steps = -1 reached the run")

    monkeypatch.setattr(cli, "_run_rl", ran)
    (tmp_path / "c.toml").write_text(f'arms = ["bf16"]\nsteps = -1\nout = "{tmp_path}"\n')
    code, err = run_main(["train", "--config", str(tmp_path / "c.toml")], capsys, monkeypatch)
    assert code == 2 and "steps" in err
