"""The packed-FP4 grouped GEMM for the CPU: ``csrc/fp4_gemm.c``, built with the system C compiler.

:func:`grouped_gemm` multiplies bf16 activation rows, grouped by expert, with packed FP4 expert
weights (two codes per byte, one scale byte per block, one FP32 divisor per expert) in one call per
GEMM, on the thread count the caller set (torch's), and returns bf16 rows with round-to-nearest-even:

    out[r, n] = bf16( fl32( sum_k x[r, k] * value(code[e, n, k]) * scale[e, n, k // block] ) / divisor[e] )

This is the GEMM of the exact dequantized operands up to the order of the float32 additions (see
the C file for why every product is exact); :func:`tracefp4.formats.reference.grouped_gemm_reference`
is the readable float64 oracle it is tested against, with the bound :func:`accumulation_bound`.

The codes and scales are taken in one of the kernel's layouts (:class:`Layout`, made by
:func:`kernel_layout` and :func:`kernel_scales`; :func:`standard_layout` and :func:`standard_scales`
invert them): the same codes, two per byte, with the bytes permuted for the kernels that read them
(see the C file). :func:`preferred_layout` is the one this CPU multiplies fastest: ``panels`` (AMX
tiles) where the CPU and OS run AMX, ``tiles`` (AVX-512 BF16) elsewhere.

Threads: built with OpenMP where the compiler has it, the kernel runs on the process's OpenMP
threads, which are PyTorch's own (torch is imported first and its ``libgomp.so.1`` answers the
kernel's dependency): one set of threads for torch's ops and ours, none spinning while the other
works (a second pool beside torch's, numba's OpenMP layer for one, starves torch on small machines).
Without OpenMP it keeps a pool of its own, woken per call. The thread count is torch's.

Build: on first use (or ``python -m tracefp4.formats.cgemm build``, which ``make setup`` runs), the C
file is compiled with ``$CC`` (default ``cc``) into a cache folder (``$TRACEFP4_CACHE_DIR``, else
``$XDG_CACHE_HOME/tracefp4``, else ``~/.cache/tracefp4``) under a name derived from the source, the
compiler and the machine; the library is written to a temporary name and renamed, so a half-written
one is never loaded. Where there is no compiler (or ``TRACEFP4_CPU_KERNEL=0``), :func:`available`
is False and says why once; callers then use the dense torch path. The code paths are chosen at run
time: AMX for the ``panels`` layout where the CPU and OS run it, AVX-512 BF16 where the CPU has it
(``avx512_bf16``), the portable C one elsewhere.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
import enum
import uuid
import warnings
from pathlib import Path

import numpy as np
import torch

from tracefp4.formats.constants import E4M3_VALUES, E8M0_VALUES, MXFP4_BLOCK, NVFP4_BLOCK, Format

__all__ = [
    "COMBINE_IMPLS",
    "IMPLS",
    "Layout",
    "accumulation_bound",
    "available",
    "build",
    "code_bytes",
    "grouped_gemm",
    "has_amx",
    "has_avx512_bf16",
    "kernel_layout",
    "library",
    "kernel_scales",
    "preferred_layout",
    "routed_gemm",
    "standard_layout",
    "standard_scales",
    "topk_combine",
    "unavailable_reason",
]

SOURCE = Path(__file__).with_name("csrc") / "fp4_gemm.c"
#: ``impl`` values of :func:`grouped_gemm`: the best the CPU runs, the portable C code, AVX-512 BF16
#: (both layouts), AMX (the ``panels`` layout; for every expert, where ``auto`` gives experts with one
#: or two rows to the AVX-512 path).
IMPLS = {"auto": 0, "portable": 1, "avx512_bf16": 2, "amx": 3}


class Layout(enum.Enum):
    """How the kernel holds a weight's codes and scales (the standard layout: codes ``[E, N, K/2]``,
    element 2i in the low nibble of byte i; scales ``[E, N, K/block]``)."""

    TILES = "tiles"
    """For the AVX-512 BF16 streaming kernels: codes ``[E, N/4, 4 * code_bytes(K, block)]``, each row's
    bytes permuted so that a vector lane sums one block's products, the rows of each 4-column tile
    interleaved 32 bytes at a time; scales standard. N a multiple of 4."""

    PANELS = "panels"
    """For AMX (and an AVX-512 BF16 kernel for experts with one or two rows): codes ``[E, N/16, K/4, 32]``,
    byte ``(e, p, t, 2c + h)`` = standard byte ``2t + h`` of column ``16p + c`` (a quad of 4 elements
    of 16 columns: two B-tile rows once decoded); scales ``[E, N/16, K/block, 16]``, ``(e, p, b, c)``
    = block b of column 16p + c. N a multiple of 16."""
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c11", "-D_POSIX_C_SOURCE=200809L", "-fno-strict-aliasing"]
_ERRORS = {-1: "bad shapes (N a multiple of 4 for tiles, 16 for panels; K of the block) or an implementation "
                 "this CPU or layout lacks",
           -2: "offsets not a non-decreasing 0..R partition", -3: "out of memory", -4: "thread start failed"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_warned = False


def _cache_dir() -> Path:
    if os.environ.get("TRACEFP4_CACHE_DIR"):
        return Path(os.environ["TRACEFP4_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tracefp4"


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc) or (shutil.which("gcc") if cc == "cc" else None)


def _library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    sources = b"".join(f.name.encode() + f.read_bytes() for f in sorted(SOURCE.parent.glob("*.[ch]")))
    key = hashlib.sha256(sources + version.encode() + " ".join(_FLAGS + ["-fopenmp?"]).encode()
                         + platform.machine().encode() + sys.platform.encode()).hexdigest()[:16]
    return _cache_dir() / f"fp4_gemm-{key}.so"


def build() -> Path:
    """Compile the kernel (if its library is not cached yet); returns the library's path.
    Raises RuntimeError with the compiler's message when that fails."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')} not found on PATH)")
    path = _library_path(cc)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        # with OpenMP (the kernel then runs on the OpenMP threads PyTorch runs on), else a pool of its own
        for extra in (["-fopenmp"], []):
            proc = subprocess.run([cc, *_FLAGS, *extra, "-o", str(tmp), str(SOURCE), "-lpthread"], capture_output=True,
                                  text=True, timeout=300)
            if proc.returncode == 0:
                break
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # whole or not at all: a reader never sees a half-written library
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _load() -> ctypes.CDLL | None:
    global _lib, _reason
    lib = _lib
    if lib is not None:  # loaded: no lock (asked at every site and GEMM of a rollout)
        return lib
    with _lock:
        if _lib is not None or _reason is not None:
            return _lib
        if os.environ.get("TRACEFP4_CPU_KERNEL", "1") == "0":
            _reason = "disabled by TRACEFP4_CPU_KERNEL=0"
            return None
        try:
            lib = ctypes.CDLL(str(build()))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            _reason = str(e)
            return None
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        c_int = ctypes.c_int
        lib.tfp4_grouped_gemm.argtypes = [p, p, p, p, p, c_int, p, p, i64, i64, i64, i64, c_int, c_int, c_int]
        lib.tfp4_grouped_gemm.restype = c_int
        lib.tfp4_routed_gemm.argtypes = [p, p, i64, p, p, p, c_int, p, p, i64, i64, i64, i64, c_int, c_int, c_int, p]
        lib.tfp4_routed_gemm.restype = c_int
        lib.tfp4_nvfp4_quantize.argtypes = [p, i64, i64, p, c_int, p, p, p, c_int, c_int, p]
        lib.tfp4_nvfp4_quantize.restype = c_int
        lib.tfp4_topk_combine.argtypes = [p, p, i64, i64, i64, p, c_int, c_int]
        lib.tfp4_topk_combine.restype = c_int
        lib.tfp4_silu_gate.argtypes = [p, i64, i64, p, p, c_int, c_int]
        lib.tfp4_silu_gate.restype = c_int
        lib.tfp4_has_avx512bf16.restype = c_int
        lib.tfp4_has_amx.restype = c_int
        _lib = lib
        return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (None where it could not be built: :func:`unavailable_reason`),
    for the other CPU kernels it holds (:mod:`tracefp4.formats.csite`)."""
    return _load()


def available() -> bool:
    """True when the kernel is built and loaded; otherwise warns once with the reason (callers fall
    back to the dense torch path)."""
    global _warned
    ok = _load() is not None
    if not ok and not _warned:
        _warned = True
        warnings.warn(f"tracefp4: packed FP4 CPU kernel unavailable ({_reason}); using the dense torch path",
                      RuntimeWarning, stacklevel=2)
    return ok


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    _load()
    return _reason


def has_avx512_bf16() -> bool:
    """Whether the kernel runs its AVX-512 BF16 path on this CPU."""
    lib = _load()
    return bool(lib is not None and lib.tfp4_has_avx512bf16())


def has_amx() -> bool:
    """Whether the kernel runs its AMX path here (the CPU has AMX-BF16 and the OS grants the tile
    state: Linux 5.16 or later)."""
    lib = _load()
    return bool(lib is not None and lib.tfp4_has_amx())


def preferred_layout(n: int) -> Layout:
    """The layout this CPU multiplies ``[*, N]`` outputs fastest in: ``panels`` where the AMX path runs
    and N is a multiple of 16, else ``tiles``. ``TRACEFP4_CPU_LAYOUT=tiles|panels`` forces one (for A/B
    benchmarks and tests; panels still needs N a multiple of 16)."""
    forced = os.environ.get("TRACEFP4_CPU_LAYOUT")
    if forced:
        try:
            return Layout(forced)
        except ValueError:
            raise ValueError(f"TRACEFP4_CPU_LAYOUT: expected one of {[m.value for m in Layout]}, got {forced!r}") from None
    return Layout.PANELS if n % 16 == 0 and has_amx() else Layout.TILES


_LUTS = {Format.NVFP4: np.ascontiguousarray(E4M3_VALUES, dtype=np.float32),
         Format.MXFP4: np.ascontiguousarray(E8M0_VALUES, dtype=np.float32)}
_BLOCKS = {Format.NVFP4: NVFP4_BLOCK, Format.MXFP4: MXFP4_BLOCK}


def code_bytes(k: int, block: int) -> int:
    """Bytes per weight row in the kernel layout: blocks 16 at a time, each 16-block super-group
    ``block / 4`` groups of 32 bytes (the last super-group padded with zero codes)."""
    return -(-(k // block) // 16) * (block // 4) * 32


_LAYOUTS: dict[tuple[int, int], torch.Tensor] = {}


def _source_bytes(k: int, block: int) -> torch.Tensor:
    """For each kernel-layout byte, the standard-layout byte it holds (-1: padding): byte 2l+i of
    group p of super-group q holds standard byte (block/2)(16q+l) + 2p + i."""
    key = (k, block)
    if key not in _LAYOUTS:
        nb, groups = k // block, block // 4
        q, p, lane, i = torch.meshgrid(torch.arange(-(-nb // 16)), torch.arange(groups), torch.arange(16),
                                       torch.arange(2), indexing="ij")
        blk = 16 * q + lane
        src = (block // 2) * blk + 2 * p + i
        _LAYOUTS[key] = torch.where(blk < nb, src, torch.full_like(src, -1)).reshape(-1)
    return _LAYOUTS[key]


def kernel_layout(codes: torch.Tensor, block: int, layout: Layout = Layout.TILES) -> torch.Tensor:
    """Standard packed codes ``[E, N, K/2]`` (element 2i in the low nibble of byte i) -> the codes in
    ``layout`` (:class:`Layout`)."""
    layout = Layout(layout)
    e, n, half = codes.shape
    if layout is Layout.PANELS:
        if n % 16:
            raise ValueError(f"kernel_layout: the panels layout needs N a multiple of 16, got codes of shape "
                             f"{tuple(codes.shape)}")
        return codes.reshape(e, n // 16, 16, half // 2, 2).permute(0, 1, 3, 2, 4).reshape(e, n // 16, half // 2, 32)
    if n % 4:
        raise ValueError(f"kernel_layout: N must be a multiple of 4, got codes of shape {tuple(codes.shape)}")
    src = _source_bytes(2 * half, block).to(codes.device)
    rows = torch.where(src >= 0, codes[..., src.clamp(min=0)], torch.zeros((), dtype=codes.dtype, device=codes.device))
    groups = rows.shape[-1] // 32
    return rows.reshape(e, n // 4, 4, groups, 32).transpose(2, 3).reshape(e, n // 4, -1).contiguous()


def standard_layout(kcodes: torch.Tensor, k: int, block: int, layout: Layout = Layout.TILES) -> torch.Tensor:
    """The inverse of :func:`kernel_layout` for rows of ``k`` elements: ``[E, N, K/2]``."""
    if Layout(layout) is Layout.PANELS:
        e, panels, quads, _ = kcodes.shape
        return kcodes.reshape(e, panels, quads, 16, 2).permute(0, 1, 3, 2, 4).reshape(e, 16 * panels, 2 * quads)
    e, tiles, _ = kcodes.shape
    src = _source_bytes(k, block).to(kcodes.device)
    rows = kcodes.reshape(e, tiles, -1, 4, 32).transpose(2, 3).reshape(e, 4 * tiles, -1)
    out = torch.empty(e, 4 * tiles, k // 2, dtype=kcodes.dtype, device=kcodes.device)
    out[..., src[src >= 0]] = rows[..., src >= 0]
    return out


def kernel_scales(scales: torch.Tensor, layout: Layout = Layout.TILES) -> torch.Tensor:
    """Standard scale bytes ``[E, N, K/block]`` -> the scales in ``layout`` (the tiles layout keeps
    them; panels: ``[E, N/16, K/block, 16]``)."""
    if Layout(layout) is Layout.TILES:
        return scales.contiguous()
    e, n, nb = scales.shape
    if n % 16:
        raise ValueError(f"kernel_scales: the panels layout needs N a multiple of 16, got scales of shape "
                         f"{tuple(scales.shape)}")
    return scales.reshape(e, n // 16, 16, nb).transpose(2, 3).contiguous()


def standard_scales(kscales: torch.Tensor, layout: Layout = Layout.TILES) -> torch.Tensor:
    """The inverse of :func:`kernel_scales`: ``[E, N, K/block]``."""
    if Layout(layout) is Layout.TILES:
        return kscales
    e, panels, nb, _ = kscales.shape
    return kscales.transpose(2, 3).reshape(e, 16 * panels, nb)


def _check(entry: str, name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape or t.device.type != "cpu":
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{entry} {name}: expected a CPU {dtype} tensor of shape {shape}, got {got}")


def _operands(name: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, divisor: torch.Tensor,
              fmt: Format | str, layout: Layout, impl: str) -> tuple[ctypes.CDLL, Format, int, int, int, int]:
    """Check the operands every entry shares; returns the library, format, block, E, N and K."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"packed FP4 CPU kernel unavailable: {_reason}")
    fmt = Format(fmt)
    block = _BLOCKS[fmt]
    layout = Layout(layout)
    dims = 4 if layout is Layout.PANELS else 3
    if not isinstance(codes, torch.Tensor) or codes.dim() != dims:
        want = "[E, N/16, K/4, 32]" if dims == 4 else "[E, N/4, bytes]"
        raise ValueError(f"{name} codes: expected {want} ({layout.value} layout), got "
                         f"{tuple(getattr(codes, 'shape', ())) or type(codes).__name__}")
    if x.dim() != 2 or x.shape[1] % block:
        raise ValueError(f"{name} x: expected [R, K] with K a multiple of {block}, got {tuple(x.shape)}")
    e, groups, k = codes.shape[0], codes.shape[1], x.shape[1]
    _check(name, "x", x, torch.bfloat16, (x.shape[0], k))
    if layout is Layout.PANELS:
        n = 16 * groups
        _check(name, "codes", codes, torch.uint8, (e, groups, k // 4, 32))
        _check(name, "scales", scales, torch.uint8, (e, groups, k // block, 16))
    else:
        n = 4 * groups
        _check(name, "codes", codes, torch.uint8, (e, groups, 4 * code_bytes(k, block)))
        _check(name, "scales", scales, torch.uint8, (e, n, k // block))
    _check(name, "divisor", divisor, torch.float32, (e,))
    if impl not in IMPLS:
        raise ValueError(f"{name} impl: expected one of {sorted(IMPLS)}, got {impl!r}")
    if impl == "amx" and layout is not Layout.PANELS:
        raise ValueError(f"{name} impl: 'amx' multiplies the panels layout, got codes in the {layout.value} layout")
    return lib, fmt, block, e, n, k


_LAYOUT_IDS = {Layout.TILES: 0, Layout.PANELS: 1}


def grouped_gemm(x: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 divisor: torch.Tensor, fmt: Format | str, *, layout: Layout = Layout.TILES, threads: int | None = None,
                 impl: str = "auto") -> torch.Tensor:
    """``x`` bf16 ``[R, K]`` (rows of expert e at ``offsets[e]:offsets[e+1]``) times the packed
    weights (``codes`` and ``scales`` uint8 in ``layout``, :class:`Layout`; ``divisor`` float32
    ``[E]``) -> bf16 ``[R, N]`` (module docstring). ``threads``: default torch's intra-op count.
    Raises RuntimeError when the kernel is unavailable."""
    lib, fmt, block, e, n, k = _operands("grouped_gemm", x, codes, scales, divisor, fmt, layout, impl)
    _check("grouped_gemm", "offsets", offsets, torch.int64, (e + 1,))
    x, offsets, codes, scales, divisor = (t.contiguous() for t in (x, offsets, codes, scales, divisor))
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    rc = lib.tfp4_grouped_gemm(
        x.data_ptr(), offsets.data_ptr(), codes.data_ptr(), scales.data_ptr(), _LUTS[fmt].ctypes.data, block,
        divisor.data_ptr(), out.data_ptr(), x.shape[0], e, n, k, _LAYOUT_IDS[Layout(layout)],
        int(threads or torch.get_num_threads()), IMPLS[impl],
    )
    if rc != 0:
        raise ValueError(f"grouped_gemm: {_ERRORS.get(rc, rc)} (x {tuple(x.shape)}, codes {tuple(codes.shape)}, "
                         f"impl {impl!r}, offsets {offsets.tolist()[:4]}...)")
    return out


def routed_gemm(x: torch.Tensor, ids: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, divisor: torch.Tensor,
                fmt: Format | str, *, per_token: bool, layout: Layout = Layout.TILES, threads: int | None = None,
                impl: str = "auto") -> torch.Tensor:
    """The routed form of :func:`grouped_gemm`: ``ids`` int64 ``[T, top_k]`` (or ``[P]`` with
    ``per_token=False``) names the expert of each (token, slot) pair ``f = t * top_k + j``, and the
    result is bf16 ``[P, N]`` in pair order, ``P = ids.numel()``. ``x`` is ``[T, K]``, one row per
    token that each of its pairs multiplies (``per_token``: the gate-up GEMM), or ``[P, K]``, one row
    per pair (the down GEMM). The kernel groups the pairs by expert itself (no sort, gather or scatter
    around the call); the numbers are those of :func:`grouped_gemm` on the grouped rows."""
    lib, fmt, block, e, n, k = _operands("routed_gemm", x, codes, scales, divisor, fmt, layout, impl)
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.device.type != "cpu":
        raise ValueError(f"routed_gemm ids: expected a CPU int64 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    pairs = ids.numel()
    fanout = ids.shape[-1] if per_token and ids.dim() else 1
    if x.shape[0] * fanout != pairs:
        raise ValueError(f"routed_gemm: {pairs} (token, slot) pairs need {pairs // fanout if pairs % fanout == 0 else '?'} "
                         f"rows of x ({'one per token' if per_token else 'one per pair'}), got {x.shape[0]}")
    x, ids, codes, scales, divisor = (t.contiguous() for t in (x, ids, codes, scales, divisor))
    out = torch.empty(pairs, n, dtype=torch.bfloat16)
    bad = ctypes.c_int64(-1)
    rc = lib.tfp4_routed_gemm(
        x.data_ptr(), ids.data_ptr(), fanout, codes.data_ptr(), scales.data_ptr(), _LUTS[fmt].ctypes.data, block,
        divisor.data_ptr(), out.data_ptr(), pairs, e, n, k, _LAYOUT_IDS[Layout(layout)],
        int(threads or torch.get_num_threads()), IMPLS[impl], ctypes.byref(bad),
    )
    if rc == -5:
        f = bad.value
        raise ValueError(f"routed_gemm: expert index {int(ids.reshape(-1)[f])} of pair {f} (token {f // fanout}) "
                         f"out of range [0, {e})")
    if rc != 0:
        raise ValueError(f"routed_gemm: {_ERRORS.get(rc, rc)} (x {tuple(x.shape)}, codes {tuple(codes.shape)}, "
                         f"impl {impl!r}, {pairs} pairs)")
    return out


#: ``impl`` values of :func:`topk_combine` and :func:`silu_gate`.
COMBINE_IMPLS = {"auto": 0, "portable": 1, "avx512": 2}


def topk_combine(out: torch.Tensor, weights: torch.Tensor, *, threads: int | None = None, impl: str = "auto"
                 ) -> torch.Tensor:
    """The routed experts' top-k sum: ``out`` bf16 ``[T, top_k, H]`` (each pair's expert output),
    ``weights`` ``[T, top_k]`` (cast to float32) -> bf16 ``[T, H]``, bit for bit torch's
    ``(out.float() * weights.float().unsqueeze(-1)).sum(dim=1).to(torch.bfloat16)`` (float32 products
    summed in slot order; csrc/combine.h), in one pass instead of five tensor ops. Raises
    RuntimeError when the kernel is unavailable."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"packed FP4 CPU kernel unavailable: {_reason}")
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or out.dim() != 3 or out.device.type != "cpu"
            or not isinstance(weights, torch.Tensor) or tuple(weights.shape) != tuple(out.shape[:2])
            or weights.device.type != "cpu"):
        raise ValueError(f"topk_combine: expected CPU bf16 out [T, top_k, H] and weights [T, top_k], got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))} and "
                         f"{tuple(getattr(weights, 'shape', ()))}")
    if impl not in COMBINE_IMPLS:
        raise ValueError(f"topk_combine impl: expected one of {sorted(COMBINE_IMPLS)}, got {impl!r}")
    n, k, h = out.shape
    out = out.contiguous()
    w = weights.to(torch.float32).contiguous()
    res = torch.empty(n, h, dtype=torch.bfloat16)
    t = 1 if n * k * h < (1 << 16) else int(threads or torch.get_num_threads())  # below 128 KiB of input: one thread
    if lib.tfp4_topk_combine(out.data_ptr(), w.data_ptr(), n, k, h, res.data_ptr(), t, COMBINE_IMPLS[impl]) != 0:
        raise ValueError(f"topk_combine: implementation {impl!r} not run by this CPU (out {tuple(out.shape)})")
    return res


_SILU_TABLE: list[torch.Tensor] = []


def silu_table() -> torch.Tensor:
    """torch's bf16 SiLU of every bf16 bit pattern, as int16 ``[65537]`` (entry ``i``: the SiLU of the
    bf16 with bits ``i``; one entry of padding), made once per process by torch itself, so that
    :func:`silu_gate` returns torch's values on this machine and build. Computed in contiguous chunks
    of 4096 (torch's vectorised kernel; its scalar loop gives the same bits on every finite input,
    which tests/test_csite.py checks)."""
    with _lock:
        if not _SILU_TABLE:
            bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            silu = torch.cat([torch.nn.functional.silu(bits[i:i + 4096]) for i in range(0, 1 << 16, 4096)])
            _SILU_TABLE.append(torch.cat([silu.view(torch.int16), torch.zeros(1, dtype=torch.int16)]))
        return _SILU_TABLE[0]


def silu_gate(x: torch.Tensor, *, threads: int | None = None, impl: str = "auto") -> torch.Tensor:
    """The SiLU-gated ``[gate; up]`` activation of bf16 rows ``x [R, 2I]`` -> bf16 ``[R, I]``, bit for
    bit torch's ``F.silu(gate) * up`` (``gate, up = x.chunk(2, -1)``; csrc/silu_gate.h: torch's SiLU
    through :func:`silu_table`, the product rounded as torch rounds it), in one pass instead of two
    tensor ops and the intermediate. Raises RuntimeError when the kernel is unavailable."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"packed FP4 CPU kernel unavailable: {_reason}")
    if (not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % 2
            or not x.shape[1] or x.device.type != "cpu"):
        raise ValueError(f"silu_gate: expected CPU bf16 [R, 2I], got {getattr(x, 'dtype', type(x).__name__)} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if impl not in COMBINE_IMPLS:
        raise ValueError(f"silu_gate impl: expected one of {sorted(COMBINE_IMPLS)}, got {impl!r}")
    x = x.contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    res = torch.empty(rows, inter, dtype=torch.bfloat16)
    t = 1 if x.numel() < (1 << 16) else int(threads or torch.get_num_threads())  # below 128 KiB of input: one thread
    table = silu_table()
    if lib.tfp4_silu_gate(x.data_ptr(), rows, inter, table.data_ptr(), res.data_ptr(), t, COMBINE_IMPLS[impl]) != 0:
        raise ValueError(f"silu_gate: implementation {impl!r} not run by this CPU (x {tuple(x.shape)})")
    return res


def accumulation_bound(x: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor, divisor: torch.Tensor
                       ) -> torch.Tensor:
    """The largest ``|fl32 sum - exact sum| / divisor`` any order of float32 additions can give, per
    output: ``gamma_(K-1) * sum_k |x w| / divisor`` with ``gamma_n = n u / (1 - n u)``, u = 2^-24
    (Higham, Accuracy and Stability, eq. 4.4); ``weights`` float64 ``[E, N, K]``."""
    k = weights.shape[-1]
    u = 2.0**-24
    gamma = (k - 1) * u / (1 - (k - 1) * u)
    xa = x.to(torch.float64).abs()
    out = torch.empty(x.shape[0], weights.shape[1], dtype=torch.float64)
    for e in range(weights.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = gamma * (xa[lo:hi] @ weights[e].abs().T) / float(divisor[e])
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m tracefp4.formats.cgemm build``: compile (or find) the kernel and say which path runs."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["build"]:
        print("usage: python -m tracefp4.formats.cgemm build", file=sys.stderr)
        return 2
    if _load() is None:
        print(f"tracefp4: packed FP4 CPU kernel not built ({_reason}); the dense torch path will be used")
        return 0
    path = _library_path(_compiler())
    paths = "AMX and AVX-512 BF16" if has_amx() else "AVX-512 BF16" if has_avx512_bf16() else "portable C"
    print(f"tracefp4: packed FP4 CPU kernel {path} ({paths} paths)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
