"""A short supervised fine-tuning before GRPO, so that every arm starts from a policy with
non-trivial reward (BF16 compute, FP32 master weights; shared by every arm).

Answer prefixes (``warm_start_prefixes``): besides ``warm_start_batch`` whole answers, each step may
train on that many answer *prefixes*: the first k answer tokens of a fresh example, k uniform in
``1..warm_start_prefix_tokens``, with no end token (the answer goes on; the model must not learn to
stop there). The loss is the mean over every labelled token of both batches. Why: in a long answer
whose later tokens can be read off earlier ones, the teacher-forced loss is dominated by tokens a
shortcut predicts, and the first tokens, which must follow the task's rule, are a sliver of it. The
long-count task (130 terms) shows it: a model that copies the term ten back (its units digit repeats
with period ten) reaches a loss of 0.07 while getting its first ten terms wrong 20-48% of the time
under teacher forcing, and greedy decoding, which starts from those terms, earns almost nothing
(docs/dev/journal/2026-12-08-long-output.md). Prefixes cost a few dozen tokens each, where a whole
answer costs hundreds, and put the loss where the greedy chain starts. The prefixes are drawn after
the step's whole answers, from the same stream: with none, a run draws exactly what it did before.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from tracefp4.rl.config import RLConfig
from tracefp4.rl.optim import MasterWeightAdamW
from tracefp4.rl.tasks import Example, Task, Tokenizer
from tracefp4.seeds import Stream, derive


def encode_batch(tok: Tokenizer, examples: Sequence[Example], prefix_tokens: Sequence[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, labels, attention mask) for supervised warm start: loss on answer + EOS.
    ``prefix_tokens[i]`` (optional): example i is only its prompt and the first ``prefix_tokens[i]``
    answer tokens, labelled, without the end token."""
    if prefix_tokens is not None and len(prefix_tokens) != len(examples):
        raise ValueError(f"encode_batch: {len(prefix_tokens)} prefix lengths for {len(examples)} examples")
    seqs, plens = [], []
    for i, e in enumerate(examples):
        p = tok.encode(e.prompt)
        answer = tok.encode(e.answer, bos=False)
        if prefix_tokens is None:
            answer = answer + [tok.EOS]
        elif not 1 <= prefix_tokens[i] <= len(answer):
            raise ValueError(f"encode_batch: example {i}'s prefix of {prefix_tokens[i]} tokens is not within its "
                             f"answer of {len(answer)}")
        else:
            answer = answer[: prefix_tokens[i]]
        seqs.append(p + answer)
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


def prefix_batch(tok: Tokenizer, task: Task, rng: random.Random, n: int, max_tokens: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` answer prefixes (module docstring): fresh examples, each cut to k answer tokens, k uniform
    in ``1..min(max_tokens, its answer's length)``."""
    examples = task.sample(rng, n)
    cuts = [rng.randint(1, min(max_tokens, len(tok.encode(e.answer, bos=False)))) for e in examples]
    return encode_batch(tok, examples, cuts)


def _labelled(labels: torch.Tensor) -> int:
    """Tokens a causal LM's loss counts: labels after the first position (it shifts by one) not -100."""
    return int((labels[:, 1:] != -100).sum())


def warm_start(model: PreTrainedModel, task: Task, tok: Tokenizer, cfg: RLConfig, progress=None) -> list[float]:
    """``cfg.warm_start_steps`` steps of next-token loss on the task's answers (and answer prefixes,
    ``cfg.warm_start_prefixes``); returns the losses."""
    opt = MasterWeightAdamW(model, lr=cfg.warm_start_lr, weight_decay=0.0, grad_clip=1.0)
    rng = random.Random(derive(cfg.seed, Stream.WARM_START))
    losses = []
    model.train()
    for _ in range(cfg.warm_start_steps):
        ids, labels, att = encode_batch(tok, task.sample(rng, cfg.warm_start_batch))
        if cfg.warm_start_prefixes:
            batches = [(ids, labels, att),
                       prefix_batch(tok, task, rng, cfg.warm_start_prefixes, cfg.warm_start_prefix_tokens)]
            total = sum(_labelled(b[1]) for b in batches)
            # each batch padded to its own width (a prefix costs its own tokens, not a whole answer's);
            # summed over tokens and divided by both batches' count: the mean over every labelled token
            loss = sum(model(input_ids=i, attention_mask=a, labels=lab, num_items_in_batch=total).loss
                       for i, lab, a in batches)
        else:
            loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses
