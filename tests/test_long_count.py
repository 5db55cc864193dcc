"""The long-output task of issue 49 (``long-count``): answer length, graded credit, held-out set."""

from __future__ import annotations

import random
import statistics

import pytest

from tracefp4.rl.config import RLConfig
from tracefp4.rl.tasks import Example, LongCount, make_task


def _prefix_corrupt(ex: Example, task: LongCount, good_terms: int) -> str:
    """The answer with every term from index ``good_terms`` on replaced by a wrong one of the same width,
    off by 1 and 2 in turn so that no wrong term follows the rule from its own previous one either."""
    terms = ex.answer[:-1].split(task.sep)
    bad = [f"{(int(t) + 1 + i % 2) % 10**task.digits:0{task.digits}d}" for i, t in enumerate(terms[good_terms:])]
    return task.sep.join(terms[:good_terms] + bad) + task.sep


def test_answers_are_long_and_exact():
    t = make_task("long-count")
    assert isinstance(t, LongCount)
    lengths = [len(t.make_tokenizer().encode(e.answer, bos=False)) for e in t.eval_set(128)]
    assert statistics.mean(lengths) >= 512  # issue 49: a mean completion of at least 512 tokens
    assert all(n == t.answer_tokens == 520 for n in lengths)
    ex = LongCount(terms=4)._example(998, 3)
    assert ex == Example("A998+003=", "001,004,007,010,")  # wraps modulo 1000


def test_reward_one_for_reference_zero_for_garbage():
    t = LongCount()
    for ex in t.eval_set(16):
        assert t.reward(ex, ex.answer) == 1.0
        assert t.reward(ex, ex.answer + " ") == 1.0  # surrounding space is not scored
        assert t.reward(ex, "") == 0.0
        assert t.reward(ex, "?" * 520) == 0.0
        assert t.reward(ex, ",,,,") == 0.0
        assert t.reward(ex, ex.answer + "123,") < 1.0  # an extra term is paid for


@pytest.mark.parametrize("credit", ["answer", "rule"])
def test_credit_is_monotone_in_the_correct_prefix(credit):
    t = LongCount(credit=credit)
    ex = t.eval_set(1)[0]
    rewards = [t.reward(ex, _prefix_corrupt(ex, t, k)) for k in range(0, t.terms + 1, 10)]
    assert rewards == sorted(rewards) and rewards[-1] == 1.0
    assert len(set(rewards)) == len(rewards)  # strictly: every 10 more correct terms earn more
    # a correct prefix of k terms and nothing after it earns k / terms
    assert t.reward(ex, ex.answer[: 4 * 65]) == pytest.approx(65 / 130)


def test_answer_credit_vs_rule_credit_after_one_slip():
    ex = LongCount(terms=4)._example(91, 4)  # 095,099,103,107,
    assert LongCount(terms=4).reward(ex, "095,100,104,108,") == 1 / 4  # off the answer's chain after the slip
    assert LongCount(terms=4, credit="rule").reward(ex, "095,100,104,108,") == 3 / 4  # one term lost
    assert LongCount(terms=4).reward(ex, "095,99,103,107,") == 3 / 4  # a dropped digit costs its own term
    assert LongCount(terms=4, credit="rule").reward(ex, "095,99,103,107,") == 1 / 4  # malformed: chain ends


def test_held_out_disjoint_and_deterministic():
    t = LongCount()
    held = t.eval_set(128)
    assert len(set(held)) == 128 and t.eval_set(128) == held
    train = t.sample(random.Random(0), 4000)
    assert {e.prompt for e in train}.isdisjoint({e.prompt for e in held})
    assert t.sample(random.Random(7), 50) == t.sample(random.Random(7), 50)
    assert all(1 <= int(e.prompt[5:8]) <= 9 for e in train)  # one-digit steps by default
    tok = t.make_tokenizer()
    ex = held[0]
    assert tok.decode(tok.encode(ex.prompt + ex.answer)) == ex.prompt + ex.answer


def test_validation_and_model_sizing():
    with pytest.raises(ValueError, match="sep must be"):
        LongCount(sep="5")
    with pytest.raises(ValueError, match="terms must be"):
        LongCount(terms=0)
    with pytest.raises(ValueError, match="credit must be"):
        LongCount(credit="sum")
    # the run config's model must hold prompt + answer + end token: 1 + 9 + 520 + 1 positions
    t = LongCount()
    ex = t.eval_set(1)[0]
    assert len(t.make_tokenizer().encode(ex.prompt + ex.answer)) + 1 == 531


def test_long_output_experiment_config_loads_and_fits_the_task():
    """configs/experiment-long-output.toml (issue 49's matrix) validates, and its model and limits hold
    the task's answers: max_new_tokens past the answer and its end token, positions past prompt + that."""
    from pathlib import Path

    from tracefp4.rl.experiment import ExperimentConfig

    path = Path(__file__).resolve().parents[1] / "configs" / "experiment-long-output.toml"
    cfg = ExperimentConfig.from_file(str(path))
    assert len(cfg.seeds) == 3
    run = cfg.run_config(cfg.seeds[0])
    assert set(run.arms) == {"bf16", "fp4-rollout", "qat", "trace", "trace-full"}
    assert run.steps >= 200 and run.model.layers >= 8 and run.is_mode == "token-truncate"
    task = make_task(run.task, **run.task_kwargs)
    assert task.answer_tokens >= 512 and run.max_new_tokens >= task.answer_tokens + 1
    tok = task.make_tokenizer()
    longest_prompt = max(len(tok.encode(e.prompt)) for e in task.eval_set(run.eval_size))
    assert run.model.max_positions >= longest_prompt + run.max_new_tokens
    assert run.model.vocab >= tok.vocab_size


def test_experiment_help_shows_one_job(capsys):
    from tracefp4.cli import main

    with pytest.raises(SystemExit):
        main(["experiment", "--help"])
    assert "SEED:JOB" in capsys.readouterr().out
