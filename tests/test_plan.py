"""``tracefp4 plan``: guidance volume per RL step, checked against the arithmetic written out by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tracefp4.cli import main
from tracefp4.reports import capacity as planner
from tracefp4.guidance.compact import CompactRecord, GuidanceSpec, rice_bits_per_entry, site_bytes_per_token
from tracefp4.formats import quantize_nvfp4
from tracefp4.reports.capacity import PRESETS, ModelDims, plan, sparse_density

STEP = dict(prompts=256, samples=16, tokens=32768)
TOKENS = 256 * 16 * 32768


def by_hand_full(hidden: int, top_k: int, inter: int, kv: int, hd: int) -> int:
    """Full information per token and MoE layer with a KV cache: 4-bit codes, an E4M3 scale per 16
    elements and a 4-byte amax per row, over expert_in (1 row), expert_mid (top_k rows), k and v (kv rows)."""

    def site(rows: int, k: int) -> int:
        return rows * (k // 2 + k // 16 + 4)

    return site(1, hidden) + site(top_k, inter) + 2 * site(kv, hd)


def test_qwen3_30b_a3b_by_hand() -> None:
    dims = ModelDims.from_config(PRESETS["qwen3-30b-a3b"])
    assert (dims.layers, len(dims.moe_layers), len(dims.kv_layers)) == (48, 48, 48)
    p = plan(dims, **STEP, bandwidth_gbps=25.0)["modes"]
    # full: expert_in 1024 + 128 + 4 = 1156; expert_mid 8 x (384 + 48 + 4) = 3488; k, v 4 x (64 + 8 + 4) = 304
    assert by_hand_full(2048, 8, 768, 4, 128) == 1156 + 3488 + 2 * 304 == 5252
    assert p["full"]["bytes_per_token"] == 48 * 5252 == 252_096
    assert p["full"]["bytes_per_step"] == 252_096 * TOKENS
    assert p["full"]["io_seconds"] == pytest.approx(252_096 * TOKENS / 25e9)  # ~1353 s at 25 GB/s
    # lsb (the paper's compact: 1 bit, scales, amax) on layers 24..47:
    # expert_in 256 + 128 + 4 = 388; expert_mid 8 x (96 + 48 + 4) = 1184; k, v 4 x (16 + 8 + 4) = 112
    assert p["lsb"]["bytes_per_token"] == 24 * (388 + 1184 + 2 * 112) == 43_104
    # lsb+parity+amax:lo3: byte fields none; packed bits per token = 3/row + 1/block + 1/element
    # expert_in 3 + 128 + 2048 = 2179 -> 273 B; expert_mid 24 + 384 + 6144 = 6552 -> 819 B;
    # k, v 12 + 32 + 512 = 556 -> 70 B
    assert p["lsb+parity+amax:lo3"]["bytes_per_token"] == 24 * (273 + 819 + 2 * 70) == 29_568
    # ldpc(1/16)+scales:ldpc(1/4)+amax:lo3 on all 48 layers: 3/row + ceil(blocks/4) + ceil(elements/16)
    # expert_in 3 + 32 + 128 = 163 -> 21 B; expert_mid 24 + 96 + 384 = 504 -> 63 B; k, v 12 + 8 + 32 = 52 -> 7 B
    best = p["ldpc(1/16)+scales:ldpc(1/4)+amax:lo3@all"]
    assert best["bytes_per_token"] == 48 * (21 + 63 + 2 * 7) == 4_704
    assert best["ratio_to_lsb"] == pytest.approx(4_704 / 43_104)  # ~0.109


def test_qwen3_235b_a22b_by_hand() -> None:
    dims = ModelDims.from_config(PRESETS["qwen3-235b-a22b"])
    p = plan(dims, **STEP)["modes"]
    # expert_in 2048 + 256 + 4 = 2308; expert_mid 8 x (768 + 96 + 4) = 6944; k, v 4 x 76 = 304
    assert by_hand_full(4096, 8, 1536, 4, 128) == 2308 + 6944 + 608 == 9860
    assert p["full"]["bytes_per_token"] == 94 * 9860 == 926_840
    # lsb on layers 47..93 (47 of them): expert_in 512 + 256 + 4 = 772; mid 8 x (192 + 96 + 4) = 2336; k, v 112
    assert p["lsb"]["bytes_per_token"] == 47 * (772 + 2336 + 2 * 112) == 156_604
    assert "io_seconds" not in p["full"]


def test_hybrid_layout_counts_kv_only_on_attention_layers() -> None:
    dims = ModelDims.from_config(PRESETS["qwen3.5-35b-a3b"])
    assert dims.kv_layers == tuple(range(3, 40, 4)) and len(dims.moe_layers) == 40
    p = plan(dims, **STEP, modes=["full"])["modes"]
    # 40 x (expert_in 1156 + expert_mid 8 x (256 + 32 + 4) = 2336) + 10 x (k, v 2 x (128 + 16 + 4) = 296 each)
    assert p["full"]["bytes_per_token"] == 40 * (1156 + 2336) + 10 * 2 * 296 == 145_600


def test_config_layouts() -> None:
    base = dict(PRESETS["qwen3-30b-a3b"], num_hidden_layers=8)
    dims = ModelDims.from_config({**base, "mlp_only_layers": [0, 5], "decoder_sparse_step": 2})
    assert dims.moe_layers == (1, 3, 7)  # (i + 1) % 2 == 0, not 5
    assert dims.sites(0).keys() == {"k", "v"} and dims.sites(1).keys() == {"expert_in", "expert_mid", "k", "v"}
    nested = ModelDims.from_config({"model_type": "x", "text_config": {**base, "full_attention_interval": 4}})
    assert nested.kv_layers == (3, 7)
    assert ModelDims.from_config({**base, "head_dim": None}).head_dim == 2048 // 32
    mixtral = {k: v for k, v in base.items() if k not in ("num_experts", "moe_intermediate_size")}
    mixtral = ModelDims.from_config({**mixtral, "num_local_experts": 8, "intermediate_size": 14336})
    assert mixtral.moe_intermediate == 14336
    for bad in ({**base, "num_experts": 0}, {**base, "hidden_size": 2050}, {**base, "layer_types": ["full_attention"]}):
        with pytest.raises(ValueError):
            ModelDims.from_config(bad)


def test_sparse_density_from_a_sweep_or_the_default() -> None:
    dims = ModelDims.from_config(PRESETS["qwen3-30b-a3b"])
    name = "sparse(0.05)+parity+amax:lo3@all"
    sweep = {"modes": [{"name": name, "density": 0.2}, {"name": "lsb", "density": None}]}
    got = plan(dims, **STEP, modes=[name], sweep=sweep)["modes"][name]
    assert got["density"] == 0.2
    # per layer: packed bits (amax 3/row, parity 1/block) + the stream's 0.2 x elements x bits per entry / 8
    bits = rice_bits_per_entry(0.2)
    per_layer = (
        math.ceil((3 + 128) / 8) + 0.2 * 2048 * bits / 8
        + math.ceil((24 + 384) / 8) + 0.2 * 6144 * bits / 8
        + 2 * (math.ceil((12 + 32) / 8) + 0.2 * 512 * bits / 8)
    )  # fmt: skip
    assert got["bytes_per_token"] == pytest.approx(48 * per_layer)
    assert plan(dims, **STEP, modes=[name])["modes"][name]["density"] == planner.DEFAULT_SPARSE_DENSITY[0.05]
    table = planner.DEFAULT_SPARSE_DENSITY
    expect = table[0.02] + (table[0.05] - table[0.02]) * (0.03 - 0.02) / (0.05 - 0.02)
    assert sparse_density(0.03) == pytest.approx(expect)
    assert sparse_density(0.2) == pytest.approx(2 * planner.DEFAULT_SPARSE_DENSITY[0.1])


@pytest.mark.parametrize("name", ["full", "lsb", "lsb+parity+amax:lo3", "ldpc(1/16)+scales:ldpc(1/4)+amax:lo3"])
def test_the_planner_counts_what_a_record_occupies(name: str) -> None:
    """The formula is not a model of the record: it is the record's own size."""
    x = torch.randn(3, 4, 128).to(torch.bfloat16)
    spec = GuidanceSpec.parse(name)
    rec = CompactRecord.encode(x, quantize_nvfp4(x, per_row=True), spec) if not spec.plain_mode else None
    per_token = site_bytes_per_token(name, (4, 128))
    if rec is not None:
        assert rec.nbytes == 3 * per_token


def test_cli_writes_the_json(tmp_path) -> None:
    out = tmp_path / "plan.json"
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"modes": [{"name": "sparse(0.05)", "density": 0.1}]}))
    cfg = tmp_path / "model"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(PRESETS["qwen3-30b-a3b"]))
    argv = ["plan", "--config", str(cfg), "--prompts", "2", "--samples", "3", "--tokens", "100", "--bandwidth", "10"]
    assert main([*argv, "--sweep-json", str(sweep), "--json", str(out)]) == 0
    p = json.loads(out.read_text())
    assert p["modes"]["full"]["bytes_per_token"] == 252_096
    assert p["modes"]["full"]["bytes_per_step"] == 252_096 * 600
    assert p["modes"]["sparse(0.05)"]["density"] == 0.1
    assert set(p["modes"]) >= {"full", "lsb", "ldpc(1/16)+scales:ldpc(1/4)+amax:lo3@all"}
    with pytest.raises(SystemExit, match="none.json"):
        main(["plan", "--config", str(tmp_path / "none.json"), *"--prompts 1 --samples 1 --tokens 1".split()])


def test_cli_defaults_to_one_typical_step(tmp_path) -> None:
    """`tracefp4 plan --preset NAME` alone plans 64 prompts x 8 samples x 4096 positions (the defaults)."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--preset", "qwen3-30b-a3b", "--modes", "full", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["modes"]["full"]["bytes_per_step"] == 252_096 * 64 * 8 * 4096


def test_qwen3_8b_dense_by_hand_beside_qwen3_30b_a3b() -> None:
    """A dense model: mlp_in (1 row of hidden) and mlp_mid (1 row of intermediate) at every layer."""
    dims = ModelDims.from_config(PRESETS["qwen3-8b"])
    assert (dims.layers, dims.moe_layers, dims.dense_layers, dims.intermediate) == (36, (), tuple(range(36)), 12288)
    assert set(dims.sites(0)) == {"mlp_in", "mlp_mid", "k", "v"}
    p = plan(dims, **STEP)["modes"]
    # full: mlp_in 2048 + 256 + 4 = 2308; mlp_mid 6144 + 768 + 4 = 6916; k, v 8 x (64 + 8 + 4) = 608
    assert p["full"]["bytes_per_token"] == 36 * (2308 + 6916 + 2 * 608) == 375_840
    # lsb on layers 18..35: mlp_in 512 + 256 + 4 = 772; mlp_mid 1536 + 768 + 4 = 2308; k, v 8 x (16 + 8 + 4) = 224
    assert p["lsb"]["bytes_per_token"] == 18 * (772 + 2308 + 2 * 224) == 63_504
    # ldpc(1/16)+scales:ldpc(1/4)+amax:lo3 on all layers: 3/row + ceil(blocks/4) + ceil(elements/16) bits
    # mlp_in 3 + 64 + 256 = 323 -> 41 B; mlp_mid 3 + 192 + 768 = 963 -> 121 B; k, v 24 + 16 + 64 = 104 -> 13 B
    assert p["ldpc(1/16)+scales:ldpc(1/4)+amax:lo3@all"]["bytes_per_token"] == 36 * (41 + 121 + 2 * 13) == 6_768
    moe = plan(ModelDims.from_config(PRESETS["qwen3-30b-a3b"]), **STEP)["modes"]
    assert (moe["full"]["bytes_per_token"], moe["lsb"]["bytes_per_token"]) == (252_096, 43_104)
