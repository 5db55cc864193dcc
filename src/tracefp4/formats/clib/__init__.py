"""The Python side of the C library of CPU kernels (``csrc/``).

* :mod:`~tracefp4.formats.clib.loader`: build, load and ask the library (``available``, ``has_amx``);
  ``python -m tracefp4.formats.clib build`` compiles it ahead of time;
* :mod:`~tracefp4.formats.clib.call`: the one call helper and the implementation enum :class:`Impl`;
* the entry points, thin on top: :mod:`~tracefp4.formats.clib.gemm` (grouped and routed packed-FP4
  GEMM, weights in a :mod:`~tracefp4.formats.clib.layout`), :mod:`~tracefp4.formats.clib.site`
  (NVFP4 rows), :mod:`~tracefp4.formats.clib.kv` (paged attention over packed K/V),
  :mod:`~tracefp4.formats.clib.combine` (top-k sum, SiLU gate);
* :mod:`~tracefp4.formats.clib.ops`: the entry points as ``torch.library`` custom ops with fake
  implementations, so ``torch.compile`` traces around them.

The package re-exports the names the engines use; the K/V attention is reached as
:mod:`tracefp4.formats.ckv` (it dequantizes through the formats' ops, which import this package).
"""

from tracefp4.formats.clib.call import Impl
from tracefp4.formats.clib.combine import silu_gate, silu_table, topk_combine
from tracefp4.formats.clib.gemm import accumulation_bound, grouped_gemm, routed_gemm
from tracefp4.formats.clib.layout import (
    Layout,
    code_bytes,
    kernel_layout,
    kernel_scales,
    preferred_layout,
    standard_layout,
    standard_scales,
)
from tracefp4.formats.clib.loader import available, build, has_amx, has_avx512_bf16, library, unavailable_reason
from tracefp4.formats.clib.site import nvfp4_rows, quantize_into

__all__ = [
    "Impl", "Layout", "accumulation_bound", "available", "build", "code_bytes", "grouped_gemm", "has_amx",
    "has_avx512_bf16", "kernel_layout", "kernel_scales", "library", "nvfp4_rows", "preferred_layout", "quantize_into",
    "routed_gemm", "silu_gate", "silu_table", "standard_layout", "standard_scales", "topk_combine",
    "unavailable_reason",
]
