"""The long suite (``tracefp4 bench rollout --preset long``): decode speed at long contexts, KV bytes and capacity, per engine and mode.

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

Modes and engines (each vLLM engine in a server process of its own, see :mod:`tracefp4.bench.server`;
the servers a phase needs are built side by side, before anything of that phase is timed):
``vllm.bf16`` vLLM's own unquantized engine, ``vllm.fp8kv`` the same with ``kv_cache_dtype="fp8"``
(BF16 experts: what a user would pick instead), ``vllm.fp4`` and ``vllm.trace`` our plugin's engine
(packed FP4 experts, packed NVFP4 K/V), ``home.bf16``/``home.fp4``/``home.trace`` our engine (its
packed FP4 K/V read by the C kernel, including at prefill: so it runs at the short contexts only,
``--home-contexts``).

Records (suite ``long``; the context is prompt plus generated tokens):

* ``rollout_tokens_per_s`` at each context and batch: **decode** tokens/s with prefill excluded. The engine is
  stepped one forward at a time (vLLM: ``LLMEngine.step``; ours:
  :func:`~tracefp4.engines.rollout.decode_one_token`) and only steps in which every sequence decodes
  one token and none prefills are timed: ``n = --new-tokens`` of them per mode, in ``--repeats``
  equal runs of steps whose median rate is reported; the prompts stop that many steps short of the
  context. Our vLLM engine runs ``fp4`` and ``trace`` over one prefill, alternating runs of
  steps and switching the recording between them (the cached K/V codes are the same in both modes;
  only what is recorded differs): one prefill per engine and cell, not per mode, and the two modes
  timed side by side. A rollout's recording runs as in any rollout (trace records its guidance
  every step); assembling the records afterwards is not decode and is left out (the vLLM engines
  drop them). Our engine prefills per mode (its modes' plans differ) and alternates the modes' runs of
  steps the same way.
* ``kv_bytes_per_token``: the bytes of the engine's own KV cache tensors over the
  tokens they hold (vLLM: its cache tensors over its reported capacity; ours: the cache after a
  prefill over its slots), and ``kv_capacity_tokens`` (vLLM): vLLM's reported capacity (blocks x
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
  ``capacity_tokens_per_s``: generated tokens over the run's own time, the sum of its
  steps' (``capacity_wall_s``: what the run takes alone, the time of the other modes' turns left out);
  ``capacity_peak_running``: the most requests running in one step, read from vLLM's
  scheduler after each step (from the first preemption on, if any: once the cache has filled);
  ``capacity_mean_running``, ``capacity_preemptions`` and ``capacity_kv_tokens`` (vLLM's capacity at
  that budget) beside them, and ``capacity_prefill_s``, the time of the steps in which a request
  entered (its prompt run, or a preempted one's prompt and tokens so far
  recomputed: vLLM's V1 preempts by recomputing).
* ``decode_time_share`` at each ``region`` (experts, attention, sites, rest): where ``--profile-steps``
  decode steps go at the largest context an engine runs (the record's context),
  from ``torch.profiler``: each op's own time goes to the innermost region it runs in: ``sites``
  (``tracefp4::site``, every quantization site), ``experts`` (vLLM's ``moe_forward`` op, router
  included, or its BF16 ``cpu_fused_moe`` kernel; our MoE experts modules), ``attention`` (vLLM's
  attention and cache-write ops; our attention function);
  ``rest`` is the steps' wall time less those three (norms, projections, sampling, the profiler).

The default run (contexts 1K at batches 8 and 32, 4K at batch 8, 16K at batch 1; our engine at 1K,
batch 8; the capacity run) is sized for ~25 minutes on 2 quiet cores with ``--repeats 3``: the
prefills and the capacity run are most of it. With the lighter MoE this preset first ran (32 experts
top-4 of dim 384, hidden 1024) one 4K prompt with its decode steps took 2.8 s in vLLM's BF16 engine,
4.0 s with its FP8 K/V and 16 s in our FP4 engine (fp4 and trace together; its prompt attention
dequantizes and runs SDPA in float32), attention growing with the square of the prompt to about a
minute per 16K prompt in BF16 and two in FP4. On quiet cores of an AMD EPYC, with this model, the
default run took 23 minutes (17 with the capacity runs one after another, before they ran side by
side: BF16's run is then its calibration's last one again), and ``--contexts 16384 --batch 8``, 8
prompts of 16K per engine, 23 minutes (with ``--repeats 1`` and the capacity runs one after
another). ``--contexts``/``--batch``
replace the cells (every context at every batch); the JSON's ``cells`` lists what ran and
``targets_not_run`` the targets whose cell did not (the targets: ``targets.toml``). Prefix caching would not shorten this honestly:
our vLLM engine turns it off (a cached block is never recomputed, so never recorded), and prompts
sharing their blocks would have every sequence of a batch read one copy of its K/V, out of cache,
which is not the long-context decode being measured.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from collections.abc import Callable, Mapping, Sequence

import torch

from tracefp4.bench.decode import CAPACITY_PROMPT, VLLM_SERVES, home_decode
from tracefp4.bench.result import Record, Run, target_line
from tracefp4.bench.server import EngineServer, start_servers
from tracefp4.bench.targets import judged
from tracefp4.pipeline.factory import EngineKind
from tracefp4.engines.model import TinyMoESpec, from_config
from tracefp4.provenance import environment

__all__ = ["LONG_MOE", "LongConfig", "bench_long", "format_long", "profile_cell", "shrunk_budget", "side_by_side"]

#: One decoder layer of the bandwidth preset's model (``rollout.BANDWIDTH_MOE`` with ``layers=1``:
#: a test holds the two equal; spelled out here, as that module imports this one).
LONG_MOE = TinyMoESpec(hidden=2048, layers=1, experts=64, top_k=8, moe_intermediate=768, heads=32, kv_heads=4,
                       head_dim=128, vocab=1024, init_std=0.02)
RESIZED = ("1 decoder layer of the bandwidth preset's model (not its 4, nor Qwen3-30B-A3B's 48), its layer shapes kept "
           "(attention 32 query heads, 4 KV heads, head dim 128; hidden 2048; 64 experts top-8 of dim 768, of the "
           "real model's 128): each 16K-token prefill is ~4 TFLOP per sequence and layer (minutes on 2 cores), so "
           "one layer keeps the default run near 25 minutes; the KV figures per layer, the attention's and the "
           "experts' shares of a decode step are those of the real layer, the vocabulary's (1024) is smaller")
HOME_MODES = ("bf16", "fp4", "trace")


@dataclasses.dataclass(frozen=True)
class LongConfig:
    """What ``--preset long`` runs (the defaults are the preset's; the module docstring says why)."""

    spec: TinyMoESpec = dataclasses.field(default_factory=lambda: dataclasses.replace(LONG_MOE))
    cells: tuple[tuple[int, int], ...] = ((1024, 8), (1024, 32), (4096, 8), (16384, 1))
    home_contexts: tuple[int, ...] = (1024,)
    #: timed decode steps per mode and cell: 96 makes each of the default 3 runs 32 steps (at 32, runs of
    #: ~10 steps of 16 ms put trace/fp4 at 4K, batch 8 at 0.912 in one quiet run and 0.974 in another)
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
            # our vLLM engine decodes fp4 and trace in turn after one prefill: 2 x new_tokens steps
            if batch < 1 or ctx <= 2 * self.new_tokens:
                raise ValueError(f"long preset: context {ctx} must exceed 2 x --new-tokens {self.new_tokens} (fp4 "
                                 f"and trace decode in turn) and batch {batch} be at least 1")
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


#: The modes the long suite runs in vLLM, each on the engine :data:`~tracefp4.bench.decode.VLLM_SERVES` names.
VLLM_MODES = ("bf16", "fp8kv", "fp4", "trace")


def _vllm_modes(kind: EngineKind) -> list[str]:
    return [m for m in VLLM_MODES if VLLM_SERVES[m] is kind]


def bench_long(engines: Sequence[str], cfg: LongConfig = LongConfig(),
               progress: Callable[[str], None] | None = None) -> Run:
    """The long suite's records (module docstring) for ``engines`` (``home``, ``vllm``)."""
    say = progress or (lambda msg: None)
    kinds = {EngineKind.parse(e, "--engines") for e in engines}  # a ValueError names a bad one
    spec = cfg.spec
    common = {"new_tokens": cfg.new_tokens, "repeats": cfg.repeats, "profile_steps": cfg.profile_steps,
              "vocab": spec.vocab, "seed": cfg.seed, "capacity_requests": cfg.capacity_requests,
              "capacity_output": cfg.capacity_output}
    resized = RESIZED if spec == LONG_MOE else "the command line's shapes (see model), not the long preset's"
    default = LongConfig()
    config: dict = {"preset": "long", "model": dataclasses.asdict(spec), "resized": resized,
                    "cells": [list(c) for c in cfg.cells], "home_contexts": list(cfg.home_contexts),
                    "new_tokens": cfg.new_tokens, "repeats": cfg.repeats, "threads": torch.get_num_threads(),
                    "batches": sorted({b for _, b in cfg.cells}), "contexts": list(cfg.contexts),
                    "decode_timing": "stepped engine; steps with every sequence decoding, prefill excluded",
                    "preset_shapes": spec == LONG_MOE,
                    # the capacity targets are set for a queue of 32 requests of which BF16 holds 8
                    "capacity_default": (cfg.capacity_fit, cfg.capacity_requests) == (default.capacity_fit,
                                                                                        default.capacity_requests)}
    env = environment()
    rec = functools.partial(Record, "long", machine=env.get("cpu_model", ""))
    records: list[Record] = []
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
                records.append(rec("rollout_tokens_per_s", r["rate"], "tokens/s", "home", mode,
                                   {"context": ctx, "batch": batch}))
                if not any(x.matches("kv_bytes_per_token", "home", mode, {}) for x in records):
                    records.append(rec("kv_bytes_per_token", r["kv_bytes_per_token"], "B", "home", mode))
                records += _shares(rec, "home", mode, ctx, r.get("share"))
    if EngineKind.VLLM in kinds:
        with tempfile.TemporaryDirectory(prefix="tracefp4-long-") as ckpt:
            model.save_pretrained(ckpt)
            records += _vllm_cells(ckpt, cfg, common, config, rec, say)
    return judged(Run("long", records, config, env))


def _warm_up(servers, common: dict, new_tokens: int) -> None:
    """A short decode per mode on each server before anything is timed (first-use costs: kernels, buffers)."""
    for srv in servers:
        modes = _vllm_modes(srv.kind)
        srv.ask("decode", modes=modes, batch=1, context=64 + new_tokens * len(modes),
                cfg={**common, "new_tokens": new_tokens, "repeats": 1}, profile=False)


def _shares(rec, engine: str, mode: str, ctx: int, share: Mapping[str, float] | None) -> list[Record]:
    return [rec("decode_time_share", v, "fraction", engine, mode, {"context": ctx, "region": region})
            for region, v in (share or {}).items()]


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


def _vllm_cells(ckpt: str, cfg: LongConfig, common: dict, config: dict, rec, say) -> list[Record]:
    # one KV budget for every decode server: the largest cell in BF16, with room for the blocks' rounding
    tokens = max(b * (c + b + 2 * cfg.profile_steps + 2 + 128) for c, b in cfg.cells)
    budget = int(tokens * _bf16_bytes_per_token(cfg.spec) * 1.1)
    config["kv_budget_bytes"] = budget
    build = {"max_len": cfg.max_len, "max_seqs": max(b for _, b in cfg.cells), "kv_bytes": budget}
    out: list[Record] = []
    servers: dict[str, EngineServer] = {}
    try:
        kinds = list(dict.fromkeys(VLLM_SERVES[m] for m in VLLM_MODES))
        say(f"vllm: building {', '.join(k.value for k in kinds)} (a server process each, side by side)")
        servers = start_servers({k.value: k for k in kinds}, ckpt, build)
        _warm_up(servers.values(), common, cfg.new_tokens)
        for srv in servers.values():
            kv = srv.ask("kv")
            for mode in _vllm_modes(srv.kind):
                out += [rec("kv_capacity_tokens", kv["tokens"], "tokens", "vllm", mode),
                        rec("kv_bytes_per_token", kv["bytes"] / kv["tokens"], "B", "vllm", mode)]
            if srv.kind is EngineKind.VLLM_BF16:
                bf16_per_token, block = kv["bytes"] / kv["tokens"], kv["block_size"]
        profiled = profile_cell(cfg.cells, cfg.primary_batch)
        for ctx, batch in cfg.cells:
            for srv in servers.values():  # the engines side by side in each cell (the machine drifts)
                modes = _vllm_modes(srv.kind)
                say(f"vllm {'/'.join(modes)}: context {ctx}, batch {batch} (one prefill of {batch} x "
                    f"{ctx - cfg.new_tokens * len(modes)} tokens)")
                r = srv.ask("decode", modes=modes, batch=batch, context=ctx, cfg=common,
                            profile=(ctx, batch) == profiled)
                for mode, rate in r["rates"].items():
                    out.append(rec("rollout_tokens_per_s", rate, "tokens/s", "vllm", mode,
                                   {"context": ctx, "batch": batch}))
                for mode, share in r["shares"].items():
                    out += _shares(rec, "vllm", mode, ctx, share)
    finally:
        for srv in servers.values():
            srv.close()
    return out + _capacity_cells(ckpt, cfg, common, config, rec, say, bf16_per_token, block)


#: At most this many BF16 capacity runs to find a budget at which vLLM runs no more than --capacity-fit
#: requests at once (each a fresh engine: the budget is fixed when vLLM builds its cache).
CALIBRATION_RUNS = 4


def shrunk_budget(tokens: int, peak: int, fit: int, block: int, floor: int) -> int:
    """The next calibration budget in tokens: the usable blocks (all but vLLM's null block) scaled by
    ``fit / peak``, rounded down to whole blocks, plus the null block; never below ``floor``."""
    return max(floor, (tokens - block) * fit // peak // block * block + block)


#: Step time each capacity run gets per turn when the modes' runs alternate (:func:`side_by_side`).
CAPACITY_TURN_S = 1.0


def side_by_side(servers: Mapping[str, EngineServer], say, turn_s: float = CAPACITY_TURN_S,
                 cfg: Mapping | None = None) -> dict[str, dict]:
    """The capacity run of each mode (``servers``: mode -> its engine's server), all begun at once and
    stepped in turns of ``turn_s`` seconds of step time until every queue is done: the runs take
    minutes each and the machine drifts over minutes, so no mode's run is timed in another stretch of
    time than the others'. Each run counts only its own steps' time."""
    for mode, srv in servers.items():
        srv.ask("capacity_begin", mode=mode, cfg=dict(cfg or {}))
    live, turns = list(servers), 0
    while live:
        live = [m for m in live if not servers[m].ask("capacity_steps", seconds=turn_s)["done"]]
        turns += 1
        if turns % 30 == 0 and live:
            say(f"capacity run: {', '.join(live)} still running ({turns} turns)")
    return {mode: srv.ask("capacity_end") for mode, srv in servers.items()}


def _capacity_records(mode: str, r: dict, kv: dict, rec, say) -> list[Record]:
    say(f"capacity run {mode}: {r['tokens_per_s']:.1f} tokens/s, peak {r['peak_running']} running, "
        f"{r['preemptions']} preemptions")
    units = {"tokens_per_s": "tokens/s", "peak_running": "requests", "mean_running": "requests",
             "preemptions": "count", "wall_s": "s", "prefill_s": "s"}
    return [rec(f"capacity_{key}", r[key], unit, "vllm", mode) for key, unit in units.items()] + \
        [rec("capacity_kv_tokens", kv["tokens"], "tokens", "vllm", mode)]


def _capacity_cells(ckpt: str, cfg: LongConfig, common: dict, config: dict, rec, say, bf16_per_token: float,
                    block: int) -> list[Record]:
    # vLLM admits a request while its prompt fits and preempts as sequences grow, so a budget of exactly
    # capacity_fit whole BF16 requests runs more than capacity_fit of them at once (14 of 8 measured). The
    # target reads "a budget at which BF16 holds at most capacity_fit": shrink the budget by the overshoot,
    # in whole blocks, until BF16's peak is within it (never below one whole request plus vLLM's null block).
    need = -(-(CAPACITY_PROMPT + cfg.capacity_output) // block) * block
    floor = need + block
    tokens = cfg.capacity_fit * need + block
    config.update(capacity_requests=cfg.capacity_requests, capacity_output=cfg.capacity_output,
                  capacity_prompt=CAPACITY_PROMPT)
    base = {"max_len": -(-(CAPACITY_PROMPT + cfg.capacity_output + 16) // 16) * 16, "max_seqs": cfg.capacity_requests}
    trail = []
    for _ in range(CALIBRATION_RUNS):  # BF16 alone
        build = {**base, "kv_bytes": int(tokens * bf16_per_token)}
        say(f"capacity calibration: vllm-bf16, {cfg.capacity_requests} requests of {cfg.capacity_output} tokens, "
            f"{build['kv_bytes'] / 2**20:.2f} MiB of KV")
        srv = EngineServer(EngineKind.VLLM_BF16, ckpt, build)
        try:
            _warm_up([srv], common, min(cfg.new_tokens, 8))
            kv = srv.ask("kv")
            peak = side_by_side({"bf16": srv}, say, cfg=common)["bf16"]["peak_running"]
        finally:
            srv.close()
        trail.append({"budget_bytes": build["kv_bytes"], "kv_tokens": kv["tokens"], "peak_running": peak})
        say(f"capacity calibration: bf16 peak {peak} running at {kv['tokens']} tokens of KV")
        if peak <= cfg.capacity_fit or tokens == floor:
            break
        tokens = shrunk_budget(tokens, peak, cfg.capacity_fit, block, floor)
    config["capacity_budget_bytes"] = build["kv_bytes"]
    config["capacity_calibration"] = trail
    # every mode at the final budget, a server each (fp4 and trace: two of our engine), run side by side
    say(f"capacity run: {', '.join(VLLM_MODES)} side by side, {build['kv_bytes'] / 2**20:.2f} MiB of KV each")
    servers = start_servers({m: VLLM_SERVES[m] for m in VLLM_MODES}, ckpt, build)
    out: list[Record] = []
    try:
        _warm_up(servers.values(), common, min(cfg.new_tokens, 8))
        kvs = {mode: srv.ask("kv") for mode, srv in servers.items()}
        for mode, r in side_by_side(servers, say, cfg=common).items():
            out += _capacity_records(mode, r, kvs[mode], rec, say)
    finally:
        for srv in servers.values():
            srv.close()
    return out


def format_long(run: Run) -> str:
    c = run.config
    m = c["model"]
    lines = [f"long-context rollouts: attention {m['heads']} x {m['head_dim']} ({m['kv_heads']} KV heads), "
             f"{m['layers']} layer(s), MoE hidden {m['hidden']}, {m['experts']} experts top-{m['top_k']} of dim "
             f"{m['moe_intermediate']} (resized: see the JSON); decode tokens/s, prefill excluded, median of "
             f"{c['repeats']} runs of steps; {c['threads']} torch threads"]
    for engine in ("home", "vllm"):
        for ctx, batch in c["cells"]:
            vals = {mode: run.value("rollout_tokens_per_s", engine, mode, context=ctx, batch=batch)
                    for mode in VLLM_MODES}
            if all(v is None for v in vals.values()):
                continue
            row = "".join(f"  {mode} {v:9.1f}" for mode, v in vals.items() if v is not None)
            lines.append(f"{engine:<5} context {ctx:>6} batch {batch:>3}:{row}")
    kv = sorted((r.engine, r.mode, r.value) for r in run.find("kv_bytes_per_token"))
    if kv:
        lines.append("KV bytes per token (the caches' own tensors): " + ", ".join(f"{e}.{m} {v:.0f}" for e, m, v in kv))
    cap = sorted((r.engine, r.mode, r.value) for r in run.find("kv_capacity_tokens"))
    if cap:
        lines.append(f"KV capacity at {c['kv_budget_bytes'] / 2**20:.0f} MiB (vLLM's report): " + ", ".join(
            f"{e}.{m} {v}" for e, m, v in cap))
    for mode in run.values("capacity_tokens_per_s", "mode"):
        v = functools.partial(run.value, engine="vllm", mode=mode)
        wall = v("capacity_wall_s")
        lines.append(f"capacity run vllm.{mode}: {v('capacity_tokens_per_s'):.1f} tokens/s, peak "
                     f"{v('capacity_peak_running')} running (mean {v('capacity_mean_running'):.1f}), "
                     f"{v('capacity_preemptions')} preemptions"
                     + (f", {v('capacity_prefill_s') / wall:.0%} of {wall:.0f} s in steps running prompts"
                        if wall is not None else ""))
    for engine in run.values("decode_time_share", "engine"):
        for mode in run.values("decode_time_share", "mode", engine):
            s = {r.shape["region"]: r for r in run.find("decode_time_share", engine, mode)}
            lines.append(f"decode time at {s['experts'].shape['context']}, {engine}.{mode}: " + ", ".join(
                f"{k} {s[k].value:.0%}" for k in ("experts", "attention", "sites", "rest")))
    lines += [target_line(t) for t in run.targets]
    for label in run.targets_not_run:
        lines.append(f"target {label}: not run (its cell or engine was not in this run)")
    if not c.get("preset_shapes", True):
        lines.append("no targets: the long preset's targets are set for its own shapes, not these")
    return "\n".join(lines)
