"""The tiny MoE the two-path tests share (test_rollout_trainer, test_ldpc_fallback, test_mod4): its config,
its ragged prompts and its sampler; test_model, test_trainer_api, test_record_versions and
test_segmented_attention build on the same config. Four layers, so the deeper half and the last layer differ; peaked
logits and routing (``initializer_range=0.1``, unlike the default 0.02), so the two paths' codes differ
where rounding decides and not everywhere."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig

from tracefp4.engines.protocol import SamplingParams

#: what every tiny test MoE shares, whatever its family (tests/test_model.py builds its Qwen2-MoE, OLMoE
#: and Mixtral from it too)
COMMON = dict(
    vocab_size=32,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=128,
    initializer_range=0.1,
)


def qwen3_config(**over: object) -> Qwen3MoeConfig:
    """The tiny Qwen3-MoE, with ``over`` in place of its fields."""
    return Qwen3MoeConfig(**{**COMMON, "moe_intermediate_size": 32, "head_dim": 16, "num_experts": 8, **over})


CONFIG = qwen3_config()


def ragged_prompts(seed: int, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    """Prompts of the given lengths, token ids in [2, 32), the one of length n seeded ``seed + n``."""
    return [torch.randint(2, 32, (n,), generator=torch.Generator().manual_seed(seed + n)) for n in lengths]


#: ragged on purpose: the paths must agree on which row is which trajectory
PROMPTS = ragged_prompts(10, (3, 7, 5, 9))
SAMPLING = SamplingParams(max_new_tokens=24, seed=0)
#: every layer of :data:`CONFIG`
ALL = frozenset(range(CONFIG.num_hidden_layers))
