"""Names, limits, errors and the file primitives every part of the store shares. See :mod:`tracefp4.guidance.store`."""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tracefp4.guidance import names


FORMAT_VERSION = 3
#: The format versions a reader opens: 3, and 2 (no per-token versions, no quantizer contract: read as
#: version-uniform, see :mod:`tracefp4.guidance.store`).
READABLE_VERSIONS = (2, 3)
ROUTING = names.ROUTING
#: The shard key suffix of a trajectory's per-token policy versions (``{traj_id}/policy_version``, int64
#: ``[T]``): not a record name (those start with ``L``), so it can never alias a record tensor.
VERSIONS_KEY = "policy_version"
MANIFEST_SUFFIX = ".manifest.json"
SHARD_SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
COMPLETE_NAME = "COMPLETE.json"
MANIFEST_FORMAT = "tracefp4.store.manifest"
COMPLETE_FORMAT = "tracefp4.store.complete"
SHARD_FORMAT = "tracefp4.store.shard"
LOCK_FORMAT = "tracefp4.store.lock"
MAX_SEQ = 99_999  # {seq:05d} must stay five digits, see module docstring
HASH_CHUNK = 1 << 20
_IOV_MAX = 1024
TOMBSTONE_TAG = ".discarded-"
SHA_RE = re.compile(r"[0-9a-f]{64}")

_O_NOFOLLOW = os.O_NOFOLLOW
O_CLOEXEC_FLAG = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO planted in the step folder must not hang (the type check follows).
_O_READ = os.O_RDONLY | _O_NOFOLLOW | O_CLOEXEC_FLAG | os.O_NONBLOCK
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | _O_NOFOLLOW | O_CLOEXEC_FLAG
O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | O_CLOEXEC_FLAG

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
DTYPE_TO_NAME = {dt: n for n, dt in SUPPORTED_DTYPES.items()}
# Hard-coded rather than taken from torch so that accounting over a manifest never depends on the
# torch build that reads it.
ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1,
}  # fmt: skip
# Dtype codes of the safetensors header, to check a shard against its manifest before reading it.
SAFETENSORS_DTYPE = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32",
    "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
    "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}  # fmt: skip
INTEGER_DTYPES = {"uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64"}


class StoreError(ValueError):
    """Any disagreement between the store, its files and what the caller expects."""


# --- Names and paths ---------------------------------------------------------------------------


def parse_name(name: str) -> tuple[int, str, str]:
    """``"L07.k.scales"`` -> ``(7, "k", "scales")``; ``"L07.routing"`` -> ``(7, "routing", "")``
    (:func:`tracefp4.guidance.names.parse_name`, failing as a :class:`StoreError`)."""
    if not isinstance(name, str):
        raise StoreError(f"tensor name must be a str, got {type(name).__name__}: {name!r}")
    try:
        return names.parse_name(name)
    except ValueError as e:
        raise StoreError(str(e)) from None


def check_traj_id(traj_id: object) -> str:
    if not isinstance(traj_id, str) or _TRAJ_ID_RE.fullmatch(traj_id) is None:
        raise StoreError(f"invalid trajectory id {traj_id!r}: must match [A-Za-z0-9_.:-]+")
    return traj_id


def check_writer_id(writer_id: object) -> str:
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


def check_step(step: object) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise StoreError(f"step must be a non-negative int, got {step!r}")
    return step


def check_policy_version(policy_version: object) -> int:
    pv = policy_version
    if not isinstance(pv, int) or isinstance(pv, bool) or pv < 0:
        raise StoreError(f"policy_version must be a non-negative int, got {policy_version!r}")
    return policy_version


def check_contract(contract: object) -> str:
    """A quantizer contract id: a non-empty single-line str (see :mod:`tracefp4.engines.contract`)."""
    if not isinstance(contract, str) or not contract or "\n" in contract:
        raise StoreError(f"contract must be a non-empty single-line str, got {contract!r}")
    return contract


def check_max_lag(max_lag: object) -> int:
    if not isinstance(max_lag, int) or isinstance(max_lag, bool) or max_lag < 0:
        raise StoreError(f"max_lag must be a non-negative int, got {max_lag!r}")
    return max_lag


def check_signature(model_signature: object) -> str:
    if not isinstance(model_signature, str) or not model_signature:
        raise StoreError(f"model_signature must be a non-empty str, got {model_signature!r}")
    return model_signature


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """Directory of one RL step under ``root``."""
    return Path(root) / f"step-{check_step(step):08d}"


def manifest_name(writer_id: str) -> str:
    return f"{writer_id}{MANIFEST_SUFFIX}"


def lock_name(writer_id: str) -> str:
    return f"{writer_id}{LOCK_SUFFIX}"


def present_writers(dfd: int) -> list[str]:
    try:
        names = os.listdir(dfd)
    except OSError:
        return []
    return sorted(n[: -len(MANIFEST_SUFFIX)] for n in names if n.endswith(MANIFEST_SUFFIX))


# --- File primitives: everything relative to an open step-folder descriptor, no link followed ----


def file_id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def open_step_dir(sdir: Path, where: str) -> int:
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


def open_nofollow(dfd: int, name: str, path: Path) -> int:
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


def read_file(dfd: int, name: str, path: Path) -> bytes:
    fd = open_nofollow(dfd, name, path)
    try:
        chunks = []
        while chunk := os.read(fd, HASH_CHUNK):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def preadv_exact(fd: int, buffers: Sequence[bytearray], offset: int, where: str) -> int:
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


def unlink_quiet(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass


def write_temp(dfd: int, name: str, data: bytes) -> tuple[str, tuple[int, int]]:
    """Write ``data`` durably to a new hidden temp file beside ``name``: (temp name, file id)."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, O_CREATE, 0o644, dir_fd=dfd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            fid = file_id(os.fstat(fd))
        finally:
            os.close(fd)
    except BaseException:
        unlink_quiet(dfd, tmp)
        raise
    return tmp, fid


def publish_new(dfd: int, tmp: str, name: str) -> None:
    """Give the temp file its final name; FileExistsError if ``name`` exists (never replaced)."""
    try:
        os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
    finally:
        unlink_quiet(dfd, tmp)
        os.fsync(dfd)


def remove_entry(dfd: int, name: str) -> None:
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
        unlink_quiet(dfd, name)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of duplicate keys silently; a manifest with two entries for one
    # trajectory is corrupt, not "the second one wins".
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate JSON key {k!r}")
        out[k] = v
    return out


def load_json(data: bytes, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except Exception as e:  # noqa: BLE001 - decoding errors, RecursionError on deep nesting, ...
        raise StoreError(f"{where}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise StoreError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def dump_json(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode("utf-8")


def version_error(where: str, what: str, version: object) -> StoreError:
    hint = ""
    if version == 1:
        hint = (
            " (version 1 has no per-trajectory checksums and cannot be read safely; "
            "write the step again with this code, e.g. discard_step() and roll out again)"
        )
    return StoreError(
        f"{where}: {what} format version {version!r}, this code reads only versions "
        f"{', '.join(map(str, READABLE_VERSIONS))}{hint}"
    )


