"""Held-out evaluation: greedy decoding on the arm's serving path (BF16 or FP4 rollout engine).

The ``bf16`` arm is also evaluated post hoc in FP4, the policy unchanged: how a BF16-trained policy
fares when it is served quantized (``eval_accuracy_fp4``: vanilla NVFP4, ``PrecisionPlan()``;
``eval_accuracy_fp4_4over6``: NVFP4 with Four over Six block scales).
"""

from __future__ import annotations

import dataclasses

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutEngine
from tracefp4.pipeline import steps
from tracefp4.pipeline.arms import Arm
from tracefp4.rl.config import RLConfig
from tracefp4.rl.tasks import Task, Tokenizer

#: The plans (:meth:`PrecisionPlan.named`) a BF16-rollout arm's policy is also evaluated under, served in
#: FP4 after the fact (``eval_accuracy_fp4``, ``eval_accuracy_fp4_4over6``: :func:`post_hoc_metric`).
POST_HOC_PLANS = ("nvfp4", "4over6")


def post_hoc_metric(plan_name: str) -> str:
    """The evaluation metric of a BF16 policy served under plan ``plan_name`` after the fact."""
    return "eval_accuracy_fp4" if plan_name == "nvfp4" else f"eval_accuracy_fp4_{plan_name}"


def evaluate(serving: RolloutEngine, arm: Arm, task: Task, tok: Tokenizer, cfg: RLConfig) -> dict[str, float]:
    """Accuracy (reward 1) and mean reward over the task's first ``cfg.eval_size`` held-out examples;
    for a BF16-rollout arm also the accuracy under each of :data:`POST_HOC_PLANS` (:func:`post_hoc_metric`)."""
    acc, reward = _greedy_scores(serving, arm, task, tok, cfg)
    out = {"eval_accuracy": acc, "eval_reward": reward}
    if arm.plan is None:
        for name in POST_HOC_PLANS:
            plan = PrecisionPlan.named(name)
            out[post_hoc_metric(name)] = _greedy_scores(serving, dataclasses.replace(arm, plan=plan), task, tok, cfg)[0]
    return out


def _greedy_scores(serving: RolloutEngine, arm: Arm, task: Task, tok: Tokenizer, cfg: RLConfig
                   ) -> tuple[float, float]:
    examples = task.eval_set(cfg.eval_size)
    out = steps.greedy(serving, [tok.encode(e.prompt) for e in examples], arm, max_new_tokens=cfg.max_new_tokens,
                        stop_token_ids=(tok.EOS,))
    rewards = [task.reward(e, tok.decode(out.completion(b).tolist())) for b, e in enumerate(examples)]
    return sum(r == 1.0 for r in rewards) / len(rewards), sum(rewards) / len(rewards)
