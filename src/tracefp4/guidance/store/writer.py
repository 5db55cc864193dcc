"""One rollout worker's writer for one step. See :mod:`tracefp4.guidance.store`."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import safetensors.torch
import torch

from tracefp4.files import fsync_dir
from tracefp4.guidance.store.common import (
    COMPLETE_NAME,
    DTYPE_TO_NAME,
    INTEGER_DTYPES,
    LOCK_FORMAT,
    MAX_SEQ,
    O_CREATE,
    ROUTING,
    SHARD_FORMAT,
    SHARD_SUFFIX,
    StoreError,
    VERSIONS_KEY,
    check_contract,
    check_policy_version,
    check_signature,
    check_step,
    check_traj_id,
    check_writer_id,
    dump_json,
    file_id,
    load_json,
    lock_name,
    manifest_name,
    open_step_dir,
    parse_name,
    publish_new,
    read_file,
    step_dir,
    unlink_quiet,
    write_temp,
)
from tracefp4.guidance.store.manifest import Manifest, ShardMeta, TensorMeta, TrajectoryMeta, shard_header




class StoreWriter:
    """Writes one rollout worker's records for one step. Use as a context manager.

    Writers of different names never coordinate: each only creates files named after its own
    ``writer_id``. A second writer of the same name for the same step is refused (lock file at
    creation, ownership check and no-replace publish at close). Nothing this writer wrote becomes
    visible before :meth:`close` has published the manifest, and the step as a whole only after
    :func:`seal_step`.

    ``contract``: the quantizer contract the records were computed under
    (:func:`tracefp4.engines.contract.quantizer_contract`), which a reader compares with its own.
    ``policy_version``: the version of the rows :meth:`add` is given without per-token ``versions``.
    The manifest's ``policy_version`` is the newest version of any row written (this one while none is).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        step: int,
        writer_id: str,
        *,
        model_signature: str,
        policy_version: int,
        contract: str,
        shard_bytes: int = 256 << 20,
    ) -> None:
        self._dfd = -1  # first, so that __del__ works whatever fails below
        self.step = check_step(step)
        self.writer_id = check_writer_id(writer_id)
        self.model_signature = check_signature(model_signature)
        self.policy_version = check_policy_version(policy_version)
        self.contract = check_contract(contract)
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
        self._dfd = open_step_dir(self.dir, self._where)
        try:
            self._dir_id = file_id(os.fstat(self._dfd))
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

    def add(self, traj_id: str, record: Mapping[str, torch.Tensor], *, prompt_len: int,
            versions: torch.Tensor | None = None) -> None:
        """Buffer one trajectory's record; flush a shard once ``shard_bytes`` are buffered.

        ``versions``: the policy version of the weights that computed each row (an integer tensor
        ``[T]``, every value >= 0); None: every row at the writer's ``policy_version``. Tensors are
        copied (to contiguous CPU memory), so the caller may reuse its buffers. An empty record (a
        BF16 rollout of a dense model records nothing) needs ``versions``: its rows are their rows.
        """
        if self._closed:
            raise StoreError(f"{self._where}: add() after close()")
        check_traj_id(traj_id)
        where = f"{self._where}, trajectory {traj_id!r}"
        if traj_id in self._trajs or traj_id in self._pending:
            raise StoreError(f"{where}: duplicate trajectory id in this writer")
        if not isinstance(record, Mapping) or not (record or versions is not None):
            raise StoreError(f"{where}: record must be a non-empty dict of tensors (or an empty one with the "
                             "trajectory's per-row versions)")

        length: int | None = None
        tensors: dict[str, torch.Tensor] = {}
        metas: dict[str, TensorMeta] = {}
        for name, t in record.items():
            dtype = _stored_dtype(name, t, where)
            wt = f"{where}, tensor {name!r}"
            if length is None:
                length = t.shape[0]
            elif t.shape[0] != length:
                raise StoreError(
                    f"{wt}: leading dim {t.shape[0]} differs from the record's T={length} "
                    f"(first tensor {next(iter(record))!r})"
                )
            tensors[name] = _owned_contiguous_cpu(t)
            metas[name] = TensorMeta(tuple(t.shape), dtype)
        if length is None:  # an empty record: as many rows as its versions (checked below)
            length = int(versions.shape[0]) if isinstance(versions, torch.Tensor) and versions.dim() == 1 else 0
        if length < 1:
            raise StoreError(f"{where}: trajectory has T=0 token positions")
        if (
            not isinstance(prompt_len, int)
            or isinstance(prompt_len, bool)
            or not 0 <= prompt_len <= length
        ):
            raise StoreError(f"{where}: prompt_len {prompt_len!r} not in [0, T={length}]")
        rows = _row_versions(versions, length, self.policy_version, where)

        for name, t in tensors.items():
            self._buffer[f"{traj_id}/{name}"] = t
            self._buffer_bytes += metas[name].nbytes
        self._buffer[f"{traj_id}/{VERSIONS_KEY}"] = rows
        self._buffer_bytes += rows.nbytes
        self._pending[traj_id] = TrajectoryMeta(
            traj_id, self._shard_name(self._seq), length, prompt_len, metas,
            versions=(int(rows.min()), int(rows.max())),
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
            self._publish(manifest_name(self.writer_id), dump_json(m.to_json()), "manifest")
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
                if file_id(st) == fid:
                    unlink_quiet(self._dfd, name)
            self._release_lock()
            os.fsync(self._dfd)
        self._published_ids.clear()
        self._shards.clear()
        self._trajs.clear()
        self._pending.clear()
        self._close_dir()

    def manifest(self) -> Manifest:
        """The manifest of what this writer has published so far (flushed shards only)."""
        newest = max((t.versions[1] for t in self._trajs.values()), default=self.policy_version)
        return Manifest(
            step=self.step,
            writer_id=self.writer_id,
            model_signature=self.model_signature,
            policy_version=newest,
            shards=dict(self._shards),
            trajectories=dict(self._trajs),
            contract=self.contract,
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
        if self._exists(manifest_name(self.writer_id)):
            raise StoreError(
                f"{self._where}: a manifest for this writer already exists "
                f"({self.dir / manifest_name(self.writer_id)}); refusing to overwrite a "
                "finished writer"
            )

    def _take_lock(self) -> None:
        name = lock_name(self.writer_id)
        info = {
            "format": LOCK_FORMAT,
            "writer_id": self.writer_id,
            "step": self.step,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "token": self._token,
        }
        try:
            fd = os.open(name, O_CREATE, 0o644, dir_fd=self._dfd)
        except FileExistsError:
            raise StoreError(
                f"{self._where}: another writer of this name holds the lock "
                f"{self.dir / name} ({self._describe_lock()}); a second writer of the same name "
                "for one step is refused. If that writer is dead, seal the step without it or "
                "discard the step (discard_step)"
            ) from None
        self._locked = True
        try:
            data = dump_json(info)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.fsync(self._dfd)

    def _read_lock(self) -> dict[str, Any] | None:
        name = lock_name(self.writer_id)
        try:
            return load_json(read_file(self._dfd, name, self.dir / name), "lock")
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
        if st is None or file_id(st) != self._dir_id:
            return "the step folder was discarded or replaced while this writer was writing"
        if self._exists(COMPLETE_NAME):
            return "the step was sealed while this writer was writing (without it)"
        info = self._read_lock()
        if info is None or info.get("token") != self._token:
            holder = "no lock" if info is None else self._describe_lock()
            return f"this writer lost its lock {self.dir / lock_name(self.writer_id)} ({holder})"
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
            unlink_quiet(self._dfd, lock_name(self.writer_id))
            os.fsync(self._dfd)

    def _publish(self, name: str, data: bytes, what: str) -> None:
        # Ownership is checked before writing (a discarded folder may be gone) and again right
        # before the link that makes the file visible.
        self._check_owner(name, what)
        tmp, fid = write_temp(self._dfd, name, data)
        try:
            self._check_owner(name, what)
        except BaseException:
            unlink_quiet(self._dfd, tmp)
            raise
        # Known before the link, so that abort() can remove it whatever fails after the link; a
        # file of that name that is not this inode is never removed.
        self._published_ids[name] = fid
        try:
            publish_new(self._dfd, tmp, name)
        except FileExistsError:
            raise StoreError(
                f"{self._where}: {what} {self.dir / name} already exists (another writer of "
                "this name, or one that died?); refusing to replace it"
            ) from None

    def _flush(self) -> None:
        if not self._buffer:
            return
        if self._seq > MAX_SEQ:
            raise StoreError(f"{self._where}: more than {MAX_SEQ + 1} shards; raise shard_bytes")
        name = self._shard_name(self._seq)
        meta = {"format": SHARD_FORMAT, "step": str(self.step), "writer_id": self.writer_id}
        # Serialise to memory so that the hashes cover exactly the bytes that reach the disk.
        where = f"{self._where}, shard {name}"
        data = sorted_metadata(safetensors.torch.save(self._buffer, metadata=meta), where)
        header_bytes, header = shard_header(data, where)
        view = memoryview(data)
        trajs: dict[str, TrajectoryMeta] = {}
        for tid, t in self._pending.items():
            h = hashlib.sha256()
            for key in [f"{tid}/{tname}" for tname in sorted(t.tensors)] + [f"{tid}/{VERSIONS_KEY}"]:
                begin, end = header[key]["data_offsets"]
                h.update(view[header_bytes + begin : header_bytes + end])
            trajs[tid] = TrajectoryMeta(
                tid, name, t.length, t.prompt_len, t.tensors, h.hexdigest(), t.versions
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


def sorted_metadata(data: bytes, where: str) -> bytes:
    """safetensors bytes with the header's ``__metadata__`` entries in sorted key order.

    safetensors writes ``__metadata__`` from a Rust hash map, whose iteration order is seeded per
    process: two processes writing the same records would write different bytes (and hashes). The
    tensor entries are already in a fixed order (by dtype alignment, then name). The header is parsed
    keeping its order, the metadata sorted, and the header written again in safetensors' own compact
    JSON, which has the same length (the same entries), so the padding and every data offset stay.
    """
    n = int.from_bytes(data[:8], "little")
    raw = data[8 : 8 + n]
    text = raw.rstrip(b" ")  # safetensors pads the header with spaces to a multiple of 8 bytes
    header = json.loads(text)  # a dict keeps the order of the file's entries
    if json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode() != text:
        # a safetensors release that formats its header otherwise: refuse rather than write a
        # header that the hashes would then cover but safetensors might not parse alike
        raise StoreError(f"{where}: safetensors wrote a header this code cannot put in canonical order")
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    out = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if out == text:
        return data  # already in order: no copy of the shard
    assert len(out) == len(text)  # the same entries, reordered
    return data[:8] + out + raw[len(text):] + data[8 + n :]


def _row_versions(versions: object, length: int, default: int, where: str) -> torch.Tensor:
    """A trajectory's per-token policy versions as int64 ``[T]`` (``default`` everywhere for None)."""
    if versions is None:
        return torch.full((length,), default, dtype=torch.int64)
    if (not isinstance(versions, torch.Tensor) or versions.dtype not in _INT_DTYPES
            or tuple(versions.shape) != (length,)):
        got = (f"{versions.dtype} {list(versions.shape)}" if isinstance(versions, torch.Tensor)
               else type(versions).__name__)
        raise StoreError(f"{where}: versions must be an integer tensor [T={length}], got {got}")
    rows = versions.detach().to("cpu", torch.int64).clone(memory_format=torch.contiguous_format)
    if length and int(rows.min()) < 0:
        bad = int((rows < 0).nonzero()[0])
        raise StoreError(f"{where}: row {bad} has policy version {int(rows[bad])}; versions must be >= 0")
    return rows


_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _stored_dtype(name: str, t: object, where: str) -> str:
    """The store's dtype name of record tensor ``name``, after checking that the name parses and that
    ``t`` is a dense tensor with a token dim, of a dtype the store holds (integers for routing)."""
    try:
        _, site, _ = parse_name(name)
    except StoreError as e:
        raise StoreError(f"{where}: {e}") from None
    wt = f"{where}, tensor {name!r}"
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        raise StoreError(f"{wt}: expected a dense torch.Tensor, got {type(t).__name__}")
    if t.dim() < 1:
        raise StoreError(f"{wt}: needs a leading token dim, got a 0-d tensor")
    dtype = DTYPE_TO_NAME.get(t.dtype)
    if dtype is None:
        fp4 = "float4" in str(t.dtype)
        hint = " (store packed FP4 codes as t.view(torch.uint8))" if fp4 else ""
        raise StoreError(f"{wt}: unsupported dtype {t.dtype}{hint}")
    if site == ROUTING and dtype not in INTEGER_DTYPES:
        raise StoreError(f"{wt}: routing indices need an integer dtype, got {t.dtype}")
    return dtype


def _owned_contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu").contiguous()  # the device->host copy already owns its memory
    return t.clone(memory_format=torch.contiguous_format)


