"""The guidance store: rollout records that cross process (and machine) boundaries.

Rollout workers (writers) record, per trajectory, the TRACE guidance of every guided site and the
routed expert indices; the trainer (reader) reads them back for its training batch. This module is
plain files on a (possibly shared) file system: safetensors shards plus JSON manifests, no pickle
anywhere.

Layout of one RL step::

    root/step-00000012/
        w0-00000.safetensors      # shard: keys "{traj_id}/{tensor_name}", plain safetensors
        w0-00001.safetensors
        w0.manifest.json          # per writer, published last, never replaced
        w1-00000.safetensors
        w1.lock                   # only while writer w1 is writing
        w1.manifest.json
        COMPLETE.json             # seal, written by the driver once all writers returned

Record
    One trajectory's record is ``dict[str, Tensor]``; every tensor has leading dim ``T`` = number of
    token positions (prompt + completion). Names are ``L{layer:02d}.{site}.{field}`` for guidance
    (site in :class:`~tracefp4.guidance.names.Site`) and ``L{layer:02d}.routing`` for the routed expert
    indices (routing replay travels in the same store; it is just one more tensor).

Decisions (and why)
    * **Visibility without replacement.** Every shard, manifest and seal is written to a hidden
      temp file in the step folder, fsynced, then published with ``link(tmp, name)``, which fails
      if ``name`` exists, and the folder fsynced. A reader therefore sees either no file or a
      complete one, and no published file is ever replaced by a later write. A writer's manifest
      is published after all of its shards; ``COMPLETE.json`` by :func:`seal_step` after all
      manifests. Readers refuse a step without ``COMPLETE.json``, so a half-written step is
      never visible, even if a worker died after some manifests landed. (The file system must
      support hard links; local file systems, NFS and Lustre do.)
    * **One writer per name.** Writers of one step do not coordinate: each only creates files
      whose names start with its own ``writer_id`` (shards ``{writer_id}-{seq:05d}.safetensors``,
      its manifest, its lock and its temp files). A second writer of the *same* name is refused:
      at creation, by an exclusive lock file ``{writer_id}.lock`` (``O_CREAT|O_EXCL``, holding
      pid, host and a random token), and again before every publish, which checks that the lock
      still holds this writer's token and that the step folder is still the one it opened; the
      manifest's ``link`` refuses to replace a manifest that appeared meanwhile. The lock is
      removed once the manifest is published (a finished writer is then refused because its
      manifest exists). The shard sequence number is capped at 99999 so the fixed-width suffix
      makes the writer id recoverable from a shard name.
    * **Checksums, hierarchically, verified on the bytes that are used.** The seal records the
      sha256 of each manifest; a manifest records, per shard, its size and sha256 and the sha256
      of its safetensors header (the 8-byte length and the JSON header), and, per trajectory, the
      sha256 of its tensor bytes (each tensor's data range, concatenated in sorted tensor-name
      order). The hashes are computed over the exact bytes written (``safetensors.torch.save`` to
      memory, then one write). A reader opens each shard once (``O_NOFOLLOW``), keeps the file
      descriptor, checks the size (so a truncation is reported as a truncation), reads the header
      with ``pread``, checks its hash and that it agrees with the manifest (keys, dtypes, shapes,
      contiguous data offsets); :meth:`StoreReader.get` reads exactly that trajectory's byte
      ranges from the same descriptor (``preadv``), checks their hash and builds the tensors from
      those verified bytes. Every byte a reader returns was verified after it was read, from the
      file whose header it verified: a file swapped in by path after opening is never read, and a
      byte changed in place is caught by the trajectory hash. :meth:`StoreReader.verify` hashes
      whole shards through the same descriptors.
    * **Rank-local reads.** Because trajectories are verified individually, a reader reads only
      the shard headers and the trajectories it is asked for; ``StoreReader.bytes_read`` counts
      those bytes (plus whole shards hashed by ``verify()``), to be reported per rank beside the
      step's size (:func:`step_bytes`) or its payload (``bytes_per_token(...)['total_bytes']``).
    * **Strictness.** Every disagreement is a :class:`StoreError` that names what and where (path,
      step, writer, trajectory id, tensor name): unknown trajectory, length, trailing shape, dtype,
      model signature, policy version, out-of-range position slice, duplicate trajectory id,
      duplicate JSON keys, malformed JSON of any kind (including nesting too deep to decode), a
      manifest or seal of another format version. Nothing is ever clipped, padded or skipped
      silently.
    * **No links followed.** A step folder, shard, manifest, seal or lock that is a symbolic link
      (or not a regular file) is an error, never followed: step folders are opened with
      ``O_DIRECTORY|O_NOFOLLOW`` and every file relative to that descriptor with ``O_NOFOLLOW``.
      Only ``root`` itself is taken as given.
    * **One trajectory, one shard.** A record is never split over shards, so reading a trajectory
      touches one file. A record larger than ``shard_bytes`` gets a shard of its own.
    * **Aborted and dead writers.** If the writer's ``with`` block raises, the manifest is not
      written and the shards it already published are removed, with its lock. A writer killed
      outright (SIGKILL, node loss) leaves temp files, unreferenced shards and its lock behind;
      readers never open them (they only open shards listed in a sealed manifest), and
      :func:`seal_step` removes everything in the step folder that is not a sealed writer's
      manifest or shard or the seal. Its stale lock refuses a retry under the same name in that
      step; :func:`discard_step` removes a whole step (sealed or half-written) so that a run
      resumed after a crash can redo it.
    * **Extra manifests.** :func:`seal_step` seals exactly the writers the driver names; the
      files of any other writer (e.g. a worker that was given up on but finished late) are
      removed when sealing, and that writer's ``close()`` fails. The driver, not the file
      system, decides what a step contains.
    * **Discarding.** :func:`discard_step` renames the step folder to a hidden tombstone name
      inside ``root`` (atomic: the step is gone for everyone at once), fsyncs ``root``, then
      deletes the tombstone without following links; an interrupted discard is finished by the
      next call. A writer still writing into a discarded step fails at its next publish.
    * **Canonical names.** Layer numbers must be written exactly as ``{layer:02d}`` so that two
      spellings (``L7`` / ``L07`` / ``L007``) can never alias the same layer.
    * **Dtypes.** All dtypes safetensors round-trips bit-exactly: bool, (u)int8..64, float16,
      bfloat16, float32, float64, float8_e4m3fn, float8_e5m2, float8_e8m0fnu. ``float4_e2m1fn_x2``
      is refused: safetensors 0.8 writes it with the unpacked element count in the shape and cannot
      load it back. Store packed FP4 codes as ``uint8`` (``t.view(torch.uint8)``), which is the same
      bytes. Routing indices must have an integer dtype. Data is little-endian (safetensors'
      byte order); readers on big-endian hosts are refused.
    * **Versions.** Manifests and seals carry :data:`FORMAT_VERSION` (2: header and per-trajectory
      hashes). Other versions, including version 1 (whole-shard hashes only), are refused with a
      message saying so; such a step has to be written again.
    * **Positions.** :meth:`StoreReader.get` takes a step-1 slice with ``0 <= start <= stop <= T``;
      negative or out-of-range bounds are an error instead of Python's silent clipping. The whole
      trajectory is read (its hash covers all of it) and then sliced.
    * **Accounting** (:func:`bytes_per_token`) counts tensor payload bytes (numel x itemsize, from
      the manifest metadata; safetensors headers and file-system overhead excluded) over all
      recorded positions, divided by the number of *generated* tokens (``T - prompt_len``
      summed), which is the unit the paper's bytes-per-token figures use. :func:`step_bytes` is
      the size of the step's shard files, headers included.
    * A reader holds one open file descriptor per shard it has used (and one for the step folder)
      until :meth:`StoreReader.close`; it is not thread-safe: use one reader per thread or
      process.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import safetensors.torch
import torch

from tracefp4.guidance import names
from tracefp4.files import fsync_dir

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
    "discard_step",
    "StoreReader",
    "bytes_per_token",
    "step_bytes",
]

FORMAT_VERSION = 2
ROUTING = names.ROUTING
MANIFEST_SUFFIX = ".manifest.json"
SHARD_SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
COMPLETE_NAME = "COMPLETE.json"
_MANIFEST_FORMAT = "tracefp4.store.manifest"
_COMPLETE_FORMAT = "tracefp4.store.complete"
_SHARD_FORMAT = "tracefp4.store.shard"
_LOCK_FORMAT = "tracefp4.store.lock"
_MAX_SEQ = 99_999  # {seq:05d} must stay five digits, see module docstring
_HASH_CHUNK = 1 << 20
_IOV_MAX = 1024
_TOMBSTONE_TAG = ".discarded-"
_SHA_RE = re.compile(r"[0-9a-f]{64}")

_O_NOFOLLOW = os.O_NOFOLLOW
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO planted in the step folder must not hang (the type check follows).
_O_READ = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | os.O_NONBLOCK
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC

_TRAJ_ID_RE = re.compile(r"[A-Za-z0-9_.:-]+")
# Writer ids become file names: no ':' (not portable) and no leading '.' (temp files are hidden).
_WRITER_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")

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
    """``"L07.k.scales"`` -> ``(7, "k", "scales")``; ``"L07.routing"`` -> ``(7, "routing", "")``
    (:func:`tracefp4.guidance.names.parse_name`, failing as a :class:`StoreError`)."""
    if not isinstance(name, str):
        raise StoreError(f"tensor name must be a str, got {type(name).__name__}: {name!r}")
    try:
        return names.parse_name(name)
    except ValueError as e:
        raise StoreError(str(e)) from None


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



def _manifest_name(writer_id: str) -> str:
    return f"{writer_id}{MANIFEST_SUFFIX}"


def _lock_name(writer_id: str) -> str:
    return f"{writer_id}{LOCK_SUFFIX}"


def _present_writers(dfd: int) -> list[str]:
    try:
        names = os.listdir(dfd)
    except OSError:
        return []
    return sorted(n[: -len(MANIFEST_SUFFIX)] for n in names if n.endswith(MANIFEST_SUFFIX))


# --------------------------------------------------------------------------------------------
# File primitives: everything relative to an open step-folder descriptor, no link followed
# --------------------------------------------------------------------------------------------


def _file_id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _open_step_dir(sdir: Path, where: str) -> int:
    """Open a step folder; FileNotFoundError if absent, StoreError if a link or not a folder."""
    try:
        return os.open(sdir, _O_DIR)
    except FileNotFoundError:
        raise
    except OSError as e:
        try:
            st = os.lstat(sdir)
        except FileNotFoundError:
            raise e from None
        if stat.S_ISLNK(st.st_mode):
            raise StoreError(
                f"{where}: {sdir} is a symbolic link; the store never follows links"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise StoreError(f"{where}: {sdir} is not a directory") from None
        raise StoreError(f"{where}: cannot open {sdir} ({e})") from None


def _open_nofollow(dfd: int, name: str, path: Path) -> int:
    """Open ``name`` in folder ``dfd`` for reading: a regular file, never through a link.

    Raises FileNotFoundError if there is no such entry, StoreError for anything else amiss.
    """
    try:
        fd = os.open(name, _O_READ, dir_fd=dfd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StoreError(f"{path} is a symbolic link; the store never follows links") from None
        raise StoreError(f"cannot open {path} ({e})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreError(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_file(dfd: int, name: str, path: Path) -> bytes:
    fd = _open_nofollow(dfd, name, path)
    try:
        chunks = []
        while chunk := os.read(fd, _HASH_CHUNK):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _preadv_exact(fd: int, buffers: Sequence[bytearray], offset: int, where: str) -> int:
    """Fill ``buffers`` with the file's bytes from ``offset`` on (one contiguous range)."""
    views = [memoryview(b) for b in buffers if len(b)]
    total = sum(len(v) for v in views)
    i = 0
    while i < len(views):
        n = os.preadv(fd, views[i : i + _IOV_MAX], offset)
        if n <= 0:
            raise StoreError(f"{where}: unexpected end of file at byte {offset} (shard shrank)")
        offset += n
        while n > 0:
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
    return total


def _unlink_quiet(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass


def _write_temp(dfd: int, name: str, data: bytes) -> tuple[str, tuple[int, int]]:
    """Write ``data`` durably to a new hidden temp file beside ``name``: (temp name, file id)."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, _O_CREATE, 0o644, dir_fd=dfd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            fid = _file_id(os.fstat(fd))
        finally:
            os.close(fd)
    except BaseException:
        _unlink_quiet(dfd, tmp)
        raise
    return tmp, fid


def _publish_new(dfd: int, tmp: str, name: str) -> None:
    """Give the temp file its final name; FileExistsError if ``name`` exists (never replaced)."""
    try:
        os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
    finally:
        _unlink_quiet(dfd, tmp)
        os.fsync(dfd)


def _remove_entry(dfd: int, name: str) -> None:
    """Remove a file, link or folder tree inside ``dfd`` without following any link."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        # The fd-based rmtree opens each level with O_NOFOLLOW and checks it is the folder it
        # lstat-ed, so a link swapped in is never followed.
        shutil.rmtree(name, dir_fd=dfd)
    else:
        _unlink_quiet(dfd, name)


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
    except Exception as e:  # noqa: BLE001 - decoding errors, RecursionError on deep nesting, ...
        raise StoreError(f"{where}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise StoreError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _dump_json(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode("utf-8")


def _version_error(where: str, what: str, version: object) -> StoreError:
    hint = ""
    if version == 1:
        hint = (
            " (version 1 has no per-trajectory checksums and cannot be read safely; "
            "write the step again with this code, e.g. discard_step() and roll out again)"
        )
    return StoreError(
        f"{where}: {what} format version {version!r}, this code reads only version "
        f"{FORMAT_VERSION}{hint}"
    )


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


def _req_sha(obj: Mapping[str, Any], key: str, where: str) -> str:
    sha = _req(obj, key, str, where)
    if _SHA_RE.fullmatch(sha) is None:
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
        return n * _ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class TrajectoryMeta:
    traj_id: str
    shard: str
    length: int
    prompt_len: int
    tensors: dict[str, TensorMeta]
    #: sha256 of the trajectory's tensor bytes, concatenated in sorted tensor-name order
    sha256: str = ""

    @property
    def generated_tokens(self) -> int:
        return self.length - self.prompt_len

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


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
            raise _version_error(where, "manifest", version)
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
            sha = _req_sha(s, "sha256", w)
            header_bytes = _req(s, "header_bytes", int, w)
            header_sha = _req_sha(s, "header_sha256", w)
            if not 8 <= header_bytes <= nbytes:
                raise StoreError(
                    f"{w}: invalid size {nbytes!r} or header size {header_bytes!r} "
                    "(need 8 <= header_bytes <= bytes)"
                )
            shards[name] = ShardMeta(name, nbytes, sha, header_bytes, header_sha)

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
            sha = _req_sha(t, "sha256", w)
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
            trajs[tid] = TrajectoryMeta(tid, shard, length, prompt_len, tensors, sha)
        return cls(step, writer_id, sig, pv, shards, trajs, version)


def _shard_header(data: bytes | bytearray | memoryview, where: str) -> tuple[int, dict[str, Any]]:
    """(header bytes incl. the 8-byte length, parsed JSON header) of safetensors bytes."""
    if len(data) < 8:
        raise StoreError(f"{where}: shorter than a safetensors length prefix")
    n = int.from_bytes(bytes(data[:8]), "little")
    if n > len(data) - 8:
        raise StoreError(f"{where}: safetensors header length {n} exceeds the file")
    return 8 + n, _load_json(bytes(data[8 : 8 + n]), f"{where}: safetensors header")


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------


class StoreWriter:
    """Writes one rollout worker's records for one step. Use as a context manager.

    Writers of different names never coordinate: each only creates files named after its own
    ``writer_id``. A second writer of the same name for the same step is refused (lock file at
    creation, ownership check and no-replace publish at close). Nothing this writer wrote becomes
    visible before :meth:`close` has published the manifest, and the step as a whole only after
    :func:`seal_step`.
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
        self._dfd = -1  # first, so that __del__ works whatever fails below
        self.step = _check_step(step)
        self.writer_id = _check_writer_id(writer_id)
        self.model_signature = _check_signature(model_signature)
        self.policy_version = _check_policy_version(policy_version)
        if not isinstance(shard_bytes, int) or isinstance(shard_bytes, bool) or shard_bytes < 1:
            raise StoreError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
        self.shard_bytes = shard_bytes
        self.root = Path(root)
        self.dir = step_dir(root, step)
        self._where = f"writer {writer_id!r}, step {step} ({self.dir})"
        self._token = secrets.token_hex(16)

        self._trajs: dict[str, TrajectoryMeta] = {}
        self._pending: dict[str, TrajectoryMeta] = {}  # buffered, not yet in a published shard
        self._shards: dict[str, ShardMeta] = {}
        self._published_ids: dict[str, tuple[int, int]] = {}  # file name -> (dev, inode)
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._seq = 0
        self._closed = False
        self._locked = False
        self._published = False

        self.root.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(self.dir)
            fsync_dir(self.root)
        except FileExistsError:
            pass
        self._dfd = _open_step_dir(self.dir, self._where)
        try:
            self._dir_id = _file_id(os.fstat(self._dfd))
            self._refuse_if_taken()
            self._take_lock()
            # A writer of this name may have published and released its lock between the check
            # above and taking the lock: check again now that no other writer can start.
            self._refuse_if_taken()
        except BaseException:
            self._release_lock()
            self._close_dir()
            raise

    # -- public ---------------------------------------------------------------------------

    def add(self, traj_id: str, record: Mapping[str, torch.Tensor], *, prompt_len: int) -> None:
        """Buffer one trajectory's record; flush a shard once ``shard_bytes`` are buffered.

        Tensors are copied (to contiguous CPU memory), so the caller may reuse its buffers.
        """
        if self._closed:
            raise StoreError(f"{self._where}: add() after close()")
        _check_traj_id(traj_id)
        where = f"{self._where}, trajectory {traj_id!r}"
        if traj_id in self._trajs or traj_id in self._pending:
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

        for name, t in tensors.items():
            self._buffer[f"{traj_id}/{name}"] = t
            self._buffer_bytes += metas[name].nbytes
        self._pending[traj_id] = TrajectoryMeta(
            traj_id, self._shard_name(self._seq), length, prompt_len, metas
        )
        if self._buffer_bytes >= self.shard_bytes:
            self._flush()

    def close(self) -> Manifest:
        """Flush the last shard and publish the manifest (never replacing one). Idempotent."""
        if self._closed:
            return self.manifest()
        try:
            self._flush()
            m = self.manifest()
            self._publish(_manifest_name(self.writer_id), _dump_json(m.to_json()), "manifest")
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._published = True
        self._release_lock()
        self._close_dir()
        return m

    def abort(self) -> None:
        """Drop everything this writer wrote; it leaves no manifest, shard or lock behind.

        A no-op once :meth:`close` has succeeded: a published manifest may already be part of a
        sealed step, and deleting it would break that step for its readers. If this writer no
        longer owns its name in the step (its lock was removed by :func:`seal_step` or the step
        was discarded), nothing is deleted: the files there may belong to another writer.
        """
        if self._published:
            return
        self._closed = True
        self._buffer.clear()
        self._buffer_bytes = 0
        if self._dfd >= 0 and self._owner_problem() is None:
            for name, fid in self._published_ids.items():
                try:
                    st = os.stat(name, dir_fd=self._dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if _file_id(st) == fid:
                    _unlink_quiet(self._dfd, name)
            self._release_lock()
            os.fsync(self._dfd)
        self._published_ids.clear()
        self._shards.clear()
        self._trajs.clear()
        self._pending.clear()
        self._close_dir()

    def manifest(self) -> Manifest:
        """The manifest of what this writer has published so far (flushed shards only)."""
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

    def __del__(self) -> None:
        # Only the descriptor: a writer dropped without close() is like a dead one (its lock and
        # files stay until the step is sealed or discarded).
        try:
            self._close_dir()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- internals ------------------------------------------------------------------------

    def _shard_name(self, seq: int) -> str:
        return f"{self.writer_id}-{seq:05d}{SHARD_SUFFIX}"

    def _close_dir(self) -> None:
        if self._dfd >= 0:
            fd, self._dfd = self._dfd, -1
            os.close(fd)

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self._dfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def _refuse_if_taken(self) -> None:
        if self._exists(COMPLETE_NAME):
            raise StoreError(
                f"{self._where}: step is already sealed, cannot add a writer "
                "(discard_step() removes the step so that it can be redone)"
            )
        if self._exists(_manifest_name(self.writer_id)):
            raise StoreError(
                f"{self._where}: a manifest for this writer already exists "
                f"({self.dir / _manifest_name(self.writer_id)}); refusing to overwrite a "
                "finished writer"
            )

    def _take_lock(self) -> None:
        name = _lock_name(self.writer_id)
        info = {
            "format": _LOCK_FORMAT,
            "writer_id": self.writer_id,
            "step": self.step,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "token": self._token,
        }
        try:
            fd = os.open(name, _O_CREATE, 0o644, dir_fd=self._dfd)
        except FileExistsError:
            raise StoreError(
                f"{self._where}: another writer of this name holds the lock "
                f"{self.dir / name} ({self._describe_lock()}); a second writer of the same name "
                "for one step is refused. If that writer is dead, seal the step without it or "
                "discard the step (discard_step)"
            ) from None
        self._locked = True
        try:
            data = _dump_json(info)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.fsync(self._dfd)

    def _read_lock(self) -> dict[str, Any] | None:
        name = _lock_name(self.writer_id)
        try:
            return _load_json(_read_file(self._dfd, name, self.dir / name), "lock")
        except (FileNotFoundError, StoreError):
            return None

    def _describe_lock(self) -> str:
        info = self._read_lock()
        if info is None:
            return "unreadable lock file"
        return f"pid {info.get('pid')!r} on host {info.get('host')!r}"

    def _owner_problem(self) -> str | None:
        """Why this writer no longer owns its name in the step, or None if it does."""
        try:
            st = os.stat(self.dir, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is None or _file_id(st) != self._dir_id:
            return "the step folder was discarded or replaced while this writer was writing"
        if self._exists(COMPLETE_NAME):
            return "the step was sealed while this writer was writing (without it)"
        info = self._read_lock()
        if info is None or info.get("token") != self._token:
            holder = "no lock" if info is None else self._describe_lock()
            return f"this writer lost its lock {self.dir / _lock_name(self.writer_id)} ({holder})"
        return None

    def _check_owner(self, name: str, what: str) -> None:
        problem = self._owner_problem()
        if problem is not None:
            raise StoreError(f"{self._where}: refusing to publish {what} {name}: {problem}")

    def _release_lock(self) -> None:
        if not self._locked or self._dfd < 0:
            return
        self._locked = False
        info = self._read_lock()
        if info is not None and info.get("token") == self._token:
            _unlink_quiet(self._dfd, _lock_name(self.writer_id))
            os.fsync(self._dfd)

    def _publish(self, name: str, data: bytes, what: str) -> None:
        # Ownership is checked before writing (a discarded folder may be gone) and again right
        # before the link that makes the file visible.
        self._check_owner(name, what)
        tmp, fid = _write_temp(self._dfd, name, data)
        try:
            self._check_owner(name, what)
        except BaseException:
            _unlink_quiet(self._dfd, tmp)
            raise
        # Known before the link, so that abort() can remove it whatever fails after the link; a
        # file of that name that is not this inode is never removed.
        self._published_ids[name] = fid
        try:
            _publish_new(self._dfd, tmp, name)
        except FileExistsError:
            raise StoreError(
                f"{self._where}: {what} {self.dir / name} already exists (another writer of "
                "this name, or one that died?); refusing to replace it"
            ) from None

    def _flush(self) -> None:
        if not self._buffer:
            return
        if self._seq > _MAX_SEQ:
            raise StoreError(f"{self._where}: more than {_MAX_SEQ + 1} shards; raise shard_bytes")
        name = self._shard_name(self._seq)
        meta = {"format": _SHARD_FORMAT, "step": str(self.step), "writer_id": self.writer_id}
        # Serialise to memory so that the hashes cover exactly the bytes that reach the disk.
        data = safetensors.torch.save(self._buffer, metadata=meta)
        header_bytes, header = _shard_header(data, f"{self._where}, shard {name}")
        view = memoryview(data)
        trajs: dict[str, TrajectoryMeta] = {}
        for tid, t in self._pending.items():
            h = hashlib.sha256()
            for tname in sorted(t.tensors):
                begin, end = header[f"{tid}/{tname}"]["data_offsets"]
                h.update(view[header_bytes + begin : header_bytes + end])
            trajs[tid] = TrajectoryMeta(
                tid, name, t.length, t.prompt_len, t.tensors, h.hexdigest()
            )
        self._publish(name, data, "shard")
        self._shards[name] = ShardMeta(
            name,
            len(data),
            hashlib.sha256(view).hexdigest(),
            header_bytes,
            hashlib.sha256(view[:header_bytes]).hexdigest(),
        )
        self._trajs.update(trajs)
        self._pending = {}
        self._buffer = {}
        self._buffer_bytes = 0
        self._seq += 1


def _owned_contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu").contiguous()  # the device->host copy already owns its memory
    return t.clone(memory_format=torch.contiguous_format)


# --------------------------------------------------------------------------------------------
# Seal and discard
# --------------------------------------------------------------------------------------------


def _read_manifest(dfd: int, sdir: Path, writer_id: str, step: int) -> tuple[Manifest, str]:
    name = _manifest_name(writer_id)
    path = sdir / name
    where = f"step {step}, writer {writer_id!r} manifest {path}"
    try:
        data = _read_file(dfd, name, path)
    except FileNotFoundError:
        raise StoreError(
            f"step {step}: manifest of writer {writer_id!r} is missing ({path}); "
            f"writers present: {_present_writers(dfd)}"
        ) from None
    except StoreError as e:
        raise StoreError(f"{where}: {e}") from None
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
    no trajectory id appears twice, and that every listed shard exists as a regular file with the
    recorded size (hashes are left to the reader). It then publishes ``COMPLETE.json`` and removes
    everything else in the step folder: temp files, lock files, shards no sealed manifest lists,
    manifests (and files) of writers it was not given. Sealing again with the same writers is a
    no-op (it finishes an interrupted clean-up); with other writers it is an error.
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
    try:
        dfd = _open_step_dir(sdir, f"cannot seal step {step}")
    except FileNotFoundError:
        raise StoreError(f"cannot seal step {step}: directory {sdir} does not exist") from None
    try:
        manifests: list[Manifest] = []
        hashes: dict[str, str] = {}
        for w in writers:
            try:
                m, h = _read_manifest(dfd, sdir, w, step)
            except StoreError as e:
                raise StoreError(f"cannot seal step {step}: {e}") from None
            manifests.append(m)
            hashes[w] = h
        try:
            _check_agreement(manifests, step)
        except StoreError as e:
            raise StoreError(f"cannot seal step {step}: {e}") from None
        keep = {COMPLETE_NAME}
        for m in manifests:
            keep.add(_manifest_name(m.writer_id))
            for s in m.shards.values():
                keep.add(s.name)
                p = sdir / s.name
                what = f"cannot seal step {step}: writer {m.writer_id!r} shard {p}"
                try:
                    st = os.stat(s.name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    raise StoreError(f"{what} is missing") from None
                if stat.S_ISLNK(st.st_mode):
                    raise StoreError(f"{what} is a symbolic link; the store never follows links")
                if not stat.S_ISREG(st.st_mode):
                    raise StoreError(f"{what} is not a regular file")
                if st.st_size != s.nbytes:
                    raise StoreError(f"{what} has {st.st_size} bytes, manifest says {s.nbytes}")

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
        data = _dump_json(complete)
        tmp, _ = _write_temp(dfd, COMPLETE_NAME, data)
        try:
            _publish_new(dfd, tmp, COMPLETE_NAME)
        except FileExistsError:
            where = f"step {step} seal {path}"
            existing = _load_json(_read_file(dfd, COMPLETE_NAME, path), where)
            if existing != json.loads(data):
                raise StoreError(
                    f"step {step} is already sealed with different contents ({path}); "
                    f"sealed writers: {sorted(existing.get('writers', {}))}, "
                    f"requested: {list(writers)}"
                ) from None
        # What no sealed manifest references can never be read: remove it (files of dead or
        # unnamed writers, temp files, locks).
        for name in os.listdir(dfd):
            if name not in keep:
                _remove_entry(dfd, name)
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


def discard_step(root: str | os.PathLike[str], step: int) -> bool:
    """Remove step ``step`` (sealed or not) so that it can be written again; idempotent.

    The step folder is renamed to a hidden tombstone name inside ``root`` (so it disappears
    atomically for every reader and writer), ``root`` is fsynced, then the tombstone is deleted
    without following any link (a step "folder" that is a symbolic link is removed as a link; its
    target is not touched). Tombstones of an earlier, interrupted discard of this step are deleted
    too. Returns whether a step folder was there. A writer still writing into the discarded step
    fails at its next publish; a reader that already opened it keeps reading its open files.
    """
    sdir = step_dir(root, step)
    try:
        rfd = os.open(Path(root), os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        found = True
        tomb_prefix = f".{sdir.name}{_TOMBSTONE_TAG}"
        try:
            # rename() moves a link itself, never its target
            os.rename(sdir.name, tomb_prefix + secrets.token_hex(8), src_dir_fd=rfd, dst_dir_fd=rfd)
        except FileNotFoundError:
            found = False
        os.fsync(rfd)
        for name in os.listdir(rfd):
            if name.startswith(tomb_prefix):
                _remove_entry(rfd, name)
        os.fsync(rfd)
    finally:
        os.close(rfd)
    return found


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


@dataclass
class _Located:
    writer_id: str
    meta: TrajectoryMeta


@dataclass
class _OpenShard:
    """A shard whose header was verified: its descriptor and each key's absolute byte range."""

    fd: int
    path: Path
    size: int
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)


def _tensor_from_bytes(buf: bytearray, tm: TensorMeta) -> torch.Tensor:
    dtype = SUPPORTED_DTYPES[tm.dtype]
    if not buf:
        return torch.empty(tm.shape, dtype=dtype)
    # bytearray: writable, owned by the tensor; uint8 then view, so float8 etc. work alike.
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(tm.shape)


class StoreReader:
    """Reads a sealed step, refusing anything that disagrees with what the caller expects.

    Shards are opened lazily, once, and every byte returned is verified right after it was read
    from that open file (see the module docstring). ``bytes_read`` counts the shard bytes read so
    far: safetensors headers, the requested trajectories' tensor bytes and, after
    :meth:`verify`, whole shards (manifests and the seal are not counted).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        step: int,
        *,
        model_signature: str,
        policy_version: int,
    ) -> None:
        self._dfd = -1  # first, so that close() and __del__ work whatever fails below
        self._shards: dict[str, _OpenShard] = {}
        self.bytes_read = 0
        self.step = _check_step(step)
        self.dir = step_dir(root, step)
        self.model_signature = _check_signature(model_signature)
        self.policy_version = _check_policy_version(policy_version)
        if sys.byteorder != "little":
            raise StoreError("the store's data is little-endian; big-endian hosts are unsupported")
        try:
            self._dfd = _open_step_dir(self.dir, f"step {step}")
        except FileNotFoundError:
            raise StoreError(f"step {step} does not exist: no directory {self.dir}") from None
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    def _load(self) -> None:
        step, dfd = self.step, self._dfd
        seal = self.dir / COMPLETE_NAME
        where = f"step {step} seal {seal}"
        try:
            data = _read_file(dfd, COMPLETE_NAME, seal)
        except FileNotFoundError:
            raise StoreError(
                f"step {step} is not sealed: writers present: {_present_writers(dfd)} "
                f"(no {COMPLETE_NAME} in {self.dir})"
            ) from None
        except StoreError as e:
            raise StoreError(f"{where}: {e}") from None
        c = _load_json(data, where)
        if c.get("format") != _COMPLETE_FORMAT:
            raise StoreError(f"{where}: unknown format {c.get('format')!r}")
        version = _req(c, "version", int, where)
        if version != FORMAT_VERSION:
            raise _version_error(where, "seal", version)
        if _req(c, "step", int, where) != step:
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
            m, h = _read_manifest(dfd, self.dir, w, step)
            expected = info.get("manifest_sha256") if isinstance(info, dict) else None
            if h != expected:
                raise StoreError(
                    f"step {step}, writer {w!r}: manifest {self.dir / _manifest_name(w)} changed "
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
        n = c.get("num_trajectories")
        if n != len(self._index):
            raise StoreError(
                f"{where}: seal counts {n!r} trajectories, the manifests hold {len(self._index)}"
            )
        self._shard_meta: dict[str, ShardMeta] = {
            s.name: s for m in self.manifests for s in m.shards.values()
        }

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
        ``0 <= start <= stop <= T`` (step 1); bounds outside the record are an error. All of the
        trajectory's bytes are read and checked against its sha256 (whatever ``positions`` and
        ``names`` ask for); nothing else of the shard but its header is read.
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
        shard = self._open_shard(meta.shard)
        where = f"{where}, shard {shard.path}"

        # One buffer per tensor; tensors adjacent in the file are read with one preadv.
        bufs = {n: bytearray(tm.nbytes) for n, tm in meta.tensors.items()}
        in_file_order = sorted(meta.tensors, key=lambda n: shard.ranges[f"{traj_id}/{n}"])
        runs: list[tuple[int, list[bytearray]]] = []
        run_end = -1
        for n in in_file_order:
            begin, end = shard.ranges[f"{traj_id}/{n}"]
            if runs and begin == run_end:
                runs[-1][1].append(bufs[n])
            else:
                runs.append((begin, [bufs[n]]))
            run_end = end
        for offset, run in runs:
            self.bytes_read += _preadv_exact(shard.fd, run, offset, where)
        h = hashlib.sha256()
        for n in sorted(meta.tensors):
            h.update(bufs[n])
        if h.hexdigest() != meta.sha256:
            raise StoreError(
                f"{where}: sha256 mismatch (corrupted trajectory data): {h.hexdigest()}, "
                f"manifest says {meta.sha256}"
            )

        out: dict[str, torch.Tensor] = {}
        for name in wanted:
            tm = meta.tensors[name]
            t = _tensor_from_bytes(bufs[name], tm)
            if positions is not None:
                t = t[start:stop].clone()  # do not keep the whole record alive behind a view
            expect_shape = (stop - start, *tm.shape[1:])
            if t.dtype != SUPPORTED_DTYPES[tm.dtype] or tuple(t.shape) != expect_shape:
                raise StoreError(
                    f"{where}, tensor {name!r}: read {t.dtype}{list(t.shape)}, "
                    f"expected {tm.dtype}{list(expect_shape)}"
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
        """Verify every shard now: size, header, and the sha256 of the whole file.

        Reads every shard in full (through the descriptors :meth:`get` uses), so the bytes count
        toward ``bytes_read``.
        """
        for name, sm in self._shard_meta.items():
            shard = self._open_shard(name)
            where = f"step {self.step}, shard {shard.path}"
            h = hashlib.sha256()
            buf = bytearray(min(_HASH_CHUNK, max(sm.nbytes, 1)))
            offset = 0
            while offset < sm.nbytes:
                n = min(len(buf), sm.nbytes - offset)
                chunk = buf if n == len(buf) else bytearray(n)
                self.bytes_read += _preadv_exact(shard.fd, [chunk], offset, where)
                h.update(chunk)
                offset += n
            size = os.fstat(shard.fd).st_size
            if size != sm.nbytes:
                raise StoreError(
                    f"{where}: shard has {size} bytes on disk, manifest says {sm.nbytes}"
                )
            if h.hexdigest() != sm.sha256:
                raise StoreError(
                    f"{where}: sha256 mismatch (corrupted shard): {h.hexdigest()}, "
                    f"manifest says {sm.sha256}"
                )

    def close(self) -> None:
        """Close the shard and step-folder descriptors; metadata stays available. Idempotent."""
        shards, self._shards = self._shards, {}
        for shard in shards.values():
            os.close(shard.fd)
        if self._dfd >= 0:
            fd, self._dfd = self._dfd, -1
            os.close(fd)

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

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

    def _open_shard(self, name: str) -> _OpenShard:
        shard = self._shards.get(name)
        if shard is not None:
            return shard
        sm = self._shard_meta[name]
        path = self.dir / name
        where = f"step {self.step}, shard {path}"
        if self._dfd < 0:
            raise StoreError(f"{where}: the reader is closed")
        try:
            fd = _open_nofollow(self._dfd, name, path)
        except FileNotFoundError:
            raise StoreError(f"{where}: shard file is missing") from None
        except StoreError as e:
            raise StoreError(f"step {self.step}: {e}") from None
        try:
            shard = self._check_header(fd, sm, path, where)
        except BaseException:
            os.close(fd)
            raise
        self._shards[name] = shard
        return shard

    def _check_header(self, fd: int, sm: ShardMeta, path: Path, where: str) -> _OpenShard:
        size = os.fstat(fd).st_size
        if size < sm.nbytes:
            raise StoreError(
                f"{where}: shard is truncated: {size} bytes on disk, manifest says {sm.nbytes}"
            )
        if size > sm.nbytes:
            raise StoreError(f"{where}: shard has {size} bytes on disk, manifest says {sm.nbytes}")
        raw = bytearray(sm.header_bytes)
        self.bytes_read += _preadv_exact(fd, [raw], 0, where)
        sha = hashlib.sha256(raw).hexdigest()
        if sha != sm.header_sha256:
            raise StoreError(
                f"{where}: header sha256 mismatch (corrupted shard header): {sha}, "
                f"manifest says {sm.header_sha256}"
            )
        header_bytes, header = _shard_header(raw, where)
        if header_bytes != sm.header_bytes:
            raise StoreError(
                f"{where}: safetensors header of {header_bytes} bytes, manifest says "
                f"{sm.header_bytes}"
            )
        header_meta = header.pop("__metadata__", None)
        writer = sm.name[: -len(f"-00000{SHARD_SUFFIX}")]
        if (
            not isinstance(header_meta, dict)
            or header_meta.get("format") != _SHARD_FORMAT
            or header_meta.get("step") != str(self.step)
            or header_meta.get("writer_id") != writer
        ):
            raise StoreError(
                f"{where}: shard header names format/step/writer {header_meta}, "
                f"expected {_SHARD_FORMAT!r}/{self.step}/{writer!r}"
            )
        expected: dict[str, TensorMeta] = {
            f"{tid}/{n}": tm
            for tid, loc in self._index.items()
            if loc.meta.shard == sm.name
            for n, tm in loc.meta.tensors.items()
        }
        if set(header) != set(expected):
            extra = sorted(set(header) - set(expected))
            missing = sorted(set(expected) - set(header))
            raise StoreError(
                f"{where}: keys disagree with the manifest: "
                f"missing {missing[:5]}, extra {extra[:5]}"
            )
        shard = _OpenShard(fd, path, size)
        for key, tm in expected.items():
            info = header[key]
            ok = isinstance(info, dict)
            shape = info.get("shape") if ok else None
            dtype = info.get("dtype") if ok else None
            offsets = info.get("data_offsets") if ok else None
            if shape != list(tm.shape) or dtype != _SAFETENSORS_DTYPE[tm.dtype]:
                raise StoreError(
                    f"{where}, key {key!r}: {dtype}{shape} in shard, manifest says "
                    f"{tm.dtype}{list(tm.shape)}"
                )
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or offsets[1] - offsets[0] != tm.nbytes
            ):
                raise StoreError(
                    f"{where}, key {key!r}: data offsets {offsets!r} do not hold "
                    f"{tm.nbytes} bytes"
                )
            shard.ranges[key] = (header_bytes + offsets[0], header_bytes + offsets[1])
        # Like safetensors itself: the tensors tile the data section exactly, no gap, no overlap.
        pos = header_bytes
        for begin, end in sorted(shard.ranges.values()):
            if begin != pos:
                raise StoreError(f"{where}: tensor data is not contiguous at byte {begin}")
            pos = end
        if pos != size:
            raise StoreError(f"{where}: tensor data ends at byte {pos}, the shard has {size}")
        return shard


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


def step_bytes(
    source: StoreReader | Manifest | Mapping[str, Any] | Iterable[Manifest | Mapping[str, Any]],
) -> int:
    """Size in bytes of a step's shard files (safetensors headers included), from manifests.

    The reference for ``StoreReader.bytes_read``: what one rank read of the whole step.
    """
    return sum(s.nbytes for m in _as_manifests(source) for s in m.shards.values())
