"""TRACE inside TRL's GRPOTrainer on a dense model (a tiny Qwen3): records without routing, the guided
forward on TRL's padded rows reproducing every FP4 code the rollout picked."""

from __future__ import annotations

import os
import random

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (make setup installs trl==1.16.0)")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402

from tracefp4.engines.model import from_config, model_layers, model_state, tiny_dense_config  # noqa: E402
from tracefp4.integrations.trl import TraceGRPOConfig, TraceGRPOTrainer  # noqa: E402
from tracefp4.pipeline.metrics import Name, trl_name  # noqa: E402
from tracefp4.rl.tasks import Example, Reverse, hf_tokenizer  # noqa: E402

torch.set_num_threads(1)

TASK = Reverse(min_len=3, max_len=5)
TOK = TASK.make_tokenizer()


def reward(completions, answer, **_):
    return [TASK.reward(Example("", a), c) for c, a in zip(completions, answer)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl-dense")
    cfg = tiny_dense_config(layers=2, hidden=32, intermediate=64, heads=2, kv_heads=1, head_dim=32, vocab=32,
                            init_std=0.1, max_positions=128, pad_token_id=TOK.PAD, bos_token_id=TOK.BOS,
                            eos_token_id=TOK.EOS)
    model = from_config(cfg, seed=0)
    model.generation_config.eos_token_id = TOK.EOS
    model.save_pretrained(path)
    hf_tokenizer(TOK).save_pretrained(path)
    return path


def test_trace_full_reproduces_every_rollout_code_on_a_dense_model(folder, tmp_path) -> None:
    ex = TASK.sample(random.Random(0), 64)
    data = Dataset.from_dict({"prompt": [e.prompt for e in ex], "answer": [e.answer for e in ex]})
    args = TraceGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                           num_generations=4, max_completion_length=5, learning_rate=1e-3, logging_steps=1,
                           report_to=[], save_strategy="no", use_cpu=True, seed=0, trace_mode="trace",
                           trace_guidance="full@all")
    trainer = TraceGRPOTrainer(str(folder), reward, args=args, train_dataset=data, processing_class=hf_tokenizer(TOK))
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
