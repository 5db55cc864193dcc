"""``tracefp4 bench rollout`` at shapes given on the command line: the figures it reports and its refusals
(no timing is asserted: speed targets are met in the benchmark itself, not in tests)."""

from __future__ import annotations

import pytest

from tracefp4.cli import main
from tracefp4.bench.result import load
from tracefp4.bench.suites.rollout import PRESETS, expert_params, preset_spec
from tracefp4.pipeline.arms import ROLLOUT_MODES

SHAPE = ["--layers", "1", "--hidden", "64", "--experts", "4", "--top-k", "2", "--expert-dim", "32", "--heads", "2",
         "--kv-heads", "1", "--head-dim", "32"]


@pytest.mark.slow
def test_shape_options_replace_the_presets_dimensions_and_drop_its_targets(tmp_path, capsys):
    path = tmp_path / "bench.json"
    args = ["bench", "rollout", "--preset", "bandwidth", "--engines", "home", *SHAPE, "--batch", "2", "--new-tokens", "2",
            "--json", str(path)]
    assert main(args) == 0
    (run,), _ = load(path)
    res = run.config
    spec = preset_spec("bandwidth", layers=1, hidden=64, experts=4, top_k=2, moe_intermediate=32, heads=2, kv_heads=1,
                       head_dim=32)
    assert res["model"]["hidden"] == 64 and res["model"]["experts"] == 4 and res["model"]["moe_intermediate"] == 32
    assert res["model"]["vocab"] == PRESETS["bandwidth"].spec.vocab  # what no option names stays the preset's
    assert res["expert_params"] == expert_params(spec) == 1 * 4 * 3 * 64 * 32
    for mode in ROLLOUT_MODES:
        assert run.value("rollout_tokens_per_s", "home", mode, batch=2) > 0
    assert res["preset_shapes"] is False and run.targets == []
    # the memory probe builds the model of the checkpoint it is given (these shapes, not the preset's)
    bf16, fp4 = (run.value("resident_bytes_per_expert_param", "home", m) for m in ("bf16", "fp4"))
    assert 0 < bf16 < fp4
    out = capsys.readouterr().out
    assert "MoE hidden 64, 1 layers, 4 experts top-2, expert dim 32" in out and "no targets" in out


@pytest.mark.parametrize("shape,message", [
    ({"hidden": 100}, "--hidden must be a multiple of 16"),
    ({"moe_intermediate": 40}, "--expert-dim must be a multiple of 16"),
    ({"head_dim": 72}, "--head-dim must be a multiple of 16"),
    ({"top_k": 9, "experts": 8}, "--top-k 9 exceeds --experts 8"),
    ({"heads": 6, "kv_heads": 4}, "--kv-heads 4 must divide --heads 6"),
    ({"layers": 0}, "--layers must be at least 1"),
])
def test_shapes_the_fp4_paths_cannot_run_are_refused_naming_the_option(shape, message):
    with pytest.raises(ValueError, match=message):
        preset_spec("mid", **shape)


def test_the_command_line_names_a_bad_shape(capsys):
    assert main(["bench", "rollout", "--engines", "home", "--expert-dim", "40"]) == 2
    assert "tracefp4: error: --expert-dim must be a multiple of 16 (the NVFP4 block), got 40" in capsys.readouterr().err


def test_the_presets_own_shapes_keep_their_targets():
    assert preset_spec("mid") == PRESETS["mid"].spec
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset_spec("huge")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.subprocess
def test_vllm_kv_cache_figures_come_from_the_engines(tmp_path):
    """The memory probes' KV figures (each engine in a fresh process, 1 GiB of KV budget): vLLM's
    reported capacity and the bytes per token of the engines' own cache tensors. Head dim 64, one KV
    head, one layer: BF16 4 x 64 = 256 bytes per token, vLLM's FP8 cache 128, our packed NVFP4 K and V
    rows 2 x (32 + 4 + 4) = 80; capacities in the inverse ratio, less one block of rounding."""
    pytest.importorskip("vllm")
    from tracefp4.engines.model import from_config
    from tracefp4.bench.result import Run
    from tracefp4.bench.suites.rollout import TINY_MOE, measure_memory

    if not __import__("torch").cpu._is_avx512_supported():
        pytest.skip("vLLM's FP8 KV cache on CPU needs AVX-512")
    ckpt = tmp_path / "ckpt"
    from_config(TINY_MOE.config(), seed=0).save_pretrained(ckpt)
    run = Run("rollout", measure_memory(str(ckpt), "bandwidth", ["vllm"]))
    per_token = {m: run.value("kv_bytes_per_token", "vllm", m) for m in ("bf16", "fp8kv", "fp4")}
    assert per_token == {"bf16": 256, "fp8kv": 128, "fp4": 80}
    tokens = {m: run.value("kv_capacity_tokens", "vllm", m) for m in ("bf16", "fp8kv", "fp4")}
    block = 128  # vLLM's CPU default block size: the capacities are whole blocks of the same budget
    assert abs(tokens["fp4"] * 80 - tokens["bf16"] * 256) <= block * 256
    assert abs(tokens["fp4"] * 80 - tokens["fp8kv"] * 128) <= block * 128
    assert run.value("kv_cache_bytes", "vllm", "fp4") == tokens["fp4"] * 80


# --- the long preset (tracefp4.bench.suites.long) -------------------------------------------------

LONG_TINY = ["--preset", "long", "--layers", "1", "--hidden", "64", "--experts", "4", "--top-k", "2", "--expert-dim", "32",
             "--heads", "4", "--kv-heads", "1", "--head-dim", "128", "--contexts", "64", "--home-contexts", "64",
             "--batch", "2", "--new-tokens", "4", "--repeats", "2", "--capacity-output", "16", "--capacity-requests", "3",
             "--capacity-fit", "1", "--profile-steps", "2"]


def _long_args(*extra: str):
    import argparse

    from tracefp4.bench.suites.rollout import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(extra))


def test_the_long_preset_runs_one_layer_of_the_bandwidth_preset():
    import dataclasses

    from tracefp4.bench.suites.long import LONG_MOE
    from tracefp4.bench.suites.rollout import BANDWIDTH_MOE

    assert LONG_MOE == dataclasses.replace(BANDWIDTH_MOE, layers=1)


def test_alternating_runs_split_the_timed_steps_the_last_taking_the_remainder():
    from tracefp4.bench.harness import run_lengths

    assert run_lengths(96, 3) == [32, 32, 32] and run_lengths(32, 3) == [10, 10, 12] and run_lengths(5, 1) == [5]


def test_capacity_runs_side_by_side_take_turns_until_every_queue_is_done():
    from tracefp4.bench.suites.long import side_by_side

    log = []

    class Server:  # an EngineServer whose queue needs `turns` turns
        def __init__(self, turns):
            self.left = turns

        def ask(self, cmd, **kw):
            log.append((self, cmd, kw.get("mode"), kw.get("seconds")))
            if cmd == "capacity_steps":
                self.left -= 1
                return {"done": self.left == 0}
            return {"tokens_per_s": 1.0} if cmd == "capacity_end" else {}

    a, b = Server(3), Server(1)
    out = side_by_side({"bf16": a, "fp4": b}, lambda msg: None, turn_s=0.5)
    assert out == {"bf16": {"tokens_per_s": 1.0}, "fp4": {"tokens_per_s": 1.0}}
    assert [(s, c, m) for s, c, m, _ in log] == [
        (a, "capacity_begin", "bf16"), (b, "capacity_begin", "fp4"),  # begun together, then in turns
        (a, "capacity_steps", None), (b, "capacity_steps", None), (a, "capacity_steps", None),
        (a, "capacity_steps", None), (a, "capacity_end", None), (b, "capacity_end", None)]
    assert {sec for _, c, _, sec in log if c == "capacity_steps"} == {0.5}


def test_long_cells_come_from_the_command_line_or_the_preset():
    from tracefp4.bench.suites.long import LONG_MOE, LongConfig
    from tracefp4.bench.suites.rollout import long_config

    cfg = long_config(_long_args("--preset", "long"), LONG_MOE)
    assert cfg.cells == LongConfig().cells and cfg.repeats == 1 and cfg.spec == LONG_MOE
    cfg = long_config(_long_args("--preset", "long", "--contexts", "1024,4096", "--batch", "8", "--batch", "32",
                                 "--capacity-output", "1024", "--repeats", "3"), LONG_MOE)
    assert cfg.cells == ((1024, 8), (4096, 8), (1024, 32), (4096, 32))
    assert cfg.capacity_output == 1024 and cfg.repeats == 3 and cfg.first_batch(4096) == 8
    with pytest.raises(ValueError, match="--contexts: expected comma-separated integers"):
        long_config(_long_args("--preset", "long", "--contexts", "1K"), LONG_MOE)
    with pytest.raises(ValueError, match="context 16 must exceed 2 x --new-tokens 96"):
        LongConfig(cells=((16, 8),))


def test_long_targets_are_ratios_of_the_figures_run_and_name_those_not_run():
    from tracefp4.bench.result import Record, Run
    from tracefp4.bench.targets import judge, targets

    def rec(metric, mode, value, **shape):
        return Record("long", metric, value, "", "vllm", mode, shape)

    records = [rec("kv_bytes_per_token", "fp4", 152.0), rec("kv_bytes_per_token", "bf16", 512.0),
               rec("rollout_tokens_per_s", "fp4", 100.0, context=1024, batch=8),
               rec("rollout_tokens_per_s", "trace", 90.0, context=1024, batch=8)]
    run = Run("long", records, {"preset_shapes": True, "capacity_default": True})
    got, not_run = judge(run)
    got = {t.target: t for t in got}
    kv = got["KV bytes per token: vllm fp4 / vllm bf16"]
    assert kv.value == pytest.approx(152 / 512) and kv.kind == "max" and kv.met
    lsb = got["decode at 1024@b8: vllm trace / vllm fp4"]
    assert lsb.value == pytest.approx(0.9) and not lsb.met
    fixed = [t for t in targets() if t.suite == "long" and not t.over]
    assert len(got) == 2 and len(fixed) == 8 and len(not_run) == 7
    run.records += [rec("capacity_tokens_per_s", "fp4", 300.0), rec("capacity_tokens_per_s", "bf16", 100.0)]
    assert "capacity run tokens/s: vllm fp4 / vllm bf16" in {t.target for t in judge(run)[0]}
    # another queue than the one the capacity targets are set for: not evaluated
    run.config["capacity_default"] = False
    assert not any(t.target.startswith("capacity") for t in judge(run)[0])


def test_the_capacity_budget_shrinks_by_the_overshoot_in_whole_blocks():
    from tracefp4.bench.suites.long import shrunk_budget

    block, need = 16, 320  # 320-token requests: 20 blocks each
    start = 8 * need + block  # 8 whole requests and vLLM's null block
    # 14 ran at once: 8/14 of the 160 usable blocks is 91.4, rounded down to 91, plus the null block
    assert shrunk_budget(start, 14, 8, block, need + block) == 91 * block + block
    assert shrunk_budget(start, 8, 8, block, need + block) == start  # within the fit: unchanged
    # never below one whole request and the null block
    assert shrunk_budget(2 * need + block, 32, 1, block, need + block) == need + block


def test_decode_time_shares_go_to_the_innermost_region():
    from types import SimpleNamespace as Ev

    from tracefp4.bench.decode import share_of_events
    from tracefp4.bench.suites.long import profile_cell

    moe = Ev(name="vllm::moe_forward", cpu_parent=None, self_cpu_time_total=100_000)
    site = Ev(name="tracefp4::site", cpu_parent=moe, self_cpu_time_total=50_000)
    mm = Ev(name="aten::mm", cpu_parent=site, self_cpu_time_total=50_000)  # inside a site inside the experts
    attn = Ev(name="vllm::unified_attention_with_output", cpu_parent=None, self_cpu_time_total=200_000)
    other = Ev(name="aten::add", cpu_parent=None, self_cpu_time_total=10_000)
    share = share_of_events([moe, site, mm, attn, other], wall_s=1.0)
    assert share == pytest.approx({"experts": 0.1, "sites": 0.1, "attention": 0.2, "rest": 0.6})
    assert profile_cell([(1024, 8), (16384, 1), (16384, 8)], 8) == (16384, 8)
    assert profile_cell([(1024, 8), (16384, 2), (16384, 1)], 8) == (16384, 1)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.subprocess
def test_long_preset_through_the_command_line(tmp_path, capsys):
    """The long preset's path at a tiny size (head dim 128, one KV head, one layer): every figure's
    key, and the KV bytes per token of the engines' own caches: BF16 2 x 128 x 2 = 512, vLLM's FP8
    256, packed NVFP4 K and V rows 2 x (64 + 8 + 4) = 152 (0.297x)."""
    pytest.importorskip("vllm")
    if not __import__("torch").cpu._is_avx512_supported():
        pytest.skip("vLLM's FP8 KV cache on CPU needs AVX-512")
    path = tmp_path / "long.json"
    assert main(["bench", "rollout", *LONG_TINY, "--engines", "home,vllm", "--json", str(path)]) == 0
    (run,), _ = load(path)
    res, v = run.config, run.value
    assert run.suite == "long"
    assert res["cells"] == [[64, 2]] and res["model"]["head_dim"] == 128 and "command line" in res["resized"]
    for engine, modes in (("home", ("bf16", "fp4", "trace")), ("vllm", ("bf16", "fp8kv", "fp4", "trace"))):
        for mode in modes:
            assert v("rollout_tokens_per_s", engine, mode, context=64, batch=2) > 0
            share = {r.shape["region"]: r for r in run.find("decode_time_share", engine, mode)}
            assert set(share) == {"experts", "attention", "sites", "rest"} and share["attention"].value > 0
            assert {r.shape["context"] for r in share.values()} == {64}
    per_token = {f"{r.engine}.{r.mode}": r.value for r in run.find("kv_bytes_per_token")}
    assert per_token == {"home.bf16": 512, "home.fp4": 152, "home.trace": 152, "vllm.bf16": 512,
                         "vllm.fp8kv": 256, "vllm.fp4": 152, "vllm.trace": 152}
    tokens = {m: v("kv_capacity_tokens", "vllm", m) for m in ("bf16", "fp8kv", "fp4")}
    block = 128  # one budget: the capacities in the inverse ratio of the bytes, less a block of rounding
    assert abs(tokens["fp4"] * 152 - tokens["bf16"] * 512) <= block * 512
    for mode in ("bf16", "fp8kv", "fp4", "trace"):
        assert v("capacity_tokens_per_s", "vllm", mode) > 0
        assert v("capacity_kv_tokens", "vllm", mode) >= block
        # the first step runs the prompts, so some of the run is prompts' steps, never more than all of it
        assert 0 < v("capacity_prefill_s", "vllm", mode) <= v("capacity_wall_s", "vllm", mode)
    # the budget holds one whole BF16 request (of one block) and all three FP4 ones: FP4 runs the three at
    # once and never preempts; vLLM admits BF16 requests while their prompts fit and preempts them as they
    # grow, so how many BF16 ones ran at once depends on its admission, not on the budget alone
    assert v("capacity_peak_running", "vllm", "fp4") == 3 and v("capacity_preemptions", "vllm", "fp4") == 0
    assert 1 <= v("capacity_peak_running", "vllm", "bf16") <= 3
    # the budget starts at its floor (one whole request), so there is nothing to shrink: one BF16 run
    trail = res["capacity_calibration"]
    assert len(trail) == 1 and trail[0]["budget_bytes"] == res["capacity_budget_bytes"]
    assert trail[0]["peak_running"] == v("capacity_peak_running", "vllm", "bf16")
    assert res["preset_shapes"] is False and run.targets == []
    assert "no targets" in capsys.readouterr().out
