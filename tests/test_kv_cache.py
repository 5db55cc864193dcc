"""Our engine's quantized KV cache (tracefp4.engines.kvcache): packed rows in pages, read by ckv's kernel.

What is exact (atol=0): the stored rows are the simulator's (the dequantized values today's K/V
sites feed attention), the rollout's K/V records are the stored codes, trace-full reproduces every
rollout K/V code, and in float32 a generate picks the simulator's codes. What is bounded: every
attention call of a generate, against float64 attention over the same rows, at the bound
tests/test_kv_attention.py derives. Between the two reads (kernel, torch) see
test_kernel_and_torch_reads_generate_the_same for the tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kv_attention import reference
from transformers import DynamicCache

from tracefp4.engines import kvcache
from tracefp4.engines import rollout as rollout_mod
from tracefp4.engines.capture import RawCapture, RolloutCapture
from tracefp4.engines.rows import take_rows
from tracefp4.engines.kvcache import KVRead, KVStorage, PageTable, QuantizedKV
from tracefp4.engines.model import CACHE_KWARG, FP4KVCache, TinyMoESpec, forward_state, from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import generate
from tracefp4.engines.sites import ForwardState
from tracefp4.engines.trainer import TrainerSpec, code_mismatch, forward_logprobs
from tracefp4.formats import clib
from tracefp4.formats.constants import HintMode
from tracefp4.formats import dequantize, unpack_fp4
from tracefp4.formats import reference as ref
from tracefp4.guidance.compact import GuidedMode

needs_kernel = pytest.mark.needs_clib  # skipped without the library, failed under CI (tests/conftest.py)

#: 8 query heads on 2 KV heads (GQA 4:1), head dim 64 (a dim ckv's kernel is tested at)
GQA = TinyMoESpec(hidden=64, heads=8, kv_heads=2, head_dim=64, vocab=32, init_std=0.1)
#: left padding (3 prompts of different lengths, one longer than a block) and a batch that shrinks
PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
SAMPLING = SamplingParams(max_new_tokens=12, stop_token_ids=(3, 5), seed=1)
PLANS = {"nvfp4": PrecisionPlan(), "mxfp4": PrecisionPlan.mxfp4("floor")}
ALL = frozenset(range(4))


@pytest.fixture(scope="module")
def model():
    return from_config(GQA.config(), seed=0)


def generate_with(model, plan, read: KVRead, sampling=SAMPLING, **kw):
    """``generate`` on a cache read as ``read`` (the engine builds its own cache with the default read)."""
    made = rollout_mod.FP4KVCache
    rollout_mod.FP4KVCache = lambda m: made(m, read=read)
    try:
        return generate(model, PROMPTS, sampling, plan=plan, **kw)
    finally:
        rollout_mod.FP4KVCache = made


def forward(model, plan, cache, ids, path=None):
    with forward_state(model, plan, path), torch.no_grad():
        return model(ids, **{CACHE_KWARG: cache}, use_cache=True).logits


# --- memory --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("plan", "ratio"), [(PrecisionPlan(), 152 / 512), (PrecisionPlan.mxfp4("floor"), 136 / 512),
                                             (PrecisionPlan.fp8(), 264 / 512)])
def test_bytes_per_token_come_from_the_caches_tensors(plan, ratio) -> None:
    """Head dim 128, per token and KV head (K and V): BF16 512 B; NVFP4 2 x (64 codes + 8 scales + 4
    amax) = 152 B (0.297x, the <= 0.31x target); MXFP4 2 x (64 + 4) = 136 B; FP8 2 x (128 + 4) = 264 B."""
    m = from_config(TinyMoESpec(heads=2, kv_heads=1, head_dim=128).config(), seed=0)
    ids = torch.randint(2, 32, (3, 21), generator=torch.Generator().manual_seed(0))
    caches = {name: FP4KVCache(m) for name in ("bf16", "q")}
    forward(m, None, caches["bf16"], ids)
    forward(m, plan, caches["q"], ids)
    assert caches["bf16"].kv_bytes_per_token() == 4 * 512  # 4 layers, one KV head
    got = caches["q"].kv_bytes_per_token() / caches["bf16"].kv_bytes_per_token()
    assert got == ratio
    if plan.kv_cache.value == "nvfp4":
        assert got <= 0.31
    with pytest.raises(ValueError, match="run a forward"):
        FP4KVCache(m).kv_bytes_per_token()


def test_the_storage_follows_the_plan(model) -> None:
    ids = torch.tensor([[1, 2, 3]])
    for plan, want in ((None, KVStorage.DENSE), (PrecisionPlan.w4a16(), KVStorage.DENSE),
                       (PrecisionPlan(), KVStorage.FP4), (PrecisionPlan.fp8(), KVStorage.FP8)):
        cache = FP4KVCache(model)
        forward(model, plan, cache, ids)
        assert {layer.storage for layer in cache.layers} == {want}
        assert all((layer.quantized is None) == (want is KVStorage.DENSE) for layer in cache.layers)
    with pytest.raises(ValueError, match="one cache serves one plan"):
        forward(model, None, cache, ids)


# --- the page table ------------------------------------------------------------------------------


def test_page_table_stores_real_tokens_only_and_reuses_blocks() -> None:
    t = PageTable(block_size=4)
    real = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    t.declare(real)  # left-padded prefill
    assert t.lens.tolist() == [3, 5] and t.held.tolist() == [1, 2]
    assert t.rows.tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    assert t.q_len.tolist() == [0, 0, 1, 2, 3, 1, 2, 3, 4, 5]  # pads attend to nothing; causal rows
    slots = t.slots.tolist()
    assert len(set(slots)) == 8 and slots[:3] == [4 * int(t.table[0, 0]) + i for i in range(3)]
    t.declare(torch.ones(2, 1, dtype=torch.bool))  # a decode step
    assert t.lens.tolist() == [4, 6] and t.q_len.tolist() == [4, 6]
    freed = t.table[1, :2].tolist()
    t.select(torch.tensor([0]))  # sequence 1 finished: its blocks go back
    assert t.lens.tolist() == [4] and sorted(t.free[-2:]) == sorted(freed)
    blocks = t.blocks
    t.declare(torch.ones(1, 5, dtype=torch.bool))  # grows into the freed blocks, not new capacity
    assert t.blocks == blocks and t.held.tolist() == [3]
    with pytest.raises(ValueError, match="2 sequences in a cache of 1"):
        t.declare(torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        t.declare(torch.ones(1, 1))


@pytest.mark.parametrize("read", [KVRead.TORCH, pytest.param(KVRead.KERNEL, marks=needs_kernel)])
def test_both_reads_of_a_left_padded_prefill_and_a_decode_meet_the_bound(read) -> None:
    """One layer's rows through :class:`QuantizedKV` (head dim 128, GQA 8:1): a left-padded prefill
    (pad rows stored nowhere, their outputs 0) then a decode step, against float64 attention over the
    same rows at the bound of tests/test_kv_attention.py. The torch read rounds no more often than the
    kernel (one softmax, no chunk rescaling) and torch's float32 exp is within 1 ulp, inside the bound's
    8 ulp, so the same bound covers it."""
    g = torch.Generator().manual_seed(5)
    table, state = PageTable(), ForwardState(PrecisionPlan())
    layer = QuantizedKV(0, table, read)
    real = torch.tensor([[False] * 7 + [True] * 13, [True] * 20, [False] * 19 + [True]])
    for step in (real, torch.ones(3, 1, dtype=torch.bool)):
        table.declare(step)
        k, v = ((torch.randn(3, 2, step.shape[1], 128, generator=g) * 3).bfloat16() for _ in range(2))
        layer.update(state, k, v)
        q = torch.randn(3, 16, step.shape[1], 128, generator=g).bfloat16()
        out = layer.attend(q, 128**-0.5)
        rows = q.transpose(1, 2).reshape(-1, 16, 128)
        want, atol = reference(rows, layer.keys.packed(), layer.values.packed(), table.table, table.lens,
                               table.q_seq, table.q_len, table.block_size, 128**-0.5)
        got = out.reshape(-1, 16, 128).double()
        # the float32 result is rounded to the query's dtype: bf16's unit roundoff is 2^-8 (8 significant
        # bits), relative to the float32 value, itself within atol of want
        atol = atol + (want.abs() + atol) * 2.0**-8
        assert torch.all((got - want).abs() <= atol), float(((got - want).abs() - atol).max())
        assert torch.all(got[table.q_len == 0] == 0)


# --- exact: the stored rows and the records ------------------------------------------------------


@pytest.mark.parametrize("plan", sorted(PLANS) + ["fp8"])
def test_stored_rows_are_the_simulators_and_the_records_are_the_stored_codes(model, plan) -> None:
    """The rows the cache holds, dequantized, are bit for bit what the K/V sites feed attention without
    our cache (a DynamicCache of the dequantized values: the simulator this cache replaced; layer 0,
    where both forwards have the same input: later layers' inputs come through the two attentions); the
    rollout's full K/V record is the stored code, field for field, at every layer."""
    plan = PLANS.get(plan) or PrecisionPlan.fp8()
    ids = torch.randint(2, 32, (2, 19), generator=torch.Generator().manual_seed(4))
    cache, dense = FP4KVCache(model), DynamicCache(config=model.config)
    capture = RolloutCapture(HintMode.FULL, diagnostic_layers=ALL)
    forward(model, plan, cache, ids, capture)
    forward(model, plan, dense, ids)
    records = capture.take().diagnostics
    slots = cache.table.slots  # rows b*S + s, all real
    for i, layer in enumerate(cache.layers):
        for store, states, site in ((layer.quantized.keys, dense.layers[i].keys, "k"),
                                    (layer.quantized.values, dense.layers[i].values, "v")):
            stored = store.gather(slots)
            want = states.transpose(1, 2).reshape(-1, *states.shape[1:2], states.shape[-1])
            if i == 0:
                assert torch.equal(dequantize(stored).to(want.dtype).view(torch.int16), want.view(torch.int16))
            q = records[f"L{i:02d}.{site}"].q
            for f in dataclasses.fields(q):
                assert torch.equal(getattr(stored, f.name).view(torch.uint8), getattr(q, f.name).view(torch.uint8))


# --- bounded: every attention call of a generate -------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_every_attention_call_of_a_generate_meets_the_bound(model, plan, monkeypatch) -> None:
    """Left-padded ragged prompts, a batch that shrinks, GQA 4:1: each call of ckv's kernel (prefill's
    causal rows, then decode rows) is within the derived bound of float64 attention over the same rows."""
    calls = []
    kernel = kvcache.paged_attention

    def checked(q, k, v, **kw):
        out = kernel(q, k, v, **kw)
        want, atol = reference(q, k, v, kw["block_table"], kw["seq_lens"], kw["q_seq"], kw["q_len"],
                               kw["block_size"], kw["scale"])
        assert torch.all((out.double() - want).abs() <= atol), float(((out.double() - want).abs() - atol).max())
        calls.append(q.shape[0])
        return out

    monkeypatch.setattr(kvcache, "paged_attention", checked)
    out = generate_with(model, PLANS[plan], KVRead.KERNEL)
    assert "stop" in out.finish_reasons and "length" in out.finish_reasons  # ragged completions
    prefill_rows = len(PROMPTS) * max(map(len, PROMPTS))
    assert calls[:4] == [prefill_rows] * 4 and len(calls) > 4 and len(set(calls[4:])) > 1  # the batch shrank


@needs_kernel
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_kernel_and_torch_reads_generate_the_same(model, plan) -> None:
    """The kernel read and the torch read (dequantize per call, attend in float32) compute the same
    attention up to the order of float32 additions and the exponential (each within the bound of the
    exact value, the test above), then round it to bf16. Where a rounding falls differently, an
    attention output moves by one bf16 ulp (at most 2^-7 relative), as one more bf16 rounding of the
    model's own forward would: the tokens are the same and the log-probs differ at bf16 resolution. We
    allow one bf16 ulp of the log-prob (2^-7 relative, 2^-7 absolute below 1); a wrong key, a leaked pad
    or a stale slot moves log-probs by O(1)."""
    outs = {read: generate_with(model, PLANS[plan], read) for read in (KVRead.KERNEL, KVRead.TORCH)}
    a, b = outs[KVRead.KERNEL], outs[KVRead.TORCH]
    assert [t.tolist() for t in a.token_ids] == [t.tolist() for t in b.token_ids]
    for x, y in zip(a.logprobs, b.logprobs):
        assert torch.all((x - y).abs() <= 2.0**-7 * y.abs().clamp(min=1.0)), (x - y).abs().max()


class SimulatorCache(DynamicCache):
    """Today's simulator as the engine's cache: the K/V sites quantize (the attention pre-hook, as for
    any cache not ours) and the cache keeps their dequantized values for the model's own attention."""

    def __init__(self, model) -> None:
        super().__init__(config=model.config)

    def begin_forward(self, real: torch.Tensor) -> None:  # the attention mask masks the pads
        pass


@dataclasses.dataclass
class InputCapture(RawCapture):
    """A diagnostic site's capture that also keeps the site's input ``x`` (float32, per row) and hands
    it back as ``{prefix}.x`` beside the codes."""

    x: torch.Tensor | None = None

    def select(self, index) -> InputCapture:
        base = super().select(index)
        return InputCapture(base.q, base.mode, take_rows(self.x, index))

    def cat(self, others: list[InputCapture]) -> InputCapture:
        base = super().cat(others)
        return InputCapture(base.q, base.mode, torch.cat([self.x, *(o.x for o in others)]).cpu())

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {**super().to_tensors(prefix), f"{prefix}.x": self.x}


def generate_keeping_inputs(m, plan, monkeypatch):
    record = RolloutCapture.record_site

    def keeping(self, layer, name, x, q):
        record(self, layer, name, x, q)
        if layer in self.diagnostic_layers:
            self._current.diagnostics[name] = InputCapture(q, HintMode.FULL, x.detach().float().clone())

    with monkeypatch.context() as patch:
        patch.setattr(RolloutCapture, "record_site", keeping)
        return generate(m, PROMPTS, SAMPLING, plan=plan, diagnostics=ALL)


#: causal order of a layer's sites at one position: K/V, then the expert input, the routing, the
#: expert intermediate (each computed from the ones before it)
SITE_RANK = {"k": 0, "v": 0, "expert_in": 1, "routing": 2, "expert_mid": 3}
#: How far two float32 forwards that differ only in addition order may drift apart at a site input,
#: per row vector, relative to its max |x|: each is within gamma_n * sum|terms| (n <= 64 terms here,
#: any order) of exact arithmetic per reduction, i.e. <= 64 u = 2^-18 of the terms' absolute sum; with
#: RMS norms before every projection and weights of std 0.1 those sums stay within a few times the
#: row's max, and four layers compound a handful of such reductions each: 2^-14 (1024 u) leaves a
#: factor 16 over that estimate and 64 over the largest drift these forwards show on an AMD EPYC (16 u).
DRIFT = 2.0**-14


def _z64(fields: dict[str, torch.Tensor], x: torch.Tensor, plan: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 z (x in grid units) of each element on the path's own grid, and the grid factor."""
    if plan == "fp8":
        factor = 1 / fields["scales"].double()
        return x.double() * factor, factor.expand_as(x)
    block = 16 if plan == "nvfp4" else 32
    if plan == "nvfp4":
        enc = ref.nvfp4_encode_factor(fields["scales"], ref.nvfp4_global_encode_scale(fields["global_amax"]))
    else:
        enc = 1 / ref.mx_scale(fields["scales"])
    factor = enc.double().unsqueeze(-1).expand(*enc.shape, block).reshape(x.shape)
    return x.double() * factor, factor


def _codes(fields: dict[str, torch.Tensor], plan: str) -> torch.Tensor:
    c = fields["codes"].view(torch.uint8)
    return c if plan == "fp8" else unpack_fp4(c)


@pytest.mark.parametrize("plan", sorted(PLANS) + ["fp8"])
def test_generate_equals_the_dequantized_simulator_in_float32(plan, monkeypatch) -> None:
    """A float32 model, where the math is the same up to float32 addition order: the packed cache (read
    by torch: the kernel takes bf16 queries) and the simulator (dequantized K/V in a DynamicCache, the
    model's SDPA). Exact (atol=0): layer 0's K/V inputs and codes wherever the tokens so far agree (no
    attention before them). Bounded: every site input upstream of the first code (or routing) that
    differs drifts by at most DRIFT of its row's max; that first difference sits within the drift of
    a code boundary (its float64 z on either path, at an element or, for a block scale, the block's
    unrounded scale), since float32 rounding of z is monotone; each path's codes there are the
    reference quantizer's of its own input. Downstream of it nothing is bounded (a code moved by a
    whole step); before it the tokens are the same and the log-probs within 1e-5: the two orders move
    a log-prob of magnitude < 5 by a few float32 ulps per op through four layers (~1e-6), while a
    wrong key, a leaked pad or a stale slot moves it by O(1)."""
    name, plan_obj = plan, PLANS.get(plan) or PrecisionPlan.fp8()
    m = from_config(GQA.config(), dtype=torch.float32, seed=0)
    packed = generate_keeping_inputs(m, plan_obj, monkeypatch)
    made = rollout_mod.FP4KVCache
    rollout_mod.FP4KVCache = SimulatorCache
    try:
        sim = generate_keeping_inputs(m, plan_obj, monkeypatch)
    finally:
        rollout_mod.FP4KVCache = made
    element = "e4m3" if name == "fp8" else "e2m1"
    checked_rows = 0
    for b, (da, db) in enumerate(zip(packed.diagnostics, sim.diagnostics)):
        assert set(da) == set(db)
        ra, rb = packed.records[b], sim.records[b]
        ta, tb = packed.token_ids[b], sim.token_ids[b]
        sites = sorted({k.rsplit(".", 1)[0] for k in da})
        rows = min(len(da[sites[0] + ".x"]), len(db[sites[0] + ".x"]))
        events = []  # (row, layer, rank, site) where the two paths' codes, scales or routing differ
        for site in sites:
            differ = torch.zeros(rows, dtype=torch.bool)
            for key in (k for k in da if k.startswith(site + ".") and k.endswith((".codes", ".scales"))):
                if da[key].dtype != torch.float32:  # not FP8's float32 row scale (it drifts by ulps)
                    differ |= (da[key][:rows].view(torch.uint8) != db[key][:rows].view(torch.uint8)).flatten(1).any(1)
            events += [(int(t), int(site[1:3]), SITE_RANK[site.split(".")[1]], site) for t in differ.nonzero()]
        for key in (k for k in ra if k.endswith(".routing")):
            n = min(len(ra[key]), len(rb[key]), rows)
            differ = (ra[key][:n].sort(-1).values != rb[key][:n].sort(-1).values).flatten(1).any(1)
            events += [(int(t), int(key[1:3]), SITE_RANK["routing"], key) for t in differ.nonzero()]
        first = min(events, default=(rows, 0, 0, None))[:3]
        # positions 0..first[0] hold the same tokens (the token after a flip's position is downstream of it)
        same = min(first[0] + 1, len(ta), len(tb))
        assert torch.equal(ta[:same], tb[:same]), b
        lo = packed.prompt_lens[b]
        if same > lo:
            x, y = packed.logprobs[b][: same - lo], sim.logprobs[b][: same - lo]
            assert torch.all((x - y).abs() <= 1e-5), (x - y).abs().max()
        for site in sites:
            layer, rank = int(site[1:3]), SITE_RANK[site.split(".")[1]]
            xa, xb = da[site + ".x"][:rows], db[site + ".x"][:rows]
            upstream = torch.tensor([(t, layer, rank) <= first for t in range(rows)])
            if layer == 0 and rank == 0:  # no attention before layer 0's K/V: the same input, exactly
                keep = torch.arange(rows) < same
                codes_a, codes_b = da[site + ".codes"][:rows][keep], db[site + ".codes"][:rows][keep]
                assert torch.equal(xa[keep], xb[keep]) and torch.equal(codes_a, codes_b), site
            drift = (xa - xb).abs()[upstream].double()
            amax = xa.abs()[upstream].amax(-1, keepdim=True).double()
            assert torch.all(drift <= DRIFT * amax), (site, float((drift / amax).max()))
            checked_rows += int(upstream.sum())
        for t, layer, rank, site in (e for e in events if e[:3] == first and ".routing" not in e[3]):
            fa = {k.rsplit(".", 1)[1]: da[k][t] for k in da if k.startswith(site + ".")}
            fb = {k.rsplit(".", 1)[1]: db[k][t] for k in db if k.startswith(site + ".")}
            bound = DRIFT * fa["x"].abs().amax(-1, keepdim=True).double()
            za, fac_a = _z64(fa, fa["x"], name)
            zb, fac_b = _z64(fb, fb["x"], name)
            slack = bound * torch.maximum(fac_a, fac_b) + fb["x"].double().abs() * (fac_a - fac_b).abs()
            for f in (fa, fb):  # the codes are the reference quantizer's of the path's own input
                want = {"fp8": lambda v: ref.quantize_fp8(v)[0], "nvfp4": lambda v: ref.quantize_nvfp4(v, per_row=True)[0],
                        "mxfp4": lambda v: ref.quantize_mxfp4(v, "floor")[0]}[name](f["x"])
                assert torch.equal(_codes(f, name), want), (site, t)
            same_grid = (fac_a == fac_b)
            moved = (_codes(fa, name) != _codes(fb, name)) & same_grid
            for z in (za, zb):
                assert torch.all(ref.boundary_distance(z[moved], element) <= slack[moved]), (site, t)
            if name == "nvfp4":  # a block scale that moved: its unrounded E4M3 scale sat near a boundary
                moved_scales = fa["scales"].view(torch.uint8) != fb["scales"].view(torch.uint8)
                for f in (fa, fb):
                    s_enc = ref.nvfp4_global_encode_scale(f["global_amax"])
                    block_amax = f["x"].reshape(*f["x"].shape[:-1], -1, 16).abs().amax(-1)
                    unrounded = block_amax.double() * (s_enc.double() / 6)
                    near = ref.boundary_distance(unrounded, "e4m3") <= bound * (s_enc.double() / 6) * 2
                    assert torch.all(near[moved_scales]), (site, t)
    assert checked_rows > 0


def test_trace_full_reproduces_every_rollout_kv_code(model) -> None:
    """The trainer's forward is unchanged (it fake-quantizes K/V with guidance); guided by full records
    of a rollout on the packed cache it reproduces every code the rollout stored, K/V included."""
    roll = generate(model, PROMPTS, SAMPLING, plan=PrecisionPlan(), guidance=GuidedMode.parse("full@all"),
                    diagnostics=ALL)
    with torch.no_grad():
        out = forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records,
                               TrainerSpec("trace", capture_codes=ALL))
    stats = code_mismatch(out.codes, roll.diagnostics)
    assert {k for k in stats if k.endswith((".k", ".v"))} == {f"L{i:02d}.{s}" for i in range(4) for s in "kv"}
    assert sum(s.mismatched for s in stats.values()) == 0 and sum(s.total for s in stats.values()) > 0


# --- FP8, refusals -------------------------------------------------------------------------------


def test_fp8_rows_are_one_byte_and_a_row_scale(model) -> None:
    """FP8 plans store E4M3 bytes and the row's float32 scale; the torch read attends over them, and
    the kernel read (FP4 only) says so."""
    out = generate_with(model, PrecisionPlan.fp8(), KVRead.AUTO)
    assert all(len(t) > len(p) for t, p in zip(out.token_ids, PROMPTS))
    cache = FP4KVCache(model)
    forward(model, PrecisionPlan.fp8(), cache, torch.tensor([[1, 2, 3]]))
    fields = cache.layers[0].quantized.keys.fields
    assert {n: (t.dtype, t.shape[1:]) for n, t in fields.items()} == {
        "data": (torch.float8_e4m3fn, (2, 64)), "scale": (torch.float32, (2, 1))}
    with pytest.raises(ValueError, match="KVRead.KERNEL reads FP4 rows"):
        forward(model, PrecisionPlan.fp8(), FP4KVCache(model, read=KVRead.KERNEL), torch.tensor([[1, 2]]))


def test_a_cache_needs_the_attention_prepare_model_sets(model) -> None:
    impl = model.config._attn_implementation
    assert impl == kvcache.ATTENTION_PREFIX + "sdpa" or impl == kvcache.ATTENTION_PREFIX + "eager"
    model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(RuntimeError, match="FP4KVCache is read by the tracefp4_"):
            forward(model, PrecisionPlan(), FP4KVCache(model), torch.tensor([[1, 2]]))
    finally:
        model.set_attn_implementation(impl)
