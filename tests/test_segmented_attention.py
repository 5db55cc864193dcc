"""The trainer's packed forward attending per sequence (tracefp4.engines.segments) against the dense mask.

Per attention call (derived): both layouts compute, for each query row of trajectory b, softmax
attention over that trajectory's keys up to the row, on the same q, k, v rows. On float32 inputs
every backend (SDPA's flash and math kernels, transformers' eager) computes the scores as float32
dot products, the exponentials in float32, and the weighted sums in float32 (the math kernel also
multiplies q and k by sqrt(scale) first: one more rounding of each, 2u relative on a score). So the
bound of tests/test_kv_attention.py's module docstring holds for each, with D + 3 roundings a score,
an exponential within EXP_ULPS ulp, the masked keys' weights exactly 0 (exp(-inf)) and chunked
rescaling for at most ceil(L/16) chunks; the numerator and the denominator may carry different weight
roundings, so the weighted mean moves by 2 x (2 eta / (1 - eta)) + 2 eta / (1 - eta), bounded by
8 eta / (1 - eta):

    atol_d = (8 eta / (1 - eta) + 2 gamma_n / (1 - gamma_n) + 2 u) * max_j |v_jd|,
    1 + eta = exp(2 u R + Ds) (1 + EXP_ULPS u)^(C + 1),  n = L + C + 5,  Ds = gamma_(D+3) scale sum |q k|.

Each layout is checked against float64 attention over the trajectory's own keys, on the q, k, v a real
packed forward handed its attention at every layer (a key of another trajectory, a wrong boundary or
a missed causal mask moves an output by a sizeable share of max |v|, far above atol ~ 1e-5 of it).

End to end, the two layouts run the same projections, sites and routers on the same rows and
differ only inside the attention core: on a float32 model their log-probs agree to float32 summation
order (~1e-7 relative, 1e-5 allowed, as tests/test_trainer_api.py allows padded against packed), and
with full records every rollout code is reproduced by both.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.masking_utils import create_causal_mask

from tracefp4.engines import kvcache, segments as seg_mod
from tracefp4.engines.model import CACHE_KWARG, from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import generate
from tracefp4.engines.segments import Segments
from tracefp4.engines.trainer import (DENSE_MASK_MAX_TOKENS, PackedAttention, TrainerSpec, code_mismatch,
                                      forward_logprobs)
from tracefp4.guidance.compact import GuidedMode

torch.set_num_threads(1)

U = 2.0**-24
EXP_ULPS = 8  # torch's float32 exp is within 1 ulp (SLEEF u10); 8 stated, as tests/test_kv_attention.py

CONFIG = Qwen3MoeConfig(
    vocab_size=32, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=128, initializer_range=0.1,
)
LENGTHS = (1, 37, 5, 64, 19)  # ragged, one of a single token, one above the kernels' 32-row blocks
ALL = frozenset(range(3))


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 causal attention of one sequence (``[H, L, D]`` q, ``[Hkv, L, D]`` k and v) and atol."""
    hq, length, d = q.shape
    group = hq // k.shape[0]
    out = torch.zeros(hq, length, d, dtype=torch.float64)
    atol = torch.zeros_like(out)
    for h in range(hq):
        kk, vv = k[h // group].double(), v[h // group].double()
        for i in range(length):
            qq = q[h, i].double()
            s = (kk[: i + 1] @ qq) * scale
            out[h, i] = torch.softmax(s, 0) @ vv[: i + 1]
            n_keys, chunks = i + 1, -(-(i + 1) // 16)
            ds = float((_gamma(d + 3) * scale * (kk[: i + 1].abs() @ qq.abs())).max())
            eta = math.exp(2 * U * (float(s.max() - s.min()) + 2 * ds) + ds) * (1 + EXP_ULPS * U) ** (chunks + 1) - 1
            n = n_keys + chunks + 5
            factor = 8 * eta / (1 - eta) + 2 * _gamma(n) / (1 - _gamma(n)) + 2 * U
            atol[h, i] = factor * vv[: i + 1].abs().amax(0)
    return out, atol


@pytest.fixture(scope="module")
def model():
    return from_config(CONFIG, dtype=torch.float32, seed=0)


def _captured_calls(model, monkeypatch) -> list[tuple]:
    """(module, q, k, v, kwargs) of every attention call of a per-sequence packed forward."""
    calls = []
    attend = Segments.attend

    def keeping(self, module, query, key, value, base, base_name, *args, **kwargs):
        calls.append((module, query.detach().clone(), key.detach().clone(), value.detach().clone(), kwargs))
        return attend(self, module, query, key, value, base, base_name, *args, **kwargs)

    monkeypatch.setattr(Segments, "attend", keeping)
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(1, 32, (n,), generator=g) for n in LENGTHS]
    with torch.no_grad():
        forward_logprobs(model, ids, [1] * len(ids), mode="bf16", replay_routing=False, packed_attention="segments")
    monkeypatch.setattr(Segments, "attend", attend)
    return calls


@pytest.mark.parametrize("base", ["sdpa", "eager"])
def test_every_attention_call_meets_the_bound_on_both_layouts(model, monkeypatch, base) -> None:
    """At every layer, on the q, k, v the packed forward produced: per-sequence attention (each base
    implementation) and the dense block-diagonal mask are each within atol of float64 attention over
    the trajectory's own keys (module docstring)."""
    calls = _captured_calls(model, monkeypatch)
    assert len(calls) == CONFIG.num_hidden_layers
    fn = kvcache._base_attention(calls[0][0], base)
    total = sum(LENGTHS)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    mask = create_causal_mask(config=model.config, inputs_embeds=torch.empty(1, total, 0), attention_mask=None,
                              **{CACHE_KWARG: None}, position_ids=position_ids)
    if base == "eager" and mask.dtype == torch.bool:  # eager adds its mask to the scores
        mask = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    for module, q, k, v, kwargs in calls:
        scale = kwargs["scaling"]
        per_seq = Segments.of(LENGTHS).attend(module, q, k, v, fn, base, **kwargs)[0]
        dense = fn(module, q, k, v, mask, **kwargs)[0]
        for got in (per_seq, dense):
            assert got.shape == (1, total, q.shape[1], q.shape[3])
            start = 0
            for n in LENGTHS:
                rows = slice(start, start + n)
                want, atol = _reference(q[0, :, rows], k[0, :, rows], v[0, :, rows], scale)
                err = (got[0, rows].transpose(0, 1).double() - want).abs()
                assert torch.all(err <= atol), (module.layer_idx, n, float((err - atol).max()))
                start += n


def test_a_foreign_key_would_fail_the_bound(model, monkeypatch) -> None:
    """The bound has teeth: attending over the whole row (no mask) leaves it at every layer."""
    calls = _captured_calls(model, monkeypatch)
    fn = kvcache._base_attention(calls[0][0], "sdpa")
    for module, q, k, v, kwargs in calls:
        wrong = fn(module, q, k, v, None, **kwargs)[0]  # causal over the row: later sequences see earlier ones
        n0 = LENGTHS[0] + LENGTHS[1]
        want, atol = _reference(q[0, :, n0:], k[0, :, n0:], v[0, :, n0:], kwargs["scaling"])
        err = (wrong[0, n0:].transpose(0, 1).double() - want[:, :, :]).abs()
        assert bool((err > atol).any())


@pytest.fixture(scope="module")
def full_rollout(model):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 32, (n,), generator=g) for n in (3, 9, 4, 6)]
    roll = generate(model, prompts, SamplingParams(max_new_tokens=40, seed=2), plan=PrecisionPlan(),
                    guidance=GuidedMode.parse("full@all"), diagnostics=ALL)
    return roll


@pytest.mark.parametrize("mode", ["trace", "qat", "bf16"])
def test_both_layouts_give_the_same_logprobs_and_codes(model, full_rollout, mode) -> None:
    """A rollout's trajectories through both layouts: log-probs within float32 summation order
    (1e-5 on a float32 model), every rollout code reproduced by both under full guidance, and in
    every mode the layer-0 K/V codes (upstream of any attention) identical bit for bit."""
    roll = full_rollout
    out = {}
    for layout in ("mask", "segments"):
        spec = TrainerSpec(mode, capture_codes=frozenset() if mode == "bf16" else ALL, packed_attention=layout)
        with torch.no_grad():
            out[layout] = forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records, spec)
    for a, b in zip(out["mask"].logprobs, out["segments"].logprobs):
        assert a.shape == b.shape and a.numel() > 0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    if mode == "bf16":
        return
    for a, b in zip(out["mask"].codes, out["segments"].codes):
        assert torch.equal(a["L00.k"], b["L00.k"]) and torch.equal(a["L00.v"], b["L00.v"])
    if mode == "trace":
        for layout in out:
            stats = code_mismatch(out[layout].codes, roll.diagnostics)
            assert sum(s.mismatched for s in stats.values()) == 0 and sum(s.total for s in stats.values()) > 0


def test_auto_attends_per_sequence_only_above_the_threshold(model, monkeypatch) -> None:
    """AUTO keeps the dense mask up to DENSE_MASK_MAX_TOKENS tokens (short-answer runs compute what
    they always did) and attends per sequence above it; SEGMENTS and MASK are what they say."""
    seen = []
    attend = Segments.attend
    monkeypatch.setattr(Segments, "attend", lambda self, *a, **kw: (seen.append(self.lengths), attend(self, *a, **kw))[1])
    assert not PackedAttention.AUTO.per_sequence(DENSE_MASK_MAX_TOKENS)
    assert PackedAttention.AUTO.per_sequence(DENSE_MASK_MAX_TOKENS + 1)
    assert PackedAttention.SEGMENTS.per_sequence(2) and not PackedAttention.MASK.per_sequence(10**6)
    ids = [torch.arange(1, 9), torch.arange(2, 7)]
    with torch.no_grad():
        forward_logprobs(model, ids, [2, 2], mode="bf16", replay_routing=False)
        assert seen == []
        forward_logprobs(model, ids, [2, 2], mode="bf16", replay_routing=False, packed_attention="segments")
    assert seen == [(8, 5)] * CONFIG.num_hidden_layers


def test_bad_input_is_refused(model) -> None:
    with pytest.raises(ValueError, match="packed_attention must be 'auto', 'mask' or 'segments', got 'padded'"):
        TrainerSpec(packed_attention="padded")
    with pytest.raises(ValueError, match=r"segments: every sequence needs at least one row, got lengths \[3, 0\]"):
        Segments.of([3, 0])
    q = torch.zeros(1, 4, 7, 16)
    with pytest.raises(ValueError, match=r"not one packed row of 8 = sum of the sequences' lengths"):
        Segments.of([3, 5]).attend(None, q, q[:, :2], q[:, :2], lambda *a, **k: (None, None), "sdpa")
    with pytest.raises(NotImplementedError, match="over the 'flex_attention' implementation is not supported"):
        Segments.of([3, 5]).attend(None, q, q, q, lambda *a, **k: (None, None), "flex_attention")


def test_an_attention_that_ignores_the_segments_fails_loudly(model) -> None:
    """A model whose attention implementation was swapped after prepare_model never reads the segments:
    the forward refuses instead of attending over the whole packed row."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(RuntimeError):
            with torch.no_grad():
                forward_logprobs(model, [torch.arange(1, 9), torch.arange(2, 7)], [2, 2], mode="bf16",
                                 replay_routing=False, packed_attention="segments")
    finally:
        model.set_attn_implementation(impl)
    assert seg_mod.SEGMENTS_KWARG == "tracefp4_segments"
