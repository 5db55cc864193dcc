"""The command line: every command has --help, and the synthetic demo runs (the benchmarks: tests/test_bench.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tracefp4.cli import main


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["demo", "--help"], ["train", "--help"], ["report", "--help"], ["twopath", "--help"],
     ["bench", "--help"], ["bench", "numerics", "--help"], ["mismatch", "--help"], ["plan", "--help"]],
)
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert "usage: tracefp4" in capsys.readouterr().out


def test_twopath_prints_mismatch_table(capsys):
    assert main(["twopath", "--rows", "64", "--cols", "256", "--inner", "256"]) == 0
    out = capsys.readouterr().out
    assert "round-to-nearest" in out and "guided (lsb)" in out and "guided (full)" in out
    assert "differ at bf16 level" in out


def _installed_script() -> str:
    """The ``tracefp4`` console script pip installed beside this interpreter (pyproject's [project.scripts])."""
    script = Path(sys.executable).parent / "tracefp4"
    if not script.is_file():
        pytest.fail(f"no installed tracefp4 script at {script}: install the package (pip install -e .)")
    return str(script)


@pytest.mark.subprocess
def test_console_script_entry_point():
    out = subprocess.run([_installed_script(), "--help"], capture_output=True, text=True, check=True)
    assert "demo" in out.stdout and "bench" in out.stdout


@pytest.mark.subprocess
@pytest.mark.parametrize("argv", [["--help"], ["plan", "--preset", "qwen3-30b-a3b", "--prompts", "2", "--samples", "3",
                                             "--tokens", "100"]])
def test_startup_is_quiet(argv):
    """Nothing on stderr that the user did not cause: torchao's missing CUDA extensions and torch's
    register_constant deprecations are dropped at start-up (tracefp4.cli.STARTUP_NOISE)."""
    out = subprocess.run([_installed_script(), *argv], capture_output=True, text=True, check=True)
    assert out.stderr == ""


def test_quiet_startup_drops_only_its_records():
    """Each STARTUP_NOISE record is dropped, any other record of the same logger passes."""
    import logging

    from tracefp4.cli import STARTUP_NOISE, quiet_startup

    quiet_startup()
    quiet_startup()  # idempotent: one filter per logger
    for name, prefix in STARTUP_NOISE:
        logger = logging.getLogger(name)
        assert len(logger.filters) == 1
        dropped = logging.LogRecord(name, logging.WARNING, __file__, 1, prefix + "%s", ("x",), None)
        kept = logging.LogRecord(name, logging.WARNING, __file__, 1, "something else", (), None)
        assert not logger.filters[0].filter(dropped) and logger.filters[0].filter(kept)
        logger.removeFilter(logger.filters[0])  # leave the other tests' logging as it was


@pytest.mark.subprocess
def test_python_m_tracefp4_runs_a_subcommand():
    argv = ["plan", "--preset", "qwen3-30b-a3b", "--prompts", "2", "--samples", "3", "--tokens", "100"]
    argv += ["--modes", "full,lsb"]
    out = subprocess.run([sys.executable, "-m", "tracefp4", *argv], capture_output=True, text=True, check=True)
    assert "guidance plan for qwen3-30b-a3b" in out.stdout and "600 token positions" in out.stdout


def test_reports_never_import_the_cli():
    """The CLI imports the reports, never the other way round (no cycle, even through a lazy import)."""
    import ast
    from pathlib import Path

    import tracefp4.reports

    for path in Path(tracefp4.reports.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n == "tracefp4.cli" or n.startswith("tracefp4.cli.") for n in names), path.name


@pytest.mark.parametrize("mode", ["lsb", "lsb+parity+amax:lo3", "ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all", "full@deeper"])
def test_guidance_option_parses(mode):
    from tracefp4.cli import build_parser

    for argv in (["demo", "--guidance", mode], ["train", "--config", "c.toml", "--guidance", mode]):
        assert build_parser().parse_args(argv).guidance == mode
    assert build_parser().parse_args(["demo"]).guidance is None  # the config's (default lsb)


def test_bad_guidance_option_is_a_usage_error(capsys):
    from tracefp4.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["demo", "--guidance", "lsbx"])
    assert e.value.code == 2
    assert "--guidance: 'lsbx' is not a guidance mode" in capsys.readouterr().err


def test_train_rejects_a_bad_config_before_any_work(tmp_path):
    from tracefp4.cli import build_parser

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'steps = "ten"\nout = "{tmp_path / "runs"}"\n')
    args = build_parser().parse_args(["train", "--config", str(cfg)])
    with pytest.raises(ValueError, match="steps = 'ten': expected an integer"):
        args.func(args)
    assert not (tmp_path / "runs").exists()
