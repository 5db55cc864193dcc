"""Rollout engines in separate processes, as Ray actors.

Each worker is a Ray actor holding its own copy of the model and its own rollout engine: ours
(``engine = "home"``) or vLLM with the tracefp4 plugin (``engine = "vllm"``). Nothing crosses the
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

from tracefp4.engines.protocol import RolloutOutput, SamplingParams, StoreTarget
from tracefp4.rl import engine
from tracefp4.rl.arms import Arm


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

    def __init__(self, config_json: str, threads: int, engine_name: str = "home", max_len: int = 0):
        from tracefp4.engines.model import from_config

        torch.set_num_threads(threads)
        cfg = json.loads(config_json)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        self.model = from_config(config, dtype=torch.bfloat16)
        self.serving = engine.serving_engine(engine_name, self.model, max_len=max_len)
        self.version = -1

    def load_weights(self, blob: bytes, version: int) -> int:
        self.serving.load_weights(load_safetensors(blob), version)  # checks that every tensor fits
        self.version = version
        return version

    def rollout(self, job_json: str) -> str:
        job = json.loads(job_json)
        if job["policy_version"] != self.version:
            raise ValueError(f"worker holds policy version {self.version}, job wants {job['policy_version']}")
        # diagnostics stay in the driver's process (they never cross it): none are kept here
        arm = dataclasses.replace(Arm.from_dict(job["arm"]), diagnostics=frozenset())
        target = StoreTarget(job["store_root"], job["step"], job["writer_id"], tuple(job["traj_ids"]),
                             job["signature"], job["policy_version"])
        t0 = time.perf_counter()
        # this worker's writer: the records never reach the driver
        out, _ = engine.rollout(self.serving, job["prompts"], SamplingParams(**job["sampling"]), arm, store=target)
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
    """``n`` Ray rollout workers with a copy of ``model`` each; :meth:`generate` splits a batch across
    them (whole groups per worker) and returns the trajectories (records go to the store)."""

    def __init__(self, model: PreTrainedModel, n: int, *, threads_per_worker: int = 1, engine: str = "home",
                 max_len: int = 0):
        ray = init_ray(n * threads_per_worker)
        cfg = model.config.to_dict()
        cfg.pop("_experts_implementation", None)
        actor = ray.remote(num_cpus=threads_per_worker, num_gpus=gpus_per_actor(ray))(_Worker)
        self._ray = ray
        self.workers = [actor.remote(json.dumps(cfg, default=str), threads_per_worker, engine, max_len)
                        for _ in range(n)]
        self.version: int | None = None

    def sync_weights(self, model: PreTrainedModel, version: int) -> None:
        if version == self.version:
            return
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        blob = self._ray.put(save_safetensors(state))
        self._ray.get([w.load_weights.remote(blob, version) for w in self.workers])
        self.version = version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, group_size: int, arm: Arm,
                 store_root: str, step: int, traj_ids: Sequence[str], signature: str
                 ) -> tuple[RolloutOutput, list[str], dict[str, float]]:
        """Roll out on ``arm``'s serving path (:func:`tracefp4.rl.engine.rollout` in each worker); the
        records it stores are the engine's store-ready records. Returns (trajectories without
        records, the writer ids to seal, worker timings)."""
        groups = len(prompts) // group_size
        per = [list(range(i * groups // len(self.workers), (i + 1) * groups // len(self.workers)))
               for i in range(len(self.workers))]
        futures, writers, slices = [], [], []
        for i, (worker, gs) in enumerate(zip(self.workers, per)):
            if not gs:
                continue
            lo, hi = gs[0] * group_size, (gs[-1] + 1) * group_size
            job = {
                "prompts": [list(map(int, p)) for p in prompts[lo:hi]],
                "sampling": {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                             "top_p": sampling.top_p, "stop_token_ids": list(sampling.stop_token_ids),
                             "seed": sampling.seed * 1009 + i, "top_logprobs": sampling.top_logprobs},
                "arm": arm.to_dict(), "store_root": str(store_root), "step": step, "writer_id": f"w{i}",
                "traj_ids": list(traj_ids[lo:hi]), "signature": signature, "policy_version": self.version,
            }
            futures.append(worker.rollout.remote(json.dumps(job)))
            writers.append(f"w{i}")
            slices.append((lo, hi))
        results = [json.loads(r) for r in self._ray.get(futures)]
        out = RolloutOutput(
            token_ids=[torch.tensor(t) for r in results for t in r["token_ids"]],
            prompt_lens=[p for r in results for p in r["prompt_lens"]],
            logprobs=[torch.tensor(lp, dtype=torch.float32) for r in results for lp in r["logprobs"]],
            finish_reasons=[f for r in results for f in r["finish_reasons"]],
            records=[],
            diagnostics=[],
            plan=arm.plan,
            guidance=arm.guidance,
            top_ids=[_top(t, torch.long, sampling.top_logprobs) for r in results for t in r["top_ids"]],
            top_logprobs=[_top(t, torch.float32, sampling.top_logprobs) for r in results for t in r["top_logprobs"]],
        )
        timings = {
            "time/rollout_s": max(r["time_generate_s"] for r in results),
            "time/store_write_s": max(r["time_store_write_s"] for r in results),
        }
        return out, writers, timings

    def shutdown(self) -> None:
        for w in self.workers:
            self._ray.kill(w)
        self.workers = []
