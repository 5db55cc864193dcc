"""The plugin's packed FP4 KV cache for vLLM, without an engine (tracefp4.engines.vllm.kv_layout / kv_backend).

The layout (planes that partition a layer's cache region, the slot's bytes), the query rows a vLLM
batch gives the C kernel, and the impl itself on a cache tensor shaped as vLLM binds it: the cache
update stores exactly the plan quantizer's codes, scales and amax at the slot mapping's slots (and the
rollout records those very codes), and attention over a mixed prefill + decode batch matches a
float64 causal attention over the dequantized rows within the kernel's float32 bound plus the bf16
rounding of the output. The engine-level tests are in tests/test_vllm_packed.py.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.vllm.kv_layout import KVStore, planes, resolve_kv_store, row_bytes, slot_bytes
from tracefp4.formats import ckv
from tracefp4.formats.constants import Format

U = 2.0**-24


def test_slot_bytes_are_the_packed_rows():
    """NVFP4 at head dim 128: codes 64 + E4M3 scales 8 + FP32 amax 4 per row, K and V: 152 bytes
    (0.297x BF16's 512); MXFP4: codes 64 + E8M0 scales 4."""
    assert row_bytes(Format.NVFP4, 128) == 76 and slot_bytes(Format.NVFP4, 128) == 152
    assert slot_bytes(Format.NVFP4, 128) / (2 * 128 * 2) == pytest.approx(0.296875)
    assert slot_bytes(Format.MXFP4, 128) == 136 and slot_bytes(Format.NVFP4, 64) == 80
    with pytest.raises(ValueError, match="fp8 with head dim 128"):
        row_bytes(Format.FP8, 128)
    with pytest.raises(ValueError, match="mxfp4 with head dim 48"):
        row_bytes(Format.MXFP4, 48)


@pytest.mark.parametrize("fmt", [Format.NVFP4, Format.MXFP4])
def test_planes_partition_the_region(fmt):
    """Every byte of the region belongs to exactly one plane; the planes are views (no copy)."""
    blocks, hkv, n, d = 3, 2, 16, 64
    region = torch.zeros(blocks, hkv, n, slot_bytes(fmt, d) // 2, dtype=torch.bfloat16)
    k, v = planes(region, fmt, hkv, d)
    tensors = [t for kv in (k, v) for t in (kv.codes, kv.scales, kv.amax) if t is not None]
    for i, t in enumerate(tensors):
        t.view(torch.uint8).fill_(i + 1)
    flat = region.view(torch.uint8).reshape(-1)
    counts = torch.bincount(flat.long(), minlength=len(tensors) + 1)
    assert counts[0] == 0 and [int(c) for c in counts[1:]] == [t.numel() * t.element_size() for t in tensors]
    assert k.codes.shape == (blocks * n, hkv, d // 2) and (k.amax is None) == (fmt is Format.MXFP4)
    k.check("k")
    v.check("v")
    with pytest.raises(ValueError, match="whole number of"):
        planes(region.view(-1)[:-2], fmt, hkv, d)
    with pytest.raises(ValueError, match="contiguous"):
        planes(region.transpose(1, 2), fmt, hkv, d)


def test_store_choice():
    """Packed by default for an FP4 K/V plan that serves itself only; values where the engine serves
    BF16 too or the K/V is FP8; packed asked for a plan it cannot hold is refused, naming the plan."""
    assert resolve_kv_store(PrecisionPlan(), False, None) is KVStore.PACKED
    assert resolve_kv_store(PrecisionPlan.mxfp4(), False, None) is KVStore.PACKED
    assert resolve_kv_store(PrecisionPlan(), True, None) is KVStore.VALUES
    assert resolve_kv_store(PrecisionPlan.fp8(), False, None) is KVStore.VALUES
    assert resolve_kv_store(PrecisionPlan(), True, "packed") is KVStore.PACKED
    for plan in (None, PrecisionPlan.fp8(), PrecisionPlan.w4a16()):
        with pytest.raises(ValueError, match="kv_store='packed' holds NVFP4 or MXFP4"):
            resolve_kv_store(plan, False, "packed")
    with pytest.raises(ValueError, match="kv_store: expected one of"):
        resolve_kv_store(PrecisionPlan(), False, "fp4")


vllm = pytest.importorskip("vllm")
needs_kernel = pytest.mark.needs_clib  # skipped without the library, failed under CI (tests/conftest.py)


def test_query_rows_of_a_mixed_batch():
    """A prompt of 3 (new sequence), a decode (length 9), a chunk of 2 continuing a length-5 prefix:
    row i attends to the keys up to and including its own position."""
    from tracefp4.engines.vllm.kv_backend import query_rows

    q_seq, q_len = query_rows(torch.tensor([0, 3, 4, 6], dtype=torch.int32), torch.tensor([3, 9, 7], dtype=torch.int32))
    assert q_seq.tolist() == [0, 0, 0, 1, 2, 2] and q_len.tolist() == [1, 2, 3, 9, 6, 7]
    assert q_seq.dtype == q_len.dtype == torch.int32


def _reference(q, k_rows, v_rows, scale):
    """Causal attention of query rows over key rows 0..len-1 in float64 (one sequence)."""
    s = (q.double() @ k_rows.double().T) * scale
    return torch.softmax(s, dim=-1) @ v_rows.double()


def _atol(q, k_rows, v_rows, scale, d, ref):
    """test_kv_attention's float32 bound of the kernel (scores to D + 1 roundings, exp within 8 ulp
    over ceil(L/16) chunk rescalings, n = L + C + 5 roundings per sum), per output element, plus the
    bf16 rounding of the output vLLM hands on (unit roundoff 2^-8, applied to |ref| + the fp32 bound)."""
    n_keys = k_rows.shape[0]
    chunks = math.ceil(n_keys / 16)
    gamma = lambda n: n * U / (1 - n * U)  # noqa: E731
    prods = (q.double().abs() @ k_rows.double().abs().T) * scale
    s = (q.double() @ k_rows.double().T) * scale
    r = float(s.max() - s.min())
    eta = math.exp(2 * U * r + gamma(d + 1) * float(prods.max())) * (1 + 8 * U) ** (chunks + 1) - 1
    nn = n_keys + chunks + 5
    vd = v_rows.double().abs().amax(dim=0)
    fp32 = (4 * eta / (1 - eta) + 2 * gamma(nn) / (1 - gamma(nn)) + 2 * U + 2 * n_keys * math.exp(-87)) * vd
    return fp32 + 2.0**-8 * (ref.abs() + fp32)


@needs_kernel
@pytest.mark.parametrize("plan", [PrecisionPlan(), PrecisionPlan.mxfp4()], ids=["nvfp4", "mxfp4"])
def test_update_stores_the_codes_and_attention_reads_them(plan):
    """A prompt of 5 tokens and a decode step of another sequence (length 18, over two blocks of 16),
    written by do_kv_cache_update at vLLM's slots, attended by forward: the cache holds the plan
    quantizer's codes (and the capture records the same), the output meets the float64 reference on
    both paths (the decode row through the C kernel, the prompt through dequantize-then-SDPA)."""
    from tracefp4.engines.capture import RolloutCapture
    from tracefp4.engines.vllm.kv_backend import PackedKVImpl, paging, query_rows
    from tracefp4.engines.vllm.runtime import RUNTIME
    from tracefp4.guidance.compact import GuidedMode

    fmt, hq, hkv, d, bs, blocks = plan.kv_cache, 4, 2, 64, 16, 6
    impl = PackedKVImpl(hq, d, 1 / math.sqrt(d), hkv, fmt=fmt, layer_name="model.layers.1.self_attn.attn")
    cache = torch.zeros(blocks, hkv, bs, slot_bytes(fmt, d) // 2, dtype=torch.bfloat16)
    layer = types.SimpleNamespace(layer_name=impl.layer_name)
    g = torch.Generator().manual_seed(0)
    rows = lambda n, h: (torch.randn(n, h, d, generator=g) * 2).to(torch.bfloat16)  # noqa: E731
    tables = torch.tensor([[4, 1], [2, 5]], dtype=torch.int32)  # sequence 0 (decoding): blocks 4, 1; 1: block 2
    keys, values = rows(18, hkv), rows(18, hkv)
    slot = lambda s, p: int(tables[s, p // bs]) * bs + p % bs  # noqa: E731
    RUNTIME.begin(plan, RolloutCapture.of(GuidedMode.parse("full@all"), frozenset(), 2))
    try:
        # history of sequence 0 (17 tokens), then one forward: its decode row + the 5-token prompt of 1
        impl.do_kv_cache_update(layer, keys[:17], values[:17], cache, torch.tensor([slot(0, p) for p in range(17)]))
        RUNTIME.capture.take()
        new_k, new_v = torch.cat([keys[17:18], keys[:5]]), torch.cat([values[17:18], values[:5]])
        mapping = torch.tensor([slot(0, 17)] + [slot(1, p) for p in range(5)] + [-1])  # -1: a padding row
        impl.do_kv_cache_update(layer, torch.cat([new_k, new_k[:1]]), torch.cat([new_v, new_v[:1]]), cache, mapping)
        record = RUNTIME.capture.take().guidance
    finally:
        RUNTIME.end()
    k, v = impl.planes(cache)
    quantizer = plan.quantizer("k")
    for name, x, pk in (("k", new_k, k), ("v", new_v, v)):
        want = quantizer.quantize(x)
        got = record[f"L01.{name}"].q
        assert torch.equal(got.codes[:6], want.codes) and torch.equal(got.scales[:6], want.scales)
        assert torch.equal(pk.codes[mapping[:6]], want.codes)
        assert torch.equal(pk.scales[mapping[:6]], want.scales.view(torch.uint8))
        if pk.amax is not None:
            assert torch.equal(pk.amax[mapping[:6]], want.global_amax.squeeze(-1))
    q = rows(6, hq)
    seq_lens = torch.tensor([18, 5], dtype=torch.int32)
    q_seq, q_len = query_rows(torch.tensor([0, 1, 6], dtype=torch.int32), seq_lens)
    meta = paging(6, tables, torch.tensor([0, 1, 6], dtype=torch.int32), seq_lens)
    assert meta.prompts == ((1, 1, 6),) and meta.decode_rows.tolist() == [0]  # the prompt goes to SDPA
    out = impl.forward(layer, q, None, None, cache, meta, torch.empty(7, hq, d, dtype=torch.bfloat16))
    deq_k, deq_v = ckv.dequantize_rows(k), ckv.dequantize_rows(v)
    for r, (s, n) in enumerate(zip(q_seq.tolist(), q_len.tolist())):
        idx = torch.tensor([slot(s, p) for p in range(n)])
        for h in range(hq):
            kr, vr = deq_k[idx, h * hkv // hq], deq_v[idx, h * hkv // hq]
            ref = _reference(q[r, h:h + 1], kr, vr, impl.scale)[0]
            tol = _atol(q[r, h:h + 1], kr, vr, impl.scale, d, ref)
            assert ((out[r, h].double() - ref).abs() <= tol).all(), (r, h)


@needs_kernel
def test_a_forward_of_another_kv_format_is_refused():
    """The cache is laid out for the engine plan's K/V format: a BF16 forward or another format's is
    refused, naming the store, before anything is written."""
    from tracefp4.engines.capture import RolloutCapture
    from tracefp4.engines.vllm.kv_backend import PackedKVImpl
    from tracefp4.engines.vllm.runtime import RUNTIME

    impl = PackedKVImpl(2, 64, 0.125, 2, fmt=Format.NVFP4, layer_name="model.layers.0.self_attn.attn")
    cache = torch.zeros(2, 2, 16, slot_bytes(Format.NVFP4, 64) // 2, dtype=torch.bfloat16)
    x = torch.ones(1, 2, 64, dtype=torch.bfloat16)
    for plan in (None, PrecisionPlan.mxfp4(), PrecisionPlan.fp8()):
        RUNTIME.begin(plan, RolloutCapture())
        try:
            with pytest.raises(ValueError, match="kv_store='values'"):
                impl.do_kv_cache_update(types.SimpleNamespace(), x, x, cache, torch.tensor([3]))
        finally:
            RUNTIME.end()
    assert not cache.any()
    with pytest.raises(NotImplementedError, match="sliding_window is not implemented"):
        PackedKVImpl(2, 64, 0.125, 2, None, 128, layer_name="model.layers.0.self_attn.attn")
