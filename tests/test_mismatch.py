"""``tracefp4 mismatch``: the report runs end to end and its figures obey the relations they must."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tracefp4.cli import main
from tracefp4.reports import commands, mismatch
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import generate
from tracefp4.guidance.names import deeper_half, layer_tag
from tracefp4.pipeline.metrics import Name

torch.set_num_threads(1)

# Tiny on purpose (the test budget is seconds); 4 layers so that "the deeper half" is 2 of them.
DIMS = dict(layers=4, experts=8, top_k=2, hidden=32, moe_intermediate=16, heads=2, kv_heads=1, head_dim=16, vocab=32)
RUN = dict(batch=4, new_tokens=12, prompt_len=8, seed=0)


def _argv(**kw) -> list[str]:
    out = []
    for k, v in kw.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("mismatch") / "report.json"
    assert main(["mismatch", *_argv(**DIMS, **RUN), "--json", str(path), "--quiet"]) == 0
    # Atomic write: the report and nothing else (no temp file left next to it).
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]
    return json.loads(path.read_text())


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


ARMS = ("bf16", "qat", "trace", "trace-full")
REQUIRED = [
    f"{Name.CODE_MISMATCH}.qat",
    f"{Name.CODE_MISMATCH}.trace",
    f"{Name.CODE_MISMATCH}.trace-full",
    f"{Name.ONE_APART}.qat",
    Name.ROUTER_FLIPS,
    *[f"logprob_gap.{arm}.{m}" for arm in ARMS for m in (Name.GAP_MEAN, Name.GAP_MAX, Name.K3_KL)],
    "bytes_per_token.full_all_layers",
    "bytes_per_token.compact_default",
    "bytes_per_token.ratio",
]


@pytest.mark.parametrize("key", REQUIRED)
def test_required_keys_are_flat_numbers(report: dict, key: str) -> None:
    v = _get(report, key)
    if key.startswith(Name.ONE_APART + ".") and report["mismatch_counts"][key.split(".")[1]]["mismatched"] == 0:
        assert v is None  # no mismatch to classify: a JSON null, neither 0 nor NaN
        return
    assert isinstance(v, float) and v == v, (key, v)


def test_per_site_detail_covers_every_site_and_layer(report: dict) -> None:
    per_site = report["per_site"]
    assert sorted(per_site) == ["expert_in", "expert_mid", "k", "v"]
    guided = {layer_tag(i) for i in deeper_half(DIMS["layers"])}
    for site, layers in per_site.items():
        assert sorted(layers) == [layer_tag(i) for i in range(DIMS["layers"])], site
        for key, row in layers.items():
            # the lsb arm is guided (and measured) on the deeper half only
            assert (row[Name.CODE_MISMATCH]["trace"] is not None) == (key in guided), (site, key)
            assert (row["bytes_per_token"]["compact"] > 0) == (key in guided), (site, key)
            assert row["bytes_per_token"]["full"] > 0


def test_mismatch_rates(report: dict) -> None:
    mr, counts = report[Name.CODE_MISMATCH], report["mismatch_counts"]
    assert report["fp4_rollouts_identical"] is True
    # Guidance with full information on every layer never does worse than vanilla QAT (<=) and, where
    # the two paths drift at all, removes mismatches outright (<): a trainer that ignored the hints
    # would tie with QAT. Machine-specific: whether incremental decode and the packed forward drift
    # depends on the kernels (under ATEN_CPU_CAPABILITY=avx2 with eager attention they are bit for bit
    # the same); without drift every arm must agree exactly.
    assert mr["trace-full"] <= mr["qat"]
    if counts["qat"]["mismatched"] > 0:
        assert mr["trace-full"] < mr["qat"]
    else:
        assert counts["trace-full"]["mismatched"] == counts["trace"]["mismatched"] == 0
    assert counts["trace-full"]["total"] == counts["qat"]["total"]
    # ... and the lsb arm is compared at its guided sites, the deeper half, like for like.
    assert counts["trace"]["total"] == counts["qat_deeper_half"]["total"] < counts["qat"]["total"]
    assert mr["trace"] <= mr["qat_deeper_half"]
    # The per-site detail adds up to the aggregate.
    per_site_mis = sum(
        row[Name.CODE_MISMATCH]["qat"] * row["elements"]
        for layers in report["per_site"].values()
        for row in layers.values()
    )
    assert per_site_mis == pytest.approx(counts["qat"]["mismatched"])
    share = report[Name.ONE_APART]["qat"]
    if counts["qat"]["mismatched"]:
        assert 0.0 <= share <= 1.0
        assert share == pytest.approx(counts["qat"]["one_apart"] / counts["qat"]["mismatched"])
    else:
        assert share is None


def test_router_flip_rate_is_a_share(report: dict) -> None:
    flips = report["router_flip"]["qat"]
    assert 0.0 <= report["router_flip_rate"] <= 1.0
    positions = report["tokens"]["positions"]
    assert flips["token_layers"] == positions * DIMS["layers"]  # every (token, MoE layer) counted once
    assert report["router_flip_rate"] == pytest.approx(flips["flips"] / flips["token_layers"])


def test_router_flips_detect_a_changed_selection() -> None:
    """The flip metric compares top-k *sets*: shifting one layer's recorded experts by one flips every
    token there (no 2-subset of 8 experts is invariant under the shift), reordering flips none."""
    model = mismatch.build_model(seed=0, **DIMS)
    prompts = mismatch.make_prompts(2, DIMS["vocab"], 6, seed=3)
    roll = generate(model, prompts, SamplingParams(max_new_tokens=4, seed=3), plan=PrecisionPlan())
    base = mismatch._router_flips_without_replay(model, roll, "qat")
    for rec in roll.records:
        rec["L01.routing"] = (rec["L01.routing"] + 1) % DIMS["experts"]
        rec["L02.routing"] = rec["L02.routing"].flip(-1)
    moved = mismatch._router_flips_without_replay(model, roll, "qat")
    assert moved["per_layer"]["L01"] == 1.0
    assert moved["per_layer"]["L02"] == base["per_layer"]["L02"]
    assert moved["per_layer"]["L00"] == base["per_layer"]["L00"]


def test_logprob_gap_bf16_below_qat(report: dict) -> None:
    gap = report["logprob_gap"]
    # a flipped FP4 code moves a log-prob by far more than BF16 drift; without drift (see
    # test_mismatch_rates) both gaps are the paths' BF16 difference, which may be exactly 0
    if report["mismatch_counts"]["qat"]["mismatched"] > 0:
        assert gap["bf16"][Name.GAP_MAX] < gap["qat"][Name.GAP_MAX]
    else:
        assert gap["qat"][Name.GAP_MAX] == gap["trace-full"][Name.GAP_MAX]
    for arm in ARMS:
        g = gap[arm]
        assert 0.0 <= g[Name.GAP_MEAN] <= g[Name.GAP_MAX], arm
        assert g[Name.K3_KL] >= 0.0, arm
        assert g["tokens"] == RUN["batch"] * RUN["new_tokens"], arm


def test_guidance_bytes_match_hand_computation(report: dict) -> None:
    L, H, k, I = DIMS["layers"], DIMS["hidden"], DIMS["top_k"], DIMS["moe_intermediate"]
    kv, d = DIMS["kv_heads"], DIMS["head_dim"]
    # Per token position and layer: elements and rows (one 4-byte float32 global amax per row) of the
    # sites expert_in [H], expert_mid [top_k, I], k and v [kv, head_dim].
    elems = H + k * I + 2 * kv * d
    rows = 1 + k + 2 * kv
    full_per_layer = elems * 4 // 8 + elems // 16 + 4 * rows  # 4-bit codes + E4M3 scale per 16 + amax
    compact_per_layer = elems // 8 + elems // 16 + 4 * rows  # 1 bit + E4M3 scale per 16 + amax
    prompts = mismatch.make_prompts(RUN["batch"], DIMS["vocab"], RUN["prompt_len"], RUN["seed"])
    generated = RUN["batch"] * RUN["new_tokens"]
    positions = sum(p.numel() for p in prompts) + generated  # records cover every position
    assert (report["tokens"]["positions"], report["tokens"]["generated"]) == (positions, generated)
    half = len(deeper_half(L))
    assert half == 2

    b = report["bytes_per_token"]
    assert b["full_all_layers"] == pytest.approx(L * full_per_layer * positions / generated, rel=1e-12)
    assert b["compact_default"] == pytest.approx(half * compact_per_layer * positions / generated, rel=1e-12)
    assert b["ratio"] == pytest.approx(L * full_per_layer / (half * compact_per_layer), rel=1e-12)
    # Without the per-row amax: 4.5 / 1.5 bits on all vs half of the layers = the paper's 6x.
    assert b["ratio_without_amax"] == pytest.approx(6.0, rel=1e-12)
    assert b["routing"] == pytest.approx(L * k * positions / generated, rel=1e-12)  # uint8 indices
    for which, total in (("full", b["full_all_layers"]), ("compact", b["compact_default"])):
        split = sum(row["bytes_per_token"][which] for layers in report["per_site"].values() for row in layers.values())
        assert split == pytest.approx(total, rel=1e-12), which


def test_add_parser_wires_the_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="tracefp4")
    sub = parser.add_subparsers(dest="command", required=True)
    commands.add_mismatch_parser(sub)
    args = parser.parse_args(["mismatch", "--layers", "2", "--top-k", "1", "--json", "x.json"])
    assert args.func is commands.run_mismatch and not args.sweep
    assert (args.layers, args.top_k, args.json, args.batch) == (2, 1, "x.json", mismatch.DEFAULTS["batch"])


def test_checkpoint_folder(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    model = mismatch.build_model(seed=1, **{**DIMS, "layers": 2})
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(SystemExit, match="--checkpoint fixes the model"):
        main(["mismatch", "--checkpoint", str(tmp_path / "ckpt"), "--layers", "3"])
    out = tmp_path / "r.json"
    argv = ["mismatch", "--checkpoint", str(tmp_path / "ckpt"), "--batch", "2", "--new-tokens", "4", "--json", str(out)]
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["layers"] == 2 and rep["config"]["compact_layers"] == [1]
    assert rep["tokens"]["generated"] == 8
    captured = capsys.readouterr()
    assert "log-prob gap" in captured.out and "rollout trace-full" in captured.err  # table and progress
