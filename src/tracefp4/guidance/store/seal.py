"""Sealing a step (the driver) and discarding one (a resumed run). See :mod:`tracefp4.guidance.store`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path



from tracefp4.guidance.store.common import (
    COMPLETE_FORMAT,
    COMPLETE_NAME,
    FORMAT_VERSION,
    O_CLOEXEC_FLAG,
    StoreError,
    TOMBSTONE_TAG,
    check_writer_id,
    dump_json,
    load_json,
    manifest_name,
    open_step_dir,
    present_writers,
    publish_new,
    read_file,
    remove_entry,
    step_dir,
    write_temp,
)
from tracefp4.guidance.store.manifest import Manifest, ShardMeta




def read_manifest(dfd: int, sdir: Path, writer_id: str, step: int) -> tuple[Manifest, str]:
    name = manifest_name(writer_id)
    path = sdir / name
    where = f"step {step}, writer {writer_id!r} manifest {path}"
    try:
        data = read_file(dfd, name, path)
    except FileNotFoundError:
        raise StoreError(
            f"step {step}: manifest of writer {writer_id!r} is missing ({path}); "
            f"writers present: {present_writers(dfd)}"
        ) from None
    except StoreError as e:
        raise StoreError(f"{where}: {e}") from None
    m = Manifest.from_json(load_json(data, where), where)
    if m.step != step or m.writer_id != writer_id:
        raise StoreError(
            f"{where}: file claims step {m.step}, writer {m.writer_id!r} "
            f"(was it copied from elsewhere?)"
        )
    return m, hashlib.sha256(data).hexdigest()


def check_agreement(manifests: Sequence[Manifest], step: int) -> None:
    """The writers of one step agree on the model signature, format version and quantizer contract, and
    no trajectory id is written twice. In format 2 they also agree on the policy version (every row of a
    format-2 step is at it); in format 3 each row carries its own, and writers may hold different ones."""
    sigs = {m.writer_id: m.model_signature for m in manifests}
    if len(set(sigs.values())) > 1:
        raise StoreError(f"step {step}: writers disagree on model_signature: {sigs}")
    formats = {m.writer_id: m.version for m in manifests}
    if len(set(formats.values())) > 1:
        raise StoreError(f"step {step}: writers of different store format versions: {formats}")
    contracts = {m.writer_id: m.contract for m in manifests}
    if len(set(contracts.values())) > 1:
        raise StoreError(f"step {step}: writers disagree on the quantizer contract: {contracts}")
    pvs = {m.writer_id: m.policy_version for m in manifests}
    if manifests and manifests[0].version < 3 and len(set(pvs.values())) > 1:
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
    writer's manifest exists and parses, that all agree on model signature and quantizer contract
    (:func:`check_agreement`), that no trajectory id appears twice, and that every listed shard exists as a regular file with the
    recorded size (hashes are left to the reader). It then publishes ``COMPLETE.json`` and removes
    everything else in the step folder: temp files, lock files, shards no sealed manifest lists,
    manifests (and files) of writers it was not given. Sealing again with the same writers is a
    no-op (it finishes an interrupted clean-up); with other writers it is an error.
    """
    sdir = step_dir(root, step)
    _check_writer_ids(writers, step)
    try:
        dfd = open_step_dir(sdir, f"cannot seal step {step}")
    except FileNotFoundError:
        raise StoreError(f"cannot seal step {step}: directory {sdir} does not exist") from None
    try:
        manifests: list[Manifest] = []
        hashes: dict[str, str] = {}
        for w in writers:
            try:
                m, h = read_manifest(dfd, sdir, w, step)
            except StoreError as e:
                raise StoreError(f"cannot seal step {step}: {e}") from None
            manifests.append(m)
            hashes[w] = h
        try:
            check_agreement(manifests, step)
        except StoreError as e:
            raise StoreError(f"cannot seal step {step}: {e}") from None
        keep = {COMPLETE_NAME}
        for m in manifests:
            keep.add(manifest_name(m.writer_id))
            for s in m.shards.values():
                keep.add(s.name)
                _check_shard_file(dfd, sdir, s, f"cannot seal step {step}: writer {m.writer_id!r}")

        if manifests[0].version != FORMAT_VERSION:
            raise StoreError(f"cannot seal step {step}: its manifests are of store format "
                             f"{manifests[0].version}; this code seals format {FORMAT_VERSION} only")
        complete = {
            "format": COMPLETE_FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "model_signature": manifests[0].model_signature,
            "contract": manifests[0].contract,
            # the newest and the oldest policy version of any row of the step
            "policy_version": max(m.policy_version for m in manifests),
            "oldest_policy_version": min(m.oldest_version for m in manifests),
            "num_trajectories": sum(len(m.trajectories) for m in manifests),
            "writers": {w: {"manifest_sha256": hashes[w]} for w in writers},
        }
        path = sdir / COMPLETE_NAME
        _publish_seal(dfd, path, complete, step, writers)
        # What no sealed manifest references can never be read: remove it (files of dead or
        # unnamed writers, temp files, locks).
        for name in os.listdir(dfd):
            if name not in keep:
                remove_entry(dfd, name)
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


def _check_writer_ids(writers: Sequence[str], step: int) -> None:
    """``writers`` is a non-empty list of distinct, valid writer ids."""
    if isinstance(writers, str) or not writers:
        raise StoreError(
            f"step {step}: writers must be a non-empty list of writer ids, got {writers!r}"
        )
    for w in writers:
        check_writer_id(w)
    if len(set(writers)) != len(writers):
        raise StoreError(f"step {step}: duplicate writer ids in {list(writers)}")


def _check_shard_file(dfd: int, sdir: Path, s: ShardMeta, whose: str) -> None:
    """Shard ``s`` is in the step folder as a regular file (not a link) of the size its manifest
    records; its hashes are left to the reader, which reads the bytes anyway."""
    what = f"{whose} shard {sdir / s.name}"
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


def _publish_seal(dfd: int, path: Path, complete: dict, step: int, writers: Sequence[str]) -> None:
    """Publish ``COMPLETE.json``; a seal already there passes only if it is this very one (sealing
    again with the same writers finishes an interrupted clean-up)."""
    data = dump_json(complete)
    tmp, _ = write_temp(dfd, COMPLETE_NAME, data)
    try:
        publish_new(dfd, tmp, COMPLETE_NAME)
    except FileExistsError:
        where = f"step {step} seal {path}"
        existing = load_json(read_file(dfd, COMPLETE_NAME, path), where)
        if existing != json.loads(data):
            raise StoreError(
                f"step {step} is already sealed with different contents ({path}); "
                f"sealed writers: {sorted(existing.get('writers', {}))}, "
                f"requested: {list(writers)}"
            ) from None


def discard_steps(root: str | os.PathLike[str]) -> int:
    """:func:`discard_step` every step folder under ``root`` (none if it does not exist); how many were there.
    For a run that starts over or resumes: steps it wrote but never consumed."""
    pattern = re.compile(re.escape(step_dir("", 0).name[:-8]) + r"(\d{8})$")
    steps = sorted(int(m.group(1)) for p in (Path(root).iterdir() if Path(root).is_dir() else ())
                   if (m := pattern.match(p.name)))
    return sum(discard_step(root, s) for s in steps)


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
        rfd = os.open(Path(root), os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC_FLAG)
    except FileNotFoundError:
        return False
    try:
        found = True
        tomb_prefix = f".{sdir.name}{TOMBSTONE_TAG}"
        try:
            # rename() moves a link itself, never its target
            os.rename(sdir.name, tomb_prefix + secrets.token_hex(8), src_dir_fd=rfd, dst_dir_fd=rfd)
        except FileNotFoundError:
            found = False
        os.fsync(rfd)
        for name in os.listdir(rfd):
            if name.startswith(tomb_prefix):
                remove_entry(rfd, name)
        os.fsync(rfd)
    finally:
        os.close(rfd)
    return found


