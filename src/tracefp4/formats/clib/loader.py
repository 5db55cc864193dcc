"""Build and load the C library of the CPU kernels (``csrc/kernels.c`` and the headers it includes).

Build: on first use (or ``python -m tracefp4.formats.clib build``), the C file is compiled with
``$CC`` (default ``cc``) into a cache folder (``$TRACEFP4_CACHE_DIR``, else
``$XDG_CACHE_HOME/tracefp4``, else ``~/.cache/tracefp4``) under a name derived from the sources, the
compiler and the machine; the library is written to a temporary name and renamed, so a half-written
one is never loaded. Where there is no compiler (or ``TRACEFP4_CPU_KERNEL=0``), :func:`available`
is False and says why once; callers then use the dense torch path and the numba kernels.

Required: ``TRACEFP4_REQUIRE_CLIB=1`` (CI sets it, ``.ci/run``) turns a library that cannot be built
from that fallback into an error where it is checked: ``python -m tracefp4.formats.clib build`` (run
by ``make setup``) exits 1, and a test that needs the library fails instead of skipping
(tests/conftest.py), so that a compile error on some compiler or CPU cannot leave CI green while its
users silently get the fallback.

Threads: built with OpenMP where the compiler has it, the kernels run on the process's OpenMP
threads, which are PyTorch's own (torch is imported first and its ``libgomp.so.1`` answers the
library's dependency): one set of threads for torch's ops and ours, none spinning while the other
works (a second pool beside torch's, numba's OpenMP layer for one, starves torch on small machines).
Without OpenMP the library keeps a pool of its own, woken per call.
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
import uuid
import warnings
from pathlib import Path

__all__ = ["REQUIRE_VARIABLE", "SOURCE", "available", "build", "has_amx", "has_avx512_bf16", "library",
           "library_path", "main", "required", "unavailable_reason"]

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "kernels.c"
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c11", "-D_POSIX_C_SOURCE=200809L", "-fno-strict-aliasing"]

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
#: Argument types of every entry point, declared once at load (ctypes would otherwise pass the int64
#: shapes as C ints).
_SIGNATURES = {
    "tfp4_grouped_gemm": [_P, _P, _P, _P, _P, _INT, _P, _P, _I64, _I64, _I64, _I64, _INT, _INT, _INT],
    "tfp4_routed_gemm": [_P, _P, _I64, _P, _P, _P, _INT, _P, _P, _I64, _I64, _I64, _I64, _INT, _INT, _INT, _P],
    "tfp4_nvfp4_quantize": [_P, _I64, _I64, _P, _INT, _P, _P, _P, _INT, _INT, _P],
    "tfp4_nvfp4_quantize_f32": [_P, _I64, _I64, _P, _INT, _P, _P, _INT, _INT, _P],
    "tfp4_abs_max": [_P, _I64, _INT, _INT, _INT, _P],
    "tfp4_block_amax": [_P, _INT, _I64, _I64, _P, _INT, _INT, _P],
    "tfp4_nvfp4_quantize_blocks": [_P, _INT, _I64, _I64, _P, _P, _P, _P, _P, _INT, _INT],
    "tfp4_dequantize": [_P, _P, _P, _P, _I64, _I64, _INT, _P, _INT, _INT, _INT],
    "tfp4_guided": [_P, _P, _P, _P, _P, _INT, _I64, _I64, _INT, _P, _P, _INT, _INT],
    "tfp4_lsb_bits": [_P, _I64, _P, _INT, _INT],
    "tfp4_fp8_quantize": [_P, _INT, _I64, _I64, _P, _P, _P, _INT, _INT],
    "tfp4_fp8_dequantize": [_P, _P, _P, _I64, _I64, _P, _INT, _INT],
    "tfp4_mxfp4_quantize": [_P, _INT, _I64, _I64, _INT, _P, _P, _P, _INT, _INT],
    "tfp4_topk_combine": [_P, _P, _I64, _I64, _I64, _P, _INT, _INT],
    "tfp4_silu_gate": [_P, _I64, _I64, _P, _P, _INT, _INT],
    "tfp4_kv_attention": [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _INT, _I64, _INT, _P, _I64, _I64,
                          _P, _P, _P, ctypes.c_float, _P, _INT, _INT, _P],
    "tfp4_kv_decode_rows": [_P, _P, _P, _I64, _I64, _P, _INT, _INT, _INT, _P],
    "tfp4_has_avx512bf16": [],
    "tfp4_has_amx": [],
}

#: The environment variable that makes the library required (see the module docstring).
REQUIRE_VARIABLE = "TRACEFP4_REQUIRE_CLIB"

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


def library_path(cc: str) -> Path:
    """Where the library built by ``cc`` from the current sources is cached."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    sources = b"".join(f.name.encode() + f.read_bytes() for f in sorted(SOURCE.parent.glob("*.[ch]")))
    key = hashlib.sha256(sources + version.encode() + " ".join(_FLAGS + ["-fopenmp?"]).encode()
                         + platform.machine().encode() + sys.platform.encode()).hexdigest()[:16]
    return _cache_dir() / f"kernels-{key}.so"


def build() -> Path:
    """Compile the library (if it is not cached yet); returns its path.
    Raises RuntimeError with the compiler's message when that fails."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')} not found on PATH)")
    path = library_path(cc)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        # with OpenMP (the kernels then run on the OpenMP threads PyTorch runs on), else a pool of their own
        for extra in (["-fopenmp"], []):
            proc = subprocess.run([cc, *_FLAGS, *extra, "-o", str(tmp), str(SOURCE), "-lpthread"], capture_output=True,
                                  text=True, timeout=300)
            if proc.returncode == 0:
                break
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE.name} (exit status {proc.returncode}): "
                               f"{proc.stderr.strip()[-2000:] or 'no message on stderr'}")
        os.replace(tmp, path)  # whole or not at all: a reader never sees a half-written library
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _open() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library, or None where it could not be built (:func:`unavailable_reason` says why)."""
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
            _lib = _open()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            _reason = str(e)
        return _lib


def available() -> bool:
    """True when the library is built and loaded; otherwise warns once with the reason (callers fall
    back to the dense torch path)."""
    global _warned
    ok = library() is not None
    if not ok and not _warned:
        _warned = True
        warnings.warn(f"tracefp4: packed FP4 CPU kernel unavailable ({_reason}); using the dense torch path",
                      RuntimeWarning, stacklevel=2)
    return ok


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    library()
    return _reason


def has_avx512_bf16() -> bool:
    """Whether the library runs its AVX-512 BF16 paths on this CPU."""
    lib = library()
    return bool(lib is not None and lib.tfp4_has_avx512bf16())


def has_amx() -> bool:
    """Whether the GEMM runs its AMX path here (the CPU has AMX-BF16 and the OS grants the tile
    state: Linux 5.16 or later)."""
    lib = library()
    return bool(lib is not None and lib.tfp4_has_amx())


def required() -> bool:
    """Whether ``TRACEFP4_REQUIRE_CLIB=1``: a library that cannot be built is then an error, not the
    fallback. Raises ValueError on any value but unset, empty, ``0`` or ``1`` (a ``true`` or ``yes``
    read as "not required" would reopen the hole the variable closes)."""
    value = os.environ.get(REQUIRE_VARIABLE, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{REQUIRE_VARIABLE}={value!r}: expected 1 (the C library must build) or 0/unset")
    return value == "1"


def _paths_line() -> str:
    """Which code paths the loaded library runs on this machine: ``tfp4_has_*`` answer for the build
    and the CPU together (a path the compiler could not build, or the CPU or OS cannot run, is off)."""
    on = ["portable C"] + (["AVX-512 BF16"] if has_avx512_bf16() else [])
    off = [] if has_avx512_bf16() else ["AVX-512 BF16 (needs a CPU with AVX-512 BF16)"]
    if has_amx():
        on.append("AMX")
    else:
        off.append("AMX (needs AMX-BF16 and AMX-TILE, Linux 5.16 or later, GCC 11 or Clang 12 or later)")
    return f"paths run here: {', '.join(on)}" + (f"; not run: {', '.join(off)}" if off else "")


def main(argv: list[str] | None = None) -> int:
    """``python -m tracefp4.formats.clib build``: compile (or find) the library and say which code paths
    it runs here. Where it cannot be built: a warning and exit 0 (the dense torch path and numba are
    used, as at run time), or exit 1 under ``TRACEFP4_REQUIRE_CLIB=1``."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["build"]:
        print("usage: python -m tracefp4.formats.clib build", file=sys.stderr)
        return 2
    try:
        must = required()
    except ValueError as e:
        print(f"tracefp4: error: {e}", file=sys.stderr)
        return 2
    if library() is None:
        if must:
            print(f"tracefp4: error: the packed FP4 CPU kernel library is required ({REQUIRE_VARIABLE}=1) but "
                  f"unavailable: {_reason} (source: {SOURCE})", file=sys.stderr)
            return 1
        print(f"tracefp4: warning: packed FP4 CPU kernel not built ({_reason}); the dense torch path will be used")
        return 0
    print(f"tracefp4: packed FP4 CPU kernel {library_path(_compiler())}")
    print(f"tracefp4: {_paths_line()}")
    return 0
