"""``tracefp4 bench rollout`` at shapes given on the command line: the figures it reports and its refusals
(no timing is asserted: speed targets are met in the benchmark itself, not in tests)."""

from __future__ import annotations

import json

import pytest

from tracefp4.cli import main
from tracefp4.reports.bench_rollout import PRESETS, expert_params, preset_spec
from tracefp4.rl.arms import ROLLOUT_MODES

SHAPE = ["--layers", "1", "--hidden", "64", "--experts", "4", "--top-k", "2", "--expert-dim", "32", "--heads", "2",
         "--kv-heads", "1", "--head-dim", "32"]


@pytest.mark.slow
def test_shape_options_replace_the_presets_dimensions_and_drop_its_targets(tmp_path, capsys):
    path = tmp_path / "bench.json"
    args = ["bench", "rollout", "--preset", "bandwidth", "--engines", "home", *SHAPE, "--batch", "2", "--new-tokens", "2",
            "--json", str(path)]
    assert main(args) == 0
    res = json.loads(path.read_text())
    spec = preset_spec("bandwidth", layers=1, hidden=64, experts=4, top_k=2, moe_intermediate=32, heads=2, kv_heads=1,
                       head_dim=32)
    assert res["model"]["hidden"] == 64 and res["model"]["experts"] == 4 and res["model"]["moe_intermediate"] == 32
    assert res["model"]["vocab"] == PRESETS["bandwidth"].spec.vocab  # what no option names stays the preset's
    assert res["expert_params"] == expert_params(spec) == 1 * 4 * 3 * 64 * 32
    for mode in ROLLOUT_MODES:
        assert res[f"rollout_tokens_per_s.home.{mode}@b2"] > 0
    assert res["preset_shapes"] is False and res["targets"] == []
    # the memory probe builds the model of the checkpoint it is given (these shapes, not the preset's)
    assert res["resident_bytes_per_expert_param.home.bf16"] > 0
    assert res["resident_bytes_per_expert_param.home.fp4"] > res["resident_bytes_per_expert_param.home.bf16"]
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
    from tracefp4.reports.bench_rollout import TINY_MOE, measure_memory

    if not __import__("torch").cpu._is_avx512_supported():
        pytest.skip("vLLM's FP8 KV cache on CPU needs AVX-512")
    ckpt = tmp_path / "ckpt"
    from_config(TINY_MOE.config(), seed=0).save_pretrained(ckpt)
    res = measure_memory(str(ckpt), "bandwidth", ["vllm"])
    per_token = {m: res[f"kv_bytes_per_token.vllm.{m}"] for m in ("bf16", "fp8kv", "fp4")}
    assert per_token == {"bf16": 256, "fp8kv": 128, "fp4": 80}
    tokens = {m: res[f"kv_capacity_tokens.vllm.{m}"] for m in ("bf16", "fp8kv", "fp4")}
    block = 128  # vLLM's CPU default block size: the capacities are whole blocks of the same budget
    assert abs(tokens["fp4"] * 80 - tokens["bf16"] * 256) <= block * 256
    assert abs(tokens["fp4"] * 80 - tokens["fp8kv"] * 128) <= block * 128
    assert res["kv_cache_bytes.vllm.fp4"] == tokens["fp4"] * 80
