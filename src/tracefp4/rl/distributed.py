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
      forward, so the experts forward (:func:`tracefp4.engines.model.expert_weight`) fake-quantizes the
      full ``[E, N, K]`` expert weights with their per-expert global amax, as in one process; routing
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
    :class:`TrainerGroup` (the driver's handle) starts N processes once per run with
    ``torch.multiprocessing``'s spawn context and a ``file://`` rendezvous on local disk, and gives
    them each arm in turn (:meth:`TrainerGroup.setup`); they exit when the driver dies. Nothing crosses
    to them but tensors, lists and the config as plain values (no pickled objects of ours). The building blocks
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
import queue
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from tracefp4.rl import engine
from tracefp4.rl.arms import Arm
from tracefp4.rl.config import RLConfig
from tracefp4.rl.grpo import LossAgg, grpo_loss, pad_right

__all__ = ["TrainerGroup", "init_distributed", "rank_share", "shard_model", "sharded_update"]

_STAT_KEYS = ("clip_frac", "is_weight_mean", "is_truncated_frac")


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


def init_distributed(rank: int | None = None, world_size: int | None = None, init_file: str | None = None) -> None:
    """Join the process group: a ``file://`` rendezvous at ``init_file`` with the given rank and
    world size (what :class:`TrainerGroup` spawns), or, without ``init_file``, torchrun's ``env://``
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). Backend: NCCL on CUDA, else gloo."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if init_file is None:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"init_distributed without init_file needs torchrun's environment; missing {missing}")
        rank = int(os.environ["RANK"])
    elif rank is None or world_size is None:
        raise ValueError("init_distributed with init_file needs rank and world_size")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if init_file is None:
        dist.init_process_group(backend, init_method="env://")
    else:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)


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
    for module in model.modules():
        if "_tracefp4_binding" in module.__dict__ and hasattr(module, "gate_up_proj"):
            module.__dict__["_tracefp4_gathered"] = True  # the experts: quantize a copy of the gathered weights
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


def sharded_update(model: PreTrainedModel, opt: torch.optim.Optimizer, arm: Arm, cfg: RLConfig, batch: dict[str, Any],
                   read_records: Callable[[list[int]], list[dict[str, torch.Tensor]]]) -> dict[str, float]:
    """This rank's part of :func:`tracefp4.rl.update.update` (same permutation, same minibatches, one
    optimizer step each): ``batch`` holds the step's trajectories without records (``token_ids``,
    ``prompt_lens``, ``advantages``, ``logp_old``, ``logp_rollout``, ``mask``, ``step``);
    ``read_records(indices)`` reads this rank's records. Returns the loss, the mean statistics and
    the mean gradient norm (equal on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = len(batch["token_ids"])
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + batch["step"]))
    width = batch["mask"].shape[1]
    params = [p for p in model.parameters() if p.requires_grad]
    agg = LossAgg(cfg.loss_agg)
    stats = {k: 0.0 for k in ("loss", *_STAT_KEYS)}
    norms = []
    reshard(model)
    model.train()
    for mb in order.chunk(cfg.updates_per_step):
        idx = mb.tolist()
        share = rank_share(idx, rank, world)
        if not share:
            raise ValueError(f"rank {rank}: no trajectory in a minibatch of {len(idx)} (trainer_world_size "
                             f"must be at most the minibatch size)")
        records = read_records(share)
        new = engine.trainer_logprobs(model, [batch["token_ids"][b] for b in share],
                                      [batch["prompt_lens"][b] for b in share], records, arm,
                                      temperature=cfg.temperature)
        logp_new, mask = pad_right(new.logprobs, width)
        loss, st = grpo_loss(
            logp_new, batch["logp_old"][share], batch["logp_rollout"][share], batch["advantages"][share], mask,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, is_cap=cfg.is_cap, agg=agg,
            max_new_tokens=cfg.max_new_tokens,
        )
        n_tok, n_seq = float(mask.sum()), float(len(share))
        tot_tok, tot_seq = _all_reduce_sum([n_tok, n_seq])
        # this rank's share of the minibatch loss: its aggregate times its share of the global denominator
        scale = n_tok / max(tot_tok, 1.0) if agg is LossAgg.TOKEN_MEAN else n_seq / tot_seq
        (loss * (scale * world)).backward()  # FSDP averages over ranks: times N makes it the sum
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the statistics: token-weighted over the whole minibatch, as one process computes them
        reduced = _all_reduce_sum([float(loss) * scale, st["clip_frac"] * n_tok, st["is_weight_mean"] * n_tok,
                                   st["is_truncated_frac"] * n_tok])
        stats["loss"] += reduced[0] / cfg.updates_per_step
        for k, v in zip(_STAT_KEYS, reduced[1:]):
            stats[k] += v / max(tot_tok, 1.0) / cfg.updates_per_step
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


def _setup_cmd(setup: dict[str, Any]) -> tuple[PreTrainedModel, torch.optim.Optimizer, Arm, RLConfig]:
    """A fresh sharded model and optimizer on this rank (one arm), from the driver's weights and state."""
    cfg = RLConfig.from_dict(setup["cfg"])
    arm = Arm.from_dict(setup["arm"])
    opt_t = setup["optimizer_tensors"]
    model = _build_model(setup["config_json"], setup["weights"])
    masters = {k[len("master/"):]: v for k, v in opt_t.items() if k.startswith("master/")}
    shard_model(model, masters or None)
    model.eval()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    load_adam_state(model, opt, opt_t)
    return model, opt, arm, cfg


def _worker(rank: int, world: int, init_file: str, threads: int, inbox, outbox) -> None:
    torch.set_num_threads(threads)
    try:
        init_distributed(rank, world, init_file)
        outbox.put(("ready", rank))
        parent = os.getppid()
        model = opt = arm = cfg = None
        while True:
            try:
                cmd, arg = inbox.get(timeout=5.0)
            except queue.Empty:
                if os.getppid() != parent:  # the driver died (killed): nothing of ours is on disk, exit
                    break
                continue
            if cmd == "stop":
                break
            if cmd == "setup":
                model = opt = None  # the previous arm's
                model, opt, arm, cfg = _setup_cmd(arg)
                del arg
                outbox.put(("setup", rank))
            elif model is None:
                raise ValueError(f"command {cmd!r} before setup")
            elif cmd == "update":
                out = _update_cmd(model, opt, arm, cfg, arg)
                weights = gather_weights(model)
                outbox.put(("update", {**out, "rank": rank, "weights": weights if rank == 0 else None}))
            elif cmd == "optimizer":
                t = gather_optimizer_tensors(model, opt)
                outbox.put(("optimizer", t if rank == 0 else None))
            elif cmd == "logprobs":  # the sharded forward over given trajectories (no gradient): checks
                with torch.no_grad():
                    new = engine.trainer_logprobs(model, arg["token_ids"], arg["prompt_lens"], arg["records"], arm,
                                                  temperature=cfg.temperature)
                reshard(model)
                outbox.put(("logprobs", [lp.detach().cpu() for lp in new.logprobs]))
            else:
                raise ValueError(f"unknown command {cmd!r}")
    except BaseException:
        outbox.put(("error", f"trainer rank {rank}: {traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _update_cmd(model, opt, arm: Arm, cfg: RLConfig, job: dict[str, Any]) -> dict[str, Any]:
    from tracefp4.guidance.store import StoreReader, step_bytes

    ids, lengths = job["traj_ids"], [t.numel() for t in job["token_ids"]]
    with StoreReader(job["store_root"], job["step"], model_signature=job["signature"],
                     policy_version=job["policy_version"]) as reader:
        stats = sharded_update(model, opt, arm, cfg, job,
                               lambda share: reader.batch([ids[b] for b in share], [lengths[b] for b in share]))
        return {"stats": stats, "bytes_read": reader.bytes_read, "bytes_step": step_bytes(reader)}


class TrainerGroup:
    """N trainer processes in one process group (the driver's handle); :meth:`setup` gives them an
    arm's sharded model and optimizer (again for the next arm: the processes are started once per run).

    ``model`` is the driver's BF16 model (its weights and config start the ranks);
    ``optimizer_tensors`` are :meth:`MasterWeightAdamW.state_tensors` (FP32 masters, and Adam state
    after a resume). After :meth:`update` the driver's model holds the new weights.
    """

    def __init__(self, world_size: int, model: PreTrainedModel | None = None, cfg: RLConfig | None = None,
                 arm: Arm | None = None, optimizer_tensors: dict[str, torch.Tensor] | None = None, *,
                 timeout_s: float = 3600.0):
        import torch.multiprocessing as mp

        if world_size < 2:
            raise ValueError(f"TrainerGroup needs world_size >= 2, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="tracefp4-rdzv-")
        init_file = os.path.join(self._tmp.name, "rendezvous")
        threads = max(1, torch.get_num_threads() // world_size)
        ctx = mp.get_context("spawn")
        self._out = ctx.Queue()
        self._in = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, threads, self._in[r], self._out),
                                   daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()
        try:
            self._collect("ready")
            if model is not None:
                self.setup(model, cfg, arm, optimizer_tensors)
        except BaseException:
            self.close()
            raise

    def setup(self, model: PreTrainedModel, cfg: RLConfig, arm: Arm,
              optimizer_tensors: dict[str, torch.Tensor]) -> None:
        """Give the ranks an arm: the driver's model (weights, config) and optimizer state."""
        self._send("setup", {
            "cfg": _plain_config(cfg), "arm": arm.to_dict(),
            "config_json": json.dumps(model.config.to_dict(), default=str),
            "weights": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
            "optimizer_tensors": {k: v.detach().cpu().clone() for k, v in optimizer_tensors.items()},
        })
        self._collect("setup")

    def _collect(self, kind: str) -> list[Any]:
        """One reply of ``kind`` from every rank (in rank order for rank-indexed replies)."""
        got: list[Any] = []
        waited = 0.0
        while len(got) < self.world_size:
            try:
                k, v = self._out.get(timeout=5.0)
            except queue.Empty:
                waited += 5.0
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or waited > self.timeout_s:
                    raise RuntimeError(f"trainer ranks {dead} exited" if dead else "trainer ranks timed out") from None
                continue
            if k == "error":
                raise RuntimeError(v)
            if k != kind:
                raise RuntimeError(f"trainer rank answered {k!r}, expected {kind!r}")
            got.append(v)
        return got

    def _send(self, cmd: str, arg: Any = None) -> None:
        for q in self._in:
            q.put((cmd, arg))

    def update(self, batch, store_root, signature: str, policy_version: int,
               model: PreTrainedModel) -> dict[str, float]:
        """One step's updates on the ranks, each reading its own records from the store; copies the
        new weights into ``model`` (the driver's) and returns the statistics with the store bytes."""
        job = {
            "step": batch.step, "token_ids": batch.token_ids, "prompt_lens": batch.prompt_lens,
            "traj_ids": batch.traj_ids, "advantages": batch.advantages, "logp_old": batch.logp_old,
            "logp_rollout": batch.logp_rollout, "mask": batch.mask, "store_root": str(store_root),
            "signature": signature, "policy_version": policy_version,
        }
        self._send("update", job)
        replies = self._collect("update")
        stats = next(r["stats"] for r in replies if r["weights"] is not None)
        weights = next(r["weights"] for r in replies if r["weights"] is not None)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n])  # in place: bumps the version the rollout's weight cache keys on
        out = dict(stats)
        for r in sorted(replies, key=lambda r: r["rank"]):
            out[f"store/bytes_read_rank{r['rank']}"] = float(r["bytes_read"])
        out["store/bytes_read_rank"] = max(float(r["bytes_read"]) for r in replies)  # the busiest rank
        out["store/bytes_step"] = float(replies[0]["bytes_step"])
        return out

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """The full FP32 masters and Adam state (gathered on rank 0), in the checkpoint's names."""
        self._send("optimizer")
        return next(t for t in self._collect("optimizer") if t is not None)

    def logprobs(self, token_ids, prompt_lens, records) -> list[list[torch.Tensor]]:
        """Every rank's sharded forward over the same trajectories (no gradient): one list per reply."""
        self._send("logprobs", {"token_ids": token_ids, "prompt_lens": prompt_lens, "records": records})
        return self._collect("logprobs")

    def close(self) -> None:
        for q in self._in:
            try:
                q.put(("stop", None))
            except (ValueError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        self._tmp.cleanup()

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain_config(cfg: RLConfig) -> dict[str, Any]:
    import dataclasses

    d = dataclasses.asdict(cfg)
    d["arms"] = list(d["arms"])
    return d
