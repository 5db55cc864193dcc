"""Reading a sealed step: only the trajectories asked for, verified from one open file. See :mod:`tracefp4.guidance.store`."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch


from tracefp4.guidance.store.common import (
    COMPLETE_FORMAT,
    COMPLETE_NAME,
    HASH_CHUNK,
    READABLE_VERSIONS,
    SAFETENSORS_DTYPE,
    SHARD_FORMAT,
    SHARD_SUFFIX,
    SUPPORTED_DTYPES,
    StoreError,
    VERSIONS_KEY,
    check_contract,
    check_max_lag,
    check_policy_version,
    check_signature,
    check_step,
    check_writer_id,
    load_json,
    manifest_name,
    open_nofollow,
    open_step_dir,
    preadv_exact,
    present_writers,
    read_file,
    step_dir,
    version_error,
)
from tracefp4.guidance.store.manifest import (
    Manifest,
    ShardMeta,
    TensorMeta,
    TrajectoryMeta,
    req,
    shard_header,
)
from tracefp4.guidance.store.seal import check_agreement, read_manifest




@dataclass
class _Located:
    writer_id: str
    meta: TrajectoryMeta
    policy_version: int  # its manifest's (the version of every row in store format 2)


def _stored_tensors(meta: TrajectoryMeta) -> dict[str, TensorMeta]:
    """Every tensor a trajectory has in its shard, by key suffix: the record's, and (format 3) its
    per-token versions."""
    vm = meta.versions_meta
    return meta.tensors if vm is None else {**meta.tensors, VERSIONS_KEY: vm}


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


def _wanted_names(meta: TrajectoryMeta, names: Sequence[str] | None, where: str) -> list[str]:
    """The tensor names :meth:`StoreReader.get` returns: ``names`` (each stored) or all of them."""
    if names is None:
        return list(meta.tensors)
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
    return wanted


def _check_shard_metadata(header_meta: object, sm: ShardMeta, step: int, where: str) -> None:
    """A shard's safetensors metadata names the store's shard format, ``step`` and the writer whose
    name starts the shard's (so a shard copied from another step or writer is refused)."""
    writer = sm.name[: -len(f"-00000{SHARD_SUFFIX}")]
    if (
        not isinstance(header_meta, dict)
        or header_meta.get("format") != SHARD_FORMAT
        or header_meta.get("step") != str(step)
        or header_meta.get("writer_id") != writer
    ):
        raise StoreError(
            f"{where}: shard header names format/step/writer {header_meta}, "
            f"expected {SHARD_FORMAT!r}/{step}/{writer!r}"
        )


def _tensor_range(key: str, info: object, tm: TensorMeta, header_bytes: int, where: str) -> tuple[int, int]:
    """The file byte range of tensor ``key`` from its header entry ``info``, which must agree with
    the manifest's ``tm`` (dtype, shape, and offsets spanning exactly its bytes)."""
    ok = isinstance(info, dict)
    shape = info.get("shape") if ok else None
    dtype = info.get("dtype") if ok else None
    offsets = info.get("data_offsets") if ok else None
    if shape != list(tm.shape) or dtype != SAFETENSORS_DTYPE[tm.dtype]:
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
    return header_bytes + offsets[0], header_bytes + offsets[1]


class StoreReader:
    """Reads a sealed step, refusing anything that disagrees with what the caller expects.

    ``policy_version``: the trainer's own version v. ``max_lag`` k: the records it accepts were
    computed by weights of versions v-k .. v, row by row (0, the default: its own weights only). A row
    newer than v, or older than v-k, is a :class:`StoreError` naming the trajectory, its rows' versions
    and the window; a step whose newest row is older than v-k is refused when opened. ``contract``: the
    trainer's quantizer contract (:func:`tracefp4.engines.contract.quantizer_contract`); a step recorded
    under another one is refused, naming both; None reads any contract unchecked. A step of store format
    2 records neither per-token versions nor a contract: its rows are read as all at its
    ``policy_version`` (format 2 wrote one version per step, and every writer of the step had to agree
    on it), and it is refused when a ``contract`` is given (it cannot be checked).

    Shards are opened lazily, once, and every byte returned is verified right after it was read
    from that open file (see the module docstring). ``bytes_read`` counts the shard bytes read so
    far: safetensors headers, the requested trajectories' tensor bytes (per-token versions included)
    and, after :meth:`verify`, whole shards (manifests and the seal are not counted).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        step: int,
        *,
        model_signature: str,
        policy_version: int,
        max_lag: int = 0,
        contract: str | None = None,
    ) -> None:
        self._dfd = -1  # first, so that close() and __del__ work whatever fails below
        self._shards: dict[str, _OpenShard] = {}
        self._versions: dict[str, torch.Tensor] = {}  # read and verified, per trajectory
        self.bytes_read = 0
        self.step = check_step(step)
        self.dir = step_dir(root, step)
        self.model_signature = check_signature(model_signature)
        self.policy_version = check_policy_version(policy_version)
        self.max_lag = check_max_lag(max_lag)
        self.contract = None if contract is None else check_contract(contract)
        if sys.byteorder != "little":
            raise StoreError("the store's data is little-endian; big-endian hosts are unsupported")
        try:
            self._dfd = open_step_dir(self.dir, f"step {step}")
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
            data = read_file(dfd, COMPLETE_NAME, seal)
        except FileNotFoundError:
            raise StoreError(
                f"step {step} is not sealed: writers present: {present_writers(dfd)} "
                f"(no {COMPLETE_NAME} in {self.dir})"
            ) from None
        except StoreError as e:
            raise StoreError(f"{where}: {e}") from None
        c = load_json(data, where)
        if c.get("format") != COMPLETE_FORMAT:
            raise StoreError(f"{where}: unknown format {c.get('format')!r}")
        version = req(c, "version", int, where)
        if version not in READABLE_VERSIONS:
            raise version_error(where, "seal", version)
        self.format_version = version
        if req(c, "step", int, where) != step:
            raise StoreError(f"{where}: file claims step {c.get('step')!r}")
        self._check_signature(c.get("model_signature"), where)
        newest = req(c, "policy_version", int, where)
        self._check_newest(newest, where)
        oldest = req(c, "oldest_policy_version", int, where) if version >= 3 else newest
        sealed_contract = req(c, "contract", str, where) if version >= 3 else None
        self._check_contract(sealed_contract, where)
        writers = req(c, "writers", dict, where)
        if not writers:
            raise StoreError(f"{where}: no writers")

        self.manifests: list[Manifest] = []
        self._index: dict[str, _Located] = {}
        for w, info in writers.items():
            try:
                check_writer_id(w)  # it becomes a path: no traversal out of the step directory
            except StoreError as e:
                raise StoreError(f"{where}: {e}") from None
            m, h = read_manifest(dfd, self.dir, w, step)
            expected = info.get("manifest_sha256") if isinstance(info, dict) else None
            if h != expected:
                raise StoreError(
                    f"step {step}, writer {w!r}: manifest {self.dir / manifest_name(w)} changed "
                    f"after sealing (sha256 {h}, sealed {expected})"
                )
            mw = f"step {step}, writer {w!r} manifest"
            self._check_signature(m.model_signature, mw)
            if m.version != version:
                raise StoreError(f"{mw}: store format {m.version}, the seal's is {version}")
            if m.contract != sealed_contract:
                raise StoreError(f"{mw}: quantizer contract {m.contract!r}, the seal's is {sealed_contract!r}")
            if m.policy_version > self.policy_version:
                self._check_newest(m.policy_version, mw)
            self.manifests.append(m)
        check_agreement(self.manifests, step)
        span = (min(m.oldest_version for m in self.manifests), max(m.policy_version for m in self.manifests))
        if span != (oldest, newest):
            raise StoreError(f"{where}: seal says policy versions {oldest}..{newest}, "
                             f"the manifests hold {span[0]}..{span[1]}")
        for m in self.manifests:
            for tid, t in m.trajectories.items():
                self._index[tid] = _Located(m.writer_id, t, m.policy_version)
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

    def version_range(self, traj_id: str) -> tuple[int, int]:
        """(oldest, newest) policy version of a trajectory's rows, from its manifest (format 2: the
        step's version, twice)."""
        loc = self._locate(traj_id)
        return loc.meta.versions if loc.meta.versions is not None else (loc.policy_version,) * 2

    def versions(self, traj_id: str) -> torch.Tensor:
        """int64 ``[T]``: the policy version of the weights that computed each row of a trajectory's
        record (format 2: all at the step's version), checked against the reader's window like the
        record itself. Read and verified with the record (:meth:`get`; read here if it was not)."""
        if traj_id not in self._versions:
            self.get(traj_id, names=[])
        return self._versions[traj_id].clone()

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
        self._check_lag(traj_id, where)
        wanted = _wanted_names(meta, names, where)
        start, stop = self._positions(positions, meta.length, where)
        shard = self._open_shard(meta.shard)
        where = f"{where}, shard {shard.path}"
        bufs = self._read_verified(shard, traj_id, meta, where)
        self._versions[traj_id] = self._row_versions(bufs, loc, where)
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

    def _read_verified(self, shard: _OpenShard, traj_id: str, meta: TrajectoryMeta,
                       where: str) -> dict[str, bytearray]:
        """Every tensor's bytes of one trajectory, read from ``shard``'s descriptor and checked against
        the trajectory's sha256 before anything is built from them."""
        # One buffer per tensor; tensors adjacent in the file are read with one preadv.
        bufs = {n: bytearray(tm.nbytes) for n, tm in _stored_tensors(meta).items()}
        in_file_order = sorted(bufs, key=lambda n: shard.ranges[f"{traj_id}/{n}"])
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
            self.bytes_read += preadv_exact(shard.fd, run, offset, where)
        h = hashlib.sha256()
        for n in sorted(meta.tensors) + ([VERSIONS_KEY] if meta.versions is not None else []):
            h.update(bufs[n])
        if h.hexdigest() != meta.sha256:
            raise StoreError(
                f"{where}: sha256 mismatch (corrupted trajectory data): {h.hexdigest()}, "
                f"manifest says {meta.sha256}"
            )
        return bufs

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
            self._check_lag(tid, f"step {self.step}, writer {loc.writer_id!r}, trajectory {tid!r}")
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
            buf = bytearray(min(HASH_CHUNK, max(sm.nbytes, 1)))
            offset = 0
            while offset < sm.nbytes:
                n = min(len(buf), sm.nbytes - offset)
                chunk = buf if n == len(buf) else bytearray(n)
                self.bytes_read += preadv_exact(shard.fd, [chunk], offset, where)
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

    def _check_signature(self, sig: object, where: str) -> None:
        if sig != self.model_signature:
            raise StoreError(
                f"{where}: model_signature mismatch: store has {sig!r}, reader expects "
                f"{self.model_signature!r}"
            )

    def _window(self) -> str:
        v, k = self.policy_version, self.max_lag
        return (f"the reader at policy version {v} accepts " +
                (f"version {v} only (max_lag=0)" if k == 0 else f"versions {max(v - k, 0)}..{v} (max_lag={k})"))

    def _check_newest(self, newest: int, where: str) -> None:
        """The step's (or a writer's) newest row is neither newer than the reader nor older than its window."""
        if newest > self.policy_version:
            raise StoreError(f"{where}: policy_version mismatch: the store holds rows of version {newest}, "
                             f"newer than the reader's {self.policy_version}; {self._window()}")
        if newest < self.policy_version - self.max_lag:
            raise StoreError(f"{where}: policy_version mismatch: the newest rows of the store are of version "
                             f"{newest}, older than the window: {self._window()}")

    def _check_contract(self, contract: str | None, where: str) -> None:
        if self.contract is None or contract == self.contract:
            return
        if contract is None:
            raise StoreError(f"{where}: store format {self.format_version} recorded no quantizer contract, the "
                             f"reader expects {self.contract!r}; read it with contract=None to accept it "
                             "unchecked, or write the step again")
        raise StoreError(f"{where}: quantizer contract mismatch: the records were computed under {contract!r}, "
                         f"the reader expects {self.contract!r}")

    def _check_lag(self, traj_id: str, where: str) -> None:
        """Every row of the trajectory is of a version in the reader's window (from its manifest)."""
        oldest, newest = self.version_range(traj_id)
        v, k = self.policy_version, self.max_lag
        if newest > v:
            raise StoreError(f"{where}: rows of policy version {newest}, newer than the reader's {v}; "
                             f"{self._window()}")
        if oldest < v - k:
            raise StoreError(f"{where}: rows of policy version {oldest} (lag {v - oldest}); {self._window()}")

    def _row_versions(self, bufs: Mapping[str, bytearray], loc: _Located, where: str) -> torch.Tensor:
        """The verified per-token versions of a trajectory (format 2: its step's version), which must
        span exactly the range its manifest states."""
        meta = loc.meta
        if meta.versions is None:
            return torch.full((meta.length,), loc.policy_version, dtype=torch.int64)
        rows = _tensor_from_bytes(bufs[VERSIONS_KEY], meta.versions_meta)
        span = (int(rows.min()), int(rows.max()))
        if span != meta.versions:
            raise StoreError(f"{where}: per-token versions span {span[0]}..{span[1]}, the manifest says "
                             f"{meta.versions[0]}..{meta.versions[1]}")
        return rows

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
            fd = open_nofollow(self._dfd, name, path)
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
        """The open shard ``fd`` checked against its manifest entry ``sm`` (size, header hash, the
        header's metadata, keys, dtypes, shapes and data offsets), with each tensor's byte range."""
        size, header_bytes, header = self._read_header(fd, sm, where)
        _check_shard_metadata(header.pop("__metadata__", None), sm, self.step, where)
        expected: dict[str, TensorMeta] = {
            f"{tid}/{n}": tm
            for tid, loc in self._index.items()
            if loc.meta.shard == sm.name
            for n, tm in _stored_tensors(loc.meta).items()
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
            shard.ranges[key] = _tensor_range(key, header[key], tm, header_bytes, where)
        # Like safetensors itself: the tensors tile the data section exactly, no gap, no overlap.
        pos = header_bytes
        for begin, end in sorted(shard.ranges.values()):
            if begin != pos:
                raise StoreError(f"{where}: tensor data is not contiguous at byte {begin}")
            pos = end
        if pos != size:
            raise StoreError(f"{where}: tensor data ends at byte {pos}, the shard has {size}")
        return shard

    def _read_header(self, fd: int, sm: ShardMeta, where: str) -> tuple[int, int, dict]:
        """(file size, header bytes, parsed header) of the open shard ``fd``, its size and header
        hash checked against ``sm`` before the header is parsed."""
        size = os.fstat(fd).st_size
        if size < sm.nbytes:
            raise StoreError(
                f"{where}: shard is truncated: {size} bytes on disk, manifest says {sm.nbytes}"
            )
        if size > sm.nbytes:
            raise StoreError(f"{where}: shard has {size} bytes on disk, manifest says {sm.nbytes}")
        raw = bytearray(sm.header_bytes)
        self.bytes_read += preadv_exact(fd, [raw], 0, where)
        sha = hashlib.sha256(raw).hexdigest()
        if sha != sm.header_sha256:
            raise StoreError(
                f"{where}: header sha256 mismatch (corrupted shard header): {sha}, "
                f"manifest says {sm.header_sha256}"
            )
        header_bytes, header = shard_header(raw, where)
        if header_bytes != sm.header_bytes:
            raise StoreError(
                f"{where}: safetensors header of {header_bytes} bytes, manifest says "
                f"{sm.header_bytes}"
            )
        return size, header_bytes, header

