"""The cost of guidance on the tiny MoE, measured side by side: rollout with and without recording,
the trainer's forward+backward with TRACE guidance and with vanilla QAT, and the store's throughput.

Every pair is timed in interleaved rounds in one process (median), so machine noise hits both sides.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from tracefp4.engines.model import from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import generate
from tracefp4.guidance.compact import GuidedMode
from tracefp4.rl.config import ModelSpec
from tracefp4.guidance.store import StoreReader, StoreWriter, seal_step
from tracefp4.rl.tasks import CharTokenizer
from tracefp4.engines.trainer import forward_logprobs
from tracefp4.reports.timing import median_times


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


def bench_system(batch: int = 32, new_tokens: int = 16, repeats: int = 5, seed: int = 0) -> dict:
    tok = CharTokenizer()
    model = from_config(ModelSpec().hf_config(tok), seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, tok.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 9, (batch,), generator=g)]
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    plan = PrecisionPlan()

    lsb = GuidedMode.parse("lsb")

    def rollout(guidance):
        return lambda: generate(model, prompts, sampling, plan=plan, guidance=guidance)

    t_roll = median_times({"plain": rollout(None), "record": rollout(lsb)}, repeats)

    roll = generate(model, prompts, sampling, plan=plan, guidance=lsb)

    def train(mode):
        def step():
            out = forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records, mode=mode, plan=plan)
            torch.cat(out.logprobs).sum().backward()
            model.zero_grad(set_to_none=True)
        return step

    model.train()
    t_train = median_times({"qat": train("qat"), "trace": train("trace")}, repeats)
    model.eval()

    nbytes = sum(t.nbytes for rec in roll.records for t in rec.values())
    write_s, read_s = _time_store(roll.records, roll.prompt_lens, [t.numel() for t in roll.token_ids], repeats)
    mb = nbytes / 2**20
    return {
        "system_model": "tiny Qwen3-MoE (demo model: 4 layers, hidden 64, 8 experts top-2)",
        "system_batch": batch,
        "system_new_tokens": new_tokens,
        "rollout_plain_s": t_roll["plain"],
        "rollout_record_s": t_roll["record"],
        "rollout_record_over_plain": t_roll["record"] / t_roll["plain"],
        "train_step_qat_s": t_train["qat"],
        "train_step_trace_s": t_train["trace"],
        "train_step_trace_over_qat": t_train["trace"] / t_train["qat"],
        "store_record_mb": mb,
        "store_write_mb_s": mb / write_s,
        "store_read_mb_s": mb / read_s,
    }


def format_system(res: dict) -> str:
    return "\n".join([
        f"guidance cost on the {res['system_model']}, batch {res['system_batch']}, "
        f"{res['system_new_tokens']} new tokens (median of interleaved rounds)",
        f"{'rollout, fp4 plain':<34}{res['rollout_plain_s'] * 1e3:>10.1f} ms",
        f"{'rollout, fp4 + lsb recording':<34}{res['rollout_record_s'] * 1e3:>10.1f} ms"
        f"   ratio {res['rollout_record_over_plain']:.3f} (target <= 1.05)",
        f"{'train fwd+bwd, vanilla QAT':<34}{res['train_step_qat_s'] * 1e3:>10.1f} ms",
        f"{'train fwd+bwd, TRACE guided':<34}{res['train_step_trace_s'] * 1e3:>10.1f} ms"
        f"   ratio {res['train_step_trace_over_qat']:.3f} (target <= 1.10)",
        f"{'store write / read':<34}{res['store_write_mb_s']:>10.1f} / {res['store_read_mb_s']:.1f} MB/s"
        f"   ({res['store_record_mb']:.2f} MB of records per batch)",
    ])
