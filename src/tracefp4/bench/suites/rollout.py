"""``tracefp4 bench rollout``: rollout throughput and memory per engine and mode, measured side by side.

Presets (``--preset``): ``mid``, a mid-size Qwen3-MoE (hidden 512, 8 layers, 16 experts top-4, expert
dim 256; 64 prompts x 128 new tokens), and ``bandwidth``, a decode-bound one at Qwen3-30B-A3B's layer
shapes (hidden 2048, 64 experts top-8, expert dim 768, 4 layers; batches of 8 and 32, so 1-4 rows per
expert per decode step, and expert weights of 2.4 GB in BF16, far beyond any cache). Random weights,
prompts of 16 tokens, a fixed number of new tokens (no stop token, so every mode generates as many).
The shape options (``--layers``, ``--hidden``, ``--experts``, ``--top-k``, ``--expert-dim``, ``--heads``,
``--kv-heads``, ``--head-dim``) replace the preset's dimensions, to measure at another model's per-layer
shapes (:func:`preset_spec` refuses those the FP4 paths cannot run); the targets are the presets' own
and are not evaluated at other shapes.

Modes: ``bf16`` (no quantization), ``fp4`` (the default W4A4 plan, routing recorded only),
``trace_lsb`` (lsb guidance on the deeper half, the paper's compact cache), ``trace_full`` (full codes
on every layer). Engines and what each mode runs on:

* ``home``: our engine (:class:`~tracefp4.engines.rollout.HomeEngine`) over one transformers model;
  ``bf16`` is its BF16 forward (torch matmuls per expert), the FP4 modes the packed-FP4 experts
  (:mod:`tracefp4.engines.experts`) kept beside the BF16 weights the trainer owns.
* ``vllm``: ``bf16`` is vLLM's own unquantized engine (:class:`~tracefp4.engines.vllm.engine.PlainVLLMEngine`,
  no tracefp4 config: what a user would run instead), the FP4 modes our plugin's engine holding
  only packed FP4 experts (``keep_bf16=False``). Each runs in a server process of its own (see
  :class:`_EngineServer`), so that both are timed in every round, interleaved with our engine's modes.

Every (engine, mode) pair runs once per round, rounds interleaved, after a short warm-up call each;
the median generation time gives ``rollout_tokens_per_s.<engine>.<mode>`` (at the preset's first
batch; ``...@b<batch>`` for each batch). Memory (``resident_bytes_per_expert_param.<engine>.<precision>``)
is measured in a fresh process per engine (side by side for a checkpoint of up to
``PARALLEL_PROBE_BYTES``, one at a time above): its resident-set growth from building the engine and one
generation, less the KV cache it allocated, over the number of routed-expert parameters (for
``home``, ``bf16`` is the model alone and ``fp4`` the model plus its packed experts). What is the
process's and not the engine's is loaded before the first reading and reported apart
(``runtime_bytes.vllm.<precision>``): the code an engine build imports on first use (vLLM imports
some 3,400 modules lazily while it builds an engine, the same for either precision and for any model
size; a first process builds one on a tiny checkpoint of the same architecture and names them) and,
for FP4, our quantizers' JIT-compiled kernels. An engine's figure is what its weights, caches and
buffers hold. The same probes give the KV cache vLLM allocates at ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB):
``kv_capacity_tokens.vllm.<mode>`` (vLLM's reported capacity, blocks x block size) and
``kv_bytes_per_token.vllm.<mode>`` (its cache tensors' bytes over that), for ``bf16`` (vLLM's own),
``fp8kv`` (vLLM's own with ``kv_cache_dtype="fp8"``, BF16 experts) and ``fp4`` (our plugin's engine:
packed FP4 experts and the packed FP4 K/V cache).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from tracefp4.engines.factory import EngineKind
from tracefp4.engines.model import TinyMoESpec, from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutEngine, SamplingParams
from tracefp4.guidance.compact import GuidedMode
from tracefp4.provenance import environment
from tracefp4.reports.bench_pipe import ServerProcess, answer_channel
from tracefp4.reports.bench_long import LONG_MOE, LongConfig, bench_long, format_long
from tracefp4.rl.arms import ROLLOUT_MODES

__all__ = ["BANDWIDTH_MOE", "MID_MOE", "PRESETS", "Preset", "bench_rollout", "format_rollout",
           "add_rollout_command", "preset_spec", "TARGETS"]

#: The mid-size MoE (about hidden 512, 8 layers, 16 experts top-4).
MID_MOE = TinyMoESpec(hidden=512, layers=8, experts=16, top_k=4, moe_intermediate=256, heads=8, kv_heads=4,
                      head_dim=64, vocab=1024, init_std=0.02)
#: Qwen3-30B-A3B's per-layer shapes (attention 32 x 128 query heads, 4 KV heads), 64 of its 128 experts.
BANDWIDTH_MOE = TinyMoESpec(hidden=2048, layers=4, experts=64, top_k=8, moe_intermediate=768, heads=32, kv_heads=4,
                            head_dim=128, vocab=1024, init_std=0.02)


@dataclasses.dataclass(frozen=True)
class Preset:
    spec: TinyMoESpec
    batches: tuple[int, ...]
    new_tokens: int
    prompt_len: int = 16


PRESETS = {"mid": Preset(MID_MOE, (64,), 128), "bandwidth": Preset(BANDWIDTH_MOE, (8, 32), 32),
           # long contexts: its own run (:mod:`tracefp4.reports.bench_long`), here for its model's shapes
           "long": Preset(LONG_MOE, LongConfig().batches, LongConfig().new_tokens)}

#: Targets per preset, as (description, key, bound): a ratio of two throughputs must reach the bound,
#: or (memory) a figure stay below it.
TARGETS = {
    "bandwidth": [
        ("vllm fp4 / vllm bf16 at batch 8", ("vllm", "fp4", "vllm", "bf16", 8), 2.0),
        ("home fp4 / home bf16 at batch 8", ("home", "fp4", "home", "bf16", 8), 2.0),
        ("vllm fp4 / vllm bf16 at batch 32", ("vllm", "fp4", "vllm", "bf16", 32), 1.4),
        ("home fp4 / home bf16 at batch 32", ("home", "fp4", "home", "bf16", 32), 1.4),
        ("vllm trace_lsb / vllm fp4 at batch 8", ("vllm", "trace_lsb", "vllm", "fp4", 8), 0.926),
    ],
    "mid": [
        ("home fp4 / home bf16", ("home", "fp4", "home", "bf16", 64), 1.0),
        ("vllm fp4 / vllm bf16", ("vllm", "fp4", "vllm", "bf16", 64), 1.0),
    ],
}
#: Resident bytes per routed-expert parameter of the FP4 vLLM engine, KV cache aside.
MEMORY_TARGET = ("vllm", "fp4", 0.8)


def expert_params(spec: TinyMoESpec) -> int:
    """Routed-expert parameters: layers x experts x (gate, up, down) x hidden x expert dim."""
    return config_expert_params(spec.config())


def config_expert_params(config) -> int:
    """:func:`expert_params` of a checkpoint's Qwen3-MoE config."""
    return config.num_hidden_layers * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _release() -> None:
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


#: A checkpoint of the presets' architecture small enough to build an engine on in seconds.
TINY_MOE = TinyMoESpec(hidden=64, layers=1, experts=4, top_k=2, moe_intermediate=32, heads=2, kv_heads=1, head_dim=64,
                       vocab=1024)


def _build_vllm(engine: str, ckpt: str):
    from tracefp4.engines.vllm.engine import PlainVLLMEngine, VLLMEngine

    common = dict(max_model_len=64, max_num_seqs=2)
    if engine == "vllm-fp8kv":  # vLLM's own FP8 KV cache (BF16 experts): what a user would pick instead
        return PlainVLLMEngine(ckpt, kv_cache_dtype="fp8", **common)
    return PlainVLLMEngine(ckpt, **common) if engine == "vllm-bf16" else VLLMEngine(ckpt, plan=PrecisionPlan(), **common)


def _generate_once(e, engine: str, prompt_len: int) -> None:
    prompts = [[3 + (i * 7 + j) % 100 for j in range(prompt_len)] for i in range(2)]
    e.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0),
               plan=PrecisionPlan() if engine == "vllm-fp4" else None, guidance=None)


def engine_modules(engine: str, ckpt: str) -> list[str]:
    """In this (fresh) process: the modules that building ``engine`` on ``ckpt`` and generating once
    imports (what :func:`memory_probe` loads before its first reading)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tracefp4.engines.vllm.engine import engine_env

    engine_env()
    before = set(sys.modules)
    e = _build_vllm(engine, ckpt)
    _generate_once(e, engine, 8)
    e.close()
    return sorted(set(sys.modules) - before)


def _load_runtime(modules: Sequence[str]) -> None:
    """Import ``modules`` (in the order an engine build imported them, parents first) and compile the
    FP4 quantizers' kernels: the code an engine runs, loaded once per process."""
    for name in modules:
        # a module that only imports as a side effect of another (or not on its own) is skipped:
        # what matters is that the bulk of the code is loaded, and its size is reported
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    from tracefp4.engines.experts import choose_gemm
    from tracefp4.guidance.names import Site

    plan = PrecisionPlan()
    choose_gemm(plan, "cpu", torch.bfloat16, gradients=False).prepare(torch.zeros(2, 16, 64, dtype=torch.bfloat16),
                                                                      plan.weight_quantizer)
    for site in (Site.EXPERT_IN, Site.EXPERT_MID, Site.K, Site.V):
        q = plan.quantizer(site)
        if q is not None:
            q.dequantize(q.quantize(torch.ones(2, 64, dtype=torch.bfloat16)))


def _probe_kind(probe: str) -> EngineKind:
    """The engine of a memory probe's name (``home``, ``vllm-bf16``, ``vllm-fp4``: engine, then precision)."""
    return EngineKind.parse(probe.split("-")[0], "memory probe")


def memory_probe(engine: str, ckpt: str, preset: str, modules: Sequence[str] = ()) -> dict:
    """In this (fresh) process: resident growth of building ``engine`` from ``ckpt`` and generating once.
    ``engine``: ``home`` (reports the model alone, then with its packed experts), ``vllm-fp4``,
    ``vllm-bf16``, ``vllm-fp8kv``. ``modules`` (see :func:`engine_modules`) and the FP4 kernels are loaded before
    the first reading; their growth is ``runtime_bytes``."""
    from transformers import AutoConfig

    p = PRESETS[preset]
    # the checkpoint's dimensions (the preset's, or those the command line replaced)
    config = AutoConfig.from_pretrained(ckpt, local_files_only=True)
    prompts = [[3 + (i * 7 + j) % 100 for j in range(p.prompt_len)] for i in range(2)]
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    out: dict = {"engine": engine, "expert_params": config_expert_params(config)}
    # everything imported before the first reading, so that only the engine's own memory is counted
    from tracefp4.engines.rollout import HomeEngine
    from tracefp4.formats import clib

    clib.available()
    if _probe_kind(engine) is not EngineKind.HOME:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its memory is ours
        from tracefp4.engines.vllm.engine import engine_env

        engine_env()
    _release()
    start = _rss()
    _load_runtime(modules)
    _release()
    before = _rss()
    out["runtime_bytes"] = before - start
    if _probe_kind(engine) is EngineKind.HOME:
        # built in memory (a loaded checkpoint's file pages would count as resident too)
        home = HomeEngine(from_config(config, seed=0))
        home.generate(prompts, sampling, plan=None, guidance=None)
        _release()
        out["bf16_bytes"] = _rss() - before
        home.generate(prompts, sampling, plan=PrecisionPlan(), guidance=None)
        _release()
        out["fp4_bytes"] = _rss() - before
        out["kv_bytes"] = 0  # our cache grows with the batch and is freed after each generation
        return out
    e = _build_vllm(engine, ckpt)
    _generate_once(e, engine, p.prompt_len)
    _release()
    out["bytes"] = _rss() - before
    kv = e.kv_cache_size()
    out["kv_bytes"], out["kv_tokens"] = kv["bytes"], kv["tokens"]
    e.close()
    return out


def _probe(args: list[str], timeout: float) -> dict | list:
    """``python -m tracefp4.reports.bench_rollout ARGS`` in a fresh process; its last stdout line as JSON."""
    cmd = [sys.executable, "-m", "tracefp4.reports.bench_rollout", *args]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: Checkpoints up to this size have their memory probes run side by side (each probe reads its own
#: process's resident set, so no figure depends on it, and a probe is mostly single-threaded imports
#: and set-up); larger ones one at a time, so that their weights never compete for the machine's memory.
PARALLEL_PROBE_BYTES = 256 * 2**20


def _probes(jobs: Sequence[list[str]], timeout: float, parallel: bool) -> list:
    """:func:`_probe` of each of ``jobs`` (in order), side by side where ``parallel``."""
    if not parallel or len(jobs) < 2:
        return [_probe(args, timeout) for args in jobs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda args: _probe(args, timeout), jobs))


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _kinds(engines: Sequence[str]) -> frozenset[EngineKind]:
    """The benchmark's engines (names as on the command line) as kinds; a ValueError names a bad one."""
    return frozenset(EngineKind.parse(e, "--engines") for e in engines)


def measure_memory(ckpt: str, preset: str, engines: Sequence[str], timeout: float = 1800) -> dict[str, float]:
    """``resident_bytes_per_expert_param.<engine>.<precision>``, each engine in a fresh process (see the
    module docstring for what is loaded before the first reading)."""
    kinds = _kinds(engines)
    probes = (["home"] if EngineKind.HOME in kinds else []) + \
        (["vllm-bf16", "vllm-fp8kv", "vllm-fp4"] if EngineKind.VLLM in kinds else [])
    res: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="tracefp4-tiny-") as tmp:
        modules = os.path.join(tmp, "modules.json")
        if EngineKind.VLLM in kinds:
            tiny = os.path.join(tmp, "ckpt")
            from_config(TINY_MOE.config(), seed=0).save_pretrained(tiny)
            # two probes on the tiny checkpoint, side by side: the fp4 build's modules first, then the bf16 one's
            found = _probes([["engine-modules", e, tiny] for e in ("vllm-fp4", "vllm-bf16")], timeout, parallel=True)
            with open(modules, "w") as f:
                json.dump(list(dict.fromkeys(n for names in found for n in names)), f)
        else:
            with open(modules, "w") as f:
                json.dump([], f)
        readings = _probes([["memory-probe", name, ckpt, preset, modules] for name in probes], timeout,
                           parallel=_dir_bytes(ckpt) <= PARALLEL_PROBE_BYTES)
        for name, m in zip(probes, readings):
            params = m["expert_params"]
            if _probe_kind(name) is EngineKind.HOME:
                res["resident_bytes_per_expert_param.home.bf16"] = m["bf16_bytes"] / params
                res["resident_bytes_per_expert_param.home.fp4"] = m["fp4_bytes"] / params
            else:
                mode = name.split("-")[1]
                # the KV figures at the probe's VLLM_CPU_KVCACHE_SPACE (1 GiB): vLLM's report, the cache tensors
                res[f"kv_capacity_tokens.vllm.{mode}"] = m["kv_tokens"]
                res[f"kv_bytes_per_token.vllm.{mode}"] = m["kv_bytes"] / m["kv_tokens"]
                if mode == "fp8kv":  # BF16 experts as vllm-bf16's: only its KV figures are its own
                    continue
                res[f"resident_bytes_per_expert_param.vllm.{mode}"] = (m["bytes"] - m["kv_bytes"]) / params
                res[f"kv_cache_bytes.vllm.{mode}"] = m["kv_bytes"]
                res[f"runtime_bytes.vllm.{mode}"] = m["runtime_bytes"]
    return res


def bench_rollout(engines: Sequence[str] = ("home", "vllm"), *, preset: str = "mid", batches: Sequence[int] | None = None,
                  new_tokens: int | None = None, repeats: int = 1, seed: int = 0, spec: TinyMoESpec | None = None,
                  memory: bool = True, progress: Callable[[str], None] | None = None, device: str = "cpu") -> dict:
    """Tokens per second per engine, mode and batch, the ratios, and (``memory``) resident memory per
    routed-expert parameter (see the module docstring). ``device``: where our engine runs (cuda: the
    Triton kernels); vLLM's engines pick their own, and the memory probes measure the CPU build."""
    if device != "cpu" and (memory or "vllm" in engines):
        raise ValueError(f"device {device!r}: our engine alone (--engines home --no-memory); the memory "
                         "probes and the vLLM servers run the CPU build")
    if preset == "long":
        raise ValueError("the long preset has its own run: tracefp4.reports.bench_long.bench_long")
    say = progress or (lambda msg: None)
    p = PRESETS[preset]
    spec = spec or p.spec
    batches = tuple(batches or p.batches)
    new_tokens = new_tokens or p.new_tokens
    plan = PrecisionPlan()
    say(f"building the {preset} model ({expert_params(spec) / 1e6:.0f}M routed-expert parameters)")
    model = from_config(spec.config(), seed=seed).to(device)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, spec.vocab, (p.prompt_len,), generator=g).tolist() for _ in range(max(batches))]
    res: dict = {"preset": preset, "model": dataclasses.asdict(spec), "batches": list(batches), "new_tokens": new_tokens,
                 "prompt_len": p.prompt_len, "repeats": repeats, "threads": torch.get_num_threads(), "device": device,
                 "expert_params": expert_params(spec), "environment": environment()}
    with tempfile.TemporaryDirectory(prefix="tracefp4-bench-") as ckpt:
        if EngineKind.VLLM in _kinds(engines) or memory:
            say("writing the checkpoint")
            model.save_pretrained(ckpt)
        for batch in batches:
            res.update(_time_batch(engines, model, ckpt, prompts[:batch], new_tokens, p.prompt_len, repeats, plan,
                                   batch, batch == batches[0], say))
        if memory:
            say("memory: one fresh process per engine")
            res.update(measure_memory(ckpt, preset, engines))
    # the targets are set for the presets' own shapes; at others the figures stand alone
    res["preset_shapes"] = spec == p.spec
    res["targets"] = _targets(res, preset) if res["preset_shapes"] else []
    return res


class _EngineServer:
    """A vLLM engine in a process of its own (``python -m tracefp4.reports.bench_rollout serve ...``),
    timed per call over a pipe: vLLM keeps process-wide state, so two vLLM engines cannot live in one
    process, and with one process each their calls can be interleaved in every round (these machines
    drift by up to 2x over minutes, so a BF16 phase followed by an FP4 phase would compare two
    different machines). The server idles between calls; only mode names and timings (JSON lines)
    cross the pipe."""

    def __init__(self, engine: str, ckpt: str, prompts: list[list[int]], new_tokens: int, max_model_len: int) -> None:
        self.server = ServerProcess("tracefp4.reports.bench_rollout",
                                    ["serve", engine, ckpt, str(new_tokens), str(max_model_len)], engine,
                                    env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})
        self.server.send(json.dumps(prompts))
        self.server.read()  # {"ready": true} once built and warmed up

    def time(self, mode: str) -> float:
        self.server.send(mode)
        return float(self.server.read()["seconds"])

    def close(self) -> None:
        self.server.close("quit")


def serve(engine: str, ckpt: str, new_tokens: int, max_model_len: int) -> None:
    """The server side of :class:`_EngineServer`: prompts as the first stdin line, then one mode name
    per line, each answered with that generation's seconds; ``quit`` ends it."""
    from tracefp4.engines.vllm.engine import PlainVLLMEngine, VLLMEngine, engine_env

    engine_env()
    prompts = json.loads(sys.stdin.readline())
    common = dict(max_model_len=max_model_len, max_num_seqs=len(prompts))
    plan = PrecisionPlan()
    e = PlainVLLMEngine(ckpt, **common) if engine == "vllm-bf16" else VLLMEngine(ckpt, plan=plan, **common)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
    answer = answer_channel()
    modes = ("bf16",) if engine == "vllm-bf16" else ("fp4", "trace_lsb", "trace_full")
    for mode in modes:  # warm-up at the timed batch (vLLM compiles per batch shape; first-use costs go here)
        _call(e, mode, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0), prompts, plan)
    answer({"ready": True})
    try:
        for line in sys.stdin:
            mode = line.strip()
            if mode == "quit":
                break
            if mode not in modes:
                raise ValueError(f"bench server {engine}: unknown mode {mode!r}; serves {modes}")
            answer({"seconds": _call(e, mode, sampling, prompts, plan)})
    finally:
        e.close()


def _call(engine: RolloutEngine, mode: str, s: SamplingParams, prompts, plan: PrecisionPlan) -> float:
    fp4, guidance = ROLLOUT_MODES[mode]
    t0 = time.perf_counter()
    engine.generate(prompts, s, plan=plan if fp4 else None, guidance=GuidedMode.parse(guidance) if guidance else None)
    return time.perf_counter() - t0


def _time_batch(engines, model, ckpt, prompts, new_tokens, prompt_len, repeats, plan, batch, primary, say) -> dict:
    """Interleaved rounds at one batch size: every (engine, mode) once per round, in a fixed order.
    Our engine runs in this process; vLLM's own BF16 engine and our FP4 one each in a server process
    (:class:`_EngineServer`), built before the first round and idle while another is timed."""
    from tracefp4.engines.rollout import HomeEngine

    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
    warm = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    calls: dict[tuple[str, str], Callable[[], float]] = {}
    servers: list[_EngineServer] = []
    try:
        if EngineKind.HOME in _kinds(engines):
            home = HomeEngine(model)
            for mode in ROLLOUT_MODES:
                _call(home, mode, warm, prompts, plan)
                calls[("home", mode)] = lambda m=mode: _call(home, m, sampling, prompts, plan)
        if EngineKind.VLLM in _kinds(engines):
            max_len = max(64, -(-(prompt_len + new_tokens + 2) // 16) * 16)
            for engine, modes in (("vllm-bf16", ("bf16",)), ("vllm-fp4", ("fp4", "trace_lsb", "trace_full"))):
                say(f"batch {batch}: building {'vLLM' + chr(39) + 's own BF16' if engine == 'vllm-bf16' else 'our FP4 vLLM'} "
                    f"engine (a server process)")
                servers.append(_EngineServer(engine, ckpt, prompts, new_tokens, max_len))
                for mode in modes:
                    calls[("vllm", mode)] = lambda m=mode, srv=servers[-1]: srv.time(m)
        times: dict[tuple[str, str], list[float]] = {}
        for rnd in range(repeats):
            for key, call in calls.items():
                times.setdefault(key, []).append(call())
                say(f"batch {batch}, round {rnd + 1}/{repeats}: {key[0]} {key[1]} {times[key][-1]:.1f}s")
    finally:
        for srv in servers:
            srv.close()
    tokens = len(prompts) * new_tokens
    out = {}
    for (name, mode), ts in times.items():
        value = tokens / statistics.median(ts)
        out[f"rollout_tokens_per_s.{name}.{mode}@b{batch}"] = value
        if primary:
            out[f"rollout_tokens_per_s.{name}.{mode}"] = value
    return out


def _targets(res: dict, preset: str) -> list[dict]:
    out = []
    for label, (e1, m1, e2, m2, batch), bound in TARGETS.get(preset, []):
        a, b = res.get(f"rollout_tokens_per_s.{e1}.{m1}@b{batch}"), res.get(f"rollout_tokens_per_s.{e2}.{m2}@b{batch}")
        if a is None or b is None:
            continue
        out.append({"target": label, "value": a / b, "bound": bound, "kind": "min", "met": a / b >= bound})
    engine, precision, bound = MEMORY_TARGET
    mem = res.get(f"resident_bytes_per_expert_param.{engine}.{precision}")
    if mem is not None and preset == "bandwidth":
        out.append({"target": "resident bytes per routed-expert parameter, FP4 vLLM engine, KV cache aside",
                    "value": mem, "bound": bound, "kind": "max", "met": mem <= bound})
    return out


def format_rollout(res: dict) -> str:
    m = res["model"]
    lines = [
        f"rollout throughput ({res['preset']}): MoE hidden {m['hidden']}, {m['layers']} layers, {m['experts']} experts "
        f"top-{m['top_k']}, expert dim {m['moe_intermediate']}; prompts of {res['prompt_len']} + {res['new_tokens']} new "
        f"tokens; {res['threads']} torch threads; median of {res['repeats']} interleaved round(s); tokens/s",
    ]
    for batch in res["batches"]:
        lines.append(f"batch {batch}: {'engine':<8}" + "".join(f"{mode:>13}" for mode in ROLLOUT_MODES)
                     + f"{'fp4/bf16':>10}{'lsb/fp4':>9}{'full/fp4':>10}")
        for e in sorted({k.split(".")[1] for k in res if k.startswith("rollout_tokens_per_s.")}):
            vals = {mode: res.get(f"rollout_tokens_per_s.{e}.{mode}@b{batch}") for mode in ROLLOUT_MODES}
            if any(v is None for v in vals.values()):
                continue
            row = "".join(f"{vals[mode]:>13.1f}" for mode in ROLLOUT_MODES)
            lines.append(f"{'':>9}{e:<8}{row}{vals['fp4'] / vals['bf16']:>10.2f}{vals['trace_lsb'] / vals['fp4']:>9.3f}"
                         f"{vals['trace_full'] / vals['fp4']:>10.3f}")
    mem = {k.split(".", 1)[1]: v for k, v in res.items() if k.startswith("resident_bytes_per_expert_param.")}
    if mem:
        lines.append("resident bytes per routed-expert parameter (KV cache aside; home fp4 = the trainer's BF16 "
                     "weights + the packed experts): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(mem.items())))
    kv = {k.split(".", 1)[1]: v for k, v in res.items() if k.startswith("kv_capacity_tokens.")}
    if kv:
        lines.append("KV cache at the probes' 1 GiB (tokens, bytes per token; vLLM's report and its cache tensors): "
                     + ", ".join(f"{k} {v} ({res[f'kv_bytes_per_token.{k}']:.0f} B)" for k, v in sorted(kv.items())))
    if not res.get("preset_shapes", True):
        lines.append(f"no targets: the {res['preset']} preset's targets are set for its own shapes, not these")
    for t in res.get("targets", []):
        sym = ">=" if t["kind"] == "min" else "<="
        lines.append(f"target {t['target']}: {t['value']:.3f} ({sym} {t['bound']}: {'ok' if t['met'] else 'MISSED'})")
    return "\n".join(lines)


#: (flag, TinyMoESpec field, what it sets) of ``bench rollout``'s shape options.
_SHAPE_FLAGS = (
    ("--layers", "layers", "decoder layers"),
    ("--hidden", "hidden", "hidden size (a multiple of 16: the NVFP4 block)"),
    ("--experts", "experts", "routed experts per layer"),
    ("--top-k", "top_k", "experts per token"),
    ("--expert-dim", "moe_intermediate", "each expert's intermediate size (a multiple of 16)"),
    ("--heads", "heads", "attention query heads"),
    ("--kv-heads", "kv_heads", "attention KV heads (dividing --heads)"),
    ("--head-dim", "head_dim", "attention head dimension (a multiple of 16)"),
)


def preset_spec(preset: str, **shape: int | None) -> TinyMoESpec:
    """The preset's model with the given dimensions replaced (None: the preset's), refused with the
    offending option named where the FP4 paths cannot run it: every dimension a quantization site or
    a packed GEMM reduces over (hidden, expert dim, head dim) must hold whole NVFP4 blocks of 16."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    flags = {field: flag for flag, field, _ in _SHAPE_FLAGS}
    unknown = sorted(set(shape) - set(flags))
    if unknown:
        raise ValueError(f"unknown model dimension(s) {unknown}; expected some of {sorted(flags)}")
    given = {k: int(v) for k, v in shape.items() if v is not None}
    for field, v in given.items():
        if v < 1:
            raise ValueError(f"{flags[field]} must be at least 1, got {v}")
    spec = dataclasses.replace(PRESETS[preset].spec, **given)
    for field in ("hidden", "moe_intermediate", "head_dim"):
        if getattr(spec, field) % 16:
            raise ValueError(f"{flags[field]} must be a multiple of 16 (the NVFP4 block), got {getattr(spec, field)}")
    if spec.top_k > spec.experts:
        raise ValueError(f"--top-k {spec.top_k} exceeds --experts {spec.experts}")
    if spec.heads % spec.kv_heads:
        raise ValueError(f"--kv-heads {spec.kv_heads} must divide --heads {spec.heads}")
    return spec


def add_rollout_command(bsub, write_json: Callable[[str | None, dict], None]) -> None:
    b = bsub.add_parser(
        "rollout",
        help="rollout tokens/s and memory per engine (home, vllm) and mode (bf16, fp4, trace_lsb, trace_full)",
        description=__doc__.split("\n\n")[0],
    )
    b.add_argument("--preset", choices=sorted(PRESETS), default="mid", help="the model and batches (module docstring)")
    b.add_argument("--engines", default="home,vllm", help="comma-separated: home, vllm (vllm needs vllm-cpu installed)")
    b.add_argument("--batch", type=int, action="append", help="batch size (repeatable; default: the preset's)")
    b.add_argument("--new-tokens", type=int, help="new tokens per prompt (default: the preset's)")
    b.add_argument("--repeats", type=int, default=1, help="interleaved rounds (median reported)")
    # the model's shapes, to measure at your model's per-layer dimensions (random weights either way)
    for flag, field, what in _SHAPE_FLAGS:
        b.add_argument(flag, type=int, dest=field, help=f"{what} (default: the preset's)")
    b.add_argument("--no-memory", action="store_true", help="skip the resident-memory probes")
    b.add_argument("--device", default="cpu", help="where our engine runs: cpu, or cuda (the Triton kernels; "
                   "with --engines home --no-memory)")
    b.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    long = b.add_argument_group("--preset long (tracefp4.reports.bench_long; --batch and --new-tokens apply too)")
    d = LongConfig()  # the help shows the preset's own defaults
    cells = ", ".join(f"{c} x {b}" for c, b in d.cells)
    long.add_argument("--contexts", help="comma-separated contexts (prompt + generated) run at every --batch "
                      f"(default: the preset's cells, context x batch: {cells})")
    long.add_argument("--home-contexts", help="comma-separated contexts our engine runs too (default "
                      f"{','.join(map(str, d.home_contexts))})")
    long.add_argument("--capacity-output", type=int, help=f"new tokens per capacity-run request (default "
                      f"{d.capacity_output})")
    long.add_argument("--capacity-requests", type=int, help=f"capacity-run queue (default {d.capacity_requests})")
    long.add_argument("--capacity-fit", type=int, help="requests vLLM's BF16 engine holds at the capacity budget "
                      f"(default {d.capacity_fit})")
    long.add_argument("--profile-steps", type=int, help="decode steps profiled at the largest context (default "
                      f"{d.profile_steps})")

    def run(args: argparse.Namespace) -> int:
        spec = preset_spec(args.preset, **{f: getattr(args, f) for _, f, _ in _SHAPE_FLAGS})  # refusals name the option
        if args.preset == "long":
            if args.device != "cpu":
                raise ValueError(f"--preset long runs vLLM's CPU build and our engine on the CPU, not --device "
                                 f"{args.device}")
            res = bench_long([e.strip() for e in args.engines.split(",") if e.strip()], long_config(args, spec),
                             progress=lambda msg: print(msg, file=sys.stderr, flush=True))
            print(format_long(res))
            write_json(args.json, res)
            return 0
        res = bench_rollout([e.strip() for e in args.engines.split(",") if e.strip()], preset=args.preset,
                            batches=args.batch, new_tokens=args.new_tokens, repeats=args.repeats, spec=spec,
                            memory=not args.no_memory, progress=lambda msg: print(msg, file=sys.stderr, flush=True),
                            device=args.device)
        print(format_rollout(res))
        write_json(args.json, res)
        return 0

    b.set_defaults(func=run)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def long_config(args: argparse.Namespace, spec: TinyMoESpec) -> LongConfig:
    """The long preset's run from ``bench rollout``'s options (unset ones: the preset's)."""
    base = LongConfig()
    cells = base.cells
    if args.contexts or args.batch:
        contexts = _ints(args.contexts, "--contexts") if args.contexts else base.contexts
        cells = tuple((c, b) for b in (args.batch or base.batches) for c in contexts)
    given = {"new_tokens": args.new_tokens, "capacity_output": args.capacity_output,
             "profile_steps": args.profile_steps, "capacity_requests": args.capacity_requests,
             "capacity_fit": args.capacity_fit}
    home = _ints(args.home_contexts, "--home-contexts") if args.home_contexts else base.home_contexts
    return dataclasses.replace(base, spec=spec, cells=cells, repeats=args.repeats, home_contexts=home,
                               **{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    """``python -m tracefp4.reports.bench_rollout memory-probe ENGINE CKPT PRESET MODULES_JSON``,
    ``... engine-modules ENGINE CKPT`` (what :func:`measure_memory` runs, each in a fresh process) or
    ``... serve ENGINE CKPT NEW_TOKENS MAX_MODEL_LEN`` (an :class:`_EngineServer`)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 5 and args[0] == "memory-probe":
        with open(args[4]) as f:
            modules = json.load(f)
        print(json.dumps(memory_probe(args[1], args[2], args[3], modules)))
        return 0
    if len(args) == 5 and args[0] == "serve":
        serve(args[1], args[2], int(args[3]), int(args[4]))
        return 0
    if len(args) == 3 and args[0] == "engine-modules":
        print(json.dumps(engine_modules(args[1], args[2])))
        return 0
    print("usage: python -m tracefp4.reports.bench_rollout memory-probe home|vllm-fp4|vllm-bf16|vllm-fp8kv CKPT PRESET "
          "MODULES_JSON\n"
          "       python -m tracefp4.reports.bench_rollout engine-modules vllm-fp4|vllm-bf16 CKPT\n"
          "       python -m tracefp4.reports.bench_rollout serve vllm-fp4|vllm-bf16 CKPT NEW_TOKENS MAX_MODEL_LEN",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
