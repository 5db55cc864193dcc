"""The paper's two closest baselines: QUADS' residual activation compensation (fast == reference at
atol=0, the derived error bound, the W4A16 trainer) and Score Centering (the sampler's top-k from our
engine, the loss's gradient against its closed form, the arms in the RL loop)."""

from __future__ import annotations

import math

import pytest
import torch

import tracefp4 as tf
from fp4data import KINDS, bits, make_data
from tracefp4.engines.model import from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import HomeEngine, generate
from tracefp4.engines.sites import ForwardState, quantize_site
import tracefp4.formats as formats
from tracefp4.formats import reference_composite as refc
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.names import Site
from tracefp4.pipeline import steps
from tracefp4.pipeline.arms import PolicyLoss, make_arm
from tracefp4.pipeline.steps import model_signature
from tracefp4.rl.collect import ArmSetup, collect
from tracefp4.rl.config import ModelSpec, RLConfig
from tracefp4.rl.optim import MasterWeightAdamW
from tracefp4.rl.score_centering import head_mass_metrics, score_centering_loss, top_k_for, trainer_scores
from tracefp4.rl.tasks import Reverse
from tracefp4.rl.update import update

torch.set_num_threads(1)

TINY = dict(
    steps=1, warm_start_steps=2, prompts_per_step=2, group_size=2, max_new_tokens=4, eval_every=1,
    eval_size=4, updates_per_step=2, threads=1,
    model=ModelSpec(hidden=32, layers=2, experts=4, top_k=2, moe_intermediate=32, heads=2, kv_heads=1),
)


# --- QUADS: residual activation compensation -----------------------------------------------------


def _same_nvfp4_ref(q: tf.NVFP4, r) -> bool:
    codes, s8, amax = r
    return (torch.equal(tf.unpack_fp4(q.codes), codes) and torch.equal(bits(q.scales), bits(s8))
            and torch.equal(bits(q.global_amax), bits(amax)))


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "saturating"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_compensation_fast_equals_reference(kind, dtype, fraction):
    x = make_data(kind, dtype, 6, 64)
    q = formats.quantize_nvfp4_rac(x, fraction)
    first, second, mask = refc.quantize_nvfp4_rac(x, fraction)
    assert _same_nvfp4_ref(q.first, first) and _same_nvfp4_ref(q.residual, second)
    assert torch.equal(bits(formats.dequantize_nvfp4_rac(q)), bits(refc.dequantize_nvfp4_rac(first, second)))
    # the residual pass lives on the chosen channels only: ceil(fraction * K) per row
    assert bool((tf.unpack_fp4(q.residual.codes)[~mask] & 0x7).eq(0).all())
    assert bool((mask.sum(dim=-1) == formats.rac_channel_count(64, fraction)).all())


def test_compensation_picks_the_largest_first_pass_errors_and_never_hurts():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(32, 128, generator=g) * torch.rand(32, 1, generator=g) * 10).to(torch.bfloat16)
    q = formats.quantize_nvfp4_rac(x, 0.5)
    x1 = tf.dequantize(q.first)
    r = x.float() - x1
    mask = refc.rac_channels(x, r, 0.5)
    # every chosen channel's error is at least every unchosen one's, row by row
    chosen = torch.where(mask, r.abs(), torch.full_like(r, float("inf"))).amin(dim=-1)
    unchosen = torch.where(mask, torch.zeros_like(r), r.abs()).amax(dim=-1)
    assert bool((chosen >= unchosen).all())
    # Per element |x - v| <= |x - x1| + ulp(r) + ulp(v)/2: the second pass rounds r to nearest on a grid
    # holding 0, so |r - x2| <= |r| (a saturated block maximum lands below it); r = fl32(x - x1) and
    # v = fl32(x1 + x2) each add one float32 rounding.
    v = formats.dequantize_nvfp4_rac(q)
    ulp = lambda t: torch.nextafter(t.abs(), torch.tensor(float("inf"))) - t.abs()  # noqa: E731
    assert bool(((x.float() - v).abs() <= (x.float() - x1).abs() + ulp(r) + ulp(v) / 2).all())
    assert float((x.float() - v).square().sum()) < float((x.float() - x1).square().sum())


def test_compensated_quantizer_in_the_quads_plan():
    qz = tf.CompensatedNVFP4Quantizer(0.5)
    assert (qz.fmt, qz.guidable) == ("nvfp4", False)
    with pytest.raises(ValueError, match="no single grid"):
        qz.grid(qz.quantize(torch.randn(2, 32)))
    with pytest.raises(ValueError, match="no codeword bracket"):
        qz.guided_quantize(torch.randn(2, 32), tf.Grid(torch.ones(2, 2)))
    for bad in (0.0, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="compensation fraction"):
            tf.CompensatedNVFP4Quantizer(bad)
    x = torch.randn(3, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    out = quantize_site(ForwardState(PrecisionPlan.quads()), 0, Site.EXPERT_MID, x)
    # the GEMM consumes the compensated value (in x's dtype), with a straight-through gradient
    assert torch.equal(out, formats.dequantize_nvfp4_rac(qz.quantize(x.detach())).to(torch.bfloat16))
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    # W4A16: the trainer's activation and KV sites are BF16, untouched
    y = torch.randn(4, 32, dtype=torch.bfloat16)
    assert quantize_site(ForwardState(PrecisionPlan.w4a16()), 0, Site.EXPERT_IN, y) is y


def test_quads_arm_rollout_and_trainer():
    arm = make_arm("quads", guidance="lsb", n_layers=2, quads_fraction=0.25)
    assert arm.plan == PrecisionPlan.quads(0.25) and arm.trainer_plan == PrecisionPlan.w4a16()
    assert arm.trainer == "qat" and arm.guidance is None and not arm.diagnostics
    assert type(arm).from_dict(arm.to_dict()) == arm
    cfg = RLConfig(**TINY)
    model = from_config(cfg.model.hf_config(Reverse().make_tokenizer()), seed=0)
    roll, _ = steps.rollout(HomeEngine(model), [[1, 5, 6, 7]], SamplingParams(max_new_tokens=3, seed=1), arm)
    assert all(k.endswith(".routing") for k in roll.records[0])  # no guidance: routing only
    plain, _ = steps.rollout(HomeEngine(model), [[1, 5, 6, 7]], SamplingParams(max_new_tokens=3, seed=1),
                              make_arm("qat", guidance="lsb", n_layers=2))
    assert any(not torch.equal(a, b) for a, b in zip(roll.logprobs, plain.logprobs))  # compensation computes
    with torch.no_grad():
        w4a16 = steps.trainer_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records, arm, temperature=1.0)
        w4a4 = steps.trainer_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records,
                                       make_arm("qat", guidance="lsb", n_layers=2), temperature=1.0)
    assert any(not torch.equal(a, b) for a, b in zip(w4a16.logprobs, w4a4.logprobs))  # the trainer's own plan


# --- Score Centering: the sampler's top-k --------------------------------------------------------


def _model():
    cfg = RLConfig(**TINY)
    return from_config(cfg.model.hf_config(Reverse().make_tokenizer()), seed=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_our_engine_returns_the_sampler_top_k(temperature):
    model = _model()
    vocab = model.config.vocab_size
    prompts = [[1, 5, 6, 7], [1, 9, 8]]
    base = SamplingParams(max_new_tokens=5, temperature=temperature, seed=3)
    plain = generate(model, prompts, base, plan=PrecisionPlan())
    for k in (3, vocab):
        out = generate(model, prompts, SamplingParams(**{**base.__dict__, "top_logprobs": k}), plan=PrecisionPlan())
        assert [t.tolist() for t in out.token_ids] == [t.tolist() for t in plain.token_ids]  # sampling unchanged
        for b in range(len(prompts)):
            ids, lps, comp = out.top_ids[b], out.top_logprobs[b], out.completion(b)
            assert ids.shape == lps.shape == (comp.numel(), k) and ids.dtype == torch.long
            assert bool((lps[:, 1:] <= lps[:, :-1]).all())  # most likely first
            hit = ids == comp[:, None]
            # where the sampled token is in the top-k, the two reported log-probs are one number
            rows = hit.any(dim=-1)
            assert torch.equal(lps[hit], out.logprobs[b][rows])
            if k == vocab:
                assert bool(rows.all())
                # a whole log-softmax row: its probabilities sum to 1 up to float32 rounding of V terms
                assert torch.allclose(lps.exp().sum(dim=-1), torch.ones(comp.numel()), atol=vocab * 2**-23)
    assert not plain.top_ids and not plain.top_logprobs
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        generate(model, prompts, SamplingParams(top_logprobs=vocab + 1), plan=None)
    assert top_k_for(128, vocab) == vocab and top_k_for(3, vocab) == 3


# --- Score Centering: the loss -------------------------------------------------------------------


def _sc_gradient(trainer_logits, sampler_logp, top_ids, y, adv=1.5, cap=2.0):
    """d loss / d logits of the Score Centering loss on one trajectory (temperature 1)."""
    z = trainer_logits.clone().requires_grad_(True)
    rows = torch.log_softmax(z, dim=-1)
    t = rows.shape[0]
    logp = rows.gather(-1, y[:, None]).squeeze(-1)[None]
    logp_roll = sampler_logp.gather(-1, y[:, None]).squeeze(-1)[None]
    top, tail = trainer_scores([rows], top_ids[None])
    loss, stats = score_centering_loss(logp, logp.detach(), logp_roll, torch.tensor([adv]), torch.ones(1, t),
                                       top, tail, sampler_logp.gather(-1, top_ids)[None], is_cap=cap, agg="token-mean")
    loss.backward()
    w = torch.exp(logp.detach() - logp_roll).clamp(max=cap)[0]
    return z.grad, w, stats


def test_score_centering_hand_computed_example():
    """One token, V = 3, k = 1. Trainer p = (0.5, 0.3, 0.2), sampler q = (0.6, 0.25, 0.15), K = {0},
    sampled y = 1, A = 2. Then w = min(0.3 / 0.25, 2) = 1.2; Q = 0.6, P = 0.5, so the centering is
    0.6 log 0.5 + 0.4 log(1 - 0.5) = log 0.5 and the loss is -1.2 * 2 * (log 0.3 - log 0.5) = 2.4 log(5/3).
    By hand, d/dz: d log p_y = e_y - p = (-0.5, 0.7, -0.2); d log p_0 = (0.5, -0.3, -0.2);
    d log(1 - p_0) = (0, 0.3, 0.2) / 0.5 - p = (-0.5, 0.3, 0.2); centering 0.6 * (.) + 0.4 * (.) =
    (0.1, -0.06, -0.04); the loss gradient -2.4 * ((-0.5, 0.7, -0.2) - (0.1, -0.06, -0.04)) =
    (1.44, -1.824, 0.384)."""
    z = torch.tensor([[0.5, 0.3, 0.2]]).log().requires_grad_(True)
    rows = torch.log_softmax(z, dim=-1)
    q = torch.tensor([0.6, 0.25, 0.15]).log()
    top, tail = trainer_scores([rows], torch.tensor([[[0]]]))
    logp = rows[:, 1][None]
    loss, stats = score_centering_loss(logp, logp.detach(), q[1].reshape(1, 1), torch.tensor([2.0]),
                                       torch.ones(1, 1), top, tail, q[0].reshape(1, 1, 1), is_cap=2.0)
    loss.backward()
    # float32: each value is a handful of roundings of O(1) terms (relative 2^-24 each)
    assert loss.item() == pytest.approx(2.4 * math.log(5 / 3), abs=2**-20)
    assert torch.allclose(z.grad, torch.tensor([[1.44, -1.824, 0.384]]), atol=2**-20)
    assert stats["is_weight_mean"] == pytest.approx(1.2, abs=2**-20) and stats["is_truncated_frac"] == 0.0


def test_score_centering_gradient_with_the_whole_vocabulary():
    """With K the whole vocabulary, d/dz of ``log p(y) - sum_v q_v log p_v`` is ``e_y - q`` (since
    ``d log p_v / dz = e_v - p`` and ``sum q = 1``), so the loss gradient is ``-w A (e_y - q) / T``:
    the trainer's own p cancels, only the sampler's q remains."""
    g = torch.Generator().manual_seed(0)
    t, v = 5, 16
    z, zq = torch.randn(t, v, generator=g), torch.randn(t, v, generator=g)
    q = torch.log_softmax(zq, dim=-1)
    y = torch.randint(0, v, (t,), generator=g)
    ids = torch.arange(v).expand(t, v)
    grad, w, stats = _sc_gradient(z, q, ids, y)
    expect = -(w * 1.5 / t)[:, None] * (torch.nn.functional.one_hot(y, v).float() - q.exp())
    # float32: each entry is a few roundings of O(1) terms plus a sum over V = 16 of them
    assert torch.allclose(grad, expect, atol=v * 2**-20)
    assert {"is_weight_mean", "is_truncated_frac", "sc/centering_abs_mean"} <= set(stats)


def test_score_centering_tail_model_is_exact_when_q_is_p_rescaled():
    """With a top-k K and the sampler's tail equal to p rescaled to its mass (``q_v = (1-Q) p_v / (1-P)``
    outside K), the tail term reproduces the whole-vocabulary centering: the same ``e_y - q``."""
    g = torch.Generator().manual_seed(1)
    t, v, k = 4, 12, 5
    z = torch.randn(t, v, generator=g)
    p = torch.softmax(z, dim=-1)
    ids = torch.randn(t, v, generator=g).argsort(dim=-1)[:, :k]
    in_k = torch.zeros(t, v, dtype=torch.bool).scatter_(1, ids, True)
    head = torch.rand(t, k, generator=g) + 0.1
    head = head / head.sum(-1, keepdim=True) * 0.7  # the sampler's mass on K: 0.7
    q = torch.zeros(t, v).scatter_(1, ids, head)
    q = torch.where(in_k, q, 0.3 * p / (p * ~in_k).sum(-1, keepdim=True))
    y = torch.randint(0, v, (t,), generator=g)
    grad, w, _ = _sc_gradient(z, q.log(), ids, y)
    expect = -(w * 1.5 / t)[:, None] * (torch.nn.functional.one_hot(y, v).float() - q)
    assert torch.allclose(grad, expect, atol=v * 2**-20)


def test_score_centering_without_mismatch_is_reinforce():
    """q == p: the sampler-expected score ``sum_v p_v grad log p_v = grad sum_v p_v`` is 0, so Score
    Centering's gradient is plain REINFORCE's, ``-w A (e_y - p) / T``, with w = 1."""
    g = torch.Generator().manual_seed(2)
    t, v = 3, 10
    z = torch.randn(t, v, generator=g)
    y = torch.randint(0, v, (t,), generator=g)
    grad, w, _ = _sc_gradient(z, torch.log_softmax(z, dim=-1), torch.arange(v).expand(t, v), y)
    assert torch.equal(w, torch.ones(t))
    expect = -(1.5 / t) * (torch.nn.functional.one_hot(y, v).float() - torch.softmax(z, dim=-1))
    assert torch.allclose(grad, expect, atol=v * 2**-20)


def test_head_mass_metrics():
    top = torch.log(torch.tensor([[[0.5, 0.3], [0.25, 0.25]], [[0.6, 0.2], [1.0, 0.0]]]))
    mask = torch.tensor([[True, True], [True, False]])
    m = head_mass_metrics(top, mask)
    assert m["sc/head_mass_mean"] == pytest.approx((0.8 + 0.5 + 0.8) / 3) and m["sc/head_mass_min"] == pytest.approx(0.5)


# --- the arms in the loop ------------------------------------------------------------------------


def test_score_centering_arms_collect_top_k_and_update(tmp_path):
    cfg = RLConfig(**{**TINY, "sc_top_k": 7})
    task = Reverse()
    tok = task.make_tokenizer()
    model = from_config(cfg.model.hf_config(tok), seed=0)
    for name in ("score-centering", "trace-sc"):
        arm = make_arm(name, guidance="lsb", n_layers=2)
        assert arm.loss is PolicyLoss.SCORE_CENTERING and arm.trainer == ("qat" if name == "score-centering" else "trace")
        s = ArmSetup(name, arm, model, task, tok, cfg, tmp_path / name, model_signature(model, arm.plan), None)
        batch = collect(s, step=0, version=0)
        n = cfg.prompts_per_step * cfg.group_size
        assert batch.top_ids.shape == batch.top_logp_rollout.shape == (n, batch.width, 7)
        assert 0 < batch.metrics["sc/head_mass_min"] <= batch.metrics["sc/head_mass_mean"] <= 1
        batch.advantages = torch.tensor([1.0, -1.0] * (n // 2))
        before = [p.detach().clone() for p in model.parameters()]
        stats = update(model, MasterWeightAdamW(model, lr=1e-2, weight_decay=0.0, grad_clip=1.0), arm, cfg, batch)
        assert "sc/centering_abs_mean" in stats and "clip_frac" not in stats  # no ratio clip
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    qat = collect(ArmSetup("qat", make_arm("qat", guidance="lsb", n_layers=2), model, task, tok, cfg,
                           tmp_path / "qat", "sig", None), step=0, version=0)
    assert qat.top_ids is None and "sc/head_mass_mean" not in qat.metrics


def test_config_knobs_of_the_baselines():
    RLConfig(arms=("qat", "trace-sc"), trainer_world_size=2).validate()  # one update on N processes (test_importance)
    with pytest.raises(ValueError, match="sc_top_k = 0"):
        RLConfig(sc_top_k=0).validate()
    with pytest.raises(ValueError, match="quads_fraction = 1.5"):
        RLConfig(quads_fraction=1.5).validate()
    fp8 = make_arm("trace-fp8", guidance="lsb", n_layers=4)
    assert fp8.plan == PrecisionPlan.fp8() and fp8.guidance == GuidedMode.parse("lsb@all")
    assert fp8.diagnostics == frozenset(range(4)) and make_arm("qat-fp8", guidance="lsb", n_layers=4).trainer == "qat"
