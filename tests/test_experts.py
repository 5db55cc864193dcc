"""The expert-GEMM seam: what each backend says it runs, the oracle's walk in priority order, and the
backend's storage given as module parameters and taken back unchanged."""

from __future__ import annotations

import pytest
import torch

from tracefp4.engines.experts import Routing, choose_gemm, gemm_named
from tracefp4.engines.experts.base import SILU_GATE, ExpertGEMM
from tracefp4.engines.experts.cpu_fp4 import pack
from tracefp4.engines.experts.oracle import BACKENDS, first_supporting
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.formats import clib
from tracefp4.formats.constants import Format

PLANS = {"bf16": None, "w4a4": PrecisionPlan(), "w4a8": PrecisionPlan.w4a8(), "mxfp4": PrecisionPlan.mxfp4(),
         "fp8": PrecisionPlan.fp8()}
FP4_PLANS = ("w4a4", "w4a8", "mxfp4")
DENSE, PACKED = gemm_named("dense"), gemm_named("cpu_fp4")
KERNEL = clib.available()


def _weight(e: int = 4, n: int = 32, k: int = 64, seed: int = 0) -> torch.Tensor:
    return (torch.randn(e, n, k, generator=torch.Generator().manual_seed(seed)) * 0.1).to(torch.bfloat16)


def _same(a, b) -> bool:
    """Two prepared weights hold the very same tensors and metadata."""
    pa, pb = a.__dict__, b.__dict__
    return pa.keys() == pb.keys() and all(pa[f] is pb[f] if isinstance(pa[f], torch.Tensor) else pa[f] == pb[f]
                                          for f in pa)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("device", ["cpu", "cuda", torch.device("cpu")], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("gradients", [False, True])
def test_supports_answers_per_plan_device_dtype(plan, device, dtype, gradients, monkeypatch):
    """dense runs every forward; cpu_fp4 exactly the FP4 rollouts on the CPU with bf16 activations,
    where the C kernel is built (and only then is the kernel asked for)."""
    assert DENSE.supports(PLANS[plan], device, dtype, gradients=gradients)
    fp4_rollout_here = plan in FP4_PLANS and not gradients and str(device) == "cpu" and dtype == torch.bfloat16
    assert PACKED.supports(PLANS[plan], device, dtype, gradients=gradients) == (fp4_rollout_here and KERNEL)
    asked = []
    monkeypatch.setattr(clib, "available", lambda: asked.append(1) and False)
    assert not PACKED.supports(PLANS[plan], device, dtype, gradients=gradients)
    assert len(asked) == fp4_rollout_here


def test_the_oracle_walks_the_backends_in_priority_order(monkeypatch):
    """The first backend that supports a forward runs it: cpu_fp4, triton_fp4, triton_bf16, dense, so
    FP4 bf16 rollouts take the packed kernel of their device (the C kernel on the CPU, the Triton one
    on CUDA), BF16 rollouts on CUDA the Triton kernel over bf16 weights, and every other forward (BF16
    on the CPU, FP8, the trainer's gradients) falls through to dense; the same walk in the other order
    never reaches another; a walk no backend answers names those it asked."""
    monkeypatch.delenv("TRACEFP4_EXPERTS_BACKEND", raising=False)
    assert list(BACKENDS) == ["cpu_fp4", "triton_fp4", "triton_bf16", "dense"]
    triton, triton_bf16 = BACKENDS["triton_fp4"], BACKENDS["triton_bf16"]
    for name, plan in PLANS.items():
        for device, dtype, gradients in [("cpu", torch.bfloat16, False), ("cpu", torch.bfloat16, True),
                                         ("cpu", torch.float32, False), ("cuda", torch.bfloat16, False),
                                         ("cuda", torch.bfloat16, True)]:
            rollout = name in FP4_PLANS and dtype == torch.bfloat16 and not gradients
            want = PACKED if rollout and device == "cpu" and KERNEL else triton if rollout and device == "cuda" else DENSE
            if plan is None and (device, dtype, gradients) == ("cuda", torch.bfloat16, False):
                want = triton_bf16
            got = choose_gemm(plan, device, dtype, gradients=gradients)
            assert got is want, (name, device, dtype, gradients)
            assert first_supporting([DENSE, PACKED, triton, triton_bf16], plan, device, dtype, gradients=gradients) is DENSE
    with pytest.raises(ValueError, match=r"no expert GEMM backend runs plan .* on cuda .* \(asked: cpu_fp4\)"):
        first_supporting([PACKED], PrecisionPlan(), "cuda", torch.bfloat16, gradients=False)


def test_a_forced_backend_is_taken_for_rollouts_only(monkeypatch):
    monkeypatch.setenv("TRACEFP4_EXPERTS_BACKEND", "dense")
    assert choose_gemm(PrecisionPlan(), "cpu", torch.bfloat16, gradients=False) is DENSE
    monkeypatch.setenv("TRACEFP4_EXPERTS_BACKEND", "cpu_fp4")
    assert choose_gemm(PrecisionPlan(), "cpu", torch.float32, gradients=False) is PACKED  # raises later, not here
    assert choose_gemm(PrecisionPlan(), "cpu", torch.bfloat16, gradients=True) is DENSE
    assert choose_gemm(None, "cpu", torch.bfloat16, gradients=False) is DENSE
    monkeypatch.setenv("TRACEFP4_EXPERTS_BACKEND", "marlin")
    with pytest.raises(ValueError, match="unknown expert GEMM backend 'marlin'; known: cpu_fp4, triton_fp4, triton_bf16, dense"):
        choose_gemm(PrecisionPlan(), "cpu", torch.bfloat16, gradients=False)


@pytest.mark.parametrize("plan", list(PLANS))
def test_dense_parameters_round_trip(plan):
    """The dense weight as parameters (``weight``, and ``divisor`` where there is one) and back: the
    very tensors, no copy, and the same product bit for bit."""
    w = _weight()
    q = None if PLANS[plan] is None else PLANS[plan].weight_quantizer
    prepared = DENSE.prepare(w, q)
    held = DENSE.to_parameters(prepared)
    assert set(held.tensors) == ({"weight"} if q is None else {"weight", "divisor"}) and held.spec is None
    back = DENSE.from_parameters(held.tensors, held.spec)
    assert _same(back, prepared) and back.shape == prepared.shape and back.nbytes == prepared.nbytes
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    routing = Routing(torch.tensor([[0], [3], [3], [1], [0]]), 4)
    assert torch.equal(DENSE.matmul(x, back, routing, per_token=True).view(torch.int16),
                       DENSE.matmul(x, prepared, routing, per_token=True).view(torch.int16))


@pytest.mark.parametrize("layout", list(clib.Layout))
@pytest.mark.parametrize("plan", FP4_PLANS)
def test_packed_parameters_round_trip(plan, layout):
    """The packed weight as parameters (codes, scale bytes, divisor; the spec: format and layout) and
    back: the very tensors, no copy, in either layout."""
    q = PLANS[plan].weight_quantizer
    prepared = pack(_weight(), q, layout)
    held = PACKED.to_parameters(prepared)
    assert set(held.tensors) == {"weight", "weight_scale", "divisor"}
    assert held.spec == (Format(q.fmt), layout)
    back = PACKED.from_parameters(held.tensors, held.spec)
    assert _same(back, prepared) and back.shape == prepared.shape == (4, 32, 64)
    assert torch.equal(back.standard_codes(), prepared.standard_codes())


@pytest.mark.needs_clib
@pytest.mark.parametrize("plan", FP4_PLANS)
def test_packed_weights_from_parameters_multiply_as_prepared(plan):
    """A forward through weights rebuilt from their parameters (what the vLLM method does every call)
    is bit for bit the one through the prepared weights (gate-up, SiLU gate, down, top-k sum)."""
    q = PLANS[plan].weight_quantizer
    w13, w2 = _weight(4, 64, 64, seed=2), _weight(4, 64, 32, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    routing = Routing(torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)]), 4)
    weights = torch.softmax(torch.randn(6, 2, generator=g), -1).to(torch.bfloat16)

    def forward(a, b) -> torch.Tensor:
        mid = PACKED.activate(PACKED.matmul(x, a, routing, per_token=True), SILU_GATE)
        return PACKED.combine(PACKED.matmul(mid, b, routing, per_token=False).reshape(6, 2, -1), weights)

    prepared = [PACKED.prepare(w, q) for w in (w13, w2)]
    rebuilt = [PACKED.from_parameters(h.tensors, h.spec) for h in map(PACKED.to_parameters, prepared)]
    assert torch.equal(forward(*rebuilt).view(torch.int16), forward(*prepared).view(torch.int16))


@pytest.mark.parametrize("gemm", [DENSE, PACKED], ids=lambda g: g.name)
def test_from_parameters_names_what_is_wrong(gemm: ExpertGEMM):
    held = gemm.to_parameters(gemm.prepare(_weight(), PrecisionPlan().weight_quantizer))
    with pytest.raises(ValueError, match=rf"the {gemm.name} expert GEMM stores a weight as .*, got \['divisor'\]"):
        gemm.from_parameters({"divisor": held.tensors["divisor"]}, held.spec)
    with pytest.raises(ValueError, match=rf"the {gemm.name} expert GEMM stores a weight as .*'bias'"):
        gemm.from_parameters({**held.tensors, "bias": held.tensors["divisor"]}, held.spec)
    with pytest.raises(ValueError, match=rf"the {gemm.name} expert GEMM's .*spec.*'tiles'"):
        gemm.from_parameters(held.tensors, "tiles")
