"""The command line: every command has --help, the synthetic demo and the numerics benchmark run."""

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


def test_bench_numerics_json(tmp_path):
    path = tmp_path / "bench.json"
    assert main(["bench", "numerics", "--rows", "64", "--cols", "256", "--repeats", "1", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    for key in ["nvfp4_quantize_s", "torchao_nvfp4_quantize_s", "copy_s", "guided_quantize_s", "encode_hint_s"]:
        assert key in res
    assert res["nvfp4_quantize_s"] > 0 and res["copy_s"] > 0
    assert res["targets"] == []  # the targets are set for 4096x4096: none at other shapes


def test_bench_numerics_targets_are_in_each_result():
    """The targets travel with the result they judge: the bound, the ratio measured in that run, met or
    not (synthetic timings in binary fractions; no timing is measured here)."""
    from tracefp4.reports.bench import NUMERICS_TARGETS, TARGET_SHAPE, _add_ratios, _targets, format_numerics

    res = {"shape": list(TARGET_SHAPE), "dtype": "bfloat16", "threads": 2, "copy_s": 1.0, "copy_into_s": 1.0,
           "float32_write_s": 1.25, "nvfp4_quantize_s": 1.5, "nvfp4_quantize_per_row_s": 1.25, "nvfp4_dequantize_s": 1.0,
           "nvfp4_dequantize_bf16_s": 0.75, "guided_quantize_s": 1.5, "guided_quantize_full_s": 2.0, "encode_hint_s": 0.25,
           "torchao_nvfp4_quantize_s": 150.0, "torchao_bit_exact": True}
    _add_ratios(res)
    res["targets"] = _targets(res)
    got = {t["ratio"]: (t["value"], t["met"]) for t in res["targets"]}
    assert set(got) == set(NUMERICS_TARGETS)
    assert got["quantize_per_row_over_copy"] == (1.25, False) and got["quantize_over_copy"] == (1.5, True)
    assert got["guided_full_over_copy"] == (2.0, False) and got["encode_hint_over_copy"] == (0.25, True)
    assert got["torchao_over_quantize"] == (100.0, True) and got["dequantize_bf16_over_copy"] == (0.75, True)
    assert res["float32_write_over_copy"] == 1.25  # the float32 dequantization's floor, reported beside it
    out = format_numerics(res)
    assert "quantize_per_row_over_copy 1.25 (<= 1.1: MISSED)" in out
    assert "torchao_over_quantize 100.00 (>= 80.0: ok)" in out


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


def test_bench_system_pairs_ratios_within_rounds():
    """The guidance-cost section times each pair in the same rounds and reports per-round ratios
    (median inside its spread); checked on the demo model so it stays quick."""
    from tracefp4.engines.model import TinyMoESpec
    from tracefp4.reports.bench_system import bench_system, format_system

    res = bench_system(batch=2, new_tokens=2, repeats=2, spec=TinyMoESpec())
    for key in ("rollout_record_over_plain", "train_step_trace_over_qat"):
        lo, hi = res[f"{key}_spread"]
        assert 0 < lo <= res[key] <= hi
    text = format_system(res)
    assert "ratios per round" in text and "target <= 1.05" in text and "target <= 1.1" in text


def test_bench_attention_keys_and_agreement():
    """``bench attention`` at a tiny shape: both sides timed per context, and the two outputs agree
    (they attend over the same rows: rounding only)."""
    from tracefp4.reports.bench_attention import bench_attention, format_attention

    res = bench_attention(contexts=(40, 128), batch=2, heads=4, kv_heads=2, head_dim=64, repeats=2)
    name = res["attention_machine"]["bf16_impl"]
    assert name in ("vllm_bf16", "sdpa_bf16")
    for c in (40, 128):
        assert res[f"attention_s_per_step.fp4.{c}"] > 0 and res[f"attention_s_per_step.{name}.{c}"] > 0
        assert res[f"attention_ratio.fp4_over_bf16.{c}"] > 0
        assert res[f"attention_max_rel_diff.{c}"] < 2e-2  # BF16 output rounding, 2^-8, and the fp32 orders
        assert res[f"attention_kv_bytes.fp4.{c}"] < 0.35 * res[f"attention_kv_bytes.{name}.{c}"]
    assert "target <= 1.0" in format_attention(res)


def test_bench_attention_cli(tmp_path):
    path = tmp_path / "attn.json"
    assert main(["bench", "attention", "--context", "32", "--batch", "1", "--heads", "2", "--kv-heads", "1",
                 "--head-dim", "64", "--repeats", "1", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert "attention_ratio.fp4_over_bf16.32" in res and "cpu_model" in res["attention_machine"]


def test_bench_attention_without_vllm_compares_against_sdpa(monkeypatch):
    """Where vLLM's op cannot be called, the BF16 side is torch's SDPA, and the keys say so."""
    from tracefp4.reports import bench_attention as ba

    monkeypatch.setattr(ba, "_vllm_ops", lambda: None)
    res = ba.bench_attention(contexts=(33,), batch=2, heads=4, kv_heads=1, head_dim=64, fmt="mxfp4", repeats=1)
    assert res["attention_machine"]["bf16_impl"] == "sdpa_bf16"
    assert "attention_s_per_step.sdpa_bf16.33" in res and res["attention_max_rel_diff.33"] < 2e-2
