"""TRACE inside TRL's GRPOTrainer on a dense model (a tiny Qwen3): records without routing, the guided
forward on TRL's padded rows reproducing every FP4 code the rollout picked."""

from __future__ import annotations

import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (make setup installs trl==1.16.0)")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl_tiny import TOK, prompts, reward, run_args, save_model  # noqa: E402

from tracefp4.engines.model import model_layers, model_state, tiny_dense_config  # noqa: E402
from tracefp4.integrations.trl import TraceGRPOConfig, TraceGRPOTrainer  # noqa: E402
from tracefp4.pipeline.metrics import Name, trl_name  # noqa: E402
from tracefp4.rl.tasks import hf_tokenizer  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = tiny_dense_config(layers=2, hidden=32, intermediate=64, heads=2, kv_heads=1, head_dim=32, vocab=32,
                            init_std=0.1, max_positions=128, pad_token_id=TOK.PAD, bos_token_id=TOK.BOS,
                            eos_token_id=TOK.EOS)
    return save_model(cfg, tmp_path_factory.mktemp("trl-dense"))


def test_trace_full_reproduces_every_rollout_code_on_a_dense_model(folder, tmp_path) -> None:
    args = TraceGRPOConfig(**run_args(tmp_path, max_steps=2, trace_mode="trace", trace_guidance="full@all"))
    trainer = TraceGRPOTrainer(str(folder), reward, args=args, train_dataset=prompts(64),
                               processing_class=hf_tokenizer(TOK))
    try:
        trainer.train()
    finally:
        trainer.close()
    assert model_layers(trainer.model) == (2, ()) and model_state(trainer.model).dense_layers == (0, 1)
    logs = trainer.state.log_history
    # two generations, the second after an optimizer step: every code of every site reproduced
    codes, nbytes = trl_name(Name.CODE_MISMATCH), trl_name(Name.GUIDANCE_BYTES)
    assert [r[codes] for r in logs if codes in r] == [0.0, 0.0]
    assert all(r[nbytes] > 0 for r in logs if nbytes in r)
