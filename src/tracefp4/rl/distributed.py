"""The trainer's update on N processes: FSDP2 (``fully_shard``) with data parallelism.

What is sharded, and how
    * **Parameters = FP32 master weights, sharded.** Each rank builds the model, sets its parameters
      to FP32 (the BF16 weights widened exactly, or the checkpoint's FP32 masters) and shards it with
      ``fully_shard`` per decoder layer and at the root, under
      ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``. So the sharded FP32
      parameters *are* :class:`~tracefp4.rl.optim.MasterWeightAdamW`'s masters, and the forward sees
      exactly the BF16 weights the single-process trainer holds (``bf16(master)``, round to nearest
      even in both). This is the simplest exact design: no second copy of the weights, and a plain
      ``torch.optim.AdamW`` (same betas, same foreach path) steps on the FP32 shards (DTensors).
    * **Full weights where they are quantized.** FSDP2 all-gathers a layer's parameters before its
      forward, so the experts forward (:func:`tracefp4.engines.model.expert_weights`) fake-quantizes the
      full ``[E, N, K]`` expert weights with their per-expert global amax, as in one process (from a
      copy: :func:`tracefp4.engines.path.weights_may_be_freed`, as under any sharding wrapper); routing
      replay is unchanged (the router hook sees the gathered gate). Checked by
      ``tests/test_distributed.py``: a sharded forward gives the same log-probs as an unsharded one.
    * **Gradients.** BF16 per rank, reduce-scattered in FP32. FSDP averages over the N ranks (gloo
      has no pre-multiplied sum for a divide factor of 1), so each rank back-propagates N times its
      loss share, which is already scaled by the global token count (see below): the shards' mean is
      the single-process gradient up to summation order and the rounding of each rank's BF16 partial
      (the factor N and the division by N are exact for N a power of two).
      Clipping uses the global norm (``clip_grad_norm_`` over DTensors all-reduces it).
    * **Data.** Each minibatch (the same permutation and chunks as :func:`tracefp4.rl.update.update`)
      is split by position: rank r takes trajectories ``idx[r::N]`` (whole trajectories). The
      denominators of the loss aggregation are global: token-mean divides each rank's token sum by the
      minibatch's token count (an all-reduce before the backward); seq-mean and dr-grpo by the global
      number of sequences.
    * **Records are rank-local.** A rank reads from the guidance store only its own trajectories of each
      minibatch (``StoreReader.batch``); nothing is broadcast. ``store/bytes_read_rank{r}`` (what rank
      r read) is reported beside ``store/bytes_step`` (the step's shard bytes).

Processes
    :class:`TrainerGroup` (the driver's handle) starts N ranks once per run as Ray actors
    (:class:`TrainerRank`), placed by Ray's resources (CPUs each, a GPU each where the cluster has
    them; any node of the cluster ``RAY_ADDRESS`` names, else a local Ray), with a TCP rendezvous on
    rank 0's node, and gives them each arm in turn (:meth:`TrainerGroup.setup`); they die with the
    driver. Nothing crosses to them but JSON strings and safetensors bytes (no pickled objects of
    ours), and each rank reads its records from the store itself. The building blocks
    (:func:`init_distributed`, :func:`shard_model`, :func:`sharded_update`) also run under torchrun
    (``init_distributed()`` reads ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``). Backend:
    NCCL when CUDA is available (one GPU per rank), else gloo on CPU; one code path. The rollout and the
    scoring (old log-probs, metrics) stay on the driver, as with ``trainer_world_size = 1`` or Ray
    rollout workers; after each step rank 0 gathers the full weights and the driver copies them into its
    BF16 model (in place, so the rollout's weight cache sees a new version). Checkpoints gather the full
    FP32 masters and Adam state on rank 0 and keep :mod:`tracefp4.rl.checkpoint`'s format (the
    driver writes them, in :class:`~tracefp4.rl.optim.MasterWeightAdamW`'s tensor names), so a run
    resumes with any world size's checkpoint files.

Pitfall found on the way (torch 2.13): FSDP2 leaves the root's parameters gathered after a forward;
a forward without gradient followed by a forward-backward then gives wrong gradients for them (a 45%
lower norm here). :func:`reshard` puts them back; every update starts with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from tracefp4.engines.sink import pack_records, unpack_records
from tracefp4.pipeline import steps
from tracefp4.pipeline.arms import Arm
from tracefp4.rl.config import RLConfig
from tracefp4.rl.optim import BETAS
from tracefp4.rl.update import Reducer, minibatch_loss, minibatch_order, take

__all__ = ["TrainerGroup", "TrainerRank", "init_distributed", "rank_share", "shard_model", "sharded_update"]

#: What Score Centering's loss reads beside the GRPO batch (sent to the ranks only for its arms).
_SC_KEYS = ("top_ids", "top_logp_rollout")


def rank_share(idx: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s trajectories of a minibatch: ``idx[rank::world_size]`` (deterministic, whole
    trajectories, every one on exactly one rank)."""
    return list(idx[rank::world_size])


def device_and_backend() -> tuple[torch.device, str]:
    """CUDA + NCCL when a GPU is present (one per rank), else CPU + gloo."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
        return torch.device("cuda", local % torch.cuda.device_count()), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(rank: int | None = None, world_size: int | None = None, init_method: str | None = None) -> None:
    """Join the process group: a rendezvous at ``init_method`` (``tcp://host:port`` or ``file://path``)
    with the given rank and world size (what :class:`TrainerGroup`'s actors do), or, without it,
    torchrun's ``env://`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). Backend: NCCL on
    CUDA, else gloo."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if init_method is None:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"init_distributed without init_method needs torchrun's environment; missing {missing}")
        rank = int(os.environ["RANK"])
    elif rank is None or world_size is None:
        raise ValueError("init_distributed with init_method needs rank and world_size")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if init_method is None:
        dist.init_process_group(backend, init_method="env://")
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def shard_model(model: PreTrainedModel, masters: dict[str, torch.Tensor] | None = None) -> PreTrainedModel:
    """Make ``model``'s parameters FP32 masters (the BF16 weights widened, or ``masters[name]``) and
    shard them with FSDP2: each decoder layer, then the root; BF16 compute, FP32 gradient reduction
    (averaged over ranks: :func:`sharded_update` scales the losses by N). Call on every rank, in an
    initialised process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device, _ = device_and_backend()
    names = {id(p): n for n, p in model.named_parameters()}
    widened: dict[int, torch.nn.Parameter] = {}  # tied parameters stay tied
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in widened:
                src = masters[names[id(p)]] if masters is not None and names[id(p)] in masters else p.detach()
                widened[id(p)] = torch.nn.Parameter(src.to(device, torch.float32).clone(),
                                                    requires_grad=p.requires_grad)
            module._parameters[key] = widened[id(p)]
    model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def reshard(model: PreTrainedModel) -> None:
    """Back to sharded parameters. FSDP2 keeps the root's parameters gathered after a forward (for the
    backward that usually follows); after a forward without gradient the next backward then produces
    wrong gradients for them (seen with torch 2.13: a 45% lower gradient norm). So every update starts
    from sharded parameters and every no-gradient forward ends with this."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def _all_reduce_sum(values: list[float]) -> list[float]:
    device, _ = device_and_backend()
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


class DistReducer(Reducer):
    """Sums over the process group (an all-reduce in float64): the trainer's counts and statistics."""

    def __init__(self) -> None:
        self.world_size = dist.get_world_size()

    def sum(self, values: list[float]) -> list[float]:
        return _all_reduce_sum(values)


def sharded_update(model: PreTrainedModel, opt: torch.optim.Optimizer, arm: Arm, cfg: RLConfig, batch: dict[str, Any],
                   read_records: Callable[[list[int]], list[dict[str, torch.Tensor]]]) -> dict[str, float]:
    """This rank's part of :func:`tracefp4.rl.update.update` (same permutation, same minibatches, the same
    :func:`~tracefp4.rl.update.minibatch_loss`, one optimizer step each): ``batch`` holds the step's
    trajectories without records (``token_ids``, ``prompt_lens``, ``advantages``, ``logp_old``,
    ``logp_rollout``, ``mask``, ``step``, and for Score Centering ``top_ids`` and ``top_logp_rollout``);
    ``read_records(indices)`` reads this rank's records. Returns the loss, the mean statistics and the
    mean gradient norm (equal on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reducer = DistReducer()
    params = [p for p in model.parameters() if p.requires_grad]
    stats: dict[str, float] = {}
    norms = []
    reshard(model)
    model.train()
    for idx in minibatch_order(cfg, batch["step"], len(batch["token_ids"])):
        share = rank_share(idx, rank, world)
        if not share:
            raise ValueError(f"rank {rank}: no trajectory in a minibatch of {len(idx)} (trainer_world_size "
                             f"must be at most the minibatch size)")
        loss, st = minibatch_loss(model, arm, cfg, take(batch, share, read_records(share)), reducer)
        (loss * world).backward()  # FSDP averages over ranks: times N makes it the sum of the shares
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + v / cfg.updates_per_step
    model.eval()
    return {"grad_norm": sum(norms) / len(norms), **stats}


# --- full state, gathered (collectives: every rank calls these in the same order) -----------------


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()


def gather_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Every parameter in full, BF16 (what the driver's model holds)."""
    return {n: _full(p).to(torch.bfloat16) for n, p in model.named_parameters()}


def gather_optimizer_tensors(model: PreTrainedModel, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """FP32 masters and Adam state in full, named as :meth:`MasterWeightAdamW.state_tensors` names them."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        out[f"master/{name}"] = _full(p)
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                out[f"{k}/{name}"] = _full(st[k])
        if "step" in st:
            out[f"step/{name}"] = _full(st["step"]).reshape(1).float()
    return out


def load_adam_state(model: PreTrainedModel, opt: torch.optim.Optimizer, t: dict[str, torch.Tensor]) -> None:
    """Adam moments from full tensors (every rank holds them: each keeps its own shard, no traffic)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        if f"exp_avg/{name}" not in t:
            continue

        def shard(full: torch.Tensor) -> torch.Tensor:
            full = full.to(p.device if not isinstance(p, DTensor) else p.to_local().device, torch.float32)
            if isinstance(p, DTensor):
                return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            return full.clone()

        opt.state[p] = {
            "exp_avg": shard(t[f"exp_avg/{name}"]),
            "exp_avg_sq": shard(t[f"exp_avg_sq/{name}"]),
            "step": t[f"step/{name}"].reshape(()).clone(),
        }


# --- the worker processes and the driver's handle ------------------------------------------------


def _build_model(config_json: str, weights: dict[str, torch.Tensor]) -> PreTrainedModel:
    from transformers import AutoConfig

    from tracefp4.engines.model import from_config

    cfg = json.loads(config_json)
    model = from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"weights do not fit the trainer's model: missing {missing}, unexpected {unexpected}")
    return model


def _update_cmd(model, opt, arm: Arm, cfg: RLConfig, job: dict[str, Any]) -> dict[str, Any]:
    from tracefp4.guidance.store import StoreReader, step_bytes

    ids, lengths = job["traj_ids"], [t.numel() for t in job["token_ids"]]
    with StoreReader(job["store_root"], job["step"], model_signature=job["signature"],
                     policy_version=job["policy_version"]) as reader:
        stats = sharded_update(model, opt, arm, cfg, job,
                               lambda share: reader.batch([ids[b] for b in share], [lengths[b] for b in share]))
        return {"stats": stats, "bytes_read": reader.bytes_read, "bytes_step": step_bytes(reader)}


def pack(tensors: dict[str, torch.Tensor]) -> bytes:
    """Tensors as safetensors bytes (what crosses to and from the ranks: no pickled objects)."""
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()})


def unpack(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(blob) if blob else {}


def _seq(d: dict[str, torch.Tensor], prefix: str) -> list[torch.Tensor]:
    """``{prefix/0, prefix/1, ...}`` back into a list, in order."""
    n = sum(1 for k in d if k.startswith(prefix + "/"))
    return [d[f"{prefix}/{b}"] for b in range(n)]


class TrainerRank:
    """One trainer process (a Ray actor: :class:`TrainerGroup` wraps it with ``ray.remote``). Its calls
    take and return JSON strings and safetensors bytes only."""

    def __init__(self, rank: int, world_size: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world_size = rank, world_size
        self.model = self.opt = self.arm = self.cfg = None

    def address(self) -> str:
        """A ``tcp://`` rendezvous on this rank's node (called on rank 0)."""
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def join(self, init_method: str) -> int:
        init_distributed(self.rank, self.world_size, init_method)
        return self.rank

    def setup(self, setup_json: str, weights: bytes, optimizer: bytes) -> int:
        """A fresh sharded model and optimizer (one arm), from the driver's weights and state."""
        self.model = self.opt = None  # the previous arm's
        setup = json.loads(setup_json)
        self.cfg, self.arm = RLConfig.from_dict(setup["cfg"]), Arm.from_dict(setup["arm"])
        opt_t = unpack(optimizer)
        self.model = _build_model(setup["config_json"], unpack(weights))
        masters = {k[len("master/"):]: v for k, v in opt_t.items() if k.startswith("master/")}
        shard_model(self.model, masters or None)
        self.model.eval()
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.cfg.lr,
                                     weight_decay=self.cfg.weight_decay, betas=BETAS)
        load_adam_state(self.model, self.opt, opt_t)
        return self.rank

    def _ready(self) -> None:
        if self.model is None:
            raise ValueError(f"trainer rank {self.rank}: called before setup")

    def update(self, job_json: str, tensors: bytes) -> tuple[str, bytes]:
        """One step's updates; rank 0 also returns the full new weights."""
        self._ready()
        t = unpack(tensors)
        job = {**json.loads(job_json), "token_ids": _seq(t, "token_ids"),
               **{k: t[k] for k in ("advantages", "logp_old", "logp_rollout", "mask", *_SC_KEYS) if k in t}}
        out = _update_cmd(self.model, self.opt, self.arm, self.cfg, job)
        weights = gather_weights(self.model)
        return json.dumps({**out, "rank": self.rank}), pack(weights) if self.rank == 0 else b""

    def optimizer(self) -> bytes:
        self._ready()
        t = gather_optimizer_tensors(self.model, self.opt)
        return pack(t) if self.rank == 0 else b""

    def logprobs(self, job_json: str, tensors: bytes, records: bytes) -> bytes:
        """The sharded forward over given trajectories (no gradient): a check that sharding keeps the numerics."""
        self._ready()
        token_ids, prompt_lens = _seq(unpack(tensors), "token_ids"), json.loads(job_json)["prompt_lens"]
        with torch.no_grad():
            new = steps.trainer_logprobs(self.model, token_ids, prompt_lens, unpack_records(records)[0],
                                          self.arm, temperature=self.cfg.temperature)
        reshard(self.model)
        return pack({f"logprobs/{b}": lp for b, lp in enumerate(new.logprobs)})

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup:
    """N trainer ranks in one process group (the driver's handle), each a Ray actor placed by Ray's
    resources (``threads`` CPUs each and, where the cluster has GPUs, one GPU); :meth:`setup` gives
    them an arm's sharded model and optimizer (again for the next arm: the ranks start once per run).
    The rendezvous is TCP on rank 0's node, so the ranks may sit on any nodes of the cluster
    (``RAY_ADDRESS``); without one, a local Ray is started.

    ``model`` is the driver's BF16 model (its weights and config start the ranks);
    ``optimizer_tensors`` are :meth:`MasterWeightAdamW.state_tensors` (FP32 masters, and Adam state
    after a resume). After :meth:`update` the driver's model holds the new weights.
    """

    def __init__(self, world_size: int, model: PreTrainedModel | None = None, cfg: RLConfig | None = None,
                 arm: Arm | None = None, optimizer_tensors: dict[str, torch.Tensor] | None = None, *,
                 threads: int | None = None):
        from tracefp4.rl.workers import gpus_per_actor, init_ray

        if world_size < 2:
            raise ValueError(f"TrainerGroup needs world_size >= 2, got {world_size}")
        threads = threads or max(1, torch.get_num_threads() // world_size)
        ray = self._ray = init_ray(world_size * threads)
        actor = ray.remote(num_cpus=threads, num_gpus=gpus_per_actor(ray), max_restarts=0)(TrainerRank)
        self.world_size = world_size
        self.ranks = [actor.remote(r, world_size, threads) for r in range(world_size)]
        try:
            init_method = self._get([self.ranks[0].address.remote()])[0]
            self._get([r.join.remote(init_method) for r in self.ranks])
            if model is not None:
                self.setup(model, cfg, arm, optimizer_tensors)
        except BaseException:
            self.close()
            raise

    def _get(self, futures: list) -> list:
        """The ranks' answers; a rank's exception (or death) surfaces here, naming the rank's error."""
        try:
            return self._ray.get(futures)
        except self._ray.exceptions.RayError as e:
            raise RuntimeError(f"trainer rank failed: {e}") from None

    def setup(self, model: PreTrainedModel, cfg: RLConfig, arm: Arm,
              optimizer_tensors: dict[str, torch.Tensor]) -> None:
        """Give the ranks an arm: the driver's model (weights, config) and optimizer state."""
        setup = json.dumps({"cfg": _plain_config(cfg), "arm": arm.to_dict(),
                            "config_json": json.dumps(model.config.to_dict(), default=str)})
        weights = self._ray.put(pack(dict(model.named_parameters())))
        opt = self._ray.put(pack(optimizer_tensors))
        self._get([r.setup.remote(setup, weights, opt) for r in self.ranks])

    def update(self, batch, store_root, signature: str, policy_version: int,
               model: PreTrainedModel) -> dict[str, float]:
        """One step's updates on the ranks, each reading its own records from the store; copies the
        new weights into ``model`` (the driver's) and returns the statistics with the store bytes."""
        job = json.dumps({"step": batch.step, "prompt_lens": list(batch.prompt_lens), "traj_ids": list(batch.traj_ids),
                          "store_root": str(store_root), "signature": signature, "policy_version": policy_version})
        tensors = self._ray.put(pack({
            **{f"token_ids/{b}": t for b, t in enumerate(batch.token_ids)}, "advantages": batch.advantages,
            "logp_old": batch.logp_old, "logp_rollout": batch.logp_rollout, "mask": batch.mask,
            **{k: getattr(batch, k) for k in _SC_KEYS if getattr(batch, k) is not None},
        }))
        replies = [(json.loads(j), blob) for j, blob in self._get([r.update.remote(job, tensors) for r in self.ranks])]
        stats = replies[0][0]["stats"]
        weights = unpack(replies[0][1])
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n])  # in place: bumps the version the rollout's weight cache keys on
        out = dict(stats)
        for r, _ in replies:
            out[f"store/bytes_read_rank{r['rank']}"] = float(r["bytes_read"])
        out["store/bytes_read_rank"] = max(float(r["bytes_read"]) for r, _ in replies)  # the busiest rank
        out["store/bytes_step"] = float(replies[0][0]["bytes_step"])
        return out

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """The full FP32 masters and Adam state (gathered on rank 0), in the checkpoint's names."""
        return unpack(self._get([r.optimizer.remote() for r in self.ranks])[0])

    def logprobs(self, token_ids, prompt_lens, records) -> list[list[torch.Tensor]]:
        """Every rank's sharded forward over the same trajectories (no gradient): one list per rank."""
        job = json.dumps({"prompt_lens": list(prompt_lens)})
        tensors = pack({f"token_ids/{b}": t for b, t in enumerate(token_ids)})
        recs = pack_records(list(records), [])
        return [_seq(unpack(blob), "logprobs")
                for blob in self._get([r.logprobs.remote(job, tensors, recs) for r in self.ranks])]

    def close(self) -> None:
        for r in getattr(self, "ranks", []):
            try:
                self._ray.get(r.close.remote(), timeout=30)
            except Exception:  # a dead rank: nothing to close
                pass
            self._ray.kill(r)
        self.ranks = []

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain_config(cfg: RLConfig) -> dict[str, Any]:
    import dataclasses

    d = dataclasses.asdict(cfg)
    d["arms"] = list(d["arms"])
    return d
