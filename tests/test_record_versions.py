"""Records that carry their version: the rollout engine stamps each row with its weights' policy version,
the store keeps the stamps, and the trainer rounds rows further behind than ``guidance_max_lag`` to
nearest (counted), computing exactly what it computed before versions existed when none is."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_moe import CONFIG, ragged_prompts

from tracefp4.engines.contract import quantizer_contract
from tracefp4.engines.model import from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import HomeEngine
from tracefp4.engines.rows import RowMap
from tracefp4.engines.sink import UNKNOWN_VERSION, StoreTarget
from tracefp4.engines.trainer import TrainerSpec, forward_logprobs, token_logprobs, trainer_forward
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.store import StoreError, StoreReader, seal_step

torch.set_num_threads(1)

PROMPTS = ragged_prompts(30, (3, 6, 4))
NEW = 6  # tokens per completion (no stop token: every trajectory has T = P + NEW rows)
SAMPLING = SamplingParams(max_new_tokens=NEW, seed=3)
FP4, LSB = PrecisionPlan(), GuidedMode.parse("lsb@all")
UPDATE_AFTER = 3  # the forward after which the new weights arrive: the prefill and two decode steps


@pytest.fixture(scope="module")
def weights():
    """The policy at version 0, and the same policy one (random) step later, at version 1."""
    model = from_config(CONFIG, seed=0)
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    v1 = {k: v + 0.02 * torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point() else v
          for k, v in v0.items()}
    return model, v0, v1


def generate_across_an_update(engine: HomeEngine, v0, v1, **kw):
    """A generation on ``engine`` at version 0 that gets version 1's weights after :data:`UPDATE_AFTER`
    forwards, as a weight push arriving while a rollout is under way does."""
    engine.load_weights(v0, 0)
    forwards = []

    def after_forward(module, args, out):
        forwards.append(1)
        if len(forwards) == UPDATE_AFTER:
            engine.load_weights(v1, 1)

    hook = engine.model.register_forward_hook(after_forward)
    try:
        return engine.generate(PROMPTS, SAMPLING, plan=FP4, guidance=LSB, **kw)
    finally:
        hook.remove()


def expected_versions() -> list[torch.Tensor]:
    """Prefill rows (the prompt) and the rows of the first two decode steps were computed at version 0,
    every later row at version 1; K/V rows written at version 0 stay version-0 rows when attended to."""
    before = [len(p) + UPDATE_AFTER - 1 for p in PROMPTS]
    return [torch.tensor([0] * b + [1] * (len(p) + NEW - b)) for b, p in zip(before, PROMPTS)]


@pytest.fixture(scope="module")
def updated(weights):
    model, v0, v1 = weights
    return generate_across_an_update(HomeEngine(copy.deepcopy(model)), v0, v1)


def test_rows_show_the_version_of_the_forward_that_computed_them(weights, updated):
    model, v0, _ = weights
    assert [v.tolist() for v in updated.versions] == [v.tolist() for v in expected_versions()]
    # the rows before the update are the rows a generation that never saw it computes (same forwards,
    # same weights), bit for bit
    steady = HomeEngine(copy.deepcopy(model))
    steady.load_weights(v0, 0)
    plain = steady.generate(PROMPTS, SAMPLING, plan=FP4, guidance=LSB)
    assert all(bool((v == 0).all()) for v in plain.versions)
    for b, v in enumerate(expected_versions()):
        old = int((v == 0).sum())
        for name, t in updated.records[b].items():
            assert torch.equal(t[:old].view(torch.uint8), plain.records[b][name][:old].view(torch.uint8)), name
    # an engine that was never told its version marks its rows unknown
    assert all(bool((v == UNKNOWN_VERSION).all()) for v in HomeEngine(model).generate(
        PROMPTS, SAMPLING, plan=FP4, guidance=LSB).versions)


def test_the_store_keeps_each_rows_version_and_the_rollouts_contract(tmp_path, weights, updated):
    model, v0, v1 = weights
    ids = ("a", "b", "c")
    target = StoreTarget(str(tmp_path), 0, "w0", ids, "tiny", 0)
    stored = generate_across_an_update(HomeEngine(copy.deepcopy(model)), v0, v1, store=target)
    assert stored.versions == [] and stored.records == []
    seal_step(tmp_path, 0, ["w0"])
    contract = quantizer_contract(FP4, LSB)
    with pytest.raises(StoreError, match=r"trajectory 'a': rows of policy version 0 \(lag 1\); the reader at "
                                         r"policy version 1 accepts version 1 only \(max_lag=0\)"):
        StoreReader(tmp_path, 0, model_signature="tiny", policy_version=1, contract=contract).get("a")
    with StoreReader(tmp_path, 0, model_signature="tiny", policy_version=1, max_lag=1, contract=contract) as r:
        assert r.manifests[0].policy_version == 1 and r.manifests[0].contract == contract
        for tid, want, rec in zip(ids, expected_versions(), updated.records):
            assert torch.equal(r.versions(tid), want)
            got = r.get(tid)
            assert all(torch.equal(got[k].view(torch.uint8), rec[k].view(torch.uint8)) for k in rec)
    # rows the engine could not stamp take the version the driver gives the target
    roll = HomeEngine(model).generate(PROMPTS, SAMPLING, plan=FP4, guidance=LSB,
                                      store=StoreTarget(str(tmp_path), 1, "w0", ids, "tiny", 4))
    seal_step(tmp_path, 1, ["w0"])
    with StoreReader(tmp_path, 1, model_signature="tiny", policy_version=4, contract=contract) as r:
        assert all(torch.equal(r.versions(t), torch.full((n.numel(),), 4)) for t, n in zip(ids, roll.token_ids))


# --- the trainer ------------------------------------------------------------------------------------


def trainer(model, roll, spec=TrainerSpec("trace", FP4), **kw):
    with torch.no_grad():
        return forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records, spec, **kw)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_no_stale_row_computes_exactly_what_the_trainer_computed_without_versions(weights, updated):
    model, _, v1 = weights
    model = copy.deepcopy(model)
    model.load_state_dict(v1)
    today = trainer(model, updated)
    own = [torch.full_like(v, 1) for v in updated.versions]
    for versions, version, lag in ((own, 1, 0), (updated.versions, 1, 1), (updated.versions, 3, 3)):
        out = trainer(model, updated, TrainerSpec("trace", FP4, guidance_max_lag=lag), versions=versions,
                      policy_version=version)
        assert same(out.logprobs, today.logprobs) and out.stale_rows == 0
        assert out.decode == today.decode


def test_rows_beyond_the_lag_bound_round_to_nearest_and_are_counted(weights, updated):
    model, _, v1 = weights
    model = copy.deepcopy(model)
    model.load_state_dict(v1)
    guided = trainer(model, updated)
    nearest = trainer(model, updated, TrainerSpec("qat", FP4))  # routing replayed, every site to nearest
    # every row two or more versions behind: the whole forward is vanilla QAT's
    out = trainer(model, updated, TrainerSpec("trace", FP4, guidance_max_lag=1), versions=updated.versions,
                  policy_version=3)
    assert same(out.logprobs, nearest.logprobs)
    assert out.stale_rows == sum(len(p) + NEW for p in PROMPTS)
    # trajectory 1's rows are stale, the others' are not: each trajectory's log-probs are those of the
    # forward that treats all its rows alike (the packed trajectories do not see each other's rows)
    versions = [torch.full_like(v, 1) for v in updated.versions]
    versions[1] = torch.zeros_like(versions[1])
    out = trainer(model, updated, versions=versions, policy_version=1)
    assert same([out.logprobs[1]], [nearest.logprobs[1]])
    assert same([out.logprobs[0], out.logprobs[2]], [guided.logprobs[0], guided.logprobs[2]])
    assert out.stale_rows == len(PROMPTS[1]) + NEW
    # the rollout's own versions: the rows of version 0 are a lag of 1 behind the trainer
    out = trainer(model, updated, versions=updated.versions, policy_version=1)
    assert out.stale_rows == sum(int((v == 0).sum()) for v in updated.versions)
    assert trainer(model, updated, TrainerSpec("qat", FP4), versions=updated.versions, policy_version=3).stale_rows == 0


def test_a_caller_s_own_padded_forward_rounds_the_same_rows_to_nearest(weights, updated):
    """The padded layout (TRL's, through a RowMap): every row stale is vanilla QAT's forward on that layout,
    and the report counts the record rows the forward covers."""
    model, _, v1 = weights
    model = copy.deepcopy(model)
    model.load_state_dict(v1)
    p_width = max(updated.prompt_lens)
    width = p_width + NEW
    ids = torch.zeros((len(PROMPTS), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (t, p) in enumerate(zip(updated.token_ids, updated.prompt_lens)):
        ids[b, p_width - p:] = t
        mask[b, p_width - p:] = 1
    rows = RowMap.padded(mask)

    def forward(spec, **kw):
        with torch.no_grad(), trainer_forward(model, rows, updated.records, spec, **kw) as fwd:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=rows.position_ids, use_cache=False).logits
        return token_logprobs(logits[:, :-1], ids[:, 1:]), fwd.report()

    nearest, _ = forward(TrainerSpec("qat", FP4))
    stale, report = forward(TrainerSpec("trace", FP4), versions=updated.versions, policy_version=2)
    assert torch.equal(stale, nearest) and report.stale_rows == int(mask.sum())
    guided, _ = forward(TrainerSpec("trace", FP4))
    mixed, report = forward(TrainerSpec("trace", FP4), versions=updated.versions, policy_version=1)
    assert report.stale_rows == sum(int((v == 0).sum()) for v in updated.versions)
    # the first decode rows of every trajectory are version 0 (stale): they and what follows them differ
    # from the all-guided forward somewhere, the prompt rows before the first guided site cannot
    assert not torch.equal(mixed, guided)


def test_versions_that_disagree_with_the_batch_or_the_trainer_are_refused(weights, updated):
    model = weights[0]
    v = updated.versions
    cases = [
        (dict(versions=v, policy_version=0), r"trajectory 0, row 5: computed by policy version 1, newer than "
                                             r"the trainer's 0"),
        (dict(versions=v), "versions and policy_version go together"),
        (dict(policy_version=1), "versions and policy_version go together"),
        (dict(versions=v[:2], policy_version=1), "2 version rows for 3 trajectories"),
        (dict(versions=[x.float() for x in v], policy_version=1), r"trajectory 0: versions must be an integer "
                                                                   r"tensor \[9\] .*got torch.float32"),
        (dict(versions=[torch.full_like(x, UNKNOWN_VERSION) for x in v], policy_version=1),
         r"trajectory 0, row 0: policy version -1 \(an engine that did not know its weights' version"),
        (dict(versions=v, policy_version=-1), "policy_version must be an int >= 0"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            trainer(model, updated, **kw)
    with pytest.raises(ValueError, match="guidance_max_lag must be an int >= 0"):
        TrainerSpec("trace", FP4, guidance_max_lag=-1)
