"""The GPU path without a GPU: the Triton routed FP4 GEMM (``triton_fp4``) against the readable
reference, and the rollout's sites and routed experts on the Triton path without host reads.

Exactness, as tests/test_fp4_gemm.py argues for the C kernel: where every float32 partial sum is
representable (small dyadic operands) any order of additions gives the exact sum, so the kernel equals
``grouped_gemm_reference`` bit for bit; elsewhere it is within that file's any-order bound
(``bound``: the accumulation error ``gamma_(K-1) sum |x w|`` of any order, then the float32 division
and the bf16 rounding).

Without a CUDA device everything here runs under Triton's interpreter (``TRITON_INTERPRET=1``, set
before triton's first import; when another module imported triton first, the tests run whole in a
fresh process, as in tests/test_triton.py). The interpreter multiplies the kernel's float32 copy of
the bf16 operands (its bf16 ``tl.dot`` misreads them): same products, exactly; what the device's
bf16 tensor cores add up is checked by ``scripts/gpu_check.py``, which runs this file on CUDA
(the tests marked ``cuda`` need a device and are skipped here).
"""

from __future__ import annotations

import os
import re
import sys
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

_CHILD_FLAG = "TRACEFP4_TRITON_EXPERTS_FRESH_PROCESS"
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import (see the module docstring)

import triton.language as tl  # noqa: E402

from fresh_interpreter import run_in_fresh_interpreter  # noqa: E402
from test_fp4_gemm import COUNTS, bound, packed  # noqa: E402
from tracefp4.engines import cuda_graph  # noqa: E402
from tracefp4.engines.capture import RolloutCapture  # noqa: E402
from tracefp4.engines.device_sites import NON_FINITE, StepChecks, site_values  # noqa: E402
from tracefp4.engines.experts import Routing, gemm_named, routed_experts  # noqa: E402
from tracefp4.engines.experts.base import SILU_GATE  # noqa: E402
from tracefp4.engines.model import from_config, tiny_config  # noqa: E402
from tracefp4.engines.plan import PrecisionPlan  # noqa: E402
from tracefp4.engines.protocol import SamplingParams  # noqa: E402
from tracefp4.engines.rollout import generate  # noqa: E402
from tracefp4.engines.sites import ForwardState  # noqa: E402
from tracefp4.engines.trainer import code_mismatch, forward_rollout  # noqa: E402
from tracefp4.formats import clib, dispatch  # noqa: E402
from tracefp4.formats import reference_composite as refc  # noqa: E402
from tracefp4.formats.constants import Format  # noqa: E402
from tracefp4.formats.quantizers import MXFP4Quantizer, NVFP4Quantizer  # noqa: E402
from tracefp4.guidance.compact import GuidedMode  # noqa: E402
from tracefp4.guidance.names import Site, layer_tag, record_prefix  # noqa: E402

_FRESH_PROCESS = not torch.cuda.is_available() and type(tl.standard.sum).__name__ != "InterpretedFunction"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
in_process = pytest.mark.skipif(_FRESH_PROCESS, reason="triton was imported before its interpreter could be "
                                "enabled; test_in_a_fresh_interpreter_process runs these")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.py)")
pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


# The tests the fresh process leaves out, by name (tests/conftest.py starts it with them deselected):
# the CUDA ones, which it could only skip (it exists only where there is no CUDA device). Every other
# test must then pass there, and the count of deselected tests (these, with their parameters, and the
# fresh-process test itself) says each name still names a test.
_NO_TRITON = ("test_a_decode_layer_issues_no_cuda_sync", "test_a_decode_layer_replays_in_a_cuda_graph")
_DESELECTED_IN_CHILD = 4  # the no-sync test (two GEMMs), the graph test, the fresh-process test


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.skipif(not _FRESH_PROCESS, reason="the tests run in this process")
def test_in_a_fresh_interpreter_process():
    """Exit 0 alone would pass with every test of the child skipped (its interpreter off, say):
    what ran is read from its summary, as tests/test_triton.py does."""
    proc = run_in_fresh_interpreter(__file__, _CHILD_FLAG, timeout=1200, ran_here=_NO_TRITON)
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and not any(word in summary for word in ("skipped", "xfail", "xpass", "error",
                                                                         "failed")), proc.stdout[-2000:]
    assert f" {_DESELECTED_IN_CHILD} deselected" in summary, summary


def triton_path():
    """CPU tensors (under the interpreter) routed to the Triton kernels; CUDA tensors go there anyway."""
    return dispatch.use_backend("triton")


def routed(x, ids, e, codes, scales, divisor, fmt, *, per_token: bool):
    """The backend's matmul on device copies -> (result on the CPU, the reference's rows in pair order)."""
    gemm = gemm_named("triton_fp4")
    weight = gemm.from_parameters({"weight": codes.to(DEVICE), "weight_scale": scales.to(DEVICE),
                                   "divisor": divisor.to(DEVICE)}, Format(fmt))
    routing = Routing(ids.to(DEVICE), e)
    out = gemm.matmul(x.to(DEVICE), weight, routing, per_token=per_token).cpu()
    order, offsets, inverse = (t.cpu() for t in routing.grouped)
    rows = x[order // ids.shape[1]] if per_token else x[order]
    return out, rows, order, offsets, inverse


def ids_for(counts: list[int], top_k: int, seed: int) -> torch.Tensor:
    """Expert ids ``[T, top_k]`` with expert e named counts[e] times, shuffled (pairs need not be sorted)."""
    flat = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    flat = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))]
    return flat.reshape(-1, top_k)


def dyadic_weights(e: int, n: int, k: int, fmt: str, g: torch.Generator):
    """Codes, scales of {1/2, 1, 2} and power-of-two divisors: every product and partial sum exact."""
    block = 16 if fmt == "nvfp4" else 32
    codes = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)
    choice = torch.randint(0, 3, (e, n, k // block), generator=g)
    if fmt == "nvfp4":  # E4M3 bytes of 0.5, 1, 2
        scales = torch.tensor([0x30, 0x38, 0x40], dtype=torch.uint8)[choice]
        divisor = 2.0 ** torch.randint(-2, 4, (e,), generator=g).float()
    else:  # E8M0 exponents -1, 0, 1
        scales = torch.tensor([126, 127, 128], dtype=torch.uint8)[choice]
        divisor = torch.ones(e)
    return codes, scales, divisor


# counts per expert, in multiples of top_k 2 (some with more rows than one 16-row program, some none)
TRITON_COUNTS = {"ragged": [3, 0, 5, 1, 0, 7, 2, 4], "many_rows": [0, 19, 0, 10, 27, 0, 0, 2],
                 "one_expert": [0, 0, 0, 0, 0, 0, 6, 0]}


@in_process
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("counts", sorted(TRITON_COUNTS))
@pytest.mark.parametrize("k", [64, 96, 160])  # 96, 160: a K tile partly past K; whole MXFP4 blocks (32) all
@pytest.mark.parametrize("per_token", [True, False])
def test_exact_where_the_sums_are_exact(fmt, counts, k, per_token):
    g = torch.Generator().manual_seed(k)
    e, n = 8, 80  # 80: an N tile partly past N
    codes, scales, divisor = dyadic_weights(e, n, k, fmt, g)
    ids = ids_for(TRITON_COUNTS[counts], 2, seed=k)
    rows = ids.shape[0] if per_token else ids.numel()
    x = (torch.randint(-8, 9, (rows, k), generator=g).to(torch.float32) / 4).to(torch.bfloat16)
    out, grouped, _, offsets, inverse = routed(x, ids, e, codes, scales, divisor, fmt, per_token=per_token)
    want = refc.grouped_gemm_reference(grouped, offsets, codes, scales, divisor, fmt)[inverse]
    assert out.dtype == torch.bfloat16 and out.shape == (ids.numel(), n)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@in_process
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("counts", ["ragged", "many_rows"])
def test_within_the_accumulation_bound_on_real_weights(fmt, counts):
    """Weights quantized by the plan's weight quantizer (real scales and divisors), Gaussian rows."""
    g = torch.Generator().manual_seed(11)
    e, n, k = 8, 48, 256
    w = (torch.randn(e, n, k, generator=g) * torch.linspace(0.01, 3, e)[:, None, None]).to(torch.bfloat16)
    codes, scales, divisor = packed(w, fmt)
    ids = ids_for(COUNTS[counts], 1, seed=3)
    x = torch.randn(ids.numel(), k, generator=g).to(torch.bfloat16)
    out, grouped, _, offsets, inverse = routed(x, ids, e, codes, scales, divisor, fmt, per_token=False)
    exact = refc.grouped_gemm_exact(grouped, offsets, codes, scales, divisor, fmt)[inverse]
    acc = clib.accumulation_bound(grouped, offsets, refc.expert_weights(codes, scales, fmt), divisor)[inverse]
    assert bool(((out.to(torch.float64) - exact).abs() <= bound(exact, acc)).all())


@in_process
def test_output_rounding_edge_cases_and_subnormal_scales():
    """The epilogue bit for bit where it is delicate (exact sums, as above): divisors near 2^127 give
    bf16 subnormal outputs, tiny ones overflow to +-inf, a NaN row gives NaN as torch writes it
    (0x7FC0); E4M3 subnormal block scales (bytes 1..7) still make exact bf16 weights."""
    g = torch.Generator().manual_seed(3)
    e, n, k = 8, 48, 64
    codes = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.full((e, n, k // 16), 0x38, dtype=torch.uint8)  # E4M3 1.0
    scales[3] = torch.randint(1, 8, (n, k // 16), generator=g, dtype=torch.int64).to(torch.uint8)
    divisor = torch.tensor([2.0**127, 2.0**-125, 2.0**-120, 1.0, 1.0, 2.0**125, 2.0**-125, 2.0**126])
    ids = ids_for([3, 2, 4, 3, 1, 2, 3, 2], 1, seed=5)
    x = (torch.randint(-8, 9, (ids.numel(), k), generator=g).to(torch.float32) / 4).to(torch.bfloat16)
    x[4] = float("nan")
    out, grouped, order, offsets, inverse = routed(x, ids, e, codes, scales, divisor, "nvfp4", per_token=False)
    want = refc.grouped_gemm_reference(grouped, offsets, codes, scales, divisor, "nvfp4")[inverse]
    rows = torch.arange(ids.numel()) != 4
    assert torch.equal(out[rows].view(torch.int16), want[rows].view(torch.int16))
    assert bool((out[4].view(torch.int16) == 0x7FC0).all())  # the NaN the CPU backend writes
    finite = out[rows].float()
    assert bool(torch.isinf(finite).any()) and bool(((finite != 0) & (finite.abs() < 2.0**-126)).any())


@in_process
@pytest.mark.parametrize("counts", sorted(TRITON_COUNTS))
@pytest.mark.parametrize("per_token", [True, False])
def test_bf16_weights_equal_the_dense_backend_on_exact_sums(counts, per_token):
    """triton_bf16 (the kernel over bf16 weights, the BF16 rollout on CUDA) against the dense backend's
    bf16 F.linear: ``bf16(fl32(x @ w.T))`` both, bit for bit where the sums are exact."""
    g = torch.Generator().manual_seed(7)
    e, n, k = 8, 80, 96
    w = (torch.randint(-8, 9, (e, n, k), generator=g).to(torch.float32) / 8).to(torch.bfloat16)
    ids = ids_for(TRITON_COUNTS[counts], 2, seed=1)
    x = (torch.randint(-8, 9, (ids.shape[0] if per_token else ids.numel(), k), generator=g).float() / 4).to(torch.bfloat16)
    fast, dense = gemm_named("triton_bf16"), gemm_named("dense")
    got = fast.matmul(x.to(DEVICE), fast.prepare(w.to(DEVICE), None), Routing(ids.to(DEVICE), e), per_token=per_token)
    want = dense.matmul(x, dense.prepare(w, None), Routing(ids, e), per_token=per_token)
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="without gradients"):
        fast.prepare(w, NVFP4Quantizer("expert"))
    back = fast.from_parameters(fast.to_parameters(fast.prepare(w, None)).tensors, None)
    assert back.values is not None and torch.equal(back.values, w)


@in_process
def test_empty_routing_and_bad_operands():
    gemm = gemm_named("triton_fp4")
    codes, scales, divisor = (t.to(DEVICE) for t in dyadic_weights(4, 32, 64, "nvfp4", torch.Generator().manual_seed(0)))
    weight = gemm.from_parameters({"weight": codes, "weight_scale": scales, "divisor": divisor}, Format.NVFP4)
    assert weight.shape == (4, 32, 64)
    empty = gemm.matmul(torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE), weight,
                        Routing(torch.zeros(0, 2, dtype=torch.long, device=DEVICE), 4), per_token=True)
    assert empty.shape == (0, 32)
    ids = torch.zeros(3, 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="expected bf16 x"):
        gemm.matmul(torch.zeros(3, 64, device=DEVICE), weight, Routing(ids, 4), per_token=False)
    with pytest.raises(ValueError, match=r"x \(3, 48\).*do not make one \[E, N, K\] weight"):
        gemm.matmul(torch.zeros(3, 48, dtype=torch.bfloat16, device=DEVICE), weight, Routing(ids, 4), per_token=False)
    with pytest.raises(ValueError, match="operands on .* expected one CUDA device"):
        gemm.matmul(torch.zeros(3, 64, dtype=torch.bfloat16, device="meta"), weight, Routing(ids, 4), per_token=False)
    with pytest.raises(ValueError, match="spec is an FP4 Format"):
        gemm.from_parameters(gemm.to_parameters(weight).tensors, "nvfp4")
    with pytest.raises(ValueError, match="stores a weight as"):
        gemm.from_parameters({"weight": codes}, Format.NVFP4)
    with pytest.raises(ValueError, match="without gradients"):
        gemm.prepare(torch.zeros(2, 32, 64), NVFP4Quantizer("expert"), gradients=True)


@in_process
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_prepare_holds_the_quantizers_codes(fmt):
    w = torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    quantizer = PrecisionPlan(weights=Format(fmt), activations=fmt).weight_quantizer
    gemm = gemm_named("triton_fp4")
    prepared = gemm.prepare(w, quantizer)
    codes, scales, divisor = packed(w, fmt)
    assert torch.equal(prepared.codes, codes) and torch.equal(prepared.scales, scales)
    assert torch.equal(prepared.divisor, divisor) and prepared.nbytes == codes.nbytes + scales.nbytes + divisor.nbytes
    back = gemm.from_parameters(**dict(zip(("tensors", "spec"), (gemm.to_parameters(prepared).tensors, prepared.fmt))))
    assert back.codes is prepared.codes


# --- sites and routed experts on the device path, without host reads -------------------------------

QUANTIZERS = {"nvfp4 row": NVFP4Quantizer("row"), "nvfp4 tensor": NVFP4Quantizer("tensor"),
              "mxfp4 floor": MXFP4Quantizer("floor"), "mxfp4 rceil": MXFP4Quantizer("rceil")}


@in_process
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_site_values_equal_the_quantizers_own(name, dtype):
    quantizer = QUANTIZERS[name]
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(1)) * 3
    x[0, 1] = 0.0  # amax 0: S_enc 1
    x[1, 2] *= 1e-38  # 448 * 6 / amax past FLT_MAX: S_enc capped
    x = x.to(dtype)
    checks = StepChecks()
    with triton_path():
        q, values = site_values(quantizer, x.to(DEVICE), checks, "L0.expert_in")
    want_q, want_values = quantizer.quantize_values(x)  # the CPU kernels, checked against the reference
    assert torch.equal(q.codes.cpu(), want_q.codes)
    assert torch.equal(q.scales.cpu().view(torch.uint8), want_q.scales.view(torch.uint8))
    if name.startswith("nvfp4"):
        assert torch.equal(q.global_amax.cpu().view(torch.int32), want_q.global_amax.view(torch.int32))
    assert values.dtype == dtype and torch.equal(values.cpu(), want_values)
    checks.raise_if_any()  # finite input: nothing flagged


@in_process
def test_non_finite_inputs_are_refused_once_per_rollout_naming_the_site():
    x = torch.ones(4, 64)
    x[2, 9] = float("inf")
    checks = StepChecks()
    with triton_path():
        site_values(NVFP4Quantizer("row"), x.to(DEVICE), checks, "L3.expert_mid")  # no raise at the call
        site_values(NVFP4Quantizer("row"), torch.ones(4, 64).to(DEVICE), checks, "L4.expert_in")
        site_values(NVFP4Quantizer("row"), x.to(DEVICE), checks, "L3.expert_mid")
    with pytest.raises(ValueError, match=rf"^L3.expert_mid: {re.escape(NON_FINITE)} \(flagged on the device") as err:
        checks.raise_if_any()
    assert "L4" not in str(err.value)
    checks.raise_if_any()  # read once: the flags start over
    with pytest.raises(ValueError, match="non-finite input at index"):  # elsewhere: refused at the call
        site_values(NVFP4Quantizer("row"), x, StepChecks(), "L3.expert_mid")


_TRITON_PACKAGE = os.path.join("site-packages", "triton", "")  # the interpreter's own frames


class HostReads(TorchFunctionMode):
    """Counts the calls of our code that read a tensor's values back to the host (what synchronises
    with a GPU); calls from inside Triton's interpreter (its own host copies) are not ours."""

    # not .numpy(): it refuses a CUDA tensor, so it marks a CPU-only branch (numerics computes S_enc
    # in numpy for CPU tensors, in torch ops for CUDA ones), never a silent device sync
    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "nonzero"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS and not any(_TRITON_PACKAGE in f.filename for f in traceback.extract_stack()):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def moe_layer(seed: int = 0, e: int = 8, hidden: int = 64, inter: int = 32, tokens: int = 6, top_k: int = 2):
    """One routed-experts layer's operands: x, ids, weights, gate-up and down weights [E, N, K]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.1).to(torch.bfloat16)
    down = (torch.randn(e, hidden, inter, generator=g) * 0.1).to(torch.bfloat16)
    return x, ids, weights, gate_up, down


def decode_layer(gemm_name: str, device: str, plan: PrecisionPlan | None = PrecisionPlan()):
    """A rollout's routed-experts layer (an FP4 plan's sites recorded with full guidance; ``plan`` None:
    BF16) on ``device``: (state, run)."""
    x, ids, weights, gate_up, down = (t.to(device) for t in moe_layer())
    gemm = gemm_named(gemm_name)
    prepared = [gemm.prepare(w, None if plan is None else plan.weight_quantizer) for w in (gate_up, down)]
    guidance = None if plan is None else GuidedMode.parse("full@all")
    state = ForwardState(plan, RolloutCapture.of(guidance, frozenset() if plan is None else frozenset({0}), 1))
    return state, lambda: routed_experts(state, 0, x, ids, weights, *prepared, gemm, SILU_GATE)


@in_process
def test_a_decode_layer_on_the_device_path_reads_nothing_back():
    """The rollout's routed-experts layer on the Triton path (sites, routing, both GEMMs, gate,
    combine) reads no tensor back to the host, FP4 and BF16; the same layer on the CPU path does
    (the counter works)."""
    _, run_bf16 = decode_layer("triton_bf16", DEVICE, plan=None)
    with triton_path():
        run_bf16()
        with HostReads() as reads:
            run_bf16()
    assert reads.calls == []
    state, run = decode_layer("triton_fp4", DEVICE)
    with triton_path():
        run()  # first call: the flags are created, kernels compiled
        with HostReads() as reads:
            out = run()
    assert reads.calls == []
    state.path.checks.raise_if_any()
    assert out.shape == (6, 64) and bool(torch.isfinite(out.float()).all())
    record = state.path.take()
    assert sorted(record.guidance) == [record_prefix(0, Site.EXPERT_IN), record_prefix(0, Site.EXPERT_MID)]
    _, run_cpu = decode_layer("dense", "cpu")
    with HostReads() as reads:
        run_cpu()
    assert reads.calls, "the counter saw nothing on the CPU path, which reads flags and counts back"


@in_process
@pytest.mark.slow  # ~15 s on 2 cores: MXFP4 through the interpreter and the numba kernels' first compile
def test_the_device_path_equals_the_dense_backend_on_exact_sums():
    """routed_experts through triton_fp4 and through dense (same sites, same weights): both GEMMs are
    ``bf16(fl32(x @ w.T) / S_enc)``; on dyadic data where every sum is exact they agree bit for bit."""
    plan = PrecisionPlan(weights=Format.MXFP4, activations="mxfp4", kv_cache=Format.MXFP4)
    g = torch.Generator().manual_seed(4)
    x = (torch.randint(-8, 9, (5, 64), generator=g).float() / 4).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [3, 1], [2, 0], [1, 2], [3, 0]])
    weights = torch.full((5, 2), 0.5)
    codes, scales, _ = dyadic_weights(4, 64, 64, "mxfp4", g)
    gate_up = refc.expert_weights(codes, scales, "mxfp4").to(torch.bfloat16)
    down = gate_up[:, :, :32].contiguous()
    outs = []
    for name, backend, device in (("triton_fp4", "triton", DEVICE), ("dense", "numba", "cpu")):
        gemm = gemm_named(name)
        state = ForwardState(plan, RolloutCapture())
        with dispatch.use_backend(backend):
            prepared = [gemm.prepare(w.to(device), plan.weight_quantizer) for w in (gate_up, down)]
            args = (t.to(device) for t in (x, ids, weights))
            outs.append(routed_experts(state, 0, *args, *prepared, gemm, SILU_GATE).cpu())
        state.path.checks.raise_if_any()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


@in_process
def test_an_out_of_range_expert_index_is_flagged_on_the_device_path():
    state, _ = decode_layer("triton_fp4", DEVICE)
    x, ids, weights, gate_up, down = moe_layer()
    gemm = gemm_named("triton_fp4")
    prepared = [gemm.prepare(w.to(DEVICE), PrecisionPlan().weight_quantizer) for w in (gate_up, down)]
    ids[1, 0] = 8
    with triton_path():
        routed_experts(state, 2, x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), *prepared, gemm, SILU_GATE)
    with pytest.raises(ValueError, match=rf"{layer_tag(2)}: expert index out of range \[0, 8\)"):
        state.path.checks.raise_if_any()


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("gemm", ["triton_fp4", "triton_bf16"])
def test_a_decode_layer_issues_no_cuda_sync(gemm):
    state, run = decode_layer(gemm, "cuda", PrecisionPlan() if gemm == "triton_fp4" else None)
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    state.path.checks.raise_if_any()


@needs_cuda
@pytest.mark.cuda
def test_a_decode_layer_replays_in_a_cuda_graph():
    """Captured once, replayed: the same bits as the eager layer on the same inputs."""
    _, run = decode_layer("triton_fp4", "cuda")
    eager = run()
    _, _, captured = cuda_graph.capture(run)
    assert torch.equal(captured.view(torch.int16), eager.view(torch.int16))


@in_process
@pytest.mark.slow  # ~60 s on 2 cores: a whole rollout through Triton's interpreter
def test_a_rollout_on_the_triton_path_is_reproduced_by_the_trainer(monkeypatch):
    """Our engine's rollout as it runs on CUDA (triton_fp4 experts; expert, K and V sites on the
    Triton kernels with their checks deferred), on CPU tensors under the interpreter; the trainer on
    the CPU kernels, guided by its full records, picks every code the rollout picked."""
    cfg = tiny_config(layers=2, experts=4, top_k=2, hidden=64, moe_intermediate=32, heads=2, kv_heads=1, head_dim=32,
                      vocab=64, init_std=0.05, max_positions=64)
    model = from_config(cfg, seed=0).to(DEVICE)
    monkeypatch.setenv("TRACEFP4_EXPERTS_BACKEND", "triton_fp4")
    with triton_path():
        out = generate(model, [[1, 2, 3, 4, 5], [7, 8, 9]], SamplingParams(max_new_tokens=3, seed=1), plan=PrecisionPlan(),
                       guidance=GuidedMode.parse("full@all"), diagnostics=frozenset({0, 1}))
    monkeypatch.delenv("TRACEFP4_EXPERTS_BACKEND")
    with torch.no_grad():  # the trainer on the CPU kernels, the other implementation
        trainer = forward_rollout(model.cpu(), out, mode="trace", capture_codes=frozenset({0, 1}))
    stats = code_mismatch(trainer.codes, out.diagnostics)
    assert {s.removeprefix(layer_tag(0) + ".") for s in stats if s.startswith(layer_tag(0))} == {"k", "v", "expert_in",
                                                                                                "expert_mid"}
    assert all(s.total > 0 and s.mismatched == 0 for s in stats.values()), stats
