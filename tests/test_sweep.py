"""``tracefp4 mismatch --sweep``: compact modes through rollout -> store -> trainer, and the curve's figures."""

from __future__ import annotations

import json

import pytest
import torch

from tracefp4.cli import main
from tracefp4.reports import mismatch
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import generate
from tracefp4.guidance.compact import CompactRecord, GuidedMode, read_record, site_bytes_per_token
from tracefp4.guidance.names import record_prefix
from tracefp4.engines.trainer import code_mismatch, forward_rollout
from tracefp4.pipeline.metrics import Name

torch.set_num_threads(1)

DIMS = dict(layers=4, experts=8, top_k=2, hidden=32, moe_intermediate=16, heads=2, kv_heads=1, head_dim=16, vocab=32)
RUN = dict(batch=4, new_tokens=12, prompt_len=8, seed=0)
MODES = [
    "full",
    "lsb",
    "lsb+parity+amax:lo3@all",
    "sparse(0.1)+parity+amax:lo3@all",
    "ldpc(1/4)+scales:ldpc(1/4)+amax:lo3@all",
]


def _argv(**kw) -> list[str]:
    return [a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, bytes]:
    d = tmp_path_factory.mktemp("sweep")
    argv = ["mismatch", "--sweep", *_argv(**DIMS, **RUN), "--modes", ",".join(MODES), "--quiet"]
    assert main([*argv, "--json", str(d / "s.json"), "--plot", str(d / "s.png")]) == 0
    return json.loads((d / "s.json").read_text()), (d / "s.png").read_bytes()


def test_sweep_json_has_every_mode_with_the_required_figures(sweep: tuple[dict, bytes]) -> None:
    rep, png = sweep
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    names = [m["name"] for m in rep["modes"]]
    assert names == ["qat", *MODES]
    for m in rep["modes"]:
        for key in ("bytes_per_token", "agreement", Name.GAP_MEAN):
            assert isinstance(m[key], float) and m[key] >= 0, (m["name"], key)
        assert 0 <= m["agreement"] <= 1


def test_sweep_figures_obey_their_relations(sweep: tuple[dict, bytes]) -> None:
    rep, _ = sweep
    by = {m["name"]: m for m in rep["modes"]}
    assert by["qat"]["bytes_per_token"] == 0
    # full information on every layer reproduces every code; lsb on the deeper half its guided ones almost
    assert by["full"]["agreement"] == 1.0 and by["full"]["scale_agreement"] == 1.0
    # (strictly better where the two paths drift at all: machine-specific, see test_mismatch_rates)
    assert by["lsb"]["agreement"] >= by["qat"]["agreement_deeper_half"]
    if by["qat"]["agreement_deeper_half"] < 1.0:
        assert by["lsb"]["agreement"] > by["qat"]["agreement_deeper_half"]
    # the exact knobs (parity scales, 3 amax bits) lose nothing against full information at this drift
    for name in ("lsb+parity+amax:lo3@all", "ldpc(1/4)+scales:ldpc(1/4)+amax:lo3@all"):
        assert by[name]["agreement"] == 1.0 and by[name]["amax_agreement"] == 1.0
        assert by[name][Name.GAP_MEAN] == pytest.approx(by["full"][Name.GAP_MEAN])
    assert by["sparse(0.1)+parity+amax:lo3@all"]["density"] > 0
    # bytes: the store's accounting equals the formula, per position, for fixed-size modes
    c = rep["config"]
    kv = (c["kv_heads"], c["head_dim"])
    sites = [(c["hidden"],), (c["top_k"], c["moe_intermediate"]), kv, kv]
    best = "ldpc(1/4)+scales:ldpc(1/4)+amax:lo3@all"
    for name, layers in (("full", c["layers"]), ("lsb", c["layers"] // 2), (best, c["layers"])):
        mode = name.split("@")[0]
        per_position = layers * sum(site_bytes_per_token(mode, s) for s in sites)
        assert by[name]["bytes_per_position"] == pytest.approx(per_position)
    t = rep["target"]
    assert t["compact"] == "lsb" and t["budget_bytes_per_token"] == pytest.approx(by["lsb"]["bytes_per_token"] / 4)
    assert set(t["met_by_exact_grid"]) <= set(t["met_by"])


def test_plot_and_modes_need_sweep() -> None:
    with pytest.raises(SystemExit, match="--sweep"):
        main(["mismatch", *_argv(**DIMS, **RUN), "--plot", "x.png", "--quiet"])
    with pytest.raises(SystemExit, match="lsb\\(2\\)"):
        main(["mismatch", "--sweep", *_argv(**DIMS, **RUN), "--modes", "lsb(2)", "--quiet"])


def test_compact_guidance_through_rollout_and_trainer() -> None:
    """The model's own path: a compact rollout record drives the trainer to the rollout's codes, and a
    record from another mode's rollout is refused when its shape disagrees."""
    model = mismatch.build_model(seed=0, **DIMS)
    prompts = mismatch.make_prompts(3, DIMS["vocab"], 6, 0)
    sampling = SamplingParams(max_new_tokens=6, seed=0)
    every = frozenset(range(4))
    full = generate(model, prompts, sampling, plan=PrecisionPlan(), diagnostics=every)
    mode = GuidedMode.parse("ldpc(1/4)+parity+amax:lo3@all")
    roll = generate(model, prompts, sampling, plan=PrecisionPlan(), guidance=mode)
    rec = read_record(roll.records[0], record_prefix(2, "expert_mid"))
    assert isinstance(rec, CompactRecord) and rec.site_shape == (DIMS["top_k"], DIMS["moe_intermediate"])
    with torch.no_grad():
        out = forward_rollout(model, roll, mode="trace", capture_codes=every)
    assert sum(s.mismatched for s in code_mismatch(out.codes, full.diagnostics).values()) == 0
    bad = [dict(r) for r in roll.records]
    name = next(k for k in bad[0] if k.startswith("L01.k.packed__"))
    bad[0][name] = bad[0][name][:, :0]
    with pytest.raises(ValueError, match="L01.k"):
        forward_rollout(model, roll.__class__(**{**roll.__dict__, "records": bad}), mode="trace")
