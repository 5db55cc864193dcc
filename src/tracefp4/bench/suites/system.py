"""The system suite: the cost of guidance, measured side by side: rollout with and without recording, the trainer's
forward+backward with TRACE guidance and with vanilla QAT, and the store's throughput.

Every pair is timed in interleaved rounds in one process, so machine noise hits both sides of a
round alike; each ratio is taken within a round and reported as the median over rounds with its
spread (min and max). The model and batch (:data:`SYSTEM_SPEC`) are sized so that each timed unit
takes a second or more on a 2-core CPU: at the demo model's size (a 66 ms train step, 16 new
tokens) scheduler noise alone is several percent, more than the 5-10% the targets are about.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import tempfile
import time

import torch

from tracefp4.bench.harness import Spread, median, paired, time_rounds
from tracefp4.bench.result import Record, Run, verdict
from tracefp4.bench.targets import judged

from tracefp4.engines.model import TinyMoESpec, from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import generate
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.store import StoreReader, StoreWriter, seal_step
from tracefp4.rl.tasks import CharTokenizer
from tracefp4.engines.trainer import TrainerSpec, forward_logprobs
from tracefp4.provenance import environment

#: The model of the guidance-cost benchmark: the demo's shape, twice as wide and with head_dim 32.
SYSTEM_SPEC = TinyMoESpec(hidden=128, layers=4, experts=8, top_k=2, moe_intermediate=128, heads=4, kv_heads=2,
                          head_dim=32)
def _time_store(records, prompt_lens, lengths, repeats: int) -> tuple[float, float]:
    """Median seconds to write and seal one step of ``records``, and to read them back."""
    writes, reads = [], []
    with tempfile.TemporaryDirectory() as root:
        ids = [f"t{b}" for b in range(len(records))]
        for step in range(repeats):
            t0 = time.perf_counter()
            with StoreWriter(root, step, "w0", model_signature="bench", policy_version=0, contract="bench") as w:
                for tid, rec, p in zip(ids, records, prompt_lens):
                    w.add(tid, rec, prompt_len=p)
            seal_step(root, step, ["w0"])
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with StoreReader(root, step, model_signature="bench", policy_version=0) as r:
                r.batch(ids, lengths)
            reads.append(time.perf_counter() - t0)
    return median(writes), median(reads)


def bench_system(batch: int = 64, new_tokens: int = 64, repeats: int = 5, seed: int = 0,
                 spec: TinyMoESpec = SYSTEM_SPEC) -> Run:
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
    nbytes = sum(t.nbytes for rec in roll.records for t in rec.values())
    write_s, read_s = _time_store(roll.records, roll.prompt_lens, [t.numel() for t in roll.token_ids], repeats)
    mb = nbytes / 2**20
    env = environment()
    shape = {"batch": batch, "new_tokens": new_tokens}
    rec = functools.partial(Record, "system", shape=shape, machine=env.get("cpu_model", ""))
    records = []
    for metric, samples in (("rollout_plain_s", t_roll["plain"]), ("rollout_record_s", t_roll["record"]),
                            ("train_step_qat_s", t_train["qat"]), ("train_step_trace_s", t_train["trace"])):
        t = Spread.of(samples)
        records.append(rec(metric, t.median, "s", spread=t.span))
    for metric, r in (("rollout_record_over_plain", paired(t_roll, "record", "plain")),
                      ("train_step_trace_over_qat", paired(t_train, "trace", "qat"))):
        records.append(rec(metric, r.median, "x", spread=r.span))
    records += [rec("store_record_mb", mb, "MB"), rec("store_write_mb_s", mb / write_s, "MB/s"),
                rec("store_read_mb_s", mb / read_s, "MB/s")]
    config = {"system_model": (f"Qwen3-MoE, {spec.layers} layers, hidden {spec.hidden}, {spec.experts} experts "
                               f"top-{spec.top_k}, expert dim {spec.moe_intermediate}"),
              "batch": batch, "new_tokens": new_tokens, "rounds": repeats}
    return judged(Run("system", records, config, env))


def _ratio(run: Run, metric: str) -> str:
    r = run.record(metric)
    lo, hi = r.spread or (float("nan"),) * 2
    got = [t for t in run.targets if t.target == metric]
    judged_as = "".join(f" (target {verdict(t)})" for t in got)
    return f"   ratio {r.value:.3f} [{lo:.3f}, {hi:.3f}]{judged_as}"


def format_system(run: Run) -> str:
    c, v = run.config, run.value
    return "\n".join([
        f"guidance cost on a {c['system_model']}, batch {c['batch']}, "
        f"{c['new_tokens']} new tokens (median of {c.get('rounds', '?')} interleaved rounds; "
        "ratios per round, median [min, max])",
        f"{'rollout, fp4 plain':<34}{v('rollout_plain_s') * 1e3:>10.1f} ms",
        f"{'rollout, fp4 + lsb recording':<34}{v('rollout_record_s') * 1e3:>10.1f} ms"
        + _ratio(run, "rollout_record_over_plain"),
        f"{'train fwd+bwd, vanilla QAT':<34}{v('train_step_qat_s') * 1e3:>10.1f} ms",
        f"{'train fwd+bwd, TRACE guided':<34}{v('train_step_trace_s') * 1e3:>10.1f} ms"
        + _ratio(run, "train_step_trace_over_qat"),
        f"{'store write / read':<34}{v('store_write_mb_s'):>10.1f} / {v('store_read_mb_s'):.1f} MB/s"
        f"   ({v('store_record_mb'):.2f} MB of records per batch)",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=64, help="rollouts per batch")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds (median reported)")
    p.add_argument("--threads", type=int, help="threads for torch and the kernels (default: as configured)")
    p.add_argument("--tiny", action="store_true", help="the demo model's shape instead of SYSTEM_SPEC (a check "
                   "that the suite runs, not a measurement)")


def run(args: argparse.Namespace) -> Run:
    from tracefp4.bench.suites.numerics import set_threads

    set_threads(args.threads)
    spec = TinyMoESpec() if args.tiny else SYSTEM_SPEC
    return bench_system(batch=args.batch, new_tokens=args.new_tokens, repeats=args.repeats, spec=spec)
