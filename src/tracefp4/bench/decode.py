"""Decode steps one at a time, and where their time goes: what the long suite measures, in our engine
(:func:`home_decode`, in the driver's process) and in a vLLM engine (:func:`vllm_decode` and
:class:`CapacityRun`, run by :mod:`tracefp4.bench.server`), so both count a rate and a time share alike.
What the figures mean is in :mod:`tracefp4.bench.suites.long`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from tracefp4.bench.harness import median_rate, run_lengths
from tracefp4.pipeline.factory import EngineKind
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.guidance.compact import GuidedMode
from tracefp4.pipeline.arms import ROLLOUT_MODES

__all__ = ["CAPACITY_PROMPT", "REGIONS", "VLLM_SERVES", "CapacityRun", "generate_mode", "home_decode", "profiled",
           "random_prompts", "share_of_events", "vllm_decode"]

#: Capacity run prompts: long enough to be a prompt, short beside the outputs.
CAPACITY_PROMPT = 64
#: The engine that serves each rollout mode in vLLM: vLLM's own for BF16 and FP8 K/V, our plugin's for FP4.
VLLM_SERVES = {"bf16": EngineKind.VLLM_BF16, "fp8kv": EngineKind.VLLM_FP8KV, "fp4": EngineKind.VLLM,
               "trace": EngineKind.VLLM, "trace-full": EngineKind.VLLM}

def generate_mode(engine, mode: str, prompts, sampling, plan: PrecisionPlan | None) -> None:
    """One generation of ``prompts`` as rollout mode ``mode`` does it (:data:`~tracefp4.pipeline.arms.ROLLOUT_MODES`:
    FP4 under ``plan`` or BF16, recording its guidance mode or routing only); a mode that is no arm's
    (``fp8kv``: vLLM's FP8 K/V engine) is its engine's own BF16 generation."""
    fp4, guidance = ROLLOUT_MODES.get(mode, (False, None))
    engine.generate(prompts, sampling, plan=plan if fp4 else None,
                    guidance=GuidedMode.parse(guidance) if guidance else None)


#: Profiler region names per category, innermost wins (a site inside the experts is a site).
REGIONS = {"sites": ("tracefp4::site",),
            # vLLM's own BF16 experts run as one op outside moe_forward; ours inside it (router included)
            "experts": ("vllm::moe_forward", "_C::cpu_fused_moe", "tracefp4::experts"),
            "attention": ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update",
                          "tracefp4::attention")}


def share_of_events(events, wall_s: float) -> dict[str, float]:
    """``{experts, attention, sites, rest}`` fractions of ``wall_s`` from a profiler's events: each
    event's own (self) CPU time goes to the innermost enclosing region of a category; ``rest`` is the
    wall time the categories do not account for."""
    names = {n: cat for cat, ns in REGIONS.items() for n in ns}
    acc = dict.fromkeys(REGIONS, 0.0)
    for ev in events:
        node, cat = ev, None
        while node is not None and cat is None:
            cat = names.get(node.name)
            node = node.cpu_parent
        if cat is not None:
            acc[cat] += ev.self_cpu_time_total / 1e6
    share = {k: v / wall_s for k, v in acc.items()}
    share["rest"] = max(0.0, 1.0 - sum(share.values()))
    return share


def profiled(step: Callable[[], None], steps: int) -> dict[str, float]:
    """:func:`share_of_events` of ``steps`` calls of ``step`` under the profiler (the sites' regions on)."""
    from torch.profiler import ProfilerActivity, profile

    from tracefp4.engines.sites import site_regions

    with site_regions(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - t0
    return share_of_events(prof.events(), wall)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` random tokens (ids 3 and up: clear of the special ones), the
    same for the same arguments in every process."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + length * 31 + batch)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


class _Stepper:
    """Requests submitted to a vLLM engine and stepped one forward at a time, with the plugin's
    recording begun for the mode (the records are dropped afterwards: assembling them is not decode)."""

    def __init__(self, e, mode: str, prompts: list[list[int]], max_tokens: int, seed: int) -> None:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        self.e, self.recording = e, False
        self.record(mode)
        self.engine = e.llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler  # in-process engine core
        self.count = len(prompts)
        self.generated: dict[str, int] = {}  # tokens so far, by the outputs' request id
        for i, p in enumerate(prompts):
            self.engine.add_request(f"long-{seed}-{i}", TokensPrompt(prompt_token_ids=p),
                                    VSP(max_tokens=max_tokens, temperature=1.0, seed=seed + i, ignore_eos=True,
                                        detokenize=False))

    def record(self, mode: str) -> None:
        """From the next step on, record as a rollout of ``mode`` records (our engine; vLLM's own
        engines record nothing). The stored K/V codes do not depend on the mode, only what is kept."""
        if self.e.plan is None:
            if mode not in VLLM_SERVES or VLLM_SERVES[mode] is EngineKind.VLLM:
                raise ValueError(f"mode {mode}: vLLM's own engines serve bf16 and fp8kv")
            return
        fp4, guidance = ROLLOUT_MODES.get(mode, (False, None))
        if not fp4:
            raise ValueError(f"mode {mode}: our FP4 engine serves fp4 and trace modes")
        if self.recording:
            self.e.llm.collective_rpc("tracefp4_abort")
        self.e.llm.collective_rpc("tracefp4_begin", args=(self.e.plan.to_dict(), guidance, [], self.e.n_layers))
        self.recording = True

    def step(self) -> None:
        for out in self.engine.step():
            self.generated[out.request_id] = len(out.outputs[0].token_ids)

    def prefilled(self) -> bool:
        """Every request has its first token (no prompt left to run)."""
        return len(self.generated) == self.count and min(self.generated.values()) > 0

    @property
    def running(self) -> set[str]:
        return {r.request_id for r in self.scheduler.running}

    @property
    def waiting(self) -> set[str]:
        return {r.request_id for r in self.scheduler.waiting}

    def unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def close(self) -> None:
        while self.unfinished():  # nothing left behind for the next run
            self.step()
        if self.recording:
            self.e.llm.collective_rpc("tracefp4_abort")


def vllm_decode(e, modes: Sequence[str], batch: int, context: int, cfg: dict, profile: bool) -> dict:
    """One decode cell on a built engine (see the module docstring) for ``modes`` of that engine,
    over one prefill: ``new_tokens`` timed steps per mode, in ``repeats`` runs that alternate the
    modes (the recording switched between runs). Returns ``rates`` per mode and, with ``profile``,
    ``shares`` of a few more steps per mode."""
    n, repeats, steps = cfg["new_tokens"], cfg["repeats"], cfg["profile_steps"] if profile else 0
    k = len(modes)
    # the prompts end n*k tokens short of the context: the timed steps run up to it
    prompts = random_prompts(batch, context - n * k, cfg["vocab"], cfg["seed"])
    st = _Stepper(e, modes[0], prompts, (n + steps) * k + batch + 1, cfg["seed"])
    try:
        while not st.prefilled():  # prefills (a decode may run beside one: not timed)
            st.step()
        times: dict[str, list[float]] = {m: [] for m in modes}
        for size in run_lengths(n, repeats):
            for mode in modes:
                st.record(mode)
                for _ in range(size):
                    if len(st.running) != batch:
                        raise RuntimeError(f"{mode} at context {context}: {len(st.running)} of {batch} sequences "
                                           "running (the KV budget is too small)")
                    t0 = time.perf_counter()
                    st.step()
                    times[mode].append(time.perf_counter() - t0)
        out: dict = {"rates": {m: median_rate(t, batch, repeats) for m, t in times.items()}, "shares": {}}
        for mode in modes if steps else ():
            st.record(mode)
            out["shares"][mode] = profiled(st.step, steps)
    finally:
        st.close()
    return out


class CapacityRun:
    """The capacity run of one mode on an engine built with the capacity budget (see
    :mod:`tracefp4.bench.suites.long`): the queue submitted at once, then stepped in turns
    (:meth:`advance`) so that several engines' runs can alternate on one machine; only the steps'
    own time is counted."""

    def __init__(self, e, mode: str, cfg: dict) -> None:
        prompts = random_prompts(cfg["capacity_requests"], CAPACITY_PROMPT, cfg["vocab"], cfg["seed"] + 1)
        self.st = _Stepper(e, mode, prompts, cfg["capacity_output"], cfg["seed"])
        self.counts: list[int] = []
        self.preempted, self.full_from, self.steps_s, self.prefill_s = 0, None, 0.0, 0.0
        self.before: set[str] = set()

    def advance(self, seconds: float) -> bool:
        """Step until ``seconds`` of step time have passed in this turn or the queue is done; True once done."""
        st, spent = self.st, 0.0
        while spent < seconds and st.unfinished():
            t = time.perf_counter()
            st.step()
            dt = time.perf_counter() - t
            spent += dt
            now = st.running
            if now - self.before:  # a request (re)entered: the step ran its prompt (a preempted one's, recomputed)
                self.prefill_s += dt
            lost = (self.before - now) & st.waiting  # left the running set unfinished: preempted
            if lost:
                self.preempted += len(lost)
                self.full_from = len(self.counts) if self.full_from is None else self.full_from
            self.counts.append(len(now))
            self.before = now
        self.steps_s += spent
        return not st.unfinished()

    def result(self) -> dict:
        """The figures (the run must be done), the engine left with nothing queued."""
        self.st.close()
        tokens = sum(self.st.generated.values())
        held = self.counts[self.full_from or 0:] or [0]
        return {"tokens_per_s": tokens / self.steps_s, "peak_running": max(held),
                "mean_running": statistics.fmean(self.counts), "preemptions": self.preempted, "tokens": tokens,
                "wall_s": self.steps_s, "prefill_s": self.prefill_s}

    def abandon(self) -> None:
        self.st.close()


class _HomeRegions:
    """Profiler regions around our engine's experts (each MoE block's ``experts`` module) and its
    attention function, for :func:`share_of_events` (installed for the profiled steps only)."""

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


