"""The supervised warm start's answer prefixes (tracefp4.rl.warm_start): what a prefix labels, the loss
over whole answers and prefixes together, and that a run without prefixes draws what it always did."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from tracefp4.engines.model import from_config
from tracefp4.rl.config import ModelSpec, RLConfig
from tracefp4.rl.tasks import Example, make_task
from tracefp4.rl.warm_start import encode_batch, prefix_batch, warm_start
from tracefp4.seeds import Stream, derive

torch.set_num_threads(1)

TASK = make_task("long-count", terms=12)
TOK = TASK.make_tokenizer()


def test_a_prefix_labels_its_first_answer_tokens_and_no_end_token() -> None:
    ex = [Example("A441+003=", "444,447,450,"), Example("A998+002=", "000,002,004,")]
    ids, labels, att = encode_batch(TOK, ex, [5, 12])
    p = len(TOK.encode("A441+003="))
    assert TOK.decode(ids[0, p: p + 5].tolist()) == "444,4" and int(att[0].sum()) == p + 5
    assert torch.equal(labels[0, p: p + 5], ids[0, p: p + 5]) and bool((labels[0, :p] == -100).all())
    assert bool((labels[0, p + 5:] == -100).all())  # padding: the row is 5 shorter than the other
    assert TOK.EOS not in labels[1].tolist()
    whole_ids, whole_labels, _ = encode_batch(TOK, ex)
    assert whole_labels[1, p + 12] == TOK.EOS  # a whole answer ends with its end token, labelled
    with pytest.raises(ValueError, match="example 0's prefix of 13 tokens is not within its answer of 12"):
        encode_batch(TOK, ex, [13, 1])
    with pytest.raises(ValueError, match="1 prefix lengths for 2 examples"):
        encode_batch(TOK, ex, [3])


def test_prefix_batch_cuts_each_fresh_example_within_the_limit() -> None:
    rng = random.Random(0)
    ids, labels, att = prefix_batch(TOK, TASK, rng, 64, 20)
    counts = (labels != -100).sum(1)
    assert int(counts.min()) == 1 and int(counts.max()) == 20 and len(set(counts.tolist())) > 10
    assert TOK.EOS not in labels.flatten().tolist()


def test_the_loss_is_the_mean_over_every_labelled_token_of_both_batches() -> None:
    """``num_items_in_batch``: transformers' causal-LM loss sums the token losses and divides by it, so
    the two batches' losses add up to the mean over both; checked against that sum computed here from
    the model's own logits in the loss's own layout (the same float32 reductions, equal bits)."""
    spec = ModelSpec(hidden=32, layers=2, experts=4, top_k=2, moe_intermediate=32, head_dim=32, max_positions=64)
    model = from_config(spec.hf_config(TOK), dtype=torch.bfloat16, seed=0)
    rng = random.Random(1)
    whole = encode_batch(TOK, TASK.sample(rng, 3))
    pre = prefix_batch(TOK, TASK, rng, 5, 16)
    total = sum(int((lab[:, 1:] != -100).sum()) for _, lab, _ in (whole, pre))
    with torch.no_grad():
        for ids, labels, att in (whole, pre):
            got = model(input_ids=ids, attention_mask=att, labels=labels, num_items_in_batch=total).loss
            logits = model(input_ids=ids, attention_mask=att).logits.float()
            shifted = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
            want = nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), shifted.reshape(-1),
                                               ignore_index=-100, reduction="sum") / total
            assert torch.equal(got, want)


def _cfg(**kw) -> RLConfig:
    return RLConfig.from_dict({"task": "long-count", "task_kwargs": {"terms": 12}, "warm_start_steps": 2,
                               "warm_start_batch": 2, "warm_start_lr": 1e-3,
                               "model": {"hidden": 32, "layers": 2, "experts": 4, "top_k": 2, "moe_intermediate": 32,
                                         "head_dim": 32, "max_positions": 64}, **kw})


def test_prefixes_are_drawn_after_the_whole_answers(monkeypatch) -> None:
    """Each step draws its whole answers first, then its prefixes, from the warm start's one stream: the
    whole answers of step 1 are the same with or without prefixes, and without prefixes a run draws
    exactly the whole answers it drew before prefixes existed."""
    drawn: dict[int, list[list[str]]] = {0: [], 4: []}
    for n in drawn:
        cfg = _cfg(warm_start_prefixes=n, warm_start_prefix_tokens=8)
        model = from_config(cfg.model.hf_config(TOK), dtype=torch.bfloat16, seed=0)
        real = TASK.sample
        monkeypatch.setattr(TASK, "sample", lambda rng, k, n=n: (out := real(rng, k),
                                                                  drawn[n].append([e.prompt for e in out]))[0])
        losses = warm_start(model, TASK, TOK, cfg)
        monkeypatch.undo()
        assert len(losses) == 2 and all(loss > 0 for loss in losses)
    rng = random.Random(derive(0, Stream.WARM_START))
    assert drawn[0] == [[e.prompt for e in TASK.sample(rng, 2)] for _ in range(2)]
    assert drawn[4][0] == drawn[0][0] and [len(d) for d in drawn[4]] == [2, 4, 2, 4]


def test_the_config_refuses_a_negative_prefix_count() -> None:
    with pytest.raises(ValueError, match="warm_start_prefixes"):
        _cfg(warm_start_prefixes=-1)
    with pytest.raises(ValueError, match="warm_start_prefix_tokens"):
        _cfg(warm_start_prefix_tokens=0)
