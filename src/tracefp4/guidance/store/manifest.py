"""What a writer publishes about its shards and trajectories, parsed and validated. See :mod:`tracefp4.guidance.store`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any



from tracefp4.guidance.store.common import (
    FORMAT_VERSION,
    ITEMSIZE,
    MANIFEST_FORMAT,
    READABLE_VERSIONS,
    SHARD_SUFFIX,
    SHA_RE,
    StoreError,
    check_contract,
    check_policy_version,
    check_signature,
    check_step,
    check_traj_id,
    check_writer_id,
    load_json,
    parse_name,
    version_error,
)




def req(obj: Mapping[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise StoreError(f"{where}: missing field {key!r}")
    val = obj[key]
    if not isinstance(val, typ) or (isinstance(val, bool) and typ is int):
        raise StoreError(f"{where}: field {key!r} has type {type(val).__name__}, expected {typ}")
    return val


def _req_sha(obj: Mapping[str, Any], key: str, where: str) -> str:
    sha = req(obj, key, str, where)
    if SHA_RE.fullmatch(sha) is None:
        raise StoreError(f"{where}: field {key!r} is not a sha256 hex digest: {sha!r}")
    return sha


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str  # key of SUPPORTED_DTYPES

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class TrajectoryMeta:
    traj_id: str
    shard: str
    length: int
    prompt_len: int
    tensors: dict[str, TensorMeta]
    #: sha256 of the trajectory's tensor bytes, concatenated in sorted tensor-name order, then (format 3)
    #: the bytes of its per-token policy versions
    sha256: str = ""
    #: (oldest, newest) policy version of its rows (format 3, whose shard holds the per-token versions as
    #: int64 ``[T]`` under ``{traj_id}/policy_version``); None in format 2: every row is at the manifest's
    #: ``policy_version``
    versions: tuple[int, int] | None = None

    @property
    def generated_tokens(self) -> int:
        return self.length - self.prompt_len

    @property
    def nbytes(self) -> int:
        """Bytes of the record's tensors (what :func:`~tracefp4.guidance.store.bytes_per_token` counts;
        the per-token versions are store overhead, like the headers)."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def versions_meta(self) -> TensorMeta | None:
        """The shard tensor of the per-token versions (None in format 2, which has none)."""
        return None if self.versions is None else TensorMeta((self.length,), "int64")


@dataclass(frozen=True)
class ShardMeta:
    name: str
    nbytes: int
    sha256: str
    #: bytes of the safetensors header: the 8-byte length plus the JSON header
    header_bytes: int = 0
    header_sha256: str = ""


@dataclass(frozen=True)
class Manifest:
    """One writer's contribution to one step.

    policy_version: the newest policy version of any row the writer wrote (format 2: the version of
    every row). contract: the quantizer contract the records were computed under (format 3; None in
    format 2, which did not record one).
    """

    step: int
    writer_id: str
    model_signature: str
    policy_version: int
    shards: dict[str, ShardMeta]
    trajectories: dict[str, TrajectoryMeta]
    version: int = FORMAT_VERSION
    contract: str | None = None

    @property
    def oldest_version(self) -> int:
        """The oldest policy version of any row (the manifest's ``policy_version`` without rows)."""
        return min((t.versions[0] if t.versions is not None else self.policy_version
                    for t in self.trajectories.values()), default=self.policy_version)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "step": self.step,
            "writer_id": self.writer_id,
            "model_signature": self.model_signature,
            "policy_version": self.policy_version,
        }
        if self.contract is not None:
            out["contract"] = self.contract
        return {
            **out,
            "shards": {
                s.name: {
                    "bytes": s.nbytes,
                    "sha256": s.sha256,
                    "header_bytes": s.header_bytes,
                    "header_sha256": s.header_sha256,
                }
                for s in self.shards.values()
            },
            "trajectories": {
                t.traj_id: {
                    "shard": t.shard,
                    "length": t.length,
                    "prompt_len": t.prompt_len,
                    "sha256": t.sha256,
                    **({} if t.versions is None else {"versions": list(t.versions)}),
                    "tensors": {
                        n: {"shape": list(m.shape), "dtype": m.dtype} for n, m in t.tensors.items()
                    },
                }
                for t in self.trajectories.values()
            },
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "manifest") -> Manifest:
        """Parse and fully validate a manifest (it may have been edited or corrupted by hand)."""
        if obj.get("format") != MANIFEST_FORMAT:
            raise StoreError(
                f"{where}: not a tracefp4 store manifest (format={obj.get('format')!r})"
            )
        version = req(obj, "version", int, where)
        if version not in READABLE_VERSIONS:
            raise version_error(where, "manifest", version)
        step = req(obj, "step", int, where)
        writer_id = req(obj, "writer_id", str, where)
        try:
            check_step(step)
            check_writer_id(writer_id)
            sig = check_signature(req(obj, "model_signature", str, where))
            pv = check_policy_version(req(obj, "policy_version", int, where))
            contract = check_contract(req(obj, "contract", str, where)) if version >= 3 else None
        except StoreError as e:
            raise StoreError(f"{where}: {e}") from None

        shards = {name: _shard_meta(name, s, writer_id, f"{where}, shard {name!r}")
                  for name, s in req(obj, "shards", dict, where).items()}
        trajs = {tid: _trajectory_meta(tid, t, shards, where, version)
                 for tid, t in req(obj, "trajectories", dict, where).items()}
        newest = max((t.versions[1] for t in trajs.values() if t.versions is not None), default=pv)
        if newest != pv:
            raise StoreError(f"{where}: policy_version {pv} is not the newest version of its rows ({newest})")
        return cls(step, writer_id, sig, pv, shards, trajs, version, contract)


def _shard_meta(name: str, s: Any, writer_id: str, w: str) -> ShardMeta:
    """One validated entry of a manifest's ``shards`` (``w``: where, for the error)."""
    if not isinstance(s, dict):
        raise StoreError(f"{w}: expected an object")
    if re.fullmatch(re.escape(writer_id) + r"-\d{5}" + re.escape(SHARD_SUFFIX), name) is None:
        raise StoreError(f"{w}: shard name does not belong to writer {writer_id!r}")
    nbytes = req(s, "bytes", int, w)
    sha = _req_sha(s, "sha256", w)
    header_bytes = req(s, "header_bytes", int, w)
    header_sha = _req_sha(s, "header_sha256", w)
    if not 8 <= header_bytes <= nbytes:
        raise StoreError(
            f"{w}: invalid size {nbytes!r} or header size {header_bytes!r} "
            "(need 8 <= header_bytes <= bytes)"
        )
    return ShardMeta(name, nbytes, sha, header_bytes, header_sha)


def _trajectory_meta(tid: str, t: Any, shards: Mapping[str, ShardMeta], where: str, version: int) -> TrajectoryMeta:
    """One validated entry of a manifest's ``trajectories``, in a shard of ``shards`` (format ``version``:
    3 has the rows' version range)."""
    w = f"{where}, trajectory {tid!r}"
    try:
        check_traj_id(tid)
    except StoreError as e:
        raise StoreError(f"{where}: {e}") from None
    if not isinstance(t, dict):
        raise StoreError(f"{w}: expected an object")
    shard = req(t, "shard", str, w)
    if shard not in shards:
        raise StoreError(f"{w}: shard {shard!r} is not listed in the manifest's shards")
    length = req(t, "length", int, w)
    prompt_len = req(t, "prompt_len", int, w)
    if length < 1 or not 0 <= prompt_len <= length:
        raise StoreError(f"{w}: invalid length {length} / prompt_len {prompt_len}")
    sha = _req_sha(t, "sha256", w)
    # no record tensors is a record too (a BF16 rollout of a dense model has nothing to record): the
    # shard still holds the trajectory's per-row versions
    tensors = {tname: _tensor_meta(tname, m, length, w) for tname, m in req(t, "tensors", dict, w).items()}
    if not tensors and version < 3:
        raise StoreError(f"{w}: no tensors")
    versions = _version_range(req(t, "versions", list, w), w) if version >= 3 else None
    return TrajectoryMeta(tid, shard, length, prompt_len, tensors, sha, versions)


def _version_range(v: list, w: str) -> tuple[int, int]:
    """A trajectory's ``[oldest, newest]`` policy versions (``w``: the trajectory, for the error)."""
    if (len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            or not 0 <= v[0] <= v[1]):
        raise StoreError(f"{w}: field 'versions' must be [oldest, newest] with 0 <= oldest <= newest, got {v!r}")
    return v[0], v[1]


def _tensor_meta(tname: str, m: Any, length: int, w: str) -> TensorMeta:
    """One validated tensor entry of a trajectory of ``length`` token positions (``w``: the trajectory)."""
    wt = f"{w}, tensor {tname!r}"
    try:
        parse_name(tname)
    except StoreError as e:
        raise StoreError(f"{w}: {e}") from None
    if not isinstance(m, dict):
        raise StoreError(f"{wt}: expected an object")
    shape = req(m, "shape", list, wt)
    dtype = req(m, "dtype", str, wt)
    if not shape or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise StoreError(f"{wt}: invalid shape {shape!r}")
    if shape[0] != length:
        raise StoreError(f"{wt}: leading dim {shape[0]} != trajectory length {length}")
    if dtype not in ITEMSIZE:
        raise StoreError(f"{wt}: unsupported dtype {dtype!r}")
    return TensorMeta(tuple(shape), dtype)


def shard_header(data: bytes | bytearray | memoryview, where: str) -> tuple[int, dict[str, Any]]:
    """(header bytes incl. the 8-byte length, parsed JSON header) of safetensors bytes."""
    if len(data) < 8:
        raise StoreError(f"{where}: shorter than a safetensors length prefix")
    n = int.from_bytes(bytes(data[:8]), "little")
    if n > len(data) - 8:
        raise StoreError(f"{where}: safetensors header length {n} exceeds the file")
    return 8 + n, load_json(bytes(data[8 : 8 + n]), f"{where}: safetensors header")


