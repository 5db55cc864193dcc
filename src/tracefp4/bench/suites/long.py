"""``tracefp4 bench rollout --preset long``: decode speed at long contexts, KV bytes and capacity, per engine and mode.

What the FP4 KV cache is for: long rollouts, where the KV cache sets both the bytes every decode step
reads and how many sequences fit a KV budget at once. The model (:data:`LONG_MOE`) is one decoder
layer of the bandwidth preset's (Qwen3-30B-A3B's layer shapes: attention of 32 query heads, 4 KV
heads, head dim 128; hidden 2048; 64 of its 128 experts, top-8 of dim 768): a 16K-token prefill is
~2.2 TFLOP of attention per sequence and layer plus ~1.9 TFLOP for the rest of the layer, and every
(mode, sequence) needs its own, so one layer, not the bandwidth preset's four;
the JSON's ``model`` and ``resized`` say so. The experts keep the real layer's size because a decode
step's share of expert bytes sets what FP4 weights save (with 32 experts top-4 of dim 384 under the
same attention, the capacity run's FP4 tokens/s was 2.36x BF16's, with this layer 2.93x: runs
``2026-12-05d`` and ``e`` in ``docs/results/bench-long/``). Random weights, random prompts, no stop token.

Modes and engines (each vLLM engine in a server process of its own, see :class:`tracefp4.reports.long_server.LongServer`;
the servers a phase needs are built side by side, before anything of that phase is timed):
``vllm.bf16`` vLLM's own unquantized engine, ``vllm.fp8kv`` the same with ``kv_cache_dtype="fp8"``
(BF16 experts: what a user would pick instead), ``vllm.fp4`` and ``vllm.trace_lsb`` our plugin's engine
(packed FP4 experts, packed NVFP4 K/V), ``home.bf16``/``home.fp4``/``home.trace_lsb`` our engine (its
packed FP4 K/V read by the C kernel, including at prefill: so it runs at the short contexts only,
``--home-contexts``).

Figures (all in one JSON; ``<ctx>`` is the context, prompt plus generated tokens):

* ``rollout_tokens_per_s.<engine>.<mode>.<ctx>``: **decode** tokens/s with prefill excluded, at the
  first batch the cells list for that context (``...@b<batch>`` for every batch run). The engine is
  stepped one forward at a time (vLLM: ``LLMEngine.step``; ours:
  :func:`~tracefp4.engines.rollout.decode_one_token`) and only steps in which every sequence decodes
  one token and none prefills are timed: ``n = --new-tokens`` of them per mode, in ``--repeats``
  equal runs of steps whose median rate is reported; the prompts stop that many steps short of the
  context. Our vLLM engine runs ``fp4`` and ``trace_lsb`` over one prefill, alternating runs of
  steps and switching the recording between them (the cached K/V codes are the same in both modes;
  only what is recorded differs): one prefill per engine and cell, not per mode, and the two modes
  timed side by side. A rollout's recording runs as in any rollout (trace_lsb records its guidance
  every step); assembling the records afterwards is not decode and is left out (the vLLM engines
  drop them). Our engine prefills per mode (its modes' plans differ) and alternates the modes' runs of
  steps the same way.
* ``kv_bytes_per_token.<engine>.<mode>``: the bytes of the engine's own KV cache tensors over the
  tokens they hold (vLLM: its cache tensors over its reported capacity; ours: the cache after a
  prefill over its slots), and ``kv_capacity_tokens.vllm.<mode>``: vLLM's reported capacity (blocks x
  block size) at the decode servers' one KV budget (``kv_budget_bytes``).
* The **capacity run**: a KV budget at which vLLM's BF16 engine runs at most ``--capacity-fit`` (8)
  requests at once. It starts at exactly that many whole BF16 requests (its measured bytes per token
  times the requests' blocks, plus the one block vLLM's pool holds back); vLLM admits a request while
  its prompt fits and preempts as sequences grow, so BF16 then runs more at once (14 of 8 measured),
  and the budget is shrunk by that overshoot, in whole blocks, and BF16 rerun, up to
  ``CALIBRATION_RUNS`` times (``capacity_calibration`` lists each try; never below one whole request).
  Then every mode runs at the final budget, on a server of its own (BF16 again), the four runs side
  by side: begun together and stepped in turns of ``CAPACITY_TURN_S`` (1 s) of step time each until
  every queue is done, so that the machine's drift over the minutes they take falls on all of them
  alike (run one after another, the same FP4 run measured 713 and 594 tokens/s an hour apart). A
  queue of ``--capacity-requests`` (32) requests of ``--capacity-output`` new tokens (default 1024)
  after 64-token prompts, all submitted at once; vLLM schedules what fits (and preempts what stops
  fitting). vLLM's CPU cache blocks are 128 tokens, so a
  short request is a few coarse blocks and concurrency moves in steps of them: at 256 new tokens (3
  blocks a request) FP4 ran 18 at once to BF16's 8 at one budget, at 1024 (9 blocks) 28 to 8.
  ``capacity_tokens_per_s.vllm.<mode>``: generated tokens over the run's own time, the sum of its
  steps' (``capacity_wall_s``: what the run takes alone, the time of the other modes' turns left out);
  ``capacity_peak_running.vllm.<mode>``: the most requests running in one step, read from vLLM's
  scheduler after each step (from the first preemption on, if any: once the cache has filled);
  ``capacity_mean_running``, ``capacity_preemptions`` and ``capacity_kv_tokens`` (vLLM's capacity at
  that budget) beside them, and ``capacity_prefill_s``, the time of the steps in which a request
  entered (its prompt run, or a preempted one's prompt and tokens so far
  recomputed: vLLM's V1 preempts by recomputing).
* ``decode_time_share.<engine>.<mode>`` = {experts, attention, sites, rest}: where ``--profile-steps``
  decode steps go at the largest context an engine runs (``decode_time_share_context.<engine>``),
  from ``torch.profiler``: each op's own time goes to the innermost region it runs in: ``sites``
  (``tracefp4::site``, every quantization site), ``experts`` (vLLM's ``moe_forward`` op, router
  included, or its BF16 ``cpu_fused_moe`` kernel; our MoE experts modules), ``attention`` (vLLM's
  attention and cache-write ops; our attention function);
  ``rest`` is the steps' wall time less those three (norms, projections, sampling, the profiler).

The default run (contexts 1K at batches 8 and 32, 4K at batch 8, 16K at batch 1; our engine at 1K,
batch 8; the capacity run) is sized for ~25 minutes on 2 quiet cores with ``--repeats 3``: the
prefills and the capacity run are most of it. With the lighter MoE this preset first ran (32 experts
top-4 of dim 384, hidden 1024) one 4K prompt with its decode steps took 2.8 s in vLLM's BF16 engine,
4.0 s with its FP8 K/V and 16 s in our FP4 engine (fp4 and trace_lsb together; its prompt attention
dequantizes and runs SDPA in float32), attention growing with the square of the prompt to about a
minute per 16K prompt in BF16 and two in FP4. On quiet cores of an AMD EPYC, with this model, the
default run took 23 minutes (17 with the capacity runs one after another, before they ran side by
side: BF16's run is then its calibration's last one again), and ``--contexts 16384 --batch 8``, 8
prompts of 16K per engine, 23 minutes (with ``--repeats 1`` and the capacity runs one after
another). ``--contexts``/``--batch``
replace the cells (every context at every batch); the JSON's ``cells`` lists what ran and
``targets_not_run`` the targets whose cell did not. Prefix caching would not shorten this honestly:
our vLLM engine turns it off (a cached block is never recomputed, so never recorded), and prompts
sharing their blocks would have every sequence of a batch read one copy of its K/V, out of cache,
which is not the long-context decode being measured.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from tracefp4.engines.factory import EngineKind
from tracefp4.engines.model import TinyMoESpec, from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.guidance.compact import GuidedMode
from tracefp4.provenance import environment
from tracefp4.reports.decode_timing import (
    median_rate,
    profiled,
    random_prompts,
    run_lengths,
)
from tracefp4.reports.long_server import (
    CAPACITY_PROMPT,
    VLLM_MODES,
    LongServer,
    start_servers,
)
from tracefp4.rl.arms import ROLLOUT_MODES

__all__ = ["LONG_MOE", "LONG_TARGETS", "LongConfig", "bench_long", "format_long", "long_targets", "profile_cell",
           "shrunk_budget"]

#: One decoder layer of the bandwidth preset's model (``bench_rollout.BANDWIDTH_MOE`` with ``layers=1``:
#: a test holds the two equal; spelled out here, as that module imports this one).
LONG_MOE = TinyMoESpec(hidden=2048, layers=1, experts=64, top_k=8, moe_intermediate=768, heads=32, kv_heads=4,
                       head_dim=128, vocab=1024, init_std=0.02)
RESIZED = ("1 decoder layer of the bandwidth preset's model (not its 4, nor Qwen3-30B-A3B's 48), its layer shapes kept "
           "(attention 32 query heads, 4 KV heads, head dim 128; hidden 2048; 64 experts top-8 of dim 768, of the "
           "real model's 128): each 16K-token prefill is ~4 TFLOP per sequence and layer (minutes on 2 cores), so "
           "one layer keeps the default run near 25 minutes; the KV figures per layer, the attention's and the "
           "experts' shares of a decode step are those of the real layer, the vocabulary's (1024) is smaller")
HOME_MODES = ("bf16", "fp4", "trace_lsb")


@dataclasses.dataclass(frozen=True)
class LongConfig:
    """What ``--preset long`` runs (the defaults are the preset's; the module docstring says why)."""

    spec: TinyMoESpec = dataclasses.field(default_factory=lambda: dataclasses.replace(LONG_MOE))
    cells: tuple[tuple[int, int], ...] = ((1024, 8), (1024, 32), (4096, 8), (16384, 1))
    home_contexts: tuple[int, ...] = (1024,)
    #: timed decode steps per mode and cell: 96 makes each of the default 3 runs 32 steps (at 32, runs of
    #: ~10 steps of 16 ms put trace_lsb/fp4 at 4K, batch 8 at 0.912 in one quiet run and 0.974 in another)
    new_tokens: int = 96
    repeats: int = 3
    capacity_fit: int = 8
    capacity_requests: int = 32
    capacity_output: int = 1024
    profile_steps: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.cells:
            raise ValueError("long preset: no (context, batch) cell to run")
        for ctx, batch in self.cells:
            # our vLLM engine decodes fp4 and trace_lsb in turn after one prefill: 2 x new_tokens steps
            if batch < 1 or ctx <= 2 * self.new_tokens:
                raise ValueError(f"long preset: context {ctx} must exceed 2 x --new-tokens {self.new_tokens} (fp4 "
                                 f"and trace_lsb decode in turn) and batch {batch} be at least 1")
        if self.new_tokens < self.repeats:
            raise ValueError(f"--new-tokens {self.new_tokens}: at least one timed step per repeat ({self.repeats})")
        if self.capacity_fit < 1 or self.capacity_requests < 1 or self.capacity_output < 1:
            raise ValueError("capacity run: --capacity-fit, --capacity-requests and --capacity-output must be >= 1")

    @property
    def primary_batch(self) -> int:
        return self.cells[0][1]

    def first_batch(self, context: int) -> int:
        """The batch of the first cell at ``context`` (its figures' plain key)."""
        return next(b for c, b in self.cells if c == context)

    @property
    def batches(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(b for _, b in self.cells))

    @property
    def contexts(self) -> tuple[int, ...]:
        return tuple(sorted({c for c, _ in self.cells}))

    @property
    def max_len(self) -> int:
        """The engines' max_model_len: the longest context, the stagger of the batch (the first sequence
        decodes while the others prefill) and the profiled steps, in whole blocks of 16."""
        longest = max(c + b for c, b in self.cells) + 2 * self.profile_steps + 2
        return -(-longest // 16) * 16


#: (description, key of the numerator, key of the denominator, bound, kind): ratios of two figures.
LONG_TARGETS = [
    ("KV bytes per token: vllm fp4 / vllm bf16", "kv_bytes_per_token.vllm.fp4", "kv_bytes_per_token.vllm.bf16", 0.31,
     "max"),
    ("KV bytes per token: vllm fp4 / vllm fp8kv", "kv_bytes_per_token.vllm.fp4", "kv_bytes_per_token.vllm.fp8kv", 0.62,
     "max"),
    ("KV capacity tokens at one budget: vllm fp4 / vllm bf16", "kv_capacity_tokens.vllm.fp4",
     "kv_capacity_tokens.vllm.bf16", 3.2, "min"),
    ("decode at 16K, batch 8: vllm fp4 / vllm bf16", "rollout_tokens_per_s.vllm.fp4.16384@b8",
     "rollout_tokens_per_s.vllm.bf16.16384@b8", 1.3, "min"),
    ("decode at 16K, batch 8: vllm fp4 / vllm fp8kv", "rollout_tokens_per_s.vllm.fp4.16384@b8",
     "rollout_tokens_per_s.vllm.fp8kv.16384@b8", 1.2, "min"),
    ("capacity run tokens/s: vllm fp4 / vllm bf16", "capacity_tokens_per_s.vllm.fp4", "capacity_tokens_per_s.vllm.bf16",
     2.5, "min"),
    ("capacity run tokens/s: vllm fp4 / vllm fp8kv", "capacity_tokens_per_s.vllm.fp4",
     "capacity_tokens_per_s.vllm.fp8kv", 1.6, "min"),
    ("capacity run peak running: vllm fp4 / vllm bf16", "capacity_peak_running.vllm.fp4",
     "capacity_peak_running.vllm.bf16", 3.0, "min"),
]


def long_targets(res: dict, capacity: bool = True) -> list[dict]:
    """The targets whose figures the run has, plus ``trace_lsb >= 0.926x fp4`` at every context and
    batch each engine ran; ``capacity`` False leaves the capacity run's out (set for a queue of 32
    requests of which BF16 holds 8, not for another)."""
    rows = [t for t in LONG_TARGETS if capacity or not t[1].startswith("capacity_")]
    for key in sorted(k for k in res if k.startswith("rollout_tokens_per_s.") and ".fp4." in k and "@b" in k):
        engine, rest = key.split(".")[1], key.split(".fp4.")[1]
        rows.append((f"decode at {rest}: {engine} trace_lsb / {engine} fp4", key.replace(".fp4.", ".trace_lsb."), key,
                     0.926, "min"))
    out = []
    for label, num, den, bound, kind in rows:
        a, b = res.get(num), res.get(den)
        if a is None or b is None or not b:
            continue
        value = a / b
        out.append({"target": label, "value": value, "bound": bound, "kind": kind,
                    "met": value >= bound if kind == "min" else value <= bound})
    return out


# --- our engine ------------------------------------------------------------------------------------


class _HomeRegions:
    """Profiler regions around our engine's experts (each MoE block's ``experts`` module) and its
    attention function, for :func:`tracefp4.reports.decode_timing.share_of_events` (installed for the profiled steps only)."""

    def __init__(self, model) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from tracefp4.engines.model import moe_layers

        self.model, self.table = model, ALL_ATTENTION_FUNCTIONS
        self.impl = model.config._attn_implementation
        self.experts = [m.experts for m in moe_layers(model)]
        self.hooks, self.open, self.saved = [], [], None

    def __enter__(self):
        from torch.autograd.profiler import record_function

        def pre(module, args):
            self.open.append(record_function("tracefp4::experts").__enter__())

        def post(module, args, out):
            self.open.pop().__exit__(None, None, None)

        for m in self.experts:
            self.hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        self.saved = self.table[self.impl]
        base = self.saved

        def attention(*args, **kwargs):
            with record_function("tracefp4::attention"):
                return base(*args, **kwargs)

        self.table[self.impl] = attention
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()
        self.table[self.impl] = self.saved


def home_decode(model, modes: Sequence[str], batch: int, context: int, cfg: dict, profile: bool) -> dict[str, dict]:
    """One decode cell of our engine for each of ``modes``: a prefill per mode (untimed; the modes'
    plans and records differ), then ``new_tokens`` timed decode steps per mode in ``repeats`` runs that
    alternate the modes, as the vLLM cell does (the machine drifts over a cell). Per mode: the bytes
    per token of the cache it built, ``rate`` and, with ``profile``, ``share`` of a few more steps."""
    from tracefp4.engines.capture import RolloutCapture
    from tracefp4.engines.model import model_layers
    from tracefp4.engines.protocol import SamplingParams
    from tracefp4.engines.rollout import decode_one_token, prefill

    n, repeats, steps = cfg["new_tokens"], cfg["repeats"], cfg["profile_steps"] if profile else 0
    prompts = [torch.tensor(p) for p in random_prompts(batch, context - n, cfg["vocab"], cfg["seed"])]
    sampling = SamplingParams(max_new_tokens=n + steps + 1, temperature=1.0, seed=cfg["seed"])
    with torch.no_grad():
        runs = {}  # mode -> [decode state, last logits, sampling generator]
        for mode in modes:
            fp4, guidance = ROLLOUT_MODES[mode]
            capture = RolloutCapture.of(GuidedMode.parse(guidance) if guidance else None, frozenset(),
                                        model_layers(model)[0])
            st, logits = prefill(model, PrecisionPlan() if fp4 else None, capture, prompts, 0)
            runs[mode] = [st, logits, torch.Generator().manual_seed(cfg["seed"])]
        out = {m: {"kv_bytes_per_token": run[0].cache.kv_bytes_per_token()} for m, run in runs.items()}

        def step(run: list) -> None:
            run[1] = decode_one_token(run[0], run[1], sampling, run[2])

        times: dict[str, list[float]] = {m: [] for m in modes}
        for size in run_lengths(n, repeats):
            for mode, run in runs.items():
                for _ in range(size):
                    t0 = time.perf_counter()
                    step(run)
                    times[mode].append(time.perf_counter() - t0)
        for mode, run in runs.items():
            out[mode]["rate"] = median_rate(times[mode], batch, repeats)
            if steps:
                with _HomeRegions(model):
                    out[mode]["share"] = profiled(lambda run=run: step(run), steps)
    return out


# --- the run ---------------------------------------------------------------------------------------


def bench_long(engines: Sequence[str], cfg: LongConfig = LongConfig(),
               progress: Callable[[str], None] | None = None) -> dict:
    """The long preset's figures (module docstring) for ``engines`` (``home``, ``vllm``)."""
    say = progress or (lambda msg: None)
    kinds = {EngineKind.parse(e, "--engines") for e in engines}  # a ValueError names a bad one
    spec = cfg.spec
    common = {"new_tokens": cfg.new_tokens, "repeats": cfg.repeats, "profile_steps": cfg.profile_steps,
              "vocab": spec.vocab, "seed": cfg.seed, "capacity_requests": cfg.capacity_requests,
              "capacity_output": cfg.capacity_output}
    resized = RESIZED if spec == LONG_MOE else "the command line's shapes (see model), not the long preset's"
    res: dict = {"preset": "long", "model": dataclasses.asdict(spec), "resized": resized,
                 "cells": [list(c) for c in cfg.cells], "home_contexts": list(cfg.home_contexts),
                 "new_tokens": cfg.new_tokens, "repeats": cfg.repeats, "threads": torch.get_num_threads(),
                 "batches": sorted({b for _, b in cfg.cells}), "contexts": list(cfg.contexts),
                 "decode_timing": "stepped engine; steps with every sequence decoding, prefill excluded", "environment": environment()}
    say(f"long preset: building the model (hidden {spec.hidden}, {spec.layers} layer(s), attention {spec.heads} x "
        f"{spec.head_dim}, {spec.kv_heads} KV heads)")
    model = from_config(spec.config(max_positions=cfg.max_len + 64), seed=cfg.seed)
    if EngineKind.HOME in kinds:
        home_cells = [(c, b) for c, b in cfg.cells if c in cfg.home_contexts]
        profiled = profile_cell(home_cells, cfg.primary_batch)
        for ctx, batch in home_cells:
            say(f"home {'/'.join(HOME_MODES)}: context {ctx}, batch {batch} (a prefill of {batch} x "
                f"{ctx - cfg.new_tokens} tokens per mode)")
            for mode, r in home_decode(model, HOME_MODES, batch, ctx, common, (ctx, batch) == profiled).items():
                _record(res, "home", mode, ctx, batch, r["rate"], cfg.first_batch(ctx))
                res[f"kv_bytes_per_token.home.{mode}"] = r["kv_bytes_per_token"]
                if "share" in r:
                    res[f"decode_time_share.home.{mode}"] = r["share"]
                    res["decode_time_share_context.home"] = ctx
    if EngineKind.VLLM in kinds:
        with tempfile.TemporaryDirectory(prefix="tracefp4-long-") as ckpt:
            model.save_pretrained(ckpt)
            _vllm_cells(ckpt, cfg, common, res, say)
    res["preset_shapes"] = spec == LONG_MOE
    capacity = (cfg.capacity_fit, cfg.capacity_requests) == (LongConfig().capacity_fit, LongConfig().capacity_requests)
    res["targets"] = long_targets(res, capacity) if res["preset_shapes"] else []
    if res["preset_shapes"]:  # a target whose cell did not run (e.g. 16K at batch 8, out of the default run)
        done = {t["target"] for t in res["targets"]}
        res["targets_not_run"] = [label for label, *_ in LONG_TARGETS if label not in done]
    return res


def _record(res: dict, engine: str, mode: str, ctx: int, batch: int, rate: float, first: int) -> None:
    """The cell's rate under ``...<ctx>@b<batch>``, and under ``...<ctx>`` at the context's first batch."""
    res[f"rollout_tokens_per_s.{engine}.{mode}.{ctx}@b{batch}"] = rate
    if batch == first:
        res[f"rollout_tokens_per_s.{engine}.{mode}.{ctx}"] = rate


def _bf16_bytes_per_token(spec: TinyMoESpec) -> int:
    """BF16 K and V per token over all layers: only to size the decode servers' budget (the figures
    reported are measured from the caches)."""
    return spec.layers * spec.kv_heads * spec.head_dim * 2 * 2


def profile_cell(cells: Sequence[tuple[int, int]], primary: int) -> tuple[int, int] | None:
    """The cell whose decode time is broken down: the largest context, at the primary batch if it
    ran there, else at its smallest batch."""
    if not cells:
        return None
    ctx = max(c for c, _ in cells)
    batches = [b for c, b in cells if c == ctx]
    return ctx, primary if primary in batches else min(batches)


def _vllm_cells(ckpt: str, cfg: LongConfig, common: dict, res: dict, say) -> None:
    # one KV budget for every decode server: the largest cell in BF16, with room for the blocks' rounding
    tokens = max(b * (c + b + 2 * cfg.profile_steps + 2 + 128) for c, b in cfg.cells)
    budget = int(tokens * _bf16_bytes_per_token(cfg.spec) * 1.1)
    res["kv_budget_bytes"] = budget
    build = {**common, "max_len": cfg.max_len, "max_seqs": max(b for _, b in cfg.cells), "kv_bytes": budget}
    servers: dict[str, LongServer] = {}
    try:
        engines = list(dict.fromkeys(VLLM_MODES.values()))
        say(f"vllm: building {', '.join(engines)} (a server process each, side by side)")
        servers = start_servers({e: e for e in engines}, ckpt, build)
        for engine, srv in servers.items():
            kv = srv.ask(cmd="kv")
            for mode in (m for m, e in VLLM_MODES.items() if e == engine):
                res[f"kv_capacity_tokens.vllm.{mode}"] = kv["tokens"]
                res[f"kv_bytes_per_token.vllm.{mode}"] = kv["bytes"] / kv["tokens"]
            if engine == "vllm-bf16":
                bf16_per_token, block = kv["bytes"] / kv["tokens"], kv["block_size"]
        profiled = profile_cell(cfg.cells, cfg.primary_batch)
        for ctx, batch in cfg.cells:
            for engine, srv in servers.items():  # the engines side by side in each cell (the machine drifts)
                modes = [m for m, e in VLLM_MODES.items() if e == engine]
                say(f"vllm {'/'.join(modes)}: context {ctx}, batch {batch} (one prefill of {batch} x "
                    f"{ctx - cfg.new_tokens * len(modes)} tokens)")
                r = srv.ask(cmd="decode", modes=modes, batch=batch, context=ctx, profile=(ctx, batch) == profiled)
                for mode, rate in r["rates"].items():
                    _record(res, "vllm", mode, ctx, batch, rate, cfg.first_batch(ctx))
                for mode, share in r["shares"].items():
                    res[f"decode_time_share.vllm.{mode}"] = share
                    res["decode_time_share_context.vllm"] = ctx
    finally:
        for srv in servers.values():
            srv.close()
    _capacity_cells(ckpt, cfg, common, res, say, bf16_per_token, block)


#: At most this many BF16 capacity runs to find a budget at which vLLM runs no more than --capacity-fit
#: requests at once (each a fresh engine: the budget is fixed when vLLM builds its cache).
CALIBRATION_RUNS = 4


def shrunk_budget(tokens: int, peak: int, fit: int, block: int, floor: int) -> int:
    """The next calibration budget in tokens: the usable blocks (all but vLLM's null block) scaled by
    ``fit / peak``, rounded down to whole blocks, plus the null block; never below ``floor``."""
    return max(floor, (tokens - block) * fit // peak // block * block + block)


#: Step time each capacity run gets per turn when the modes' runs alternate (:func:`side_by_side`).
CAPACITY_TURN_S = 1.0


def side_by_side(servers: Mapping[str, LongServer], say, turn_s: float = CAPACITY_TURN_S) -> dict[str, dict]:
    """The capacity run of each mode (``servers``: mode -> its engine's server), all begun at once and
    stepped in turns of ``turn_s`` seconds of step time until every queue is done: the runs take
    minutes each and the machine drifts over minutes, so no mode's run is timed in another stretch of
    time than the others'. Each run counts only its own steps' time."""
    for mode, srv in servers.items():
        srv.ask(cmd="capacity_begin", mode=mode)
    live, turns = list(servers), 0
    while live:
        live = [m for m in live if not servers[m].ask(cmd="capacity_steps", seconds=turn_s)["done"]]
        turns += 1
        if turns % 30 == 0 and live:
            say(f"capacity run: {', '.join(live)} still running ({turns} turns)")
    return {mode: srv.ask(cmd="capacity_end") for mode, srv in servers.items()}


def _capacity_record(mode: str, r: dict, kv: dict, res: dict, say) -> None:
    for key in ("tokens_per_s", "peak_running", "mean_running", "preemptions", "wall_s", "prefill_s"):
        res[f"capacity_{key}.vllm.{mode}"] = r[key]
    res[f"capacity_kv_tokens.vllm.{mode}"] = kv["tokens"]
    say(f"capacity run {mode}: {r['tokens_per_s']:.1f} tokens/s, peak {r['peak_running']} running, "
        f"{r['preemptions']} preemptions")


def _capacity_cells(ckpt: str, cfg: LongConfig, common: dict, res: dict, say, bf16_per_token: float,
                    block: int) -> None:
    # vLLM admits a request while its prompt fits and preempts as sequences grow, so a budget of exactly
    # capacity_fit whole BF16 requests runs more than capacity_fit of them at once (14 of 8 measured). The
    # target reads "a budget at which BF16 holds at most capacity_fit": shrink the budget by the overshoot,
    # in whole blocks, until BF16's peak is within it (never below one whole request plus vLLM's null block).
    need = -(-(CAPACITY_PROMPT + cfg.capacity_output) // block) * block
    floor = need + block
    tokens = cfg.capacity_fit * need + block
    res["capacity_requests"], res["capacity_output"], res["capacity_prompt"] = (
        cfg.capacity_requests, cfg.capacity_output, CAPACITY_PROMPT)
    base = {**common, "max_len": -(-(CAPACITY_PROMPT + cfg.capacity_output + 16) // 16) * 16,
            "max_seqs": cfg.capacity_requests, "new_tokens": min(cfg.new_tokens, 8)}
    trail = []
    for _ in range(CALIBRATION_RUNS):  # BF16 alone
        build = {**base, "kv_bytes": int(tokens * bf16_per_token)}
        say(f"capacity calibration: vllm-bf16, {cfg.capacity_requests} requests of {cfg.capacity_output} tokens, "
            f"{build['kv_bytes'] / 2**20:.2f} MiB of KV")
        srv = LongServer("vllm-bf16", ckpt, build)
        try:
            kv = srv.ask(cmd="kv")
            peak = side_by_side({"bf16": srv}, say)["bf16"]["peak_running"]
        finally:
            srv.close()
        trail.append({"budget_bytes": build["kv_bytes"], "kv_tokens": kv["tokens"], "peak_running": peak})
        say(f"capacity calibration: bf16 peak {peak} running at {kv['tokens']} tokens of KV")
        if peak <= cfg.capacity_fit or tokens == floor:
            break
        tokens = shrunk_budget(tokens, peak, cfg.capacity_fit, block, floor)
    res["capacity_budget_bytes"] = build["kv_bytes"]
    res["capacity_calibration"] = trail
    # every mode at the final budget, a server each (fp4 and trace_lsb: two of our engine), run side by side
    say(f"capacity run: {', '.join(VLLM_MODES)} side by side, {build['kv_bytes'] / 2**20:.2f} MiB of KV each")
    servers = start_servers(VLLM_MODES, ckpt, build)
    try:
        kvs = {mode: srv.ask(cmd="kv") for mode, srv in servers.items()}
        for mode, r in side_by_side(servers, say).items():
            _capacity_record(mode, r, kvs[mode], res, say)
    finally:
        for srv in servers.values():
            srv.close()


def format_long(res: dict) -> str:
    m = res["model"]
    lines = [f"long-context rollouts: attention {m['heads']} x {m['head_dim']} ({m['kv_heads']} KV heads), "
             f"{m['layers']} layer(s), MoE hidden {m['hidden']}, {m['experts']} experts top-{m['top_k']} of dim "
             f"{m['moe_intermediate']} (resized: see the JSON); decode tokens/s, prefill excluded, median of "
             f"{res['repeats']} runs of steps; {res['threads']} torch threads"]
    for engine in ("home", "vllm"):
        for ctx, batch in res["cells"]:
            vals = {mode: res.get(f"rollout_tokens_per_s.{engine}.{mode}.{ctx}@b{batch}")
                    for mode in ("bf16", "fp8kv", "fp4", "trace_lsb")}
            if all(v is None for v in vals.values()):
                continue
            row = "".join(f"  {mode} {v:9.1f}" for mode, v in vals.items() if v is not None)
            lines.append(f"{engine:<5} context {ctx:>6} batch {batch:>3}:{row}")
    kv = sorted(k.split(".", 1)[1] for k in res if k.startswith("kv_bytes_per_token."))
    if kv:
        lines.append("KV bytes per token (the caches' own tensors): " + ", ".join(
            f"{k} {res['kv_bytes_per_token.' + k]:.0f}" for k in kv))
    cap = sorted(k.split(".", 1)[1] for k in res if k.startswith("kv_capacity_tokens."))
    if cap:
        lines.append(f"KV capacity at {res['kv_budget_bytes'] / 2**20:.0f} MiB (vLLM's report): " + ", ".join(
            f"{k} {res['kv_capacity_tokens.' + k]}" for k in cap))
    for k in sorted(k.split(".", 1)[1] for k in res if k.startswith("capacity_tokens_per_s.")):
        lines.append(f"capacity run {k}: {res['capacity_tokens_per_s.' + k]:.1f} tokens/s, peak "
                     f"{res['capacity_peak_running.' + k]} running (mean {res['capacity_mean_running.' + k]:.1f}), "
                     f"{res['capacity_preemptions.' + k]} preemptions"
                     + (f", {res['capacity_prefill_s.' + k] / res['capacity_wall_s.' + k]:.0%} of "
                        f"{res['capacity_wall_s.' + k]:.0f} s in steps running prompts"
                        if 'capacity_wall_s.' + k in res else ""))
    for k in sorted(k.split(".", 1)[1] for k in res if k.startswith("decode_time_share.")):
        s = res["decode_time_share." + k]
        ctx = res[f"decode_time_share_context.{k.split('.')[0]}"]
        lines.append(f"decode time at {ctx}, {k}: " + ", ".join(f"{c} {s[c]:.0%}" for c in
                                                                ("experts", "attention", "sites", "rest")))
    for t in res.get("targets", []):
        sym = ">=" if t["kind"] == "min" else "<="
        lines.append(f"target {t['target']}: {t['value']:.3f} ({sym} {t['bound']}: {'ok' if t['met'] else 'MISSED'})")
    for label in res.get("targets_not_run", []):
        lines.append(f"target {label}: not run (its cell or engine was not in this run)")
    if not res.get("preset_shapes", True):
        lines.append("no targets: the long preset's targets are set for its own shapes, not these")
    return "\n".join(lines)
