"""The tiny MoE the two-path tests share (test_rollout_trainer, test_ldpc_fallback, test_mod4): its config,
its ragged prompts and its sampler. Four layers, so the deeper half and the last layer differ; peaked
logits and routing (``initializer_range=0.1``, unlike the default 0.02), so the two paths' codes differ
where rounding decides and not everywhere."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig

from tracefp4.engines.protocol import SamplingParams

CONFIG = Qwen3MoeConfig(
    vocab_size=32,
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=128,
    initializer_range=0.1,
)
#: ragged on purpose: the paths must agree on which row is which trajectory
PROMPTS = [torch.randint(2, 32, (n,), generator=torch.Generator().manual_seed(10 + n)) for n in (3, 7, 5, 9)]
SAMPLING = SamplingParams(max_new_tokens=24, seed=0)
#: every layer of :data:`CONFIG`
ALL = frozenset(range(CONFIG.num_hidden_layers))
