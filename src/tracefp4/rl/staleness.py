"""The asynchronous loop's fixed schedule: every step trains on a rollout generated ``k`` policy
versions earlier (``RLConfig.max_staleness = k > 0``, ``staleness_schedule = "fixed"``).

Step ``s`` trains on the rollout of step ``s`` (its prompts and sampling seeds are step ``s``'s, as
in the synchronous loop) generated with the weights of version ``max(0, s - k)``: at step ``s`` the
runner first rolls out, with its current weights ``θ_s``, the batch step ``s + k`` will train on
(at step 0: the batches of steps 0 … k, all with ``θ_0``), then trains on step ``s``'s. Between
steps it holds ``k`` pending batches: their records sealed in the guidance store under their own
step and policy version, their tokens, rollout log-probs and (in memory only in the synchronous
loop) the rollout's full-code diagnostics here (:class:`Pending`).

The loss is decoupled as in AReaL (arXiv 2505.24298): the rollout's log-probs are the behaviour
policy, the trainer's log-probs at the consumed version ``θ_s`` before the update are the proximal
policy (``logp_old``), the PPO ratio is taken against the proximal one and the importance weight
(:class:`~tracefp4.rl.grpo.ISMode`) is proximal / behaviour. That is the synchronous loss's own shape
(:func:`~tracefp4.rl.grpo.grpo_loss`); what changes is only that ``logp_old`` is computed when the
batch is consumed, with the weights that train on it (:func:`~tracefp4.rl.collect.score`).

A guided arm's trainer reads the rollout's guidance while the batch's lag is at most
``guidance_max_lag`` and rounds to nearest beyond it (:func:`~tracefp4.rl.update.lag_arm`); in this
schedule every token of a batch has one lag, so the switch is per batch. Each step's metrics row
adds the lag (mean and max over the samples) and the generated tokens trained with and without
guidance (``tracefp4.pipeline.metrics.Name``). No sample is ever dropped: each batch is rolled out
exactly ``min(s, k)`` versions before the step that trains on it.

Crash safety: a checkpoint after step ``s`` (``runner.step = s + 1``) carries the pending batches of
steps ``s + 1`` … ``s + k`` in its ``extra/`` files (:func:`checkpoint_files`): each batch's tokens and
log-probs (:func:`encode_pending`) and the bytes of its sealed store step. A resume discards every
store step and writes those steps back (:func:`restore_store_step`, published by one rename), so
the resumed run trains on the very batches the uninterrupted one did and generates the later ones
with the same weights: it ends with the same weights, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from tracefp4.engines.protocol import RolloutOutput
from tracefp4.engines.trainer import TrainerMode
from tracefp4.faults import crash_point
from tracefp4.files import fsync_dir, read_regular
from tracefp4.guidance.store import step_dir
from tracefp4.pipeline.arms import Arm
from tracefp4.pipeline.metrics import Name
from tracefp4.rl.collect import ArmSetup, Batch, Records, read_records, roll_out, score
from tracefp4.rl.update import lag_arm

__all__ = ["FixedSchedule", "Pending", "behaviour_version", "checkpoint_files", "decode_pending",
           "encode_pending", "restore_store_step"]

#: Where a checkpoint's ``extra/`` files keep the pending batches and their store steps.
PENDING_DIR, STORE_DIR = "pending", "store"
#: Hidden folders in a store root that a restore writes before renaming them to a step folder.
_RESTORE_PREFIX = ".restore-"


def behaviour_version(step: int, k: int) -> int:
    """The policy version whose weights generate the batch step ``step`` trains on."""
    return max(0, step - k)


@dataclasses.dataclass
class Pending:
    """One batch generated ahead of the step that trains on it; its records are in the store under
    ``step`` and ``version``."""

    step: int  # the step that trains on it (its prompts, sampling seeds and store step)
    version: int  # the policy version that generated it (the behaviour policy)
    rollout: RolloutOutput  # tokens, prompt lengths, rollout log-probs (records: in the store)
    diagnostics: Records | None  # the rollout's full codes at the arm's diagnostics layers, if kept in memory


def encode_pending(p: Pending) -> bytes:
    """A pending batch as safetensors bytes (tensors per trajectory, the rest in the header's metadata)."""
    r = p.rollout
    tensors: dict[str, torch.Tensor] = {}
    for b in range(len(r.token_ids)):
        tensors[f"token_ids.{b}"] = r.token_ids[b]
        tensors[f"logprobs.{b}"] = r.logprobs[b]
        if r.top_ids:
            tensors[f"top_ids.{b}"], tensors[f"top_logprobs.{b}"] = r.top_ids[b], r.top_logprobs[b]
        for name, t in (p.diagnostics[b] if p.diagnostics is not None else {}).items():
            tensors[f"diag.{b}.{name}"] = t
    meta = {"step": p.step, "version": p.version, "prompt_lens": list(r.prompt_lens),
            "finish_reasons": list(r.finish_reasons), "top": bool(r.top_ids), "diagnostics": p.diagnostics is not None}
    return safetensors.torch.save({k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()},
                                  metadata={"pending": json.dumps(meta)})


def decode_pending(data: bytes, arm: Arm, where: str) -> Pending:
    """The :class:`Pending` of :func:`encode_pending`'s bytes; a ValueError naming ``where`` if they
    are not one."""
    try:
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["pending"])
        tensors = safetensors.torch.load(data)
        lens, reasons = [int(x) for x in meta["prompt_lens"]], [str(x) for x in meta["finish_reasons"]]
        step, version = int(meta["step"]), int(meta["version"])
    except Exception as e:  # malformed bytes of any kind: the checkpoint verified, so a bug upstream
        raise ValueError(f"{where}: not a pending batch ({type(e).__name__}: {e})") from None
    n_traj = len(lens)
    if len(reasons) != n_traj or any(f"token_ids.{b}" not in tensors for b in range(n_traj)):
        raise ValueError(f"{where}: pending batch of {n_traj} trajectories with missing fields")
    per = [f"token_ids.{b}" for b in range(n_traj)]
    top = [t for b in range(n_traj) for t in (f"top_ids.{b}", f"top_logprobs.{b}")] if meta["top"] else []
    diagnostics = None
    if meta["diagnostics"]:
        diagnostics = [{} for _ in range(n_traj)]
        for key, t in tensors.items():
            if key.startswith("diag."):
                _, b, name = key.split(".", 2)
                diagnostics[int(b)][name] = t
    roll = RolloutOutput([tensors[k] for k in per], lens, [tensors[f"logprobs.{b}"] for b in range(n_traj)], reasons,
                         [], [], arm.plan, arm.guidance, top_ids=[tensors[k] for k in top[0::2]],
                         top_logprobs=[tensors[k] for k in top[1::2]])
    return Pending(step, version, roll, diagnostics)


def _step_name(step: int) -> str:
    return step_dir("", step).name  # the store's own step folder name


def store_step_files(root: Path, step: int) -> dict[str, bytes]:
    """The bytes of every file of a sealed store step (its shards, manifests and seal)."""
    sdir = step_dir(root, step)
    out = {}
    for p in sorted(sdir.iterdir()):
        out[p.name] = read_regular(p, ValueError)
    return out


def restore_store_step(root: Path, step: int, files: Mapping[str, bytes]) -> None:
    """Write a store step back from its files: into a hidden folder, fsynced, then renamed to the step
    folder (which must not exist), so a reader sees the whole step or none of it."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{_RESTORE_PREFIX}{_step_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        for name, data in files.items():
            if "/" in name or name in ("", ".", ".."):
                raise ValueError(f"store step {step}: bad file name {name!r} in a checkpoint")
            with open(tmp / name, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        fsync_dir(tmp)
        os.rename(tmp, root / _step_name(step))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)


def remove_stale_restores(root: Path) -> None:
    """Delete the hidden folders of a restore that was killed before its rename."""
    for p in root.glob(f"{_RESTORE_PREFIX}*") if root.is_dir() else ():
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def checkpoint_files(pending: Mapping[int, Pending], store_root: Path) -> dict[str, bytes]:
    """A checkpoint's ``extra`` files for the pending batches: each batch and its store step's files."""
    out = {}
    for step, p in sorted(pending.items()):
        out[f"{PENDING_DIR}/{_step_name(step)}.safetensors"] = encode_pending(p)
        for name, data in store_step_files(store_root, step).items():
            out[f"{STORE_DIR}/{_step_name(step)}/{name}"] = data
    return out


class FixedSchedule:
    """The pending batches of one arm under the fixed schedule, and the step's batch from them."""

    def __init__(self, setup: ArmSetup, k: int, guidance_lag_bound: int):
        if k < 1:
            raise ValueError(f"FixedSchedule: max_staleness must be >= 1, got {k} (0 is the synchronous loop)")
        self.setup, self.k, self.bound = setup, k, guidance_lag_bound
        self.pending: dict[int, Pending] = {}

    def batch(self, step: int, version: int) -> tuple[Batch, Arm, dict[str, float]]:
        """Roll out what is missing of steps ``step`` … ``step + k`` with the current weights (of
        ``version``), then step ``step``'s batch scored with them: the batch, the arm its trainer runs
        (guided, or round to nearest beyond the lag bound) and the step's staleness metrics."""
        timings: dict[str, float] = {}
        for j in range(step, step + self.k + 1):
            if j in self.pending:
                continue
            if behaviour_version(j, self.k) != version:  # a resume that lost a pending batch: never silent
                raise RuntimeError(f"arm {self.setup.name!r} step {step}: the batch of step {j} should have been "
                                   f"generated with version {behaviour_version(j, self.k)}, not {version}")
            out = roll_out(self.setup, j, version, read_back=False)
            self.pending[j] = Pending(j, version, out.rollout, out.diagnostics)
            for key, t in out.timings.items():
                timings[key] = timings.get(key, 0.0) + t
        p = self.pending.pop(step)
        records, timings["time/store_read_s"] = read_records(self.setup, step, p.version, p.rollout)
        lag = version - p.version
        arm = lag_arm(self.setup.arm, version, p.version, self.bound)
        batch = score(self.setup, step, p.rollout, records, p.diagnostics, timings, arm)
        generated = int(batch.mask.sum())
        guided = self.setup.arm.trainer is TrainerMode.TRACE
        metrics = {
            Name.LAG_MEAN: float(lag), Name.LAG_MAX: lag,
            Name.LAG_GUIDED: generated if guided and arm is self.setup.arm else 0,
            Name.LAG_FALLBACK: generated if guided and arm is not self.setup.arm else 0,
        }
        return batch, arm, metrics

    def state(self) -> list[list[int]]:
        """The pending batches' (step, version), for the checkpoint's JSON state."""
        return [[s, p.version] for s, p in sorted(self.pending.items())]

    def checkpoint_files(self) -> dict[str, bytes]:
        return checkpoint_files(self.pending, self.setup.store_root)

    def restore(self, state: Any, extra: Mapping[str, bytes], where: str) -> None:
        """Take the pending batches a checkpoint carries (after every store step was discarded): into
        memory, and their store steps back into the store."""
        root = self.setup.store_root
        remove_stale_restores(root)
        self.pending = {}
        for step, version in state:
            name = f"{PENDING_DIR}/{_step_name(step)}.safetensors"
            if name not in extra:
                raise ValueError(f"{where}: the checkpoint lists pending step {step} but has no {name}")
            p = decode_pending(extra[name], self.setup.arm, f"{where}/{name}")
            if (p.step, p.version) != (step, version):
                raise ValueError(f"{where}/{name}: holds step {p.step} of version {p.version}, the state lists "
                                 f"step {step} of version {version}")
            prefix = f"{STORE_DIR}/{_step_name(step)}/"
            files = {k[len(prefix):]: v for k, v in extra.items() if k.startswith(prefix)}
            if not files:
                raise ValueError(f"{where}: the checkpoint lists pending step {step} but holds no store files for it")
            restore_store_step(root, step, files)
            crash_point("restored")  # some pending store steps back in the store, maybe not all
            self.pending[step] = p
