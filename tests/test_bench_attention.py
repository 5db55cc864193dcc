"""``tracefp4 bench attention`` as a user runs it, and what makes its direct calls into vLLM's CPU ops
safe (:func:`tracefp4.engines.vllm.process.init_cpu_ops`).

Each check runs in a child process: the AMX tile permission is process-wide and one-way, so a test
process where anything (our C library, oneDNN, an earlier test) already asked for it would hide the
crash these tests are about: vLLM's AMX attention dying of SIGILL (exit 132) in a process that never
asked (issue 46). On a CPU without AMX they check that the initialisation is harmless and truthful.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import subprocess
import sys

import pytest

from tracefp4.bench.result import load
from tracefp4.bench.suites.attention import IMPLS

pytestmark = pytest.mark.subprocess

#: The Linux x86-64 system call and arch_prctl codes the kernel's permission mask is read with.
_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1022, 18

#: Run in a fresh interpreter: the permission mask before and after init_cpu_ops, read from the
#: kernel itself (not from torch, whose helper init_cpu_ops uses), and the answers of two calls.
_PERMISSION_SCRIPT = f"""
import ctypes, json, torch
from tracefp4.engines.vllm.process import init_cpu_ops

def mask():
    libc = ctypes.CDLL(None, use_errno=True)
    m = ctypes.c_ulong(0)
    return m.value if libc.syscall({_SYS_ARCH_PRCTL}, {_ARCH_GET_XCOMP_PERM}, ctypes.byref(m)) == 0 else None

before = mask()
first = init_cpu_ops()
second = init_cpu_ops()
print(json.dumps({{"before": before, "after": mask(), "same": first is second, "tile": first.amx_tile,
                  "permitted": first.amx_permitted, "torch_tile": bool(torch.cpu._is_amx_tile_supported())}}))
"""


def _tiledata(mask: int | None) -> bool:
    return mask is not None and bool(mask >> _XFEATURE_XTILEDATA & 1)


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                    reason="the AMX tile permission is Linux x86-64's (arch_prctl)")
def test_init_cpu_ops_requests_the_amx_tile_state_and_says_so() -> None:
    """A fresh process holds no tile permission; after init_cpu_ops it holds it exactly where the
    CPU has AMX tiles, and the answer (recorded once, the same object on a second call) is what the
    kernel's permission mask says. On a CPU without AMX: no error, nothing granted, False recorded."""
    out = subprocess.run([sys.executable, "-c", _PERMISSION_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["same"], "init_cpu_ops must record its answer once (idempotent)"
    assert got["tile"] == got["torch_tile"], got  # the CPUID answer vLLM's ISA choosers act on
    assert not _tiledata(got["before"]), f"the child already held the tile state before init_cpu_ops: {got}"
    assert got["permitted"] == _tiledata(got["after"]), got
    if got["tile"]:  # vLLM would pick its AMX kernels here: the permission must be held
        assert got["permitted"], f"AMX CPU, but the tile state was not granted: {got}"
    else:
        assert not got["permitted"], got


def _expected_records(contexts: tuple[int, ...], engine: str) -> set[tuple]:
    """(metric, engine, mode, context) of every record the attention suite documents."""
    out = set()
    for c in contexts:
        for metric in ("attention_s_per_step", "attention_kv_bytes"):
            out |= {(metric, "tracefp4", "fp4", c), (metric, engine, "bf16", c)}
        out |= {("attention_ratio", None, None, c), ("attention_max_rel_diff", None, None, c)}
    return out


def test_bench_attention_command_at_toy_size(tmp_path) -> None:
    """``tracefp4 bench attention`` end to end in its own process (where vLLM's AMX attention died of
    SIGILL on Sapphire Rapids): exit 0, the table on stdout, and the JSON with exactly the documented
    records. With vLLM installed the BF16 side must be vLLM's op (not the SDPA fallback), and the record
    says whether the process holds the AMX tile state."""
    from tracefp4.formats import ckv, clib

    if not ckv.available():
        pytest.skip(f"the C library is unavailable: {clib.unavailable_reason()}")
    contexts = (128, 200)
    path = tmp_path / "attention.json"
    cmd = [sys.executable, "-m", "tracefp4", "bench", "attention",
           *(a for c in contexts for a in ("--context", str(c))), "--batch", "2", "--heads", "4", "--kv-heads", "2",
           "--head-dim", "32", "--repeats", "1", "--json", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"exit {out.returncode} (132/-4: SIGILL)\n{out.stderr[-3000:]}"
    (run,), _ = load(path)
    has_vllm = importlib.util.find_spec("vllm") is not None
    bf16 = "vllm_bf16" if has_vllm else "sdpa_bf16"
    got = {(r.metric, r.engine, r.mode, r.shape["context"]) for r in run.records}
    expected = _expected_records(contexts, IMPLS[bf16][0])
    assert got == expected and len(run.records) == len(expected), sorted(got ^ expected)
    assert run.record("attention_ratio", context=contexts[0]).spread is not None
    machine = run.machine
    assert machine["bf16_impl"] == bf16
    assert set(machine) == {"cpu_model", "cpu_capability", "torch_threads", "avx512_bf16", "amx", "vllm_amx_permitted",
                            "bf16_impl", "bf16_isa", "vllm"}
    if has_vllm:
        assert isinstance(machine["vllm_amx_permitted"], bool)
        # vLLM's AMX kernels ran only where the permission was held
        assert machine["bf16_isa"] != "amx" or machine["vllm_amx_permitted"], machine
    else:
        assert machine["vllm_amx_permitted"] is None and machine["bf16_isa"] == "sdpa"
    assert {k: v for k, v in run.config.items() if k != "command"} == {"batch": 2, "heads": 4, "kv_heads": 2, "head_dim": 32, "fmt": "nvfp4",
                                      "block_size": 128, "rounds": 1}
    for c in contexts:
        assert run.value("attention_s_per_step", "tracefp4", context=c) > 0
        assert run.value("attention_s_per_step", *IMPLS[bf16], context=c) > 0
        assert run.value("attention_max_rel_diff", context=c) < 2e-2  # same rows on both sides: rounding only
    assert "fp4/bf16" in out.stdout and f"{bf16}" in out.stdout
