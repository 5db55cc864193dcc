"""A short supervised fine-tuning before GRPO, so that every arm starts from a policy with
non-trivial reward (BF16 compute, FP32 master weights; shared by every arm)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from tracefp4.rl.config import RLConfig
from tracefp4.rl.optim import MasterWeightAdamW
from tracefp4.rl.tasks import Example, Task, Tokenizer
from tracefp4.seeds import Stream, derive


def encode_batch(tok: Tokenizer, examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, labels, attention mask) for supervised warm start: loss on answer + EOS."""
    seqs, plens = [], []
    for e in examples:
        p = tok.encode(e.prompt)
        seqs.append(p + tok.encode(e.answer, bos=False) + [tok.EOS])
        plens.append(len(p))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.PAD, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, p) in enumerate(zip(seqs, plens)):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        labels[i, p : len(s)] = torch.tensor(s[p:])
    return ids, labels, att


def warm_start(model: PreTrainedModel, task: Task, tok: Tokenizer, cfg: RLConfig, progress=None) -> list[float]:
    """``cfg.warm_start_steps`` steps of next-token loss on the task's answers; returns the losses."""
    opt = MasterWeightAdamW(model, lr=cfg.warm_start_lr, weight_decay=0.0, grad_clip=1.0)
    rng = random.Random(derive(cfg.seed, Stream.WARM_START))
    losses = []
    model.train()
    for _ in range(cfg.warm_start_steps):
        ids, labels, att = encode_batch(tok, task.sample(rng, cfg.warm_start_batch))
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses
