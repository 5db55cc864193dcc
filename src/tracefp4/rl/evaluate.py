"""Held-out evaluation: greedy decoding on the arm's serving path (BF16 or FP4 rollout engine)."""

from __future__ import annotations

from transformers import PreTrainedModel

from tracefp4.rl import engine
from tracefp4.rl.arms import Arm
from tracefp4.rl.config import RLConfig
from tracefp4.rl.tasks import Task, Tokenizer


def evaluate(model: PreTrainedModel, arm: Arm, task: Task, tok: Tokenizer, cfg: RLConfig) -> dict[str, float]:
    """Accuracy (reward 1) and mean reward over the task's first ``cfg.eval_size`` held-out examples."""
    examples = task.eval_set(cfg.eval_size)
    out = engine.greedy(model, [tok.encode(e.prompt) for e in examples], arm, max_new_tokens=cfg.max_new_tokens,
                        stop_token_ids=(tok.EOS,))
    rewards = [task.reward(e, tok.decode(out.completion(b).tolist())) for b, e in enumerate(examples)]
    return {
        "eval_accuracy": sum(r == 1.0 for r in rewards) / len(rewards),
        "eval_reward": sum(rewards) / len(rewards),
    }
