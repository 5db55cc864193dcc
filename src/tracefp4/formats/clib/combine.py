"""The MoE block's elementwise steps in C, bit for bit torch's: the routed experts' top-k sum
(``csrc/combine.h``) and the SiLU-gated activation (``csrc/silu_gate.h``), one pass each instead of
several tensor ops and their intermediates."""

from __future__ import annotations

import functools

import torch

from tracefp4.formats.clib.call import NOT_RUN, Impl, call, impl_name, impl_of, threads_for, tracing

__all__ = ["silu_gate", "silu_table", "topk_combine"]

#: Elements below which a call runs on one thread (128 KiB of bf16 input: a fork costs more).
_ONE_THREAD_BELOW = 1 << 16


def topk_combine(out: torch.Tensor, weights: torch.Tensor, *, threads: int | None = None, impl: Impl | str = "auto"
                 ) -> torch.Tensor:
    """The routed experts' top-k sum: ``out`` bf16 ``[T, top_k, H]`` (each pair's expert output),
    ``weights`` ``[T, top_k]`` (cast to float32) -> bf16 ``[T, H]``, bit for bit torch's
    ``(out.float() * weights.float().unsqueeze(-1)).sum(dim=1).to(torch.bfloat16)`` (float32 products
    summed in slot order). Raises RuntimeError when the library is unavailable."""
    if tracing():
        return torch.ops.tracefp4.topk_combine(out, weights, threads or 0, impl_name(impl))
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or out.dim() != 3 or out.device.type != "cpu"
            or not isinstance(weights, torch.Tensor) or tuple(weights.shape) != tuple(out.shape[:2])
            or weights.device.type != "cpu"):
        raise ValueError(f"topk_combine: expected CPU bf16 out [T, top_k, H] and weights [T, top_k], got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))} and "
                         f"{tuple(getattr(weights, 'shape', ()))}")
    impl = impl_of("topk_combine", impl)
    n, k, h = out.shape
    out = out.contiguous()
    w = weights.to(torch.float32).contiguous()
    res = torch.empty(n, h, dtype=torch.bfloat16)
    t = threads_for(threads) if n * k * h >= _ONE_THREAD_BELOW else 1
    call("topk_combine", out.data_ptr(), w.data_ptr(), n, k, h, res.data_ptr(), t, impl.value,
         messages=NOT_RUN, what=lambda: f"out {tuple(out.shape)}, impl {impl.name.lower()!r}")
    return res


@functools.cache
def silu_table() -> torch.Tensor:
    """torch's bf16 SiLU of every bf16 bit pattern, as int16 ``[65537]`` (entry ``i``: the SiLU of the
    bf16 with bits ``i``; one entry of padding), made once per process by torch itself, so that
    :func:`silu_gate` returns torch's values on this machine and build. Computed in contiguous chunks
    of 4096 (torch's vectorised kernel; its scalar loop gives the same bits on every finite input,
    which tests/test_csite.py checks)."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    silu = torch.cat([torch.nn.functional.silu(bits[i:i + 4096]) for i in range(0, 1 << 16, 4096)])
    return torch.cat([silu.view(torch.int16), torch.zeros(1, dtype=torch.int16)])


def silu_gate(x: torch.Tensor, *, threads: int | None = None, impl: Impl | str = "auto") -> torch.Tensor:
    """The SiLU-gated ``[gate; up]`` activation of bf16 rows ``x [R, 2I]`` -> bf16 ``[R, I]``, bit for
    bit torch's ``F.silu(gate) * up`` (``gate, up = x.chunk(2, -1)``: torch's SiLU through
    :func:`silu_table`, the product rounded as torch rounds it). Raises RuntimeError when the library
    is unavailable."""
    if tracing():
        return torch.ops.tracefp4.silu_gate(x, threads or 0, impl_name(impl))
    if (not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % 2
            or not x.shape[1] or x.device.type != "cpu"):
        raise ValueError(f"silu_gate: expected CPU bf16 [R, 2I], got {getattr(x, 'dtype', type(x).__name__)} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    impl = impl_of("silu_gate", impl)
    x = x.contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    res = torch.empty(rows, inter, dtype=torch.bfloat16)
    t = threads_for(threads) if x.numel() >= _ONE_THREAD_BELOW else 1
    table = silu_table()
    call("silu_gate", x.data_ptr(), rows, inter, table.data_ptr(), res.data_ptr(), t, impl.value,
         messages=NOT_RUN, what=lambda: f"x {tuple(x.shape)}, impl {impl.name.lower()!r}")
    return res
