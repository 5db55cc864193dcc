"""Held-out evaluation: greedy decoding on the arm's serving path (BF16 or FP4 rollout engine).

The ``bf16`` arm is also evaluated post hoc in FP4, the policy unchanged: how a BF16-trained policy
fares when it is served quantized (``eval_accuracy_fp4``: vanilla NVFP4, ``PrecisionPlan()``;
``eval_accuracy_fp4_4over6``: NVFP4 with Four over Six block scales).
"""

from __future__ import annotations

import dataclasses

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutEngine
from tracefp4.rl import engine
from tracefp4.rl.arms import Arm
from tracefp4.rl.config import RLConfig
from tracefp4.rl.tasks import Task, Tokenizer

#: The post-hoc FP4 serving plans of a BF16-rollout arm's evaluation, by metric suffix.
POST_HOC_FP4 = {"fp4": PrecisionPlan(), "fp4_4over6": PrecisionPlan.four_over_six()}


def evaluate(serving: RolloutEngine, arm: Arm, task: Task, tok: Tokenizer, cfg: RLConfig) -> dict[str, float]:
    """Accuracy (reward 1) and mean reward over the task's first ``cfg.eval_size`` held-out examples;
    for a BF16-rollout arm also ``eval_accuracy_<suffix>`` under each :data:`POST_HOC_FP4` plan."""
    acc, reward = _greedy_scores(serving, arm, task, tok, cfg)
    out = {"eval_accuracy": acc, "eval_reward": reward}
    if arm.plan is None:
        for suffix, plan in POST_HOC_FP4.items():
            out[f"eval_accuracy_{suffix}"] = _greedy_scores(serving, dataclasses.replace(arm, plan=plan), task, tok, cfg)[0]
    return out


def _greedy_scores(serving: RolloutEngine, arm: Arm, task: Task, tok: Tokenizer, cfg: RLConfig
                   ) -> tuple[float, float]:
    examples = task.eval_set(cfg.eval_size)
    out = engine.greedy(serving, [tok.encode(e.prompt) for e in examples], arm, max_new_tokens=cfg.max_new_tokens,
                        stop_token_ids=(tok.EOS,))
    rewards = [task.reward(e, tok.decode(out.completion(b).tolist())) for b, e in enumerate(examples)]
    return sum(r == 1.0 for r in rewards) / len(rewards), sum(rewards) / len(rewards)
