"""Rollout engines in separate processes, as Ray actors.

Each worker is a Ray actor holding its own copy of the model and its own rollout engine: ours
(:attr:`EngineKind.HOME`) or vLLM with the tracefp4 plugin (:attr:`EngineKind.VLLM`). Nothing crosses the
process boundary as a pickled Python object of ours: weights travel as safetensors bytes (pushed
into the engine with ``load_weights`` every step), the model config as JSON, the sampled
trajectories come back as a JSON string, and the records go through the guidance store, each
engine writing its own shards and manifest (writer ``w{i}``, :class:`~tracefp4.engines.sink.StoreTarget`)
without coordinating with the others. The driver seals the step once every worker has returned.

Placement is Ray's: each actor asks for ``threads_per_worker`` CPUs and, where the cluster has GPUs,
one GPU; Ray puts it on a node that has them. With ``RAY_ADDRESS`` set (a cluster started with
``ray start``) the pool joins that cluster, otherwise it starts a local one.

Ray is optional (``pip install ray``); everything else in tracefp4 runs in-process without it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import AutoConfig, PreTrainedModel

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutOutput, SamplingParams, StoreTarget
from tracefp4.guidance.compact import GuidedMode
from tracefp4.pipeline import steps
from tracefp4.pipeline.factory import EngineKind
from tracefp4.seeds import Stream, derive


def _require_ray():
    try:
        import ray
    except ModuleNotFoundError:
        raise RuntimeError("rollout workers need Ray: pip install ray (or set rollout_workers = 0)") from None
    return ray


def init_ray(cpus: int):
    """Ray, initialised, with ``cpus`` CPUs free for the caller's actors: joins the cluster named by
    ``RAY_ADDRESS`` (``ray start`` on each node), else starts a local one with at least ``cpus`` CPUs
    and at least as many as the machine has.

    A local Ray is started once per process and keeps its CPU count, so a later caller asking for
    more than is free would wait forever for its actors: that is refused here with an error instead
    (a cluster given by ``RAY_ADDRESS`` may autoscale, so there the request is left to Ray).
    """
    import os

    ray = _require_ray()
    local = not os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        quiet = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
        if local:
            ray.init(num_cpus=max(cpus, os.cpu_count() or 1, 1), **quiet)
        else:
            ray.init(**quiet)
    if local:
        import time

        deadline = time.monotonic() + 30.0  # actors killed a moment ago release their CPUs asynchronously
        while (free := ray.available_resources().get("CPU", 0.0)) < cpus and time.monotonic() < deadline:
            time.sleep(0.2)
        if free < cpus:
            raise RuntimeError(
                f"the local Ray of this process has {free:g} of {ray.cluster_resources().get('CPU', 0.0):g} CPUs "
                f"free and {cpus} are needed: its actors would never start (ray.shutdown() first, or ask for fewer)"
            )
    return ray


def gpus_per_actor(ray) -> int:
    """One GPU for each engine or trainer actor where the cluster has GPUs, none elsewhere."""
    return 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0


class _Worker:
    """The actor body (wrapped with ``ray.remote`` at pool construction, so importing this module
    does not need Ray)."""

    def __init__(self, config_json: str, threads: int, engine_name: str = EngineKind.HOME.value, max_len: int = 0):
        from tracefp4.engines.model import from_config

        torch.set_num_threads(threads)
        cfg = json.loads(config_json)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        self.model = from_config(config, dtype=torch.bfloat16)
        self.serving = steps.serving_engine(EngineKind.parse(engine_name), self.model, max_len=max_len)
        self.version = -1

    def load_weights(self, blob: bytes, version: int) -> int:
        self.serving.load_weights(load_safetensors(blob), version)  # checks that every tensor fits
        self.version = version
        return version

    def rollout(self, job_json: str) -> str:
        job = json.loads(job_json)
        version = job["target"]["policy_version"]
        if version != self.version:
            raise ValueError(f"worker holds policy version {self.version}, job wants {version}")
        # diagnostics stay in the driver's process (they never cross it): none are kept here
        plan = None if job["plan"] is None else PrecisionPlan(**job["plan"])
        guidance = None if job["guidance"] is None else GuidedMode.parse(job["guidance"])
        target = StoreTarget(**{**job["target"], "traj_ids": tuple(job["target"]["traj_ids"])})
        t0 = time.perf_counter()
        # this worker's writer: the records never reach the driver
        out = self.serving.generate(job["prompts"], SamplingParams(**job["sampling"]), plan=plan, guidance=guidance,
                                    store=target)
        t_write = out.timings.get("store_write_s", 0.0)
        t_gen = time.perf_counter() - t0 - t_write
        return json.dumps({
            "token_ids": [t.tolist() for t in out.token_ids],
            "prompt_lens": out.prompt_lens,
            "logprobs": [lp.tolist() for lp in out.logprobs],
            "finish_reasons": out.finish_reasons,
            "top_ids": [t.tolist() for t in out.top_ids],
            "top_logprobs": [t.tolist() for t in out.top_logprobs],
            "time_generate_s": t_gen,
            "time_store_write_s": t_write,
        })


def _top(rows: list[list[float]], dtype: torch.dtype, k: int) -> torch.Tensor:
    """A trajectory's ``[C, k]`` sampler top-k from its JSON rows (``[0, k]`` for an empty completion)."""
    return torch.tensor(rows, dtype=dtype).reshape(len(rows), k)


class RolloutPool:
    """``n`` Ray rollout workers with a copy of ``model`` each, serving as one rollout engine:
    :meth:`generate` splits a batch across them (whole groups of ``group_size`` prompts per worker),
    each worker writing its records to the store under its own writer (:meth:`writer_ids`), and
    returns the trajectories without records."""

    def __init__(self, model: PreTrainedModel, n: int, *, threads_per_worker: int = 1,
                 engine: EngineKind = EngineKind.HOME, max_len: int = 0, group_size: int = 1):
        ray = init_ray(n * threads_per_worker)
        cfg = model.config.to_dict()
        cfg.pop("_experts_implementation", None)
        actor = ray.remote(num_cpus=threads_per_worker, num_gpus=gpus_per_actor(ray))(_Worker)
        self._ray = ray
        self.workers = [actor.remote(json.dumps(cfg, default=str), threads_per_worker, EngineKind.parse(engine).value,
                                     max_len) for _ in range(n)]
        self.group_size = group_size
        self.version: int | None = None

    def sync_weights(self, model: PreTrainedModel, version: int) -> None:
        if version == self.version:
            return
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        blob = self._ray.put(save_safetensors(state))
        self._ray.get([w.load_weights.remote(blob, version) for w in self.workers])
        self.version = version

    def _slices(self, n_prompts: int) -> list[tuple[int, int, int]]:
        """(worker, first prompt, end) of each worker given prompts: whole groups, in order."""
        groups, n = n_prompts // self.group_size, len(self.workers)
        spans = [(i, i * groups // n * self.group_size, (i + 1) * groups // n * self.group_size) for i in range(n)]
        return [(i, lo, hi) for i, lo, hi in spans if hi > lo]

    def writer_ids(self, target: StoreTarget) -> list[str]:
        """The writers of the step :meth:`generate` wrote for ``target``: one per worker given prompts."""
        return [f"w{i}" for i, _, _ in self._slices(len(target.traj_ids))]

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, plan: PrecisionPlan | None,
                 guidance: GuidedMode | None, diagnostics: frozenset[int] = frozenset(),
                 store: StoreTarget | None = None) -> RolloutOutput:
        """Roll out on ``plan`` and ``guidance`` (the engine of each worker, whose
        sampler seed is derived from ``sampling.seed`` and its index), the records into ``store`` (which
        is required: they never reach this process). Diagnostics are not kept (they would have to cross
        the process boundary). The rollout's timings are the slowest worker's."""
        if store is None:
            raise ValueError("RolloutPool.generate: a store target is required (the workers write the records)")
        futures = []
        for i, lo, hi in self._slices(len(prompts)):
            job = {
                "prompts": [list(map(int, p)) for p in prompts[lo:hi]],
                "sampling": {**dataclasses.asdict(sampling), "seed": derive(sampling.seed, Stream.WORKER, i)},
                "plan": None if plan is None else plan.to_dict(),
                "guidance": None if guidance is None else guidance.name,
                "target": {**dataclasses.asdict(store), "writer_id": f"w{i}", "traj_ids": list(store.traj_ids[lo:hi]),
                           "policy_version": self.version},
            }
            futures.append(self.workers[i].rollout.remote(json.dumps(job)))
        return _merged([json.loads(r) for r in self._ray.get(futures)], plan, guidance, sampling.top_logprobs)

    def shutdown(self) -> None:
        for w in self.workers:
            self._ray.kill(w)
        self.workers = []


def _merged(results: list[dict], plan: PrecisionPlan | None, guidance: GuidedMode | None, k: int) -> RolloutOutput:
    """The workers' JSON results as one rollout, in prompt order (records and diagnostics stayed behind)."""
    return RolloutOutput(
        token_ids=[torch.tensor(t) for r in results for t in r["token_ids"]],
        prompt_lens=[p for r in results for p in r["prompt_lens"]],
        logprobs=[torch.tensor(lp, dtype=torch.float32) for r in results for lp in r["logprobs"]],
        finish_reasons=[f for r in results for f in r["finish_reasons"]],
        records=[],
        diagnostics=[],
        plan=plan,
        guidance=guidance,
        top_ids=[_top(t, torch.long, k) for r in results for t in r["top_ids"]],
        top_logprobs=[_top(t, torch.float32, k) for r in results for t in r["top_logprobs"]],
        timings={"generate_s": max(r["time_generate_s"] for r in results),
                 "store_write_s": max(r["time_store_write_s"] for r in results)},
    )
