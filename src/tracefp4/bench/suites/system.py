"""The cost of guidance, measured side by side: rollout with and without recording, the trainer's
forward+backward with TRACE guidance and with vanilla QAT, and the store's throughput.

Every pair is timed in interleaved rounds in one process, so machine noise hits both sides of a
round alike; each ratio is taken within a round and reported as the median over rounds with its
spread (min and max). The model and batch (:data:`SYSTEM_SPEC`) are sized so that each timed unit
takes a second or more on a 2-core CPU: at the demo model's size (a 66 ms train step, 16 new
tokens) scheduler noise alone is several percent, more than the 5-10% the targets are about.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time

import torch

from tracefp4.engines.model import TinyMoESpec, from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import generate
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.store import StoreReader, StoreWriter, seal_step
from tracefp4.rl.tasks import CharTokenizer
from tracefp4.engines.trainer import TrainerSpec, forward_logprobs
from tracefp4.reports.timing import time_rounds

#: The model of the guidance-cost benchmark: the demo's shape, twice as wide and with head_dim 32.
SYSTEM_SPEC = TinyMoESpec(hidden=128, layers=4, experts=8, top_k=2, moe_intermediate=128, heads=4, kv_heads=2,
                          head_dim=32)
#: Targets: recording at most 5% of a rollout, guided training at most 10% over vanilla QAT.
SYSTEM_TARGETS = {"rollout_record_over_plain": 1.05, "train_step_trace_over_qat": 1.10}


def _paired(samples: dict[str, list[float]], num: str, den: str) -> dict[str, float]:
    """Median and spread of the per-round ratio ``num / den`` (each round times both once)."""
    ratios = sorted(a / b for a, b in zip(samples[num], samples[den]))
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1], "rounds": len(ratios)}


def _time_store(records, prompt_lens, lengths, repeats: int) -> tuple[float, float]:
    """Median seconds to write and seal one step of ``records``, and to read them back."""
    writes, reads = [], []
    with tempfile.TemporaryDirectory() as root:
        ids = [f"t{b}" for b in range(len(records))]
        for step in range(repeats):
            t0 = time.perf_counter()
            with StoreWriter(root, step, "w0", model_signature="bench", policy_version=0) as w:
                for tid, rec, p in zip(ids, records, prompt_lens):
                    w.add(tid, rec, prompt_len=p)
            seal_step(root, step, ["w0"])
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with StoreReader(root, step, model_signature="bench", policy_version=0) as r:
                r.batch(ids, lengths)
            reads.append(time.perf_counter() - t0)
    return statistics.median(writes), statistics.median(reads)


def bench_system(batch: int = 64, new_tokens: int = 64, repeats: int = 5, seed: int = 0,
                 spec: TinyMoESpec = SYSTEM_SPEC) -> dict:
    tok = CharTokenizer()
    spec = dataclasses.replace(spec, vocab=max(spec.vocab, tok.vocab_size))
    model = from_config(spec.config(), seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, tok.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 9, (batch,), generator=g)]
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    plan = PrecisionPlan()

    lsb = GuidedMode.parse("lsb")

    def rollout(guidance):
        return lambda: generate(model, prompts, sampling, plan=plan, guidance=guidance)

    t_roll = time_rounds({"plain": rollout(None), "record": rollout(lsb)}, repeats)

    roll = generate(model, prompts, sampling, plan=plan, guidance=lsb)

    def train(mode):
        def step():
            out = forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records, TrainerSpec(mode, plan))
            torch.cat(out.logprobs).sum().backward()
            model.zero_grad(set_to_none=True)
        return step

    model.train()
    t_train = time_rounds({"qat": train("qat"), "trace": train("trace")}, repeats)
    model.eval()
    rec, trn = _paired(t_roll, "record", "plain"), _paired(t_train, "trace", "qat")
    med = {k: statistics.median(v) for k, v in {**t_roll, **{f"train_{k}": v for k, v in t_train.items()}}.items()}

    nbytes = sum(t.nbytes for rec in roll.records for t in rec.values())
    write_s, read_s = _time_store(roll.records, roll.prompt_lens, [t.numel() for t in roll.token_ids], repeats)
    mb = nbytes / 2**20
    return {
        "system_model": (f"Qwen3-MoE, {spec.layers} layers, hidden {spec.hidden}, {spec.experts} experts "
                         f"top-{spec.top_k}, expert dim {spec.moe_intermediate}"),
        "system_batch": batch,
        "system_new_tokens": new_tokens,
        "system_rounds": repeats,
        "rollout_plain_s": med["plain"],
        "rollout_record_s": med["record"],
        "rollout_record_over_plain": rec["median"],
        "rollout_record_over_plain_spread": [rec["min"], rec["max"]],
        "train_step_qat_s": med["train_qat"],
        "train_step_trace_s": med["train_trace"],
        "train_step_trace_over_qat": trn["median"],
        "train_step_trace_over_qat_spread": [trn["min"], trn["max"]],
        "store_record_mb": mb,
        "store_write_mb_s": mb / write_s,
        "store_read_mb_s": mb / read_s,
    }


def _ratio(res: dict, key: str) -> str:
    lo, hi = res.get(f"{key}_spread", (float("nan"),) * 2)
    bound = SYSTEM_TARGETS[key]
    ok = "ok" if res[key] <= bound else "MISSED"
    return f"   ratio {res[key]:.3f} [{lo:.3f}, {hi:.3f}] (target <= {bound}: {ok})"


def format_system(res: dict) -> str:
    return "\n".join([
        f"guidance cost on a {res['system_model']}, batch {res['system_batch']}, "
        f"{res['system_new_tokens']} new tokens (median of {res.get('system_rounds', '?')} interleaved rounds; "
        "ratios per round, median [min, max])",
        f"{'rollout, fp4 plain':<34}{res['rollout_plain_s'] * 1e3:>10.1f} ms",
        f"{'rollout, fp4 + lsb recording':<34}{res['rollout_record_s'] * 1e3:>10.1f} ms"
        + _ratio(res, "rollout_record_over_plain"),
        f"{'train fwd+bwd, vanilla QAT':<34}{res['train_step_qat_s'] * 1e3:>10.1f} ms",
        f"{'train fwd+bwd, TRACE guided':<34}{res['train_step_trace_s'] * 1e3:>10.1f} ms"
        + _ratio(res, "train_step_trace_over_qat"),
        f"{'store write / read':<34}{res['store_write_mb_s']:>10.1f} / {res['store_read_mb_s']:.1f} MB/s"
        f"   ({res['store_record_mb']:.2f} MB of records per batch)",
    ])
