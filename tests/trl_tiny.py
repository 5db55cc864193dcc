"""The tiny GRPO setup the TRL integration tests share (test_trl, test_trl_async, test_trl_dense): the
reverse task and its tokenizer, its reward in TRL's signature, a prompt dataset, a tiny model saved
with the tokenizer, and the arguments of a short CPU run. Import it after ``pytest.importorskip("trl")``
(it imports ``datasets``, which TRL brings)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from datasets import Dataset

from tracefp4.engines.model import from_config, tiny_config
from tracefp4.rl.tasks import Example, Reverse, hf_tokenizer

TASK = Reverse(min_len=3, max_len=5)
TOK = TASK.make_tokenizer()


def reward(completions, answer, **_):
    """The task's reward of each completion against its prompt's answer (TRL's reward signature)."""
    return [TASK.reward(Example("", a), c) for c, a in zip(completions, answer)]


def prompts(n: int) -> Dataset:
    """``n`` task prompts with their answers (seed 0), as TRL's trainers take a dataset."""
    ex = TASK.sample(random.Random(0), n)
    return Dataset.from_dict({"prompt": [e.prompt for e in ex], "answer": [e.answer for e in ex]})


def moe_config(layers: int):
    """A tiny Qwen3-MoE of ``layers`` layers with the tokenizer's special ids (head_dim 32: vLLM's CPU
    attention needs it)."""
    return tiny_config(layers=layers, experts=4, top_k=2, hidden=32, moe_intermediate=32, heads=2, kv_heads=1,
                       head_dim=32, vocab=32, init_std=0.1, max_positions=128, norm_topk_prob=True,
                       pad_token_id=TOK.PAD, bos_token_id=TOK.BOS, eos_token_id=TOK.EOS)


def save_model(config, path: Path) -> Path:
    """The model of ``config`` (seed 0), generating up to the tokenizer's EOS, saved at ``path`` with the
    tokenizer: a folder TRL's trainers load by name."""
    model = from_config(config, seed=0)
    model.generation_config.eos_token_id = TOK.EOS
    model.save_pretrained(path)
    hf_tokenizer(TOK).save_pretrained(path)
    return path


def run_args(tmp_path: Path, **over: Any) -> dict[str, Any]:
    """The arguments of a short GRPO run on CPU (4 prompts of 4 generations of at most 5 tokens a step,
    a log row a step, nothing saved), writing under ``tmp_path``; ``over`` in place of any."""
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=5, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                use_cpu=True, seed=0)
    return {**base, **over}
