"""The tiny GRPO run the loop, config and arm tests share: its config and one arm's setup."""

from __future__ import annotations

from tracefp4.engines.model import from_config
from tracefp4.pipeline.arms import make_arm
from tracefp4.pipeline.steps import model_signature
from tracefp4.rl.collect import ArmSetup
from tracefp4.rl.config import ModelSpec, RLConfig
from tracefp4.rl.tasks import Reverse

TINY = dict(
    steps=2, warm_start_steps=3, prompts_per_step=2, group_size=2, max_new_tokens=4, eval_every=1,
    eval_size=4, updates_per_step=2, threads=3,
    model=ModelSpec(hidden=32, layers=2, experts=4, top_k=2, moe_intermediate=32, heads=2, kv_heads=1),
)

#: The ``[run]`` table of the tiny experiment files the experiment and seed-record tests write.
EXPERIMENT_RUN = """
[run]
arms = ["bf16", "trace"]
steps = 1
prompts_per_step = 2
group_size = 2
max_new_tokens = 3
warm_start_steps = 1
warm_start_batch = 4
eval_every = 1
eval_size = 4
threads = 1
[run.model]
hidden = 32
layers = 2
moe_intermediate = 16
"""


def setup_arm(tmp_path, arm: str, guidance: str = "lsb") -> ArmSetup:
    cfg = RLConfig(**{**TINY, "guidance": guidance})
    task = Reverse()
    tok = task.make_tokenizer()
    model = from_config(cfg.model.hf_config(tok), seed=0)
    a = make_arm(arm, guidance=cfg.guidance, n_layers=cfg.model.layers)
    return ArmSetup(arm, a, model, task, tok, cfg, tmp_path / "store", model_signature(model, a.plan), None)

