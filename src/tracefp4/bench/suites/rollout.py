"""The rollout suite (``tracefp4 bench rollout``): rollout throughput and memory per engine and mode, measured side by side.

Presets (``--preset``): ``mid``, a mid-size Qwen3-MoE (hidden 512, 8 layers, 16 experts top-4, expert
dim 256; 64 prompts x 128 new tokens), and ``bandwidth``, a decode-bound one at Qwen3-30B-A3B's layer
shapes (hidden 2048, 64 experts top-8, expert dim 768, 4 layers; batches of 8 and 32, so 1-4 rows per
expert per decode step, and expert weights of 2.4 GB in BF16, far beyond any cache). Random weights,
prompts of 16 tokens, a fixed number of new tokens (no stop token, so every mode generates as many).
The shape options (``--layers``, ``--hidden``, ``--experts``, ``--top-k``, ``--expert-dim``, ``--heads``,
``--kv-heads``, ``--head-dim``) replace the preset's dimensions, to measure at another model's per-layer
shapes (:func:`preset_spec` refuses those the FP4 paths cannot run); the targets are the presets' own
and are not evaluated at other shapes.

Modes (:data:`~tracefp4.pipeline.arms.ROLLOUT_MODES`): ``bf16`` (no quantization), ``fp4`` (the default
W4A4 plan, routing recorded only), ``trace`` (lsb guidance on the deeper half, the paper's compact cache),
``trace-full`` (full codes on every layer); the recording modes go by their arm's name. Engines and what each mode runs on:

* ``home``: our engine (:class:`~tracefp4.engines.rollout.HomeEngine`) over one transformers model;
  ``bf16`` is its BF16 forward (torch matmuls per expert), the FP4 modes the packed-FP4 experts
  (:mod:`tracefp4.engines.experts`) kept beside the BF16 weights the trainer owns.
* ``vllm``: ``bf16`` is vLLM's own unquantized engine (:class:`~tracefp4.engines.vllm.engine.PlainVLLMEngine`,
  no tracefp4 config: what a user would run instead), the FP4 modes our plugin's engine holding
  only packed FP4 experts (``keep_bf16=False``). Each runs in a server process of its own (see
  :mod:`tracefp4.bench.server`), so that both are timed in every round, interleaved with our engine's modes.

Every (engine, mode) pair runs once per round, rounds interleaved, after a short warm-up call each;
the median generation time gives the record ``rollout_tokens_per_s`` of the engine and mode at each
batch. Memory (``resident_bytes_per_expert_param`` of the engine and precision)
is measured in a fresh process per engine (side by side for a checkpoint of up to
``PARALLEL_PROBE_BYTES``, one at a time above): its resident-set growth from building the engine and one
generation, less the KV cache it allocated, over the number of routed-expert parameters (for
``home``, ``bf16`` is the model alone and ``fp4`` the model plus its packed experts). What is the
process's and not the engine's is loaded before the first reading and reported apart
(``runtime_bytes``): the code an engine build imports on first use (vLLM imports
some 3,400 modules lazily while it builds an engine, the same for either precision and for any model
size; a first process builds one on a tiny checkpoint of the same architecture and names them) and,
for FP4, our quantizers' JIT-compiled kernels. An engine's figure is what its weights, caches and
buffers hold. The same probes give the KV cache vLLM allocates at ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB):
``kv_capacity_tokens`` (vLLM's reported capacity, blocks x block size) and
``kv_bytes_per_token`` (its cache tensors' bytes over that), for ``bf16`` (vLLM's own),
``fp8kv`` (vLLM's own with ``kv_cache_dtype="fp8"``, BF16 experts) and ``fp4`` (our plugin's engine:
packed FP4 experts and the packed FP4 K/V cache).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import os
import sys
import tempfile
from collections.abc import Callable, Sequence

import torch

from tracefp4.bench.decode import generate_mode
from tracefp4.bench.harness import Spread, interleave, timed
from tracefp4.bench.memory import ResidentProbe, run_children
from tracefp4.bench.result import Record, Run, target_line
from tracefp4.bench.server import EngineServer, start_servers
from tracefp4.bench.suites.long import LONG_MOE, LongConfig
from tracefp4.bench.targets import judged
from tracefp4.pipeline.factory import EngineKind, make_engine
from tracefp4.engines.model import TinyMoESpec, from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.provenance import environment
from tracefp4.pipeline.arms import ROLLOUT_MODES

__all__ = ["BANDWIDTH_MOE", "MID_MOE", "PRESETS", "Preset", "add_arguments", "bench_rollout", "format_rollout",
           "long_config", "preset_spec", "run"]

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
           # long contexts: its own suite (:mod:`tracefp4.bench.suites.long`), here for its model's shapes
           "long": Preset(LONG_MOE, LongConfig().batches, LongConfig().new_tokens)}

def expert_params(spec: TinyMoESpec) -> int:
    """Routed-expert parameters: layers x experts x (gate, up, down) x hidden x expert dim."""
    return config_expert_params(spec.config())


def config_expert_params(config) -> int:
    """:func:`expert_params` of a checkpoint's Qwen3-MoE config."""
    return config.num_hidden_layers * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size


#: A checkpoint of the presets' architecture small enough to build an engine on in seconds.
TINY_MOE = TinyMoESpec(hidden=64, layers=1, experts=4, top_k=2, moe_intermediate=32, heads=2, kv_heads=1, head_dim=64,
                       vocab=1024)



#: The memory probes: each engine kind and the precision its figures are recorded under.
PROBES = {EngineKind.VLLM_BF16: "bf16", EngineKind.VLLM_FP8KV: "fp8kv", EngineKind.VLLM: "fp4"}
#: Checkpoints up to this size have their memory probes run side by side (each probe reads its own
#: process's resident set, so no figure depends on it, and a probe is mostly single-threaded imports
#: and set-up); larger ones one at a time, so that their weights never compete for the machine's memory.
PARALLEL_PROBE_BYTES = 256 * 2**20
#: The probes' KV budget (GiB): what vLLM's CPU build allocates for its cache in each probe process.
PROBE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def _build_vllm(kind: EngineKind, ckpt: str):
    plan = {"plan": PrecisionPlan()} if kind is EngineKind.VLLM else {}
    return make_engine(kind, checkpoint=ckpt, max_len=64, max_num_seqs=2, **plan)


def _generate_once(e, kind: EngineKind, prompt_len: int) -> None:
    prompts = [[3 + (i * 7 + j) % 100 for j in range(prompt_len)] for i in range(2)]
    e.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0),
               plan=PrecisionPlan() if kind is EngineKind.VLLM else None, guidance=None)


def engine_modules(kind: str, ckpt: str) -> list[str]:
    """In a fresh process (:func:`~tracefp4.bench.memory.run_child`): the modules that building the
    engine of ``kind`` on ``ckpt`` and generating once imports (what :func:`engine_memory` loads
    before its first reading)."""
    from tracefp4.engines.vllm.engine import engine_env

    engine_env()
    k = EngineKind.parse(kind, "engine_modules kind")
    before = set(sys.modules)
    e = _build_vllm(k, ckpt)
    _generate_once(e, k, 8)
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


def engine_memory(kind: str, ckpt: str, preset: str, modules: Sequence[str] = ()) -> dict:
    """In a fresh process: resident growth of building the engine of ``kind`` from ``ckpt`` and
    generating once (``home``: the model alone, then with its packed experts). ``modules`` (see
    :func:`engine_modules`) and the FP4 kernels are loaded before the first reading; their growth is
    ``runtime_bytes``."""
    from transformers import AutoConfig

    k = EngineKind.parse(kind, "engine_memory kind")
    p = PRESETS[preset]
    # the checkpoint's dimensions (the preset's, or those the command line replaced)
    config = AutoConfig.from_pretrained(ckpt, local_files_only=True)
    prompts = [[3 + (i * 7 + j) % 100 for j in range(p.prompt_len)] for i in range(2)]
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    out: dict = {"engine": k.value, "expert_params": config_expert_params(config)}
    # everything imported before the first reading, so that only the engine's own memory is counted
    from tracefp4.formats import clib

    clib.available()
    if k is not EngineKind.HOME:
        from tracefp4.engines.vllm.engine import engine_env

        engine_env()
    start = ResidentProbe()
    _load_runtime(modules)
    out["runtime_bytes"] = start.growth()
    probe = ResidentProbe()
    if k is EngineKind.HOME:
        # built in memory (a loaded checkpoint's file pages would count as resident too)
        home = make_engine(EngineKind.HOME, from_config(config, seed=0))
        home.generate(prompts, sampling, plan=None, guidance=None)
        out["bf16_bytes"] = probe.growth()
        home.generate(prompts, sampling, plan=PrecisionPlan(), guidance=None)
        out["fp4_bytes"] = probe.growth()
        out["kv_bytes"] = 0  # our cache grows with the batch and is freed after each generation
        return out
    e = _build_vllm(k, ckpt)
    _generate_once(e, k, p.prompt_len)
    out["bytes"] = probe.growth()
    kv = e.kv_cache_size()
    out["kv_bytes"], out["kv_tokens"] = kv["bytes"], kv["tokens"]
    e.close()
    return out


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _kinds(engines: Sequence[str]) -> frozenset[EngineKind]:
    """The benchmark's engines (``home``, ``vllm`` as on the command line) as kinds; a ValueError names a bad one."""
    kinds = frozenset(EngineKind.parse(e, "--engines") for e in engines)
    bad = sorted(k.value for k in kinds - {EngineKind.HOME, EngineKind.VLLM})
    if bad:
        raise ValueError(f"--engines: {', '.join(bad)}: the rollout suite compares home and vllm (vLLM's own "
                         "engines are its baselines)")
    return kinds


def measure_memory(ckpt: str, preset: str, engines: Sequence[str], timeout: float = 1800) -> list[Record]:
    """Resident bytes per routed-expert parameter and vLLM's KV figures, each engine in a fresh
    process (see the module docstring for what is loaded before the first reading)."""
    kinds = _kinds(engines)
    probes = ([EngineKind.HOME] if EngineKind.HOME in kinds else []) + (list(PROBES) if EngineKind.VLLM in kinds else [])
    child = "tracefp4.bench.suites.rollout:"
    modules: list[str] = []
    if EngineKind.VLLM in kinds:
        with tempfile.TemporaryDirectory(prefix="tracefp4-tiny-") as tiny:
            from_config(TINY_MOE.config(), seed=0).save_pretrained(tiny)
            # two probes on the tiny checkpoint, side by side: the fp4 build's modules first, then the bf16 one's
            found = run_children([(child + "engine_modules", {"kind": k.value, "ckpt": tiny})
                                  for k in (EngineKind.VLLM, EngineKind.VLLM_BF16)],
                                 timeout=timeout, parallel=True, env=PROBE_ENV)
        modules = list(dict.fromkeys(n for names in found for n in names))
    readings = run_children([(child + "engine_memory", {"kind": k.value, "ckpt": ckpt, "preset": preset,
                                                        "modules": modules}) for k in probes],
                            timeout=timeout, parallel=_dir_bytes(ckpt) <= PARALLEL_PROBE_BYTES, env=PROBE_ENV)
    rec = functools.partial(Record, "rollout", machine=environment().get("cpu_model", ""))
    out = []
    for kind, m in zip(probes, readings):
        params = m["expert_params"]
        if kind is EngineKind.HOME:
            out += [rec("resident_bytes_per_expert_param", m["bf16_bytes"] / params, "B/param", "home", "bf16"),
                    rec("resident_bytes_per_expert_param", m["fp4_bytes"] / params, "B/param", "home", "fp4")]
            continue
        mode = PROBES[kind]
        # the KV figures at the probe's VLLM_CPU_KVCACHE_SPACE (1 GiB): vLLM's report, the cache tensors
        out += [rec("kv_capacity_tokens", m["kv_tokens"], "tokens", "vllm", mode),
                rec("kv_bytes_per_token", m["kv_bytes"] / m["kv_tokens"], "B", "vllm", mode)]
        if kind is EngineKind.VLLM_FP8KV:  # BF16 experts as vllm-bf16's: only its KV figures are its own
            continue
        out += [rec("resident_bytes_per_expert_param", (m["bytes"] - m["kv_bytes"]) / params, "B/param", "vllm", mode),
                rec("kv_cache_bytes", m["kv_bytes"], "B", "vllm", mode),
                rec("runtime_bytes", m["runtime_bytes"], "B", "vllm", mode)]
    return out


def _time_batch(kinds, model, ckpt, prompts, new_tokens, prompt_len, repeats, plan, batch, say) -> list[Record]:
    """Interleaved rounds at one batch size: every (engine, mode) once per round, in a fixed order.
    Our engine runs in this process; vLLM's own BF16 engine and our FP4 one each in a server process,
    built side by side before the first round and idle while another is timed."""
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
    warm = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    calls: dict[tuple[str, str], Callable[[], float]] = {}
    servers: dict[str, EngineServer] = {}
    try:
        if EngineKind.HOME in kinds:
            home = make_engine(EngineKind.HOME, model)
            for mode in ROLLOUT_MODES:
                generate_mode(home, mode, prompts, warm, plan)
                calls[("home", mode)] = timed(lambda m=mode: generate_mode(home, m, prompts, sampling, plan))
        if EngineKind.VLLM in kinds:
            max_len = max(64, -(-(prompt_len + new_tokens + 2) // 16) * 16)
            say(f"batch {batch}: building vLLM's own BF16 engine and our FP4 one (a server process each)")
            servers = start_servers({"bf16": EngineKind.VLLM_BF16, "fp4": EngineKind.VLLM}, ckpt,
                                    {"max_len": max_len, "max_seqs": len(prompts)},
                                    env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})
            for srv, modes in ((servers["bf16"], ("bf16",)), (servers["fp4"], ("fp4", "trace", "trace-full"))):
                for mode in modes:  # warm-up at the timed batch (vLLM compiles per batch shape; first-use costs here)
                    srv.ask("generate", mode=mode, prompts=prompts, new_tokens=4)
                    calls[("vllm", mode)] = lambda m=mode, s=srv: s.ask("generate", mode=m, prompts=prompts,
                                                                        new_tokens=new_tokens)["seconds"]
        times = interleave(calls, repeats, say=lambda msg: say(f"batch {batch}, {msg}"))
    finally:
        for srv in servers.values():
            srv.close()
    tokens = len(prompts) * new_tokens
    rec = functools.partial(Record, "rollout", unit="tokens/s", shape={"batch": batch},
                            machine=environment().get("cpu_model", ""))
    out = []
    for (engine, mode), ts in times.items():
        t = Spread.of(ts)
        out.append(rec("rollout_tokens_per_s", tokens / t.median, engine=engine, mode=mode,
                       spread=(tokens / t.hi, tokens / t.lo)))
    return out


def bench_rollout(engines: Sequence[str] = ("home", "vllm"), *, preset: str = "mid", batches: Sequence[int] | None = None,
                  new_tokens: int | None = None, repeats: int = 1, seed: int = 0, spec: TinyMoESpec | None = None,
                  memory: bool = True, progress: Callable[[str], None] | None = None, device: str = "cpu") -> Run:
    """Tokens per second per engine, mode and batch and (``memory``) resident memory per routed-expert
    parameter (see the module docstring). ``device``: where our engine runs (cuda: the Triton
    kernels); vLLM's engines pick their own, and the memory probes measure the CPU build."""
    kinds = _kinds(engines)
    if device != "cpu" and (memory or EngineKind.VLLM in kinds):
        raise ValueError(f"device {device!r}: our engine alone (--engines home --no-memory); the memory "
                         "probes and the vLLM servers run the CPU build")
    if preset == "long":
        raise ValueError("the long preset is its own suite: tracefp4.bench.suites.long.bench_long")
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
    config = {"preset": preset, "model": dataclasses.asdict(spec), "batches": list(batches), "new_tokens": new_tokens,
              "prompt_len": p.prompt_len, "repeats": repeats, "threads": torch.get_num_threads(), "device": device,
              "expert_params": expert_params(spec),
              # the targets are set for the presets' own shapes; at others the figures stand alone
              "preset_shapes": spec == p.spec}
    records: list[Record] = []
    with tempfile.TemporaryDirectory(prefix="tracefp4-bench-") as ckpt:
        if EngineKind.VLLM in kinds or memory:
            say("writing the checkpoint")
            model.save_pretrained(ckpt)
        for batch in batches:
            records += _time_batch(kinds, model, ckpt, prompts[:batch], new_tokens, p.prompt_len, repeats, plan, batch,
                                   say)
        if memory:
            say("memory: one fresh process per engine")
            records += measure_memory(ckpt, preset, engines)
    return judged(Run("rollout", records, config, environment()))


def format_rollout(run: Run) -> str:
    c = run.config
    m = c["model"]
    lines = [
        f"rollout throughput ({c['preset']}): MoE hidden {m['hidden']}, {m['layers']} layers, {m['experts']} experts "
        f"top-{m['top_k']}, expert dim {m['moe_intermediate']}; prompts of {c['prompt_len']} + {c['new_tokens']} new "
        f"tokens; {c['threads']} torch threads; median of {c['repeats']} interleaved round(s); tokens/s",
    ]
    for batch in c["batches"]:
        lines.append(f"batch {batch}: {'engine':<8}" + "".join(f"{mode:>13}" for mode in ROLLOUT_MODES)
                     + f"{'fp4/bf16':>10}{'lsb/fp4':>9}{'full/fp4':>10}")
        for e in run.values("rollout_tokens_per_s", "engine"):
            vals = {mode: run.value("rollout_tokens_per_s", e, mode, batch=batch) for mode in ROLLOUT_MODES}
            if any(v is None for v in vals.values()):
                continue
            row = "".join(f"{vals[mode]:>13.1f}" for mode in ROLLOUT_MODES)
            lines.append(f"{'':>9}{e:<8}{row}{vals['fp4'] / vals['bf16']:>10.2f}{vals['trace'] / vals['fp4']:>9.3f}"
                         f"{vals['trace-full'] / vals['fp4']:>10.3f}")
    mem = sorted((r.engine, r.mode, r.value) for r in run.find("resident_bytes_per_expert_param"))
    if mem:
        lines.append("resident bytes per routed-expert parameter (KV cache aside; home fp4 = the trainer's BF16 "
                     "weights + the packed experts): " + ", ".join(f"{e}.{m} {v:.3f}" for e, m, v in mem))
    kv = sorted((r.engine, r.mode, r.value) for r in run.find("kv_capacity_tokens"))
    if kv:
        lines.append("KV cache at the probes' 1 GiB (tokens, bytes per token; vLLM's report and its cache tensors): "
                     + ", ".join(f"{e}.{m} {v} ({run.value('kv_bytes_per_token', e, m):.0f} B)" for e, m, v in kv))
    if not c.get("preset_shapes", True):
        lines.append(f"no targets: the {c['preset']} preset's targets are set for its own shapes, not these")
    lines += [target_line(t) for t in run.targets]
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


def add_arguments(b: argparse.ArgumentParser) -> None:
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
    long = b.add_argument_group("--preset long (the long suite, tracefp4.bench.suites.long; --batch and --new-tokens "
                                "apply too)")
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


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> Run:
    """``bench rollout``: the rollout suite, or with ``--preset long`` the long suite."""
    from tracefp4.bench.suites.long import bench_long

    spec = preset_spec(args.preset, **{f: getattr(args, f) for _, f, _ in _SHAPE_FLAGS})  # refusals name the option
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.preset == "long":
        if args.device != "cpu":
            raise ValueError(f"--preset long runs vLLM's CPU build and our engine on the CPU, not --device "
                             f"{args.device}")
        return bench_long(engines, long_config(args, spec), progress=_say)
    return bench_rollout(engines, preset=args.preset, batches=args.batch, new_tokens=args.new_tokens,
                         repeats=args.repeats, spec=spec, memory=not args.no_memory, progress=_say, device=args.device)


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
