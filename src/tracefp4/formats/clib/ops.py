"""The C entry points as ``torch.library`` custom ops (namespace ``tracefp4``), each with a fake
implementation that gives the output's shape and dtype from the inputs', so ``torch.compile`` traces
a model around them (the op stays one node of the graph; the C call runs when the graph does).

The Python functions (:func:`~tracefp4.formats.clib.gemm.grouped_gemm` and the others) call these ops
while ``torch.compile`` traces them and the C library directly otherwise (the op's dispatch costs
microseconds a call that eager decoding does not pay). Enums travel as their names, ``threads`` 0
meaning torch's count.
"""

from __future__ import annotations

import torch

from tracefp4.formats.clib import combine, gemm, kv, quant, site
from tracefp4.formats.constants import MXFP4_BLOCK, NVFP4_BLOCK, Format

__all__ = ["dequantize_rows", "fp8_dequantize_rows", "fp8_rows", "grouped_gemm", "guided_rows", "lsb_bits",
           "mxfp4_rows", "nvfp4_rows", "paged_attention", "routed_gemm", "silu_gate", "tensor_amax", "topk_combine"]

_NS = "tracefp4"


def _threads(threads: int) -> int | None:
    return threads or None


@torch.library.custom_op(f"{_NS}::grouped_gemm", mutates_args=())
def grouped_gemm(x: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 divisor: torch.Tensor, fmt: str, layout: str, threads: int, impl: str) -> torch.Tensor:
    return gemm.grouped_gemm(x, offsets, codes, scales, divisor, fmt, layout=layout, threads=_threads(threads),
                             impl=impl)


@grouped_gemm.register_fake
def _(x, offsets, codes, scales, divisor, fmt, layout, threads, impl):
    return x.new_empty((x.shape[0], gemm.gemm_out_features(codes, layout)), dtype=torch.bfloat16)


@torch.library.custom_op(f"{_NS}::routed_gemm", mutates_args=())
def routed_gemm(x: torch.Tensor, ids: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, divisor: torch.Tensor,
                fmt: str, per_token: bool, layout: str, threads: int, impl: str) -> torch.Tensor:
    return gemm.routed_gemm(x, ids, codes, scales, divisor, fmt, per_token=per_token, layout=layout,
                            threads=_threads(threads), impl=impl)


@routed_gemm.register_fake
def _(x, ids, codes, scales, divisor, fmt, per_token, layout, threads, impl):
    return x.new_empty((ids.numel(), gemm.gemm_out_features(codes, layout)), dtype=torch.bfloat16)


@torch.library.custom_op(f"{_NS}::topk_combine", mutates_args=())
def topk_combine(out: torch.Tensor, weights: torch.Tensor, threads: int, impl: str) -> torch.Tensor:
    return combine.topk_combine(out, weights, threads=_threads(threads), impl=impl)


@topk_combine.register_fake
def _(out, weights, threads, impl):
    return out.new_empty((out.shape[0], out.shape[2]), dtype=torch.bfloat16)


@torch.library.custom_op(f"{_NS}::silu_gate", mutates_args=())
def silu_gate(x: torch.Tensor, threads: int, impl: str) -> torch.Tensor:
    return combine.silu_gate(x, threads=_threads(threads), impl=impl)


@silu_gate.register_fake
def _(x, threads, impl):
    return x.new_empty((x.shape[0], x.shape[1] // 2), dtype=torch.bfloat16)


@torch.library.custom_op(f"{_NS}::nvfp4_rows", mutates_args=())
def nvfp4_rows(x: torch.Tensor, amax: torch.Tensor | None, threads: int, impl: str
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~tracefp4.formats.clib.site.nvfp4_rows` with the values always made, ``bad`` a tensor
    and a given amax copied (an op's outputs never alias its inputs)."""
    codes, scales, row_amax, values, bad = site.nvfp4_rows(x, amax, values=True, threads=_threads(threads), impl=impl)
    return codes, scales, row_amax if amax is None else row_amax.clone(), values, torch.from_numpy(bad)


@nvfp4_rows.register_fake
def _(x, amax, threads, impl):
    r, k = x.shape
    return (x.new_empty((r, k // 2), dtype=torch.uint8), x.new_empty((r, k // NVFP4_BLOCK), dtype=torch.uint8),
            x.new_empty((r,), dtype=torch.float32), x.new_empty((r, k), dtype=torch.bfloat16),
            x.new_empty((r,), dtype=torch.bool))


@torch.library.custom_op(f"{_NS}::tensor_amax", mutates_args=())
def tensor_amax(x: torch.Tensor, threads: int, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-tensor amax pass: ``(max |x| float32 0-d, whether x holds a NaN or Inf: bool 0-d)``; the
    caller refuses the latter (an op cannot raise from inside a traced graph's data)."""
    return quant.amax_pass(x, threads=_threads(threads), impl=impl)


@tensor_amax.register_fake
def _(x, threads, impl):
    return x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.bool)


@torch.library.custom_op(f"{_NS}::mxfp4_rows", mutates_args=())
def mxfp4_rows(x: torch.Tensor, rceil: bool, threads: int, impl: str
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return quant.mxfp4_rows(x, rceil, threads=_threads(threads), impl=impl)


@mxfp4_rows.register_fake
def _(x, rceil, threads, impl):
    r, k = x.shape
    return (x.new_empty((r, k // 2), dtype=torch.uint8), x.new_empty((r, k // MXFP4_BLOCK), dtype=torch.uint8),
            x.new_empty((r,), dtype=torch.bool))


@torch.library.custom_op(f"{_NS}::fp8_rows", mutates_args=())
def fp8_rows(x: torch.Tensor, threads: int, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return quant.fp8_rows(x, threads=_threads(threads), impl=impl)


@fp8_rows.register_fake
def _(x, threads, impl):
    r, k = x.shape
    return (x.new_empty((r, k), dtype=torch.uint8), x.new_empty((r,), dtype=torch.float32),
            x.new_empty((r,), dtype=torch.bool))


@torch.library.custom_op(f"{_NS}::fp8_dequantize_rows", mutates_args=())
def fp8_dequantize_rows(rows: torch.Tensor, scale: torch.Tensor, threads: int, impl: str) -> torch.Tensor:
    return quant.fp8_dequantize_rows(rows, scale, threads=_threads(threads), impl=impl)


@fp8_dequantize_rows.register_fake
def _(rows, scale, threads, impl):
    return rows.new_empty(rows.shape, dtype=torch.float32)


@torch.library.custom_op(f"{_NS}::dequantize_rows", mutates_args=())
def dequantize_rows(rows: torch.Tensor, scale_rows: torch.Tensor, fmt: str, row_div: torch.Tensor, bf16: bool,
                    threads: int, impl: str) -> torch.Tensor:
    return quant.dequantize_rows(rows, scale_rows, fmt, row_div, dtype=torch.bfloat16 if bf16 else torch.float32,
                                 threads=_threads(threads), impl=impl)


@dequantize_rows.register_fake
def _(rows, scale_rows, fmt, row_div, bf16, threads, impl):
    return rows.new_empty((rows.shape[0], rows.shape[1] * 2), dtype=torch.bfloat16 if bf16 else torch.float32)


@torch.library.custom_op(f"{_NS}::guided_rows", mutates_args=())
def guided_rows(x: torch.Tensor, scale_rows: torch.Tensor, fmt: str, s_dec: torch.Tensor, hint_rows: torch.Tensor,
                full: bool, threads: int, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    return quant.guided_rows(x, scale_rows, fmt, s_dec, hint_rows, full, threads=_threads(threads), impl=impl)


@guided_rows.register_fake
def _(x, scale_rows, fmt, s_dec, hint_rows, full, threads, impl):
    return (x.new_empty((x.shape[0], x.shape[1] // 2), dtype=torch.uint8),
            x.new_empty((x.shape[0],), dtype=torch.bool))


@torch.library.custom_op(f"{_NS}::lsb_bits", mutates_args=())
def lsb_bits(rows: torch.Tensor, threads: int, impl: str) -> torch.Tensor:
    return quant.lsb_rows(rows, threads=_threads(threads), impl=impl)


@lsb_bits.register_fake
def _(rows, threads, impl):
    return rows.new_empty((rows.shape[0], rows.shape[1] // 4), dtype=torch.uint8)


@torch.library.custom_op(f"{_NS}::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor, k_amax: torch.Tensor | None,
                    v_codes: torch.Tensor, v_scales: torch.Tensor, v_amax: torch.Tensor | None, fmt: str,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, q_seq: torch.Tensor, q_len: torch.Tensor,
                    block_size: int, scale: float, threads: int, impl: str) -> torch.Tensor:
    f = Format(fmt)
    return kv.paged_attention(q, kv.PackedKV(k_codes, k_scales, k_amax, f), kv.PackedKV(v_codes, v_scales, v_amax, f),
                              block_table=block_table, seq_lens=seq_lens, q_seq=q_seq, q_len=q_len,
                              block_size=block_size, scale=scale, threads=_threads(threads), impl=impl)


@paged_attention.register_fake
def _(q, k_codes, k_scales, k_amax, v_codes, v_scales, v_amax, fmt, block_table, seq_lens, q_seq, q_len, block_size,
      scale, threads, impl):
    return q.new_empty(q.shape, dtype=torch.float32)

