"""``tracefp4 bench``: the suites at toy sizes, the results schema and the targets (no timing is
asserted: speed targets are judged in the benchmarks themselves, not in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracefp4.bench.harness import Spread, paired, run_lengths
from tracefp4.bench.result import SCHEMA_VERSION, SUITES, Record, ResultError, Run, load, save
from tracefp4.bench.targets import Target, judge, targets
from tracefp4.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _one(path: Path) -> Run:
    runs, _ = load(path)
    assert len(runs) == 1
    return runs[0]


# --- numerics ------------------------------------------------------------------------------------------------


def test_bench_numerics_json(tmp_path):
    path = tmp_path / "bench.json"
    assert main(["bench", "numerics", "--rows", "64", "--cols", "256", "--repeats", "1", "--json", str(path)]) == 0
    run = _one(path)
    assert run.suite == "numerics" and run.config["command"].startswith("tracefp4 bench numerics --rows 64")
    for key in ["nvfp4_quantize_s", "copy_s", "guided_quantize_s", "encode_hint_s"]:
        assert run.value(key) > 0
    assert run.value("nvfp4_quantize_s", rows=64, cols=256) > 0
    assert run.targets == []  # the targets are set for 4096x4096: none at other shapes


def test_bench_numerics_targets_are_in_each_result():
    """The targets travel with the result they judge: the bound, the ratio measured in that run, met or
    not (synthetic timings in binary fractions; no timing is measured here)."""
    from tracefp4.bench.suites.numerics import format_numerics, numerics_run

    secs = {"copy_s": 1.0, "copy_into_s": 1.0, "float32_write_s": 1.25, "nvfp4_quantize_s": 1.5,
            "nvfp4_quantize_per_row_s": 1.25, "nvfp4_dequantize_s": 1.0, "nvfp4_dequantize_bf16_s": 0.75,
            "guided_quantize_s": 1.5, "guided_quantize_full_s": 2.0, "encode_hint_s": 0.25,
            "torchao_nvfp4_quantize_s": 150.0}
    run = numerics_run({k: Spread(v, v, v, 1) for k, v in secs.items()},
                       {"shape": [4096, 4096], "dtype": "bfloat16", "threads": 2, "torchao_bit_exact": True})
    got = {t.target: (t.value, t.met) for t in run.targets}
    assert set(got) == {t.label for t in targets() if t.suite == "numerics" and not t.over}
    assert got["quantize_per_row_over_copy"] == (1.25, False) and got["quantize_over_copy"] == (1.5, True)
    assert got["guided_full_over_copy"] == (2.0, False) and got["encode_hint_over_copy"] == (0.25, True)
    assert got["torchao_over_quantize"] == (100.0, True) and got["dequantize_bf16_over_copy"] == (0.75, True)
    assert run.value("float32_write_over_copy") == 1.25  # the float32 dequantization's floor, reported beside it
    out = format_numerics(run)
    assert "target quantize_per_row_over_copy: 1.250 (<= 1.1: MISSED)" in out
    assert "target torchao_over_quantize: 100.000 (>= 80.0: ok)" in out


# --- system and attention --------------------------------------------------------------------------------------


def test_bench_system_pairs_ratios_within_rounds():
    """The guidance-cost suite times each pair in the same rounds and reports per-round ratios
    (median inside its spread); checked on the demo model so it stays quick."""
    from tracefp4.bench.suites.system import bench_system, format_system
    from tracefp4.engines.model import TinyMoESpec

    run = bench_system(batch=2, new_tokens=2, repeats=2, spec=TinyMoESpec())
    for key in ("rollout_record_over_plain", "train_step_trace_over_qat"):
        r = run.record(key)
        lo, hi = r.spread
        assert 0 < lo <= r.value <= hi
    text = format_system(run)
    assert "ratios per round" in text and "target <= 1.05" in text and "target <= 1.1" in text


def test_bench_attention_records_and_agreement():
    """``bench attention`` at a tiny shape: both sides timed per context, and the two outputs agree
    (they attend over the same rows: rounding only)."""
    from tracefp4.bench.suites.attention import IMPLS, bench_attention, format_attention

    run = bench_attention(contexts=(40, 128), batch=2, heads=4, kv_heads=2, head_dim=64, repeats=2)
    name = run.machine["bf16_impl"]
    assert name in ("vllm_bf16", "sdpa_bf16")
    for c in (40, 128):
        assert run.value("attention_s_per_step", "tracefp4", "fp4", context=c) > 0
        assert run.value("attention_s_per_step", *IMPLS[name], context=c) > 0
        assert run.value("attention_ratio", context=c) > 0
        assert run.value("attention_max_rel_diff", context=c) < 2e-2  # BF16 output rounding, 2^-8, fp32 orders
        assert run.value("attention_kv_bytes", "tracefp4", context=c) < \
            0.35 * run.value("attention_kv_bytes", *IMPLS[name], context=c)
    assert "target <= 1.0" in format_attention(run)


def test_bench_attention_cli(tmp_path):
    path = tmp_path / "attn.json"
    assert main(["bench", "attention", "--context", "32", "--batch", "1", "--heads", "2", "--kv-heads", "1",
                 "--head-dim", "64", "--repeats", "1", "--json", str(path)]) == 0
    run = _one(path)
    assert run.value("attention_ratio", context=32) is not None and "cpu_model" in run.machine


def test_bench_attention_without_vllm_compares_against_sdpa(monkeypatch):
    """Where vLLM's op cannot be called, the BF16 side is torch's SDPA, and the records say so."""
    from tracefp4.bench.suites import attention as ba

    monkeypatch.setattr(ba, "_vllm_ops", lambda: None)
    run = ba.bench_attention(contexts=(33,), batch=2, heads=4, kv_heads=1, head_dim=64, fmt="mxfp4", repeats=1)
    assert run.machine["bf16_impl"] == "sdpa_bf16"
    assert run.value("attention_s_per_step", "sdpa", "bf16", context=33) > 0
    assert run.value("attention_max_rel_diff", context=33) < 2e-2


# --- the harness, the results file, the targets -----------------------------------------------------------------


def test_paired_ratios_are_taken_within_rounds():
    r = paired({"a": [2.0, 4.0, 9.0], "b": [1.0, 4.0, 3.0]}, "a", "b")
    assert (r.median, r.lo, r.hi, r.rounds) == (2.0, 1.0, 3.0, 3)
    assert run_lengths(10, 3) == [3, 3, 4]
    with pytest.raises(ValueError, match="no round"):
        Spread.of([])


def _run() -> Run:
    recs = [Record("long", "rollout_tokens_per_s", v, "tokens/s", "vllm", mode, {"context": 16384, "batch": 8})
            for mode, v in (("fp4", 260.0), ("bf16", 200.0), ("trace", 250.0))]
    return Run("long", recs, {"preset_shapes": True}, {"cpu_model": "AMD EPYC"})


def test_a_results_file_round_trips_and_is_written_whole(tmp_path):
    path = tmp_path / "r.json"
    run = _run()
    run.targets, run.targets_not_run = judge(run)
    save(path, [run], date="2099-01-01")
    runs, prov = load(path)
    assert runs == [run] and prov == {"date": "2099-01-01"}
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left beside it
    assert runs[0].value("rollout_tokens_per_s", "vllm", "fp4", context=16384, batch=8) == 260.0
    with pytest.raises(ValueError, match="name the cell"):
        runs[0].value("rollout_tokens_per_s", "vllm")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("schema_version"), "schema_version = None"),
    (lambda d: d["runs"][0].update(suite="speed"), r"runs\[0\]: suite = 'speed'"),
    (lambda d: d["runs"][0]["records"][1].update(value="fast"), r"runs\[0\].records\[1\]: value = 'fast'"),
    (lambda d: d["runs"][0]["records"][0].pop("metric"), r"records\[0\]: missing field\(s\) \['metric'\]"),
    (lambda d: d["runs"][0]["records"][0].update(spread=[1]), r"records\[0\]: spread"),
])
def test_a_malformed_results_file_is_refused_naming_file_and_field(tmp_path, edit, message):
    path = tmp_path / "r.json"
    save(path, [_run()])
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError, match=f"{path.name}.*{message}"):
        load(path)


def test_targets_are_ratios_of_the_records_run_and_name_those_not_run():
    got, not_run = judge(_run())
    by = {j.target: j for j in got}
    assert by["decode at 16K, batch 8: vllm fp4 / vllm bf16"].value == 1.3
    assert by["decode at 16K, batch 8: vllm fp4 / vllm bf16"].met
    assert by["decode at 16384@b8: vllm trace / vllm fp4"].value == 250.0 / 260.0
    assert "decode at 16K, batch 8: vllm fp4 / vllm fp8kv" in not_run  # no fp8kv record
    # the capacity run's targets are set for the default queue only
    assert not any(label.startswith("capacity") for label in not_run)
    off = _run()
    off.config["preset_shapes"] = False
    assert judge(off) == ([], [])


def test_every_committed_result_follows_the_schema():
    files = sorted((ROOT / "docs/results").glob("bench-*/*.json"))
    assert files
    for path in files:
        for run in load(path)[0]:
            assert run.records and run.suite in SUITES


def test_every_target_names_a_suite_and_a_metric():
    assert {t.suite for t in targets()} == set(SUITES)
    assert all(isinstance(t, Target) and t.kind in ("min", "max") for t in targets())


# --- every suite -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.subprocess
def test_bench_all_runs_every_suite(tmp_path):
    """``tracefp4 bench all --size toy`` in a child process: every suite runs and its run is in the
    results file, valid against the schema."""
    path = tmp_path / "all.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "tracefp4", "bench", "all", "--size", "toy", "--json", str(path)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs, _ = load(path)
    assert [r.suite for r in runs] == list(SUITES)
    for run in runs:
        assert run.records, run.suite
        assert all(r.name == run.suite for r in run.records)
        assert run.config["command"].startswith(f"tracefp4 bench {'rollout' if run.suite == 'long' else run.suite}")
    assert "rollout throughput" in proc.stdout and "long-context rollouts" in proc.stdout
