"""The importance correction as a knob (``RLConfig.is_mode``), on hand-computed batches, and the one
minibatch loss (``tracefp4.rl.update.minibatch_loss``) split over simulated trainer processes.

Tolerances: the weights go through float32 ``log``/``exp`` (each correctly rounded to within an ulp,
2^-24 relative), a few of them in a row: rel=1e-6 bounds that. The sequence ratio is summed in float64.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from tracefp4.engines.model import from_config
from tracefp4.pipeline.arms import make_arm
from tracefp4.pipeline.steps import model_signature
from tracefp4.rl.collect import ArmSetup, collect
from tracefp4.rl.config import ModelSpec, RLConfig
from tracefp4.rl.grpo import ISMode, grpo_loss, importance_weights
from tracefp4.rl.tasks import Reverse
from tracefp4.rl.update import Reducer, minibatch_loss, minibatch_order, select

REL = 1e-6  # float32 log/exp roundings (module docstring)


def _batch(rhos: list[list[float]]):
    """``logp_old - logp_rollout = log rho`` per generated token; rows padded with mask False."""
    width = max(map(len, rhos))
    log_rho = torch.zeros(len(rhos), width)
    mask = torch.zeros(len(rhos), width, dtype=torch.bool)
    for b, row in enumerate(rhos):
        log_rho[b, : len(row)] = torch.tensor([math.log(r) for r in row])
        mask[b, : len(row)] = True
    logp_rollout = torch.full_like(log_rho, -1.0)
    return logp_rollout + log_rho, logp_rollout, mask


TOKEN = [[2.0, 0.1, 8.0], [1.0, 1.0]]  # cap 5: one token above (8), one below 1/5 (0.1)
SEQ = [[2.0, 4.0, 1.0], [0.5, 0.5]]  # products 8 (above 5) and 0.25 (inside [1/5, 5])


@pytest.mark.parametrize("mode, rhos, expected, stats", [
    ("token-truncate", TOKEN, [[2, 0.1, 5], [1, 1]],
     {"is_truncated_frac": 1 / 5, "is_masked_frac": 0, "is_seq_truncated_frac": 1 / 2, "is_seq_masked_frac": 0}),
    ("off", TOKEN, [[1, 1, 1], [1, 1]],
     {"is_truncated_frac": 0, "is_masked_frac": 0, "is_seq_truncated_frac": 0, "is_seq_masked_frac": 0}),
    ("token-mask", TOKEN, [[2, 0, 0], [1, 1]],
     {"is_truncated_frac": 0, "is_masked_frac": 2 / 5, "is_seq_truncated_frac": 0, "is_seq_masked_frac": 1 / 2}),
    ("sequence-truncate", SEQ, [[5, 5, 5], [0.25, 0.25]],
     {"is_truncated_frac": 3 / 5, "is_masked_frac": 0, "is_seq_truncated_frac": 1 / 2, "is_seq_masked_frac": 0}),
    ("sequence-mask", SEQ, [[0, 0, 0], [0.25, 0.25]],
     {"is_truncated_frac": 0, "is_masked_frac": 3 / 5, "is_seq_truncated_frac": 0, "is_seq_masked_frac": 1 / 2}),
])
def test_importance_weights_by_hand(mode, rhos, expected, stats):
    old, roll, mask = _batch(rhos)
    w, st = importance_weights(old, roll, mask, mode, cap=5.0)
    for b, row in enumerate(expected):
        assert w[b, : len(row)].tolist() == pytest.approx(row, rel=REL, abs=0), (mode, b)
    assert st["is_weight_mean"] == pytest.approx(sum(map(sum, expected)) / 5, rel=REL)
    for k, v in stats.items():
        # a count over a count, divided in float32: the correctly rounded quotient, exactly
        assert st[k] == float(torch.tensor(v, dtype=torch.float32)), (mode, k)


def test_sequence_ratio_ignores_padding_and_does_not_overflow():
    """10,000 tokens each at ratio e: the product e^10000 overflows float32 (and float64) as a product,
    not as a log-sum; padding (mask False, any value) never enters it."""
    n = 10_000
    roll = torch.zeros(2, n)
    old = torch.ones(2, n)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, 1:] = False  # one token, ratio e, then padding that would overflow if summed
    w, st = importance_weights(old, roll, mask, "sequence-truncate", cap=5.0)
    assert torch.isfinite(w).all()
    assert float(w[0, 0]) == pytest.approx(5.0, rel=REL) and float(w[1, 0]) == pytest.approx(math.e, rel=REL)
    w, _ = importance_weights(old, roll, mask, "sequence-mask", cap=5.0)
    assert float(w[0].abs().max()) == 0.0 and float(w[1, 0]) == pytest.approx(math.e, rel=REL)


def test_grpo_loss_uses_the_mode_and_default_is_token_truncate():
    old, roll, mask = _batch(TOKEN)
    logp = old.clone().requires_grad_(True)  # ratio pi / pi_old = 1: the surrogate is A per token
    adv = torch.tensor([1.0, -1.0])
    default, _ = grpo_loss(logp, old, roll, adv, mask, is_cap=5.0)
    explicit, _ = grpo_loss(logp, old, roll, adv, mask, is_cap=5.0, is_mode="token-truncate")
    assert torch.equal(default, explicit)
    off, st = grpo_loss(logp, old, roll, adv, mask, is_cap=5.0, is_mode=ISMode.OFF)
    assert float(off.detach()) == pytest.approx(-(3 * 1 - 2 * 1) / 5, rel=REL) and st["is_weight_mean"] == 1.0
    masked, _ = grpo_loss(logp, old, roll, adv, mask, is_cap=5.0, is_mode="token-mask")
    assert float(masked.detach()) == pytest.approx(-(2 - 2) / 5, abs=1e-7)


def test_bad_is_mode_and_cap_are_refused_by_name():
    with pytest.raises(ValueError, match="is_mode"):
        RLConfig(is_mode="sequence").validate()
    with pytest.raises(ValueError, match="is_cap"):
        RLConfig(is_mode="token-mask", is_cap=1.0).validate()
    with pytest.raises(ValueError, match="cap must be > 1"):
        importance_weights(*_batch(TOKEN), "sequence-mask", cap=0.5)


class _Threads(Reducer):
    """Simulated trainer processes in threads: ``sum`` is an all-reduce over them. Only one thread
    runs torch at a time (``turn``, released only while waiting in the all-reduce): the numerics'
    numba threading layer may not be entered from two threads at once."""

    def __init__(self, world: int) -> None:
        self.world_size = world
        self.turn = threading.Lock()
        self._barrier = threading.Barrier(world)
        self._slots: list[list[float] | None] = [None] * world
        self.rank = threading.local()

    def _wait(self) -> None:
        self.turn.release()
        self._barrier.wait()
        self.turn.acquire()

    def sum(self, values: list[float]) -> list[float]:
        self._slots[self.rank.r] = list(values)
        self._wait()
        out = [sum(col) for col in zip(*self._slots)]
        self._wait()  # nobody overwrites a slot before everyone has read it
        return out


MODEL = ModelSpec(hidden=32, layers=2, experts=4, top_k=2, moe_intermediate=32, heads=2, kv_heads=1)


@pytest.mark.parametrize("arm, is_mode, agg", [
    ("trace-full", "token-truncate", "token-mean"),
    ("qat", "sequence-mask", "seq-mean"),
    ("score-centering", "token-mask", "token-mean"),
])
def test_minibatch_loss_split_over_processes_equals_one(tmp_path, arm, is_mode, agg):
    """The update written once: each of two simulated processes computes ``minibatch_loss`` of its
    share with a reducer that sums over both; the shares' losses add up to the one-process loss, the
    shares' gradients to its gradient, and the statistics are the one-process statistics. Only the
    float32 summation order differs (a two-term split of each sum): rel=1e-5 covers it for sums of
    at most a few hundred terms (n * 2^-24), the statistics are float64 sums of the same terms; the BF16
    gradients are bounded where they are compared."""
    torch.manual_seed(0)
    cfg = RLConfig(steps=1, warm_start_steps=0, prompts_per_step=2, group_size=4, max_new_tokens=4,
                   updates_per_step=1, threads=1, model=MODEL, is_mode=is_mode, loss_agg=agg, sc_top_k=8)
    task = Reverse()
    tok = task.make_tokenizer()
    model = from_config(cfg.model.hf_config(tok), seed=0)
    a = make_arm(arm, guidance=cfg.guidance, n_layers=cfg.model.layers)
    s = ArmSetup(arm, a, model, task, tok, cfg, tmp_path / "store", model_signature(model, a.plan), None)
    b = collect(s, step=0, version=0)
    b.advantages = torch.tensor([1.0, -0.5] * (len(b.token_ids) // 2))
    (idx,) = minibatch_order(cfg, b.step, len(b.token_ids))

    def grads_of(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    one, one_st = minibatch_loss(model, a, cfg, select(b, idx))
    g_one = grads_of(one)
    red = _Threads(2)
    out: list = [None, None]

    def rank(r):
        red.rank.r = r
        with red.turn:
            out[r] = minibatch_loss(model, a, cfg, select(b, idx[r::2]), red)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    g_two = grads_of(out[0][0] + out[1][0])
    assert float(out[0][0] + out[1][0]) == pytest.approx(float(one), rel=1e-5, abs=1e-7)
    for k, v in one_st.items():
        assert out[0][1][k] == pytest.approx(v, rel=1e-5, abs=1e-9), k
        assert out[0][1][k] == out[1][1][k], k  # every process sees the same statistics
    # the gradients are BF16 (the model's dtype): each path rounds every partial sum of the backward to
    # 8 significant bits (2^-8 relative to the running value), in a different order; a few such
    # roundings apart, bounded by 2^-5 of the tensor's largest element
    for n, g in g_one.items():
        assert float((g_two[n].float() - g.float()).abs().max()) <= 2**-5 * float(g.float().abs().max()), n
