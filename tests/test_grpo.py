"""GRPO arithmetic and the mismatch metrics, checked against hand calculations."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tracefp4.pipeline.metrics import logprob_gap
from tracefp4.rl.grpo import LossAgg, aggregate, group_advantages, grpo_loss, pad_right
from tracefp4.rl.tasks import Addition, CharTokenizer, CountBy, Example, Reverse, make_task


def test_group_advantages_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(r, 4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))  # a solved group carries no signal
    assert torch.equal(group_advantages(r, 4, normalize_std=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        group_advantages(r, 3)


def test_aggregation_modes():
    per_tok = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(per_tok, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(per_tok, mask, "seq-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(per_tok, mask, LossAgg.DR_GRPO, max_new_tokens=5).item() == pytest.approx(10 / 10)


def test_grpo_loss_clip_and_truncated_is():
    logp_old = torch.log(torch.tensor([[0.5, 0.5]]))
    logp = torch.log(torch.tensor([[0.9, 0.5]])).requires_grad_(True)  # ratio 1.8 (clipped at 1.2), 1.0
    logp_roll = torch.log(torch.tensor([[0.05, 0.5]]))  # pi_old/pi_roll = 10 -> truncated to 5
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 2)
    loss, stats = grpo_loss(logp, logp_old, logp_roll, adv, mask, is_cap=5.0)
    # token 1: -5 * min(1.8, 1.2) = -6; token 2: -1 * 1 = -1; token-mean -> -3.5
    assert loss.item() == pytest.approx(-3.5, rel=1e-5)
    assert stats["clip_frac"] == 0.5 and stats["is_truncated_frac"] == 0.5
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # clipped: no gradient
    assert logp.grad[0, 1].item() == pytest.approx(-0.5)  # d/dlogp of -ratio*A/2 at ratio 1


def test_logprob_gap_hand_values():
    lr = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]])
    lt = torch.tensor([[math.log(0.25), math.log(0.25), -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    m = logprob_gap(lr, lt, mask)
    assert m["rollout_corr/kl"] == pytest.approx(math.log(2) / 2)
    assert m["train_rollout_logprob_abs_diff_max"] == pytest.approx(math.log(2))
    # r = 0.5 on token 1 -> 0.5 - log 0.5 - 1 ; token 2 -> 0
    assert m["rollout_corr/k3_kl"] == pytest.approx((0.5 + math.log(2) - 1) / 2)
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(-math.log(2) / 2)
    with pytest.raises(ValueError, match="no tokens"):
        logprob_gap(lr, lt, torch.zeros(1, 3))


def test_tokenizer_round_trip_and_errors():
    tok = CharTokenizer()
    ids = tok.encode("12+34=")
    assert ids[0] == tok.BOS and tok.decode(ids[1:] + [tok.EOS, 5]) == "12+34="
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("1x")


@pytest.mark.parametrize("task", [Addition(), Reverse(), CountBy(), CountBy(max_step=9, credit="rule")])
def test_tasks_rewards_and_held_out(task):
    train = task.sample(random.Random(0), 500)
    held = task.eval_set(64)
    assert {e.prompt for e in train}.isdisjoint({e.prompt for e in held})
    assert task.eval_set(64) == held  # fixed
    ex = held[0]
    assert task.reward(ex, ex.answer) == 1.0
    assert task.reward(ex, ex.answer + "9") < 1.0
    tok = task.make_tokenizer()  # the task makes the tokenizer its prompts are written for
    assert tok.decode(tok.encode(ex.prompt + ex.answer)) == ex.prompt + ex.answer


def test_reverse_partial_credit_and_make_task():
    t = make_task("reverse")
    assert t.reward(Example("R123=", "321"), "329") == pytest.approx(0.5 * 2 / 3)
    with pytest.raises(ValueError, match="unknown task"):
        make_task("chess")


def test_count_by_answers_and_per_position_credit():
    t = make_task("count", terms=4)
    ex = t._example(91, 4)
    assert ex == Example("A91+04=", "95990307")  # 95, 99, 103 -> 03, 107 -> 07 (mod 100)
    assert t.reward(ex, "95990307") == 1.0
    assert t.reward(ex, "95990308") == 7 / 8
    assert t.reward(ex, "9599") == 0.5  # scored over the longer string: a short answer loses the rest
    assert t.reward(ex, "9599030700") == pytest.approx(8 / 10)
    assert all(len(e.answer) == 32 for e in make_task("count").eval_set(16))
    assert len(set(make_task("count").eval_set(64))) == 64  # distinct held-out prompts
    with pytest.raises(ValueError, match="terms must be a positive integer"):
        CountBy(terms=0)


def test_count_by_rule_credit_and_max_step():
    """``credit = "rule"``: a term scores when it is the completion's own previous term plus the step,
    so a slip costs one term; ``max_step`` bounds the step."""
    t = CountBy(terms=4, credit="rule")
    ex = t._example(91, 4)
    assert t.reward(ex, "95990307") == 1.0
    assert t.reward(ex, "96000408") == 3 / 4  # 96 is off the chain; 00, 04, 08 each follow their previous term
    assert t.reward(ex, "95990308") == 3 / 4
    assert t.reward(ex, "9599") == 1 / 2 and t.reward(ex, "9599030700") == 4 / 5  # length as for "answer"
    assert t.reward(ex, "95a90307") == 1 / 4  # a malformed term ends the chain
    assert all(1 <= int(e.prompt[4:6]) <= 9 for e in CountBy(max_step=9).sample(random.Random(0), 200))
    with pytest.raises(ValueError, match="credit must be"):
        CountBy(credit="sum")
    with pytest.raises(ValueError, match=r"max_step must be an integer in \[1, 99\]"):
        CountBy(max_step=100)


def test_pad_right():
    out, mask = pad_right([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], 3)
    assert torch.equal(out, torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]))
    assert mask.tolist() == [[True, True, False], [True, False, False]]
