"""The long preset's vLLM engines, each in a server process of its own: ``python -m
tracefp4.reports.long_server serve ENGINE CKPT BUILD_JSON`` builds one engine (vLLM's BF16, its FP8
K/V, or ours with packed FP4 experts and K/V) and answers JSON commands: ``kv`` (its cache's bytes and
capacity), ``decode`` (a timed decode cell) and ``capacity_begin``/``capacity_steps``/``capacity_end``
(the capacity run of one mode, stepped in turns: :class:`CapacityRun`).
:class:`LongServer` is the driver's handle on one; what the figures mean is in
:mod:`tracefp4.reports.bench_long`."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Mapping, Sequence

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.reports.bench_pipe import ServerProcess, answer_channel
from tracefp4.reports.decode_timing import (
    median_rate,
    profiled,
    random_prompts,
    run_lengths,
)
from tracefp4.rl.arms import ROLLOUT_MODES

__all__ = ["CAPACITY_PROMPT", "VLLM_MODES", "CapacityRun", "LongServer", "serve", "start_servers", "vllm_decode"]

#: The vLLM modes and the server (engine) each runs on.
VLLM_MODES = {"bf16": "vllm-bf16", "fp8kv": "vllm-fp8kv", "fp4": "vllm-fp4", "trace_lsb": "vllm-fp4"}
#: Capacity run prompts: long enough to be a prompt, short beside the outputs.
CAPACITY_PROMPT = 64


def _vllm_engine(engine: str, ckpt: str, max_len: int, max_seqs: int, kv_bytes: int):
    from tracefp4.engines.vllm.engine import PlainVLLMEngine, VLLMEngine

    # max_num_batched_tokens: one whole prompt per step (no chunked prefill, see VLLMEngine)
    common = dict(max_model_len=max_len, max_num_seqs=max_seqs, kv_cache_memory_bytes=int(kv_bytes),
                  max_num_batched_tokens=max(max_len, 2048))
    if engine == "vllm-bf16":
        return PlainVLLMEngine(ckpt, **common)
    if engine == "vllm-fp8kv":
        return PlainVLLMEngine(ckpt, kv_cache_dtype="fp8", **common)
    if engine == "vllm-fp4":
        return VLLMEngine(ckpt, plan=PrecisionPlan(), **common)
    raise ValueError(f"unknown long-preset engine {engine!r}; expected one of {sorted(set(VLLM_MODES.values()))}")


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
            if mode not in VLLM_MODES or VLLM_MODES[mode] == "vllm-fp4":
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
    :mod:`tracefp4.reports.bench_long`): the queue submitted at once, then stepped in turns
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


def serve(engine: str, ckpt: str, build: dict) -> None:
    """The server side of :class:`LongServer`: JSON commands on stdin (``decode``, ``capacity``,
    ``kv``, ``quit``), one marked JSON answer each on stdout."""
    from tracefp4.engines.vllm.engine import engine_env

    engine_env()
    answer = answer_channel()
    e = _vllm_engine(engine, ckpt, build["max_len"], build["max_seqs"], build["kv_bytes"])
    run: CapacityRun | None = None
    try:
        # warm-up: a short generation per mode (first-use costs: kernels, buffers)
        modes = [m for m, eng in VLLM_MODES.items() if eng == engine]
        vllm_decode(e, modes, 1, 64 + build["new_tokens"] * len(modes), {**build, "repeats": 1}, profile=False)
        answer({"ready": True})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "decode":
                ans = vllm_decode(e, cmd["modes"], cmd["batch"], cmd["context"], build, cmd["profile"])
            elif cmd["cmd"] == "capacity_begin":
                if run is not None:
                    raise ValueError("long server: a capacity run is already in progress")
                run, ans = CapacityRun(e, cmd["mode"], build), {}
            elif cmd["cmd"] == "capacity_steps":
                ans = {"done": run.advance(cmd["seconds"])}
            elif cmd["cmd"] == "capacity_end":
                run, ans = None, run.result()
            elif cmd["cmd"] == "kv":
                ans = {**e.kv_cache_size(), "block_size": int(e.llm.llm_engine.vllm_config.cache_config.block_size)}
            else:
                raise ValueError(f"long server: unknown command {cmd['cmd']!r}")
            answer(ans)
    finally:
        if run is not None:
            run.abandon()
        e.close()


class LongServer:
    """A vLLM engine of the long preset in a process of its own (``python -m
    tracefp4.reports.long_server serve ENGINE CKPT BUILD_JSON``): vLLM keeps process-wide state, so
    each engine needs its own process, and with all of them built first their cells can be run side
    by side (the machine's speed drifts over minutes). Commands and answers are JSON lines.
    ``wait=False`` returns once the process is started; :meth:`ready` then waits for it (see
    :func:`start_servers`)."""

    def __init__(self, engine: str, ckpt: str, build: dict, *, wait: bool = True) -> None:
        self.server = ServerProcess("tracefp4.reports.long_server", ["serve", engine, ckpt, json.dumps(build)],
                                    f"long {engine}")
        if wait:
            self.ready()

    def ready(self) -> LongServer:
        """Wait for the server's {"ready": true}: its engine built and warmed up."""
        self.server.read()
        return self

    def ask(self, **cmd) -> dict:
        self.server.send(json.dumps(cmd))
        return self.server.read()

    def close(self) -> None:
        self.server.close(json.dumps({"cmd": "quit"}))


def start_servers(engines: Mapping[str, str], ckpt: str, build: dict) -> dict[str, LongServer]:
    """A :class:`LongServer` per entry of ``engines`` (name -> engine: one engine may serve under
    several names), their processes started together and built side by side (an engine build is
    mostly single-threaded imports and set-up); returns once every one is ready, under its name.
    Nothing is timed while they build: a server's timed commands are only sent after this returns.
    If one fails, all are closed."""
    servers: dict[str, LongServer] = {}
    try:
        for name, engine in engines.items():
            servers[name] = LongServer(engine, ckpt, build, wait=False)
        for srv in servers.values():
            srv.ready()
    except BaseException:
        for srv in servers.values():
            srv.close()
        raise
    return servers


def main(argv: list[str] | None = None) -> int:
    """``python -m tracefp4.reports.long_server serve ENGINE CKPT BUILD_JSON`` (a :class:`LongServer`)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 4 and args[0] == "serve":
        serve(args[1], args[2], json.loads(args[3]))
        return 0
    print("usage: python -m tracefp4.reports.long_server serve vllm-bf16|vllm-fp8kv|vllm-fp4 CKPT BUILD_JSON",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
