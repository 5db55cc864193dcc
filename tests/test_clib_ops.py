"""The C entry points as torch custom ops (:mod:`tracefp4.formats.clib.ops`): each passes
``torch.library.opcheck`` (schema, fake implementation against the real one, autograd registration,
AOT dispatch), and ``torch.compile`` traces a function calling them (the ops stay graph nodes) with
the eager result, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tracefp4.formats import clib, nvfp4_global_encode_scale
from tracefp4.formats.quantizers import NVFP4Quantizer

pytestmark = pytest.mark.needs_clib  # skipped without the library, failed under CI (tests/conftest.py)

_G = torch.Generator().manual_seed(11)


def _experts(e: int = 3, n: int = 32, k: int = 64):
    """Packed NVFP4 weights ``[E, N, K]`` in the tiles layout, with their per-expert divisors."""
    w = torch.randn(e, n, k, generator=_G).to(torch.bfloat16)
    q = NVFP4Quantizer("expert").quantize(w)
    divisor = nvfp4_global_encode_scale(q.global_amax.reshape(e, -1)[:, 0]).to(torch.float32)
    return clib.kernel_layout(q.codes, 16), clib.kernel_scales(q.scales.view(torch.uint8)), divisor


def _gemm_args():
    codes, scales, divisor = _experts()
    x = torch.randn(5, 64, generator=_G).to(torch.bfloat16)
    offsets = torch.tensor([0, 2, 2, 5])
    return x, offsets, codes, scales, divisor


def _opcheck_cases():
    x, offsets, codes, scales, divisor = _gemm_args()
    ids = torch.tensor([[0, 2], [1, 0], [2, 2], [0, 1], [1, 1]])
    out = torch.randn(5, 2, 24, generator=_G).to(torch.bfloat16)
    rows = torch.randn(4, 32, generator=_G).to(torch.bfloat16)
    codes8 = torch.randint(0, 256, (4, 16), generator=_G).to(torch.uint8)
    scales8 = torch.randint(0, 0x7F, (4, 2), generator=_G).to(torch.uint8)
    return {
        "grouped_gemm": (torch.ops.tracefp4.grouped_gemm, (x, offsets, codes, scales, divisor, "nvfp4", "tiles", 0, "auto")),
        "routed_gemm": (torch.ops.tracefp4.routed_gemm, (x, ids, codes, scales, divisor, "nvfp4", True, "tiles", 0, "auto")),
        "topk_combine": (torch.ops.tracefp4.topk_combine, (out, torch.rand(5, 2, generator=_G), 0, "auto")),
        "silu_gate": (torch.ops.tracefp4.silu_gate, (torch.randn(3, 48, generator=_G).to(torch.bfloat16), 0, "auto")),
        "nvfp4_rows": (torch.ops.tracefp4.nvfp4_rows, (rows, None, 0, "auto")),
        "nvfp4_rows_given_amax": (torch.ops.tracefp4.nvfp4_rows, (rows, torch.full((4,), 2.0), 0, "auto")),
        "tensor_amax": (torch.ops.tracefp4.tensor_amax, (rows, 0, "auto")),
        "tensor_amax_float32": (torch.ops.tracefp4.tensor_amax, (rows.float(), 0, "auto")),
        "dequantize_rows": (torch.ops.tracefp4.dequantize_rows, (codes8, scales8, "nvfp4", torch.rand(4), False, 0, "auto")),
        "dequantize_rows_bf16": (torch.ops.tracefp4.dequantize_rows, (codes8, scales8, "nvfp4", torch.rand(4), True, 0,
                                                                       "auto")),
        "guided_rows_lsb": (torch.ops.tracefp4.guided_rows, (rows, scales8, "nvfp4", torch.rand(4), codes8[:, :4].contiguous(), False,
                                                              0, "auto")),
        "guided_rows_full": (torch.ops.tracefp4.guided_rows, (rows, scales8, "nvfp4", torch.rand(4), codes8, True, 0,
                                                               "auto")),
        "lsb_bits": (torch.ops.tracefp4.lsb_bits, (codes8, 0, "auto")),
        "fp8_rows": (torch.ops.tracefp4.fp8_rows, (rows, 0, "auto")),
        "fp8_rows_float32": (torch.ops.tracefp4.fp8_rows, (rows.float(), 0, "auto")),
        # codes & 0xFE: no NaN code (opcheck compares outputs with ==)
        "fp8_dequantize_rows": (torch.ops.tracefp4.fp8_dequantize_rows, (codes8 & 0xFE, torch.rand(4), 0, "auto")),
        "mxfp4_rows": (torch.ops.tracefp4.mxfp4_rows, (rows, False, 0, "auto")),
        "mxfp4_rows_rceil_float32": (torch.ops.tracefp4.mxfp4_rows, (rows.float(), True, 0, "auto")),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_custom_op_passes_opcheck(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


def test_paged_attention_op_passes_opcheck():
    from tracefp4.formats import ckv

    slots, hkv, d = 8, 2, 64
    kv = torch.randn(slots, hkv, d, generator=_G).to(torch.bfloat16)
    codes, scales, amax, _, _ = clib.nvfp4_rows(kv.reshape(-1, d), None, values=False)
    k = ckv.PackedKV(codes.reshape(slots, hkv, -1), scales.reshape(slots, hkv, -1), amax.reshape(slots, hkv))
    q = torch.randn(3, 4, d, generator=_G).to(torch.bfloat16)
    args = (q, k.codes, k.scales, k.amax, k.codes, k.scales, k.amax, "nvfp4",
            torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([7], dtype=torch.int32),
            torch.zeros(3, dtype=torch.int32), torch.tensor([5, 6, 7], dtype=torch.int32), 4, d**-0.5, 0, "auto")
    torch.library.opcheck(torch.ops.tracefp4.paged_attention, args)


def test_torch_compile_traces_around_the_c_entry_points():
    """A compiled MoE-like step (GEMM, SiLU gate, torch ops between) runs the C kernels as graph nodes
    and gives the eager bits."""
    x, offsets, codes, scales, divisor = _gemm_args()
    codes2, scales2, divisor2 = _experts(n=32, k=16 * 1)  # the down GEMM: K = I = 16

    def step(x):
        h = clib.grouped_gemm(x, offsets, codes, scales, divisor, "nvfp4")  # [R, 32]: gate and up
        a = clib.silu_gate(h * 2)
        return clib.grouped_gemm(a, offsets, codes2, scales2, divisor2, "nvfp4").float().sum(dim=-1)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=False, backend="aot_eager")
    assert torch.equal(compiled(x), step(x))


def test_compiled_graph_holds_the_custom_ops():
    """The traced graph calls ``tracefp4::grouped_gemm`` itself (no graph break around the C call)."""
    x, offsets, codes, scales, divisor = _gemm_args()
    seen: list[str] = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda x: clib.grouped_gemm(x, offsets, codes, scales, divisor, "nvfp4") + 1,
                      fullgraph=True, backend=record)
    assert torch.equal(f(x), clib.grouped_gemm(x, offsets, codes, scales, divisor, "nvfp4") + 1)
    assert any("tracefp4.grouped_gemm" in s for s in seen), seen
