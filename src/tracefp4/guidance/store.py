"""The guidance store: rollout records that cross process (and machine) boundaries.

Rollout workers (writers) record, per trajectory, the TRACE guidance of every guided site and the
routed expert indices; the trainer (reader) reads them back for its training batch. The contract is
in ``shared/DESIGN.md`` section 4. This module is plain files on a (possibly shared) file system:
safetensors shards plus JSON manifests, no pickle anywhere.

Layout of one RL step::

    root/step-00000012/
        w0-00000.safetensors      # shard: keys "{traj_id}/{tensor_name}"
        w0-00001.safetensors
        w0.manifest.json          # per writer, written last and atomically
        w1-00000.safetensors
        w1.manifest.json
        COMPLETE.json             # seal, written by the driver once all writers returned

Record
    One trajectory's record is ``dict[str, Tensor]``; every tensor has leading dim ``T`` = number of
    token positions (prompt + completion). Names are ``L{layer:02d}.{site}.{field}`` for guidance
    (site in :class:`~tracefp4.formats.constants.Site`) and ``L{layer:02d}.routing`` for the routed expert
    indices (routing replay travels in the same store; it is just one more tensor).

Decisions (and why)
    * **Visibility.** Every file is written to a hidden temp file in the step directory, flushed,
      fsynced, renamed, and the directory fsynced, so a reader sees either nothing or a complete
      file. A writer's manifest is written after all of its shards; ``COMPLETE.json`` is written by
      :func:`seal_step` after all manifests. Readers refuse a step without ``COMPLETE.json``, so a
      half-written step is never visible, even if a worker died after some manifests landed.
    * **No coordination between writers.** Each writer only creates files whose names start with its
      own ``writer_id`` (shards ``{writer_id}-{seq:05d}.safetensors``, its manifest and its temp
      files), so writers never race on a name. The shard sequence number is capped at 99999 so the
      fixed-width suffix makes the writer id recoverable from a shard name (no aliasing across
      writers).
    * **Checksums, hierarchically.** A manifest records the byte size and sha256 of each of its
      shards; the seal records the sha256 of each manifest. A reader therefore detects a changed,
      truncated or swapped manifest as well as a corrupted shard. Shards are verified lazily, on
      first use, size first (so a truncation is reported as a truncation, not as a hash mismatch),
      then the hash, then the safetensors header against the manifest (keys, shapes, dtypes).
      The bytes that are hashed at write time are exactly the bytes written to disk
      (``safetensors.torch.save`` to memory, then one write).
    * **Strictness.** Every disagreement is a :class:`StoreError` that names what and where (path,
      step, writer, trajectory id, tensor name): unknown trajectory, length, trailing shape, dtype,
      model signature, policy version, out-of-range position slice, duplicate trajectory id,
      duplicate JSON keys in a manifest. Nothing is ever clipped, padded or skipped silently.
    * **One trajectory, one shard.** A record is never split over shards, so reading a trajectory
      touches one file. A record larger than ``shard_bytes`` gets a shard of its own.
    * **Aborted writers leave nothing visible.** If the writer's ``with`` block raises, the
      manifest is not written and the shards it already renamed into place are removed (no manifest
      references them, so they would only waste disk). Files of a writer that was killed outright
      (SIGKILL, node loss) stay behind as unreferenced orphans; they are harmless because readers
      only open shards listed in a sealed manifest, and a retry of the same ``writer_id`` simply
      overwrites them.
    * **Extra manifests.** :func:`seal_step` seals exactly the writers the driver names. A manifest
      from a writer the driver did not name (e.g. a worker that was given up on but finished late)
      is ignored by readers; the driver, not the file system, decides what a step contains.
    * **Canonical names.** Layer numbers must be written exactly as ``{layer:02d}`` so that two
      spellings (``L7`` / ``L07`` / ``L007``) can never alias the same layer.
    * **Dtypes.** All dtypes safetensors round-trips bit-exactly: bool, (u)int8..64, float16,
      bfloat16, float32, float64, float8_e4m3fn, float8_e5m2, float8_e8m0fnu. ``float4_e2m1fn_x2``
      is refused: safetensors 0.8 writes it with the unpacked element count in the shape and cannot
      load it back. Store packed FP4 codes as ``uint8`` (``t.view(torch.uint8)``), which is the same
      bytes. Routing indices must have an integer dtype.
    * **Positions.** :meth:`StoreReader.get` takes a step-1 slice with ``0 <= start <= stop <= T``;
      negative or out-of-range bounds are an error instead of Python's silent clipping.
    * **Accounting** (:func:`bytes_per_token`) counts tensor payload bytes (numel x itemsize, from
      the manifest metadata; safetensors headers and file-system overhead excluded) over all
      recorded positions, divided by the number of *generated* tokens (``T - prompt_len``
      summed), which is the unit the paper's bytes-per-token figures use.
    * The reader keeps one memory-mapped ``safe_open`` handle per verified shard and is not
      thread-safe; use one reader per thread or process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open

from tracefp4.formats.constants import Site
from tracefp4.files import atomic_write_bytes, fsync_dir

__all__ = [
    "COMPLETE_NAME",
    "FORMAT_VERSION",
    "ROUTING",
    "SUPPORTED_DTYPES",
    "StoreError",
    "TensorMeta",
    "TrajectoryMeta",
    "ShardMeta",
    "Manifest",
    "parse_name",
    "step_dir",
    "StoreWriter",
    "seal_step",
    "StoreReader",
    "bytes_per_token",
]

FORMAT_VERSION = 1
ROUTING = "routing"
MANIFEST_SUFFIX = ".manifest.json"
SHARD_SUFFIX = ".safetensors"
COMPLETE_NAME = "COMPLETE.json"
_MANIFEST_FORMAT = "tracefp4.guidance.store.manifest"
_COMPLETE_FORMAT = "tracefp4.guidance.store.complete"
_SHARD_FORMAT = "tracefp4.guidance.store.shard"
_MAX_SEQ = 99_999  # {seq:05d} must stay five digits, see module docstring
_HASH_CHUNK = 1 << 20

_TRAJ_ID_RE = re.compile(r"[A-Za-z0-9_.:-]+")
# Writer ids become file names: no ':' (not portable) and no leading '.' (temp files are hidden).
_WRITER_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_SITES = tuple(s.value for s in Site)
_GUIDANCE_NAME_RE = re.compile(r"L(\d+)\.(" + "|".join(_SITES) + r")\.([A-Za-z0-9_]+)")
_ROUTING_NAME_RE = re.compile(r"L(\d+)\.routing")

_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e8m0fnu",
)
#: Manifest dtype name -> torch dtype (only those this torch build has).
SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}
_DTYPE_TO_NAME = {dt: n for n, dt in SUPPORTED_DTYPES.items()}
# Hard-coded rather than taken from torch so that accounting over a manifest never depends on the
# torch build that reads it.
_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1,
}  # fmt: skip
# Dtype codes of the safetensors header, to check a shard against its manifest before reading it.
_SAFETENSORS_DTYPE = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32",
    "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
    "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}  # fmt: skip
_INTEGER_DTYPES = {"uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64"}


class StoreError(ValueError):
    """Any disagreement between the store, its files and what the caller expects."""


# --------------------------------------------------------------------------------------------
# Names and paths
# --------------------------------------------------------------------------------------------


def parse_name(name: str) -> tuple[int, str, str]:
    """``"L07.k.scales"`` -> ``(7, "k", "scales")``; ``"L07.routing"`` -> ``(7, "routing", "")``."""
    if not isinstance(name, str):
        raise StoreError(f"tensor name must be a str, got {type(name).__name__}: {name!r}")
    m = _GUIDANCE_NAME_RE.fullmatch(name)
    if m is not None:
        layer, site, fld = int(m.group(1)), m.group(2), m.group(3)
    else:
        m = _ROUTING_NAME_RE.fullmatch(name)
        if m is None:
            raise StoreError(
                f"tensor name {name!r} does not match 'L{{layer:02d}}.{{site}}.{{field}}' "
                f"(site in {list(_SITES)}) or 'L{{layer:02d}}.routing'"
            )
        layer, site, fld = int(m.group(1)), ROUTING, ""
    if m.group(1) != f"{layer:02d}":
        raise StoreError(
            f"tensor name {name!r}: layer must be written as {layer:02d} "
            f"(canonical 'L{{layer:02d}}'), so that names cannot alias"
        )
    return layer, site, fld


def _check_traj_id(traj_id: object) -> str:
    if not isinstance(traj_id, str) or _TRAJ_ID_RE.fullmatch(traj_id) is None:
        raise StoreError(f"invalid trajectory id {traj_id!r}: must match [A-Za-z0-9_.:-]+")
    return traj_id


def _check_writer_id(writer_id: object) -> str:
    if (
        not isinstance(writer_id, str)
        or _WRITER_ID_RE.fullmatch(writer_id) is None
        or writer_id in {".", ".."}
    ):
        raise StoreError(
            f"invalid writer id {writer_id!r}: must match [A-Za-z0-9_-][A-Za-z0-9_.-]* "
            "(it becomes part of file names)"
        )
    return writer_id


def _check_step(step: object) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise StoreError(f"step must be a non-negative int, got {step!r}")
    return step


def _check_policy_version(policy_version: object) -> int:
    pv = policy_version
    if not isinstance(pv, int) or isinstance(pv, bool) or pv < 0:
        raise StoreError(f"policy_version must be a non-negative int, got {policy_version!r}")
    return policy_version


def _check_signature(model_signature: object) -> str:
    if not isinstance(model_signature, str) or not model_signature:
        raise StoreError(f"model_signature must be a non-empty str, got {model_signature!r}")
    return model_signature


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """Directory of one RL step under ``root``."""
    return Path(root) / f"step-{_check_step(step):08d}"


def _manifest_path(sdir: Path, writer_id: str) -> Path:
    return sdir / f"{writer_id}{MANIFEST_SUFFIX}"


def _present_writers(sdir: Path) -> list[str]:
    if not sdir.is_dir():
        return []
    return sorted(p.name[: -len(MANIFEST_SUFFIX)] for p in sdir.glob(f"*{MANIFEST_SUFFIX}"))


# --------------------------------------------------------------------------------------------
# Durable file primitives
# --------------------------------------------------------------------------------------------




def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of duplicate keys silently; a manifest with two entries for one
    # trajectory is corrupt, not "the second one wins".
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate JSON key {k!r}")
        out[k] = v
    return out


def _load_json(data: bytes, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise StoreError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise StoreError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _dump_json(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode("utf-8")


# --------------------------------------------------------------------------------------------
# Manifest metadata
# --------------------------------------------------------------------------------------------


def _req(obj: Mapping[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise StoreError(f"{where}: missing field {key!r}")
    val = obj[key]
    if not isinstance(val, typ) or (isinstance(val, bool) and typ is int):
        raise StoreError(f"{where}: field {key!r} has type {type(val).__name__}, expected {typ}")
    return val


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str  # key of SUPPORTED_DTYPES

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class TrajectoryMeta:
    traj_id: str
    shard: str
    length: int
    prompt_len: int
    tensors: dict[str, TensorMeta]

    @property
    def generated_tokens(self) -> int:
        return self.length - self.prompt_len


@dataclass(frozen=True)
class ShardMeta:
    name: str
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """One writer's contribution to one step."""

    step: int
    writer_id: str
    model_signature: str
    policy_version: int
    shards: dict[str, ShardMeta]
    trajectories: dict[str, TrajectoryMeta]
    version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _MANIFEST_FORMAT,
            "version": self.version,
            "step": self.step,
            "writer_id": self.writer_id,
            "model_signature": self.model_signature,
            "policy_version": self.policy_version,
            "shards": {
                s.name: {"bytes": s.nbytes, "sha256": s.sha256} for s in self.shards.values()
            },
            "trajectories": {
                t.traj_id: {
                    "shard": t.shard,
                    "length": t.length,
                    "prompt_len": t.prompt_len,
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
        if obj.get("format") != _MANIFEST_FORMAT:
            raise StoreError(
                f"{where}: not a tracefp4 store manifest (format={obj.get('format')!r})"
            )
        version = _req(obj, "version", int, where)
        if version != FORMAT_VERSION:
            raise StoreError(
                f"{where}: manifest version {version}, this code reads {FORMAT_VERSION}"
            )
        step = _req(obj, "step", int, where)
        writer_id = _req(obj, "writer_id", str, where)
        try:
            _check_step(step)
            _check_writer_id(writer_id)
            sig = _check_signature(_req(obj, "model_signature", str, where))
            pv = _check_policy_version(_req(obj, "policy_version", int, where))
        except StoreError as e:
            raise StoreError(f"{where}: {e}") from None

        shard_re = re.compile(re.escape(writer_id) + r"-\d{5}" + re.escape(SHARD_SUFFIX))
        shards: dict[str, ShardMeta] = {}
        for name, s in _req(obj, "shards", dict, where).items():
            w = f"{where}, shard {name!r}"
            if not isinstance(s, dict):
                raise StoreError(f"{w}: expected an object")
            if shard_re.fullmatch(name) is None:
                raise StoreError(f"{w}: shard name does not belong to writer {writer_id!r}")
            nbytes = _req(s, "bytes", int, w)
            sha = _req(s, "sha256", str, w)
            if nbytes < 0 or re.fullmatch(r"[0-9a-f]{64}", sha) is None:
                raise StoreError(f"{w}: invalid size {nbytes!r} or sha256 {sha!r}")
            shards[name] = ShardMeta(name, nbytes, sha)

        trajs: dict[str, TrajectoryMeta] = {}
        for tid, t in _req(obj, "trajectories", dict, where).items():
            w = f"{where}, trajectory {tid!r}"
            try:
                _check_traj_id(tid)
            except StoreError as e:
                raise StoreError(f"{where}: {e}") from None
            if not isinstance(t, dict):
                raise StoreError(f"{w}: expected an object")
            shard = _req(t, "shard", str, w)
            if shard not in shards:
                raise StoreError(f"{w}: shard {shard!r} is not listed in the manifest's shards")
            length = _req(t, "length", int, w)
            prompt_len = _req(t, "prompt_len", int, w)
            if length < 1 or not 0 <= prompt_len <= length:
                raise StoreError(f"{w}: invalid length {length} / prompt_len {prompt_len}")
            tensors: dict[str, TensorMeta] = {}
            for tname, m in _req(t, "tensors", dict, w).items():
                wt = f"{w}, tensor {tname!r}"
                try:
                    parse_name(tname)
                except StoreError as e:
                    raise StoreError(f"{w}: {e}") from None
                if not isinstance(m, dict):
                    raise StoreError(f"{wt}: expected an object")
                shape = _req(m, "shape", list, wt)
                dtype = _req(m, "dtype", str, wt)
                if not shape or not all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
                ):
                    raise StoreError(f"{wt}: invalid shape {shape!r}")
                if shape[0] != length:
                    raise StoreError(f"{wt}: leading dim {shape[0]} != trajectory length {length}")
                if dtype not in _ITEMSIZE:
                    raise StoreError(f"{wt}: unsupported dtype {dtype!r}")
                tensors[tname] = TensorMeta(tuple(shape), dtype)
            if not tensors:
                raise StoreError(f"{w}: no tensors")
            trajs[tid] = TrajectoryMeta(tid, shard, length, prompt_len, tensors)
        return cls(step, writer_id, sig, pv, shards, trajs, version)


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------


class StoreWriter:
    """Writes one rollout worker's records for one step. Use as a context manager.

    Writers of the same step never coordinate: each only creates files named after its own
    ``writer_id``. Nothing this writer wrote becomes visible before :meth:`close` has written the
    manifest, and the step as a whole only after :func:`seal_step`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        step: int,
        writer_id: str,
        *,
        model_signature: str,
        policy_version: int,
        shard_bytes: int = 256 << 20,
    ) -> None:
        self.step = _check_step(step)
        self.writer_id = _check_writer_id(writer_id)
        self.model_signature = _check_signature(model_signature)
        self.policy_version = _check_policy_version(policy_version)
        if not isinstance(shard_bytes, int) or shard_bytes < 1:
            raise StoreError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
        self.shard_bytes = shard_bytes
        self.root = Path(root)
        self.dir = step_dir(root, step)
        self._where = f"writer {writer_id!r}, step {step} ({self.dir})"

        if (self.dir / COMPLETE_NAME).exists():
            raise StoreError(f"{self._where}: step is already sealed, cannot add a writer")
        if _manifest_path(self.dir, writer_id).exists():
            raise StoreError(
                f"{self._where}: a manifest for this writer already exists "
                f"({_manifest_path(self.dir, writer_id)}); refusing to overwrite a finished writer"
            )
        new_dir = not self.dir.is_dir()
        self.dir.mkdir(parents=True, exist_ok=True)
        if new_dir:
            fsync_dir(self.dir.parent)

        self._trajs: dict[str, TrajectoryMeta] = {}
        self._shards: dict[str, ShardMeta] = {}
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._seq = 0
        self._closed = False
        self._manifest_written = False
        self._published = False

    # -- public ---------------------------------------------------------------------------

    def add(self, traj_id: str, record: Mapping[str, torch.Tensor], *, prompt_len: int) -> None:
        """Buffer one trajectory's record; flush a shard once ``shard_bytes`` are buffered.

        Tensors are copied (to contiguous CPU memory), so the caller may reuse its buffers.
        """
        if self._closed:
            raise StoreError(f"{self._where}: add() after close()")
        _check_traj_id(traj_id)
        where = f"{self._where}, trajectory {traj_id!r}"
        if traj_id in self._trajs:
            raise StoreError(f"{where}: duplicate trajectory id in this writer")
        if not isinstance(record, Mapping) or not record:
            raise StoreError(f"{where}: record must be a non-empty dict of tensors")

        length: int | None = None
        tensors: dict[str, torch.Tensor] = {}
        metas: dict[str, TensorMeta] = {}
        for name, t in record.items():
            try:
                _, site, _ = parse_name(name)
            except StoreError as e:
                raise StoreError(f"{where}: {e}") from None
            wt = f"{where}, tensor {name!r}"
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                raise StoreError(f"{wt}: expected a dense torch.Tensor, got {type(t).__name__}")
            if t.dim() < 1:
                raise StoreError(f"{wt}: needs a leading token dim, got a 0-d tensor")
            dtype = _DTYPE_TO_NAME.get(t.dtype)
            if dtype is None:
                fp4 = "float4" in str(t.dtype)
                hint = " (store packed FP4 codes as t.view(torch.uint8))" if fp4 else ""
                raise StoreError(f"{wt}: unsupported dtype {t.dtype}{hint}")
            if site == ROUTING and dtype not in _INTEGER_DTYPES:
                raise StoreError(f"{wt}: routing indices need an integer dtype, got {t.dtype}")
            if length is None:
                length = t.shape[0]
            elif t.shape[0] != length:
                raise StoreError(
                    f"{wt}: leading dim {t.shape[0]} differs from the record's T={length} "
                    f"(first tensor {next(iter(record))!r})"
                )
            tensors[name] = _owned_contiguous_cpu(t)
            metas[name] = TensorMeta(tuple(t.shape), dtype)
        assert length is not None
        if length < 1:
            raise StoreError(f"{where}: trajectory has T=0 token positions")
        if (
            not isinstance(prompt_len, int)
            or isinstance(prompt_len, bool)
            or not 0 <= prompt_len <= length
        ):
            raise StoreError(f"{where}: prompt_len {prompt_len!r} not in [0, T={length}]")

        shard = self._shard_name(self._seq)
        for name, t in tensors.items():
            self._buffer[f"{traj_id}/{name}"] = t
            self._buffer_bytes += metas[name].nbytes
        self._trajs[traj_id] = TrajectoryMeta(traj_id, shard, length, prompt_len, metas)
        if self._buffer_bytes >= self.shard_bytes:
            self._flush()

    def close(self) -> Manifest:
        """Flush the last shard and publish the manifest atomically. Idempotent."""
        if self._closed:
            return self.manifest()
        try:
            self._flush()
            m = self.manifest()
            atomic_write_bytes(_manifest_path(self.dir, self.writer_id), _dump_json(m.to_json()))
            self._manifest_written = True
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._published = True
        return m

    def abort(self) -> None:
        """Drop everything this writer wrote; it leaves no manifest and no shard behind.

        A no-op once :meth:`close` has succeeded: a published manifest may already be part of a
        sealed step, and deleting it would break that step for its readers.
        """
        if self._published:
            return
        self._closed = True
        self._buffer.clear()
        if self._manifest_written:
            _manifest_path(self.dir, self.writer_id).unlink(missing_ok=True)
            self._manifest_written = False
        for name in self._shards:
            (self.dir / name).unlink(missing_ok=True)
        self._shards.clear()
        self._trajs.clear()
        if self.dir.is_dir():
            fsync_dir(self.dir)

    def manifest(self) -> Manifest:
        return Manifest(
            step=self.step,
            writer_id=self.writer_id,
            model_signature=self.model_signature,
            policy_version=self.policy_version,
            shards=dict(self._shards),
            trajectories=dict(self._trajs),
        )

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- internals ------------------------------------------------------------------------

    def _shard_name(self, seq: int) -> str:
        return f"{self.writer_id}-{seq:05d}{SHARD_SUFFIX}"

    def _flush(self) -> None:
        if not self._buffer:
            return
        if self._seq > _MAX_SEQ:
            raise StoreError(f"{self._where}: more than {_MAX_SEQ + 1} shards; raise shard_bytes")
        name = self._shard_name(self._seq)
        meta = {"format": _SHARD_FORMAT, "step": str(self.step), "writer_id": self.writer_id}
        # Serialise to memory so that the hash covers exactly the bytes that reach the disk.
        data = safetensors.torch.save(self._buffer, metadata=meta)
        atomic_write_bytes(self.dir / name, data)
        self._shards[name] = ShardMeta(name, len(data), hashlib.sha256(data).hexdigest())
        self._buffer = {}
        self._buffer_bytes = 0
        self._seq += 1


def _owned_contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu").contiguous()  # the device->host copy already owns its memory
    return t.clone(memory_format=torch.contiguous_format)


# --------------------------------------------------------------------------------------------
# Seal
# --------------------------------------------------------------------------------------------


def _read_manifest(sdir: Path, writer_id: str, step: int) -> tuple[Manifest, str]:
    path = _manifest_path(sdir, writer_id)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise StoreError(
            f"step {step}: manifest of writer {writer_id!r} is missing ({path}); "
            f"writers present: {_present_writers(sdir)}"
        ) from None
    where = f"step {step}, writer {writer_id!r} manifest {path}"
    m = Manifest.from_json(_load_json(data, where), where)
    if m.step != step or m.writer_id != writer_id:
        raise StoreError(
            f"{where}: file claims step {m.step}, writer {m.writer_id!r} "
            f"(was it copied from elsewhere?)"
        )
    return m, hashlib.sha256(data).hexdigest()


def _check_agreement(manifests: Sequence[Manifest], step: int) -> None:
    sigs = {m.writer_id: m.model_signature for m in manifests}
    if len(set(sigs.values())) > 1:
        raise StoreError(f"step {step}: writers disagree on model_signature: {sigs}")
    pvs = {m.writer_id: m.policy_version for m in manifests}
    if len(set(pvs.values())) > 1:
        raise StoreError(f"step {step}: writers disagree on policy_version: {pvs}")
    owner: dict[str, str] = {}
    for m in manifests:
        for tid in m.trajectories:
            if tid in owner:
                raise StoreError(
                    f"step {step}: trajectory id {tid!r} written by both writer {owner[tid]!r} "
                    f"and writer {m.writer_id!r}"
                )
            owner[tid] = m.writer_id


def seal_step(root: str | os.PathLike[str], step: int, writers: Sequence[str]) -> Path:
    """Make ``step`` visible to readers, after checking the writers' manifests agree.

    The driver calls this once every rollout worker has returned. It checks that every named
    writer's manifest exists and parses, that all agree on model signature and policy version, that
    no trajectory id appears twice, and that every listed shard exists with the recorded size
    (hashes are left to the reader). Sealing again with the same writers is a no-op.
    """
    sdir = step_dir(root, step)
    if isinstance(writers, str) or not writers:
        raise StoreError(
            f"step {step}: writers must be a non-empty list of writer ids, got {writers!r}"
        )
    for w in writers:
        _check_writer_id(w)
    if len(set(writers)) != len(writers):
        raise StoreError(f"step {step}: duplicate writer ids in {list(writers)}")
    if not sdir.is_dir():
        raise StoreError(f"cannot seal step {step}: directory {sdir} does not exist")

    manifests: list[Manifest] = []
    hashes: dict[str, str] = {}
    for w in writers:
        try:
            m, h = _read_manifest(sdir, w, step)
        except StoreError as e:
            raise StoreError(f"cannot seal step {step}: {e}") from None
        manifests.append(m)
        hashes[w] = h
    try:
        _check_agreement(manifests, step)
    except StoreError as e:
        raise StoreError(f"cannot seal step {step}: {e}") from None
    for m in manifests:
        for s in m.shards.values():
            p = sdir / s.name
            if not p.is_file():
                raise StoreError(
                    f"cannot seal step {step}: writer {m.writer_id!r} shard {p} is missing"
                )
            size = p.stat().st_size
            if size != s.nbytes:
                raise StoreError(
                    f"cannot seal step {step}: writer {m.writer_id!r} shard {p} has {size} bytes, "
                    f"manifest says {s.nbytes}"
                )

    complete = {
        "format": _COMPLETE_FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "model_signature": manifests[0].model_signature,
        "policy_version": manifests[0].policy_version,
        "num_trajectories": sum(len(m.trajectories) for m in manifests),
        "writers": {w: {"manifest_sha256": hashes[w]} for w in writers},
    }
    path = sdir / COMPLETE_NAME
    if path.exists():
        existing = _load_json(path.read_bytes(), f"step {step} seal {path}")
        if existing == json.loads(_dump_json(complete)):
            return path
        raise StoreError(
            f"step {step} is already sealed with different contents ({path}); "
            f"sealed writers: {sorted(existing.get('writers', {}))}, requested: {list(writers)}"
        )
    atomic_write_bytes(path, _dump_json(complete))
    return path


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


@dataclass
class _Located:
    writer_id: str
    meta: TrajectoryMeta


class StoreReader:
    """Reads a sealed step, refusing anything that disagrees with what the caller expects."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        step: int,
        *,
        model_signature: str,
        policy_version: int,
    ) -> None:
        self.step = _check_step(step)
        self.dir = step_dir(root, step)
        self.model_signature = _check_signature(model_signature)
        self.policy_version = _check_policy_version(policy_version)
        if not self.dir.is_dir():
            raise StoreError(f"step {step} does not exist: no directory {self.dir}")
        seal = self.dir / COMPLETE_NAME
        if not seal.is_file():
            raise StoreError(
                f"step {step} is not sealed: writers present: {_present_writers(self.dir)} "
                f"(no {COMPLETE_NAME} in {self.dir})"
            )
        where = f"step {step} seal {seal}"
        c = _load_json(seal.read_bytes(), where)
        if c.get("format") != _COMPLETE_FORMAT or c.get("version") != FORMAT_VERSION:
            raise StoreError(
                f"{where}: unknown format/version {c.get('format')!r}/{c.get('version')!r}"
            )
        if c.get("step") != step:
            raise StoreError(f"{where}: file claims step {c.get('step')!r}")
        self._check_expected(c.get("model_signature"), c.get("policy_version"), where)
        writers = _req(c, "writers", dict, where)
        if not writers:
            raise StoreError(f"{where}: no writers")

        self.manifests: list[Manifest] = []
        self._index: dict[str, _Located] = {}
        for w, info in writers.items():
            try:
                _check_writer_id(w)  # it becomes a path: no traversal out of the step directory
            except StoreError as e:
                raise StoreError(f"{where}: {e}") from None
            m, h = _read_manifest(self.dir, w, step)
            expected = info.get("manifest_sha256") if isinstance(info, dict) else None
            if h != expected:
                raise StoreError(
                    f"step {step}, writer {w!r}: manifest {_manifest_path(self.dir, w)} changed "
                    f"after sealing (sha256 {h}, sealed {expected})"
                )
            self._check_expected(
                m.model_signature, m.policy_version, f"step {step}, writer {w!r} manifest"
            )
            self.manifests.append(m)
        _check_agreement(self.manifests, step)
        for m in self.manifests:
            for tid, t in m.trajectories.items():
                self._index[tid] = _Located(m.writer_id, t)
        self._shard_meta: dict[str, ShardMeta] = {
            s.name: s for m in self.manifests for s in m.shards.values()
        }
        # shard name -> safe_open handle, present only once the shard has been verified
        self._shards: dict[str, Any] = {}

    # -- public ---------------------------------------------------------------------------

    def trajectories(self) -> list[str]:
        """Trajectory ids, in writer order (as sealed) then write order."""
        return list(self._index)

    def length(self, traj_id: str) -> int:
        return self._locate(traj_id).meta.length

    def prompt_len(self, traj_id: str) -> int:
        return self._locate(traj_id).meta.prompt_len

    def tensor_meta(self, traj_id: str) -> dict[str, TensorMeta]:
        return dict(self._locate(traj_id).meta.tensors)

    def get(
        self,
        traj_id: str,
        positions: slice | None = None,
        names: Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Tensors of one trajectory, optionally restricted to token positions and names.

        ``positions`` is a slice ``start:stop`` over the leading (token) dim with
        ``0 <= start <= stop <= T`` (step 1); bounds outside the record are an error.
        """
        loc = self._locate(traj_id)
        meta = loc.meta
        where = f"step {self.step}, writer {loc.writer_id!r}, trajectory {traj_id!r}"
        if names is None:
            wanted = list(meta.tensors)
        else:
            if isinstance(names, str):
                raise StoreError(
                    f"{where}: names must be a list of tensor names, got a str {names!r}"
                )
            wanted = list(names)
            missing = [n for n in wanted if n not in meta.tensors]
            if missing:
                raise StoreError(
                    f"{where}: no tensor(s) {missing} in this record; "
                    f"stored: {sorted(meta.tensors)}"
                )
        start, stop = self._positions(positions, meta.length, where)
        handle = self._open_shard(meta.shard)
        out: dict[str, torch.Tensor] = {}
        for name in wanted:
            tm = meta.tensors[name]
            key = f"{traj_id}/{name}"
            if positions is None:
                t = handle.get_tensor(key)
            else:
                t = handle.get_slice(key)[start:stop]
            expect_shape = (stop - start, *tm.shape[1:])
            if t.dtype != SUPPORTED_DTYPES[tm.dtype] or tuple(t.shape) != expect_shape:
                raise StoreError(
                    f"{where}, tensor {name!r} in shard {self.dir / meta.shard}: read "
                    f"{t.dtype}{list(t.shape)}, expected {tm.dtype}{list(expect_shape)}"
                )
            out[name] = t
        return out

    def batch(
        self,
        traj_ids: Sequence[str],
        lengths: Sequence[int],
        *,
        names: Sequence[str] | None = None,
        trailing_shapes: Mapping[str, Sequence[int]] | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """Full records for a (micro-)batch, checked against what the trainer holds.

        ``lengths[i]`` is the number of token positions the trainer has for ``traj_ids[i]``;
        ``trailing_shapes`` optionally gives, per tensor name, the shape after the token dim the
        trainer expects (e.g. ``{"L03.k.codes": (n_kv, head_dim // 2)}``). Every check runs before
        any data is read, so a bad batch fails fast and whole.
        """
        if isinstance(traj_ids, str) or len(traj_ids) != len(lengths):
            raise StoreError(
                f"step {self.step}: batch needs one length per trajectory, got "
                f"{len(traj_ids)} ids and {len(lengths)} lengths"
            )
        for tid, n in zip(traj_ids, lengths):
            loc = self._locate(tid)
            if n != loc.meta.length:
                raise StoreError(
                    f"step {self.step}, writer {loc.writer_id!r}, trajectory {tid!r}: batch "
                    f"expects length {n}, the store holds length {loc.meta.length}"
                )
            for name, tail in (trailing_shapes or {}).items():
                tm = loc.meta.tensors.get(name)
                if tm is None:
                    raise StoreError(
                        f"step {self.step}, writer {loc.writer_id!r}, trajectory {tid!r}: "
                        f"no tensor {name!r} in this record"
                    )
                if tuple(tail) != tm.shape[1:]:
                    raise StoreError(
                        f"step {self.step}, writer {loc.writer_id!r}, trajectory {tid!r}, tensor "
                        f"{name!r}: batch expects trailing shape {list(tail)}, the store holds "
                        f"{list(tm.shape[1:])}"
                    )
        return [self.get(tid, names=names) for tid in traj_ids]

    def verify(self) -> None:
        """Verify every shard now (size, sha256, header) instead of on first use."""
        for name in self._shard_meta:
            self._open_shard(name)

    def close(self) -> None:
        self._shards.clear()  # drops the mmapped safe_open handles

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    # -- internals ------------------------------------------------------------------------

    def _check_expected(self, sig: object, pv: object, where: str) -> None:
        if sig != self.model_signature:
            raise StoreError(
                f"{where}: model_signature mismatch: store has {sig!r}, reader expects "
                f"{self.model_signature!r}"
            )
        if pv != self.policy_version or isinstance(pv, bool):
            raise StoreError(
                f"{where}: policy_version mismatch: store has {pv!r}, reader expects "
                f"{self.policy_version!r}"
            )

    def _locate(self, traj_id: str) -> _Located:
        loc = self._index.get(traj_id) if isinstance(traj_id, str) else None
        if loc is None:
            raise StoreError(
                f"step {self.step}: unknown trajectory {traj_id!r} "
                f"({len(self._index)} trajectories stored in {self.dir})"
            )
        return loc

    @staticmethod
    def _positions(positions: slice | None, length: int, where: str) -> tuple[int, int]:
        if positions is None:
            return 0, length
        if not isinstance(positions, slice):
            raise StoreError(f"{where}: positions must be a slice or None, got {positions!r}")
        start = 0 if positions.start is None else positions.start
        stop = length if positions.stop is None else positions.stop
        ok_types = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop))
        if (
            not ok_types
            or positions.step not in (None, 1)
            or not 0 <= start <= stop <= length
        ):
            raise StoreError(
                f"{where}: positions {positions} outside the record's 0..{length} "
                "(need 0 <= start <= stop <= T, step 1)"
            )
        return start, stop

    def _open_shard(self, name: str) -> Any:
        handle = self._shards.get(name)
        if handle is not None:
            return handle
        sm = self._shard_meta[name]
        path = self.dir / name
        where = f"step {self.step}, shard {path}"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise StoreError(f"{where}: shard file is missing") from None
        if size < sm.nbytes:
            raise StoreError(
                f"{where}: shard is truncated: {size} bytes on disk, manifest says {sm.nbytes}"
            )
        if size > sm.nbytes:
            raise StoreError(
                f"{where}: shard has {size} bytes on disk, manifest says {sm.nbytes}"
            )
        sha = _sha256_file(path)
        if sha != sm.sha256:
            raise StoreError(
                f"{where}: sha256 mismatch (corrupted shard): {sha}, manifest says {sm.sha256}"
            )
        try:
            handle = safe_open(str(path), framework="pt")
            keys = set(handle.keys())
            header_meta = handle.metadata() or {}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise StoreError(f"{where}: cannot open as safetensors ({e})") from e
        writer = name[: -len(f"-00000{SHARD_SUFFIX}")]
        if header_meta.get("step") != str(self.step) or header_meta.get("writer_id") != writer:
            raise StoreError(
                f"{where}: shard header names step/writer {header_meta}, "
                f"expected {self.step}/{writer!r}"
            )
        expected: dict[str, TensorMeta] = {
            f"{tid}/{n}": tm
            for tid, loc in self._index.items()
            if loc.meta.shard == name
            for n, tm in loc.meta.tensors.items()
        }
        if keys != set(expected):
            extra, missing = sorted(keys - set(expected)), sorted(set(expected) - keys)
            raise StoreError(
                f"{where}: keys disagree with the manifest: "
                f"missing {missing[:5]}, extra {extra[:5]}"
            )
        for key, tm in expected.items():
            sl = handle.get_slice(key)
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if shape != tm.shape or dtype != _SAFETENSORS_DTYPE[tm.dtype]:
                raise StoreError(
                    f"{where}, key {key!r}: {dtype}{list(shape)} in shard, manifest says "
                    f"{tm.dtype}{list(tm.shape)}"
                )
        self._shards[name] = handle
        return handle


# --------------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------------


def _as_manifests(source: object) -> list[Manifest]:
    if isinstance(source, StoreReader):
        return list(source.manifests)
    if isinstance(source, Manifest):
        return [source]
    if isinstance(source, Mapping):
        return [Manifest.from_json(source)]
    if isinstance(source, Iterable) and not isinstance(source, (str, bytes)):
        out: list[Manifest] = []
        for s in source:
            out.extend(_as_manifests(s))
        return out
    raise StoreError(f"bytes_per_token: cannot account for a {type(source).__name__}")


def bytes_per_token(
    source: StoreReader | Manifest | Mapping[str, Any] | Iterable[Manifest | Mapping[str, Any]],
    generated_tokens: int | None = None,
) -> dict[str, Any]:
    """Record bytes per generated token, from manifest metadata only (shapes x dtype sizes).

    Returns ``total_bytes``, ``guidance_bytes``, ``routing_bytes``, ``generated_tokens`` and, in
    bytes per generated token: ``total``, ``guidance``, ``routing``, ``by_site`` (guidance by site),
    ``by_layer`` (guidance by layer), ``routing_by_layer``. ``sum(by_site) == sum(by_layer) ==
    guidance`` and ``guidance + routing == total``. ``generated_tokens`` defaults to
    ``sum(T - prompt_len)`` over the trajectories.
    """
    manifests = _as_manifests(source)
    site_bytes: dict[str, int] = {}
    layer_bytes: dict[int, int] = {}
    routing_layer_bytes: dict[int, int] = {}
    gen = 0
    for m in manifests:
        for t in m.trajectories.values():
            gen += t.generated_tokens
            for name, tm in t.tensors.items():
                layer, site, _ = parse_name(name)
                if site == ROUTING:
                    routing_layer_bytes[layer] = routing_layer_bytes.get(layer, 0) + tm.nbytes
                else:
                    site_bytes[site] = site_bytes.get(site, 0) + tm.nbytes
                    layer_bytes[layer] = layer_bytes.get(layer, 0) + tm.nbytes
    if generated_tokens is not None:
        if not isinstance(generated_tokens, int) or isinstance(generated_tokens, bool):
            raise StoreError(f"generated_tokens must be an int, got {generated_tokens!r}")
        gen = generated_tokens
    if gen <= 0:
        raise StoreError(f"bytes_per_token: {gen} generated tokens, cannot divide")
    guidance = sum(site_bytes.values())
    routing = sum(routing_layer_bytes.values())
    return {
        "generated_tokens": gen,
        "total_bytes": guidance + routing,
        "guidance_bytes": guidance,
        "routing_bytes": routing,
        "total": (guidance + routing) / gen,
        "guidance": guidance / gen,
        "routing": routing / gen,
        "by_site": {s: b / gen for s, b in sorted(site_bytes.items())},
        "by_layer": {layer: b / gen for layer, b in sorted(layer_bytes.items())},
        "routing_by_layer": {layer: b / gen for layer, b in sorted(routing_layer_bytes.items())},
    }
