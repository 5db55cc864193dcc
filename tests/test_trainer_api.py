"""The trainer-side API (any trainer's own forward): row maps, padded batches, K/V sites without a cache,
the model's state object, the FSDP safety copy."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_moe import CONFIG, ragged_prompts
from transformers import DynamicCache

from tracefp4.engines import path as path_mod
from tracefp4.engines.capture import RolloutCapture
from tracefp4.engines.experts.dense import DenseGEMM
from tracefp4.engines.model import CACHE_KWARG, forward_state, from_config, model_state, moe_layers
from tracefp4.engines.path import PLAIN, weights_may_be_freed
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import generate
from tracefp4.engines.rows import RowMap, take_rows
from tracefp4.engines.trainer import TrainerSpec, code_mismatch, forward_logprobs, token_logprobs, trainer_forward
from tracefp4.formats.constants import HintMode
from tracefp4.guidance.compact import GuidedMode

torch.set_num_threads(1)

PROMPTS = ragged_prompts(20, (3, 6, 4))
ALL = frozenset(range(4))


def padded_batch(token_ids, prompt_lens, pad: int = 0):
    """TRL's layout: prompts left-padded, completions right-padded; returns ids, mask, completion width."""
    p_width = max(prompt_lens)
    c_width = max(t.numel() - p for t, p in zip(token_ids, prompt_lens))
    ids = torch.full((len(token_ids), p_width + c_width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (t, p) in enumerate(zip(token_ids, prompt_lens)):
        c = t.numel() - p
        ids[b, p_width - p:p_width], ids[b, p_width:p_width + c] = t[:p], t[p:]
        mask[b, p_width - p:p_width + c] = 1
    return ids, mask, c_width


def padded_forward(model, roll, spec, token_ids=None, prompt_lens=None):
    """A caller's own forward over a padded batch; returns (completion log-probs per trajectory, report)."""
    token_ids = token_ids or roll.token_ids
    prompt_lens = prompt_lens or roll.prompt_lens
    ids, mask, width = padded_batch(token_ids, prompt_lens)
    lengths = [t.numel() for t in roll.token_ids]
    records = roll.records
    rows = RowMap.padded(mask, lengths)
    with trainer_forward(model, rows, records, spec) as fwd:
        out = model(input_ids=ids, attention_mask=mask, position_ids=rows.position_ids, use_cache=False,
                    logits_to_keep=width + 1)
    logp = token_logprobs(out.logits[:, :-1], ids[:, -width:], spec.temperature)
    per_traj = [logp[b, : t.numel() - p] for b, (t, p) in enumerate(zip(token_ids, prompt_lens))]
    return per_traj, fwd.report()


@pytest.fixture(scope="module")
def full_rollout():
    model = from_config(CONFIG, dtype=torch.float32, seed=0)
    roll = generate(model, PROMPTS, SamplingParams(max_new_tokens=7, seed=1), plan=PrecisionPlan(),
                    guidance=GuidedMode.parse("full@all"), diagnostics=ALL)
    return model, roll


def test_padded_batch_reproduces_every_code_and_the_packed_logprobs(full_rollout) -> None:
    """A padded batch (TRL's layout: prompts left-padded) through the caller's own forward: with full
    records every rollout code is reproduced, and the log-probs are the packed forward's up to float32
    summation order (float32 model: the guided sites give both layouts the same values, the rest differs
    only in the order of float32 additions, ~1e-7 relative, far below 1e-5)."""
    model, roll = full_rollout
    spec = TrainerSpec("trace", capture_codes=ALL)
    with torch.no_grad():
        mine, report = padded_forward(model, roll, spec)
        packed = forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records, spec)
    assert sum(s.mismatched for s in code_mismatch(report.codes, roll.diagnostics).values()) == 0
    assert sum(s.mismatched for s in code_mismatch(packed.codes, roll.diagnostics).values()) == 0
    assert sorted(report.router_flips) == [0, 1, 2, 3] and report.decode.failed_blocks == 0
    for a, b in zip(mine, packed.logprobs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_forward_may_cover_part_of_each_trajectory(full_rollout) -> None:
    """A trainer that drops each sequence's last token (it predicts nothing) still lines up: the records
    are taken at the positions the forward covers."""
    model, roll = full_rollout
    ids = [t[:-1] for t in roll.token_ids]
    spec = TrainerSpec("trace", capture_codes=ALL)
    with torch.no_grad():
        _, report = padded_forward(model, roll, spec, token_ids=ids)
    short = [{k: v[:-1] for k, v in d.items()} for d in roll.diagnostics]
    assert [r["L00.k"].shape[0] for r in report.codes] == [t.numel() for t in ids]
    assert sum(s.mismatched for s in code_mismatch(report.codes, short).values()) == 0


def test_kv_sites_are_quantized_with_or_without_a_cache() -> None:
    """The K/V sites do not depend on the caller's cache: no cache (use_cache=False, as trainers run) or
    transformers' DynamicCache give the same logits bit for bit, and the sites run (and record) without
    a cache. (FP4KVCache stores these sites' codes and attends over them itself: tests/test_kv_cache.py.)"""
    model = from_config(CONFIG, seed=0)
    ids = torch.randint(2, 32, (2, 9), generator=torch.Generator().manual_seed(3))
    outs = {}
    with torch.no_grad():
        for name in ("none", "dynamic"):
            cache = {"none": None, "dynamic": DynamicCache(config=model.config)}[name]
            with forward_state(model, PrecisionPlan()):
                outs[name] = model(ids, **{CACHE_KWARG: cache}, use_cache=cache is not None).logits
        capture = RolloutCapture(HintMode.FULL, diagnostic_layers={0, 3})
        with forward_state(model, PrecisionPlan(), capture):
            model(ids, use_cache=False)
    assert torch.equal(outs["none"], outs["dynamic"])
    rec = capture.take()
    assert rec.diagnostics["L03.k"].q.codes.shape == rec.diagnostics["L00.v"].q.codes.shape == (ids.numel(), 2, 8)


def test_row_maps() -> None:
    packed = RowMap.packed([3, 2])
    assert packed.dense and packed.complete and packed.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    padded = RowMap.padded(mask)
    assert not padded.dense and padded.complete
    assert padded.lengths == (2, 4) and padded.real.tolist() == [1, 2, 4, 5, 6, 7] and padded.pad.tolist() == [0, 3]
    assert padded.position_ids.tolist() == [[0, 0, 1, 0], [0, 1, 2, 3]]
    assert RowMap.padded(mask, [3, 5]).index.tolist() == [0, 1, 3, 4, 5, 6] and not RowMap.padded(mask, [3, 5]).complete
    with pytest.raises(ValueError, match="more than one row"):
        RowMap.of(torch.tensor([[0, 0]]), torch.tensor([[1, 1]]), [2])
    with pytest.raises(ValueError, match="position 2 of trajectory 0"):
        RowMap.of(torch.tensor([[0, 0]]), torch.tensor([[0, 2]]), [2])
    with pytest.raises(ValueError, match="do not cover"):
        RowMap(torch.zeros(3), torch.zeros(3), (3,), (2, 2))


def test_take_rows_is_indexing() -> None:
    """The assembly's row gather gives indexing's tensor (float8 too); masks, slices and scalars index."""
    index = torch.tensor([4, 0, 3, 3, 1])
    for dtype in (torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int64):
        t = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(0)).mul(50).to(dtype)
        for i in (index, index.int()):
            taken = take_rows(t, i)
            assert taken.dtype == dtype and torch.equal(taken.view(torch.uint8), t[index].view(torch.uint8))
    t = torch.arange(5.0)
    assert torch.equal(take_rows(t, t > 2), t[t > 2]) and torch.equal(take_rows(t, slice(1, 3)), t[1:3])


def test_a_row_map_must_fit_the_forward(full_rollout) -> None:
    model, roll = full_rollout
    rows = RowMap.packed([t.numel() for t in roll.token_ids])
    with pytest.raises(ValueError, match="row map"), torch.no_grad():
        with trainer_forward(model, rows, roll.records, TrainerSpec("qat")):
            model(roll.token_ids[0][None], use_cache=False)


def test_the_model_state_is_one_object_and_nothing_sits_in_transformers_modules() -> None:
    model = from_config(CONFIG, seed=0)
    assert not [k for m in model.modules() for k in vars(m) if k.startswith("_tracefp4")]
    state = model_state(model)
    twin = copy.deepcopy(model)
    assert model_state(twin) is not state and model_state(twin).current is None
    assert [m.index for m in model_state(twin).moe] == [0, 1, 2, 3]
    assert model_state(twin).moe[0].experts is moe_layers(twin)[0].experts  # bound to the copy's own modules
    with forward_state(model, PrecisionPlan()) as st:
        assert state.forward() is st and model_state(twin).forward().path is PLAIN


def test_expert_weights_are_copied_whenever_a_process_group_is_up(tmp_path, monkeypatch) -> None:
    """The trainer quantizes a copy of the expert weights under any sharding wrapper (accelerate's or
    torchtitan's FSDP2, FSDP1, ZeRO-3: each may free a gathered weight after its layer), which all run in
    an initialised process group; alone in a process it quantizes the parameter itself."""
    model = from_config(CONFIG, seed=0)
    roll = generate(model, PROMPTS[:1], SamplingParams(max_new_tokens=3), plan=PrecisionPlan())
    seen = []
    prepare = DenseGEMM.prepare

    def spy(self, weight, quantizer, *, gradients=False, copy=False):
        seen.append(copy)
        return prepare(self, weight, quantizer, gradients=gradients, copy=copy)

    monkeypatch.setattr(DenseGEMM, "prepare", spy)
    forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records, mode="qat")
    assert seen and not any(seen) and not weights_may_be_freed()
    seen.clear()
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        assert path_mod.weights_may_be_freed()
        forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records, mode="qat")
    finally:
        torch.distributed.destroy_process_group()
    assert seen and all(seen)
