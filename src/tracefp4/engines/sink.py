"""The cache tier as an engine sees it: where a rollout's records go when the engine writes them itself.

A trainer that reads records from the guidance store does not need them to pass through the process
that drives the rollout. An engine given a :class:`StoreTarget` writes every trajectory's records
into the store under the target's writer (one writer per engine, keyed by trajectory id) and hands
back only token ids, log-probs and finish reasons; the driver seals the step once every engine has
returned (:func:`tracefp4.guidance.store.seal_step`). The target is plain data (JSON), so it crosses
into a vLLM worker or a Ray actor without pickling anything of ours.

Each row goes to the store with the policy version of the weights that computed it (the engine's
stamp, :attr:`~tracefp4.engines.protocol.RolloutOutput.versions`) and the records with their quantizer
contract (:func:`~tracefp4.engines.contract.quantizer_contract` of the rollout's plan and guidance). A
row the engine could not stamp (:data:`UNKNOWN_VERSION`: an engine on a model whose weights others
update, such as ours on the trainer's own model object, which never had ``load_weights``) is written
at the target's ``policy_version``: the version the driver says those weights are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tracefp4.faults import crash_point
from tracefp4.guidance.store import StoreWriter

__all__ = ["UNKNOWN_VERSION", "StoreTarget", "write_records", "pack_records", "unpack_records", "unpack_rollout"]

#: A row's policy version where the engine does not know the version of its weights (see the module docstring).
UNKNOWN_VERSION = -1


@dataclasses.dataclass(frozen=True)
class StoreTarget:
    """One writer of one step of a guidance store.

    root: the store's folder (shared by every engine and trainer rank: a local or shared filesystem).
    step: the step the records belong to. writer_id: this engine's writer (``w0``, ``w1``, ...; unique
    per step). traj_ids: the store's name of each trajectory, in prompt order. model_signature: what
    every reader checks before it hands a record to a trainer. policy_version: the version of the
    weights the driver gave the engine, written for rows the engine could not stamp itself
    (:data:`UNKNOWN_VERSION`); rows it stamped keep their own version.
    """

    root: str
    step: int
    writer_id: str
    traj_ids: tuple[str, ...]
    model_signature: str
    policy_version: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", str(self.root))
        object.__setattr__(self, "traj_ids", tuple(str(t) for t in self.traj_ids))
        if len(set(self.traj_ids)) != len(self.traj_ids):
            raise ValueError(f"store target {self.writer_id!r}: trajectory ids repeat")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "traj_ids": list(self.traj_ids)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StoreTarget:
        return cls(**d)

    def slice(self, lo: int, hi: int, writer_id: str) -> StoreTarget:
        """The target of trajectories ``lo:hi`` under another writer (one engine of several)."""
        return dataclasses.replace(self, writer_id=writer_id, traj_ids=self.traj_ids[lo:hi])


def write_records(target: StoreTarget, records: Sequence[Mapping[str, torch.Tensor]], prompt_lens: Sequence[int],
                  *, versions: Sequence[torch.Tensor], contract: str) -> int:
    """Write one rollout's records under ``target``'s writer; returns the bytes of tensors written.
    ``versions[b]``: the policy version of each row of trajectory b (``RolloutOutput.versions``;
    :data:`UNKNOWN_VERSION` rows are written at ``target.policy_version``); ``contract``: the quantizer
    contract the records were computed under. The writer's manifest is committed only when every
    trajectory is in (a crash leaves nothing a reader would take for complete)."""
    n = len(target.traj_ids)
    if len(records) != n or len(prompt_lens) != n or len(versions) != n:
        raise ValueError(
            f"store target {target.writer_id!r} names {n} trajectories, the rollout has "
            f"{len(records)} records, {len(prompt_lens)} prompts and {len(versions)} version rows"
        )
    crash_point("rollout")  # sampled, nothing written
    total = 0
    with StoreWriter(target.root, target.step, target.writer_id, model_signature=target.model_signature,
                     policy_version=target.policy_version, contract=contract) as w:
        for tid, rec, p, v in zip(target.traj_ids, records, prompt_lens, versions):
            w.add(tid, rec, prompt_len=int(p), versions=torch.where(v == UNKNOWN_VERSION, target.policy_version, v))
            total += sum(t.nbytes for t in rec.values())
            crash_point("store-write")  # a writer with part of its records (and maybe shards) on disk
    return total


_VERSIONS = "policy_version"  # the name of a trajectory's per-row versions in a packed batch


def pack_records(records: list[dict[str, torch.Tensor]], diagnostics: list[dict[str, torch.Tensor]],
                 versions: Sequence[torch.Tensor] = ()) -> bytes:
    """Records, diagnostics and (optionally) per-row versions of a batch of trajectories as safetensors
    bytes, for a process boundary the store is not on (a vLLM worker's RPC reply, a trainer rank's
    job): no pickled objects."""
    from safetensors.torch import save

    flat = {}
    for kind, per_traj in (("r", records), ("d", diagnostics), ("v", [{_VERSIONS: v} for v in versions])):
        for b, rec in enumerate(per_traj):
            for name, t in rec.items():
                flat[f"{kind}/{b}/{name}"] = t.clone(memory_format=torch.contiguous_format)  # no shared storage
    return save(flat, metadata={"trajectories": str(len(records))})


def unpack_rollout(blob: bytes) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """(records, diagnostics, versions) of :func:`pack_records`' bytes (versions: ``[]`` if none were packed)."""
    import json
    import struct

    from safetensors.torch import load

    flat = load(blob)
    # the count is in the header's metadata: a batch may carry no tensor at all
    header_len = struct.unpack("<Q", blob[:8])[0]
    n = int(json.loads(blob[8 : 8 + header_len])["__metadata__"]["trajectories"])
    out: dict[str, list[dict[str, torch.Tensor]]] = {k: [{} for _ in range(n)] for k in "rdv"}
    for key, t in flat.items():
        kind, b, name = key.split("/", 2)
        out[kind][int(b)][name] = t
    versions = [v[_VERSIONS] for v in out["v"]] if any(out["v"]) else []
    return out["r"], out["d"], versions


def unpack_records(blob: bytes) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """(records, diagnostics) of :func:`pack_records`' bytes."""
    records, diagnostics, _ = unpack_rollout(blob)
    return records, diagnostics
