"""Atomic, checksummed checkpoints of one arm: a reader sees a whole checkpoint or none.

Layout of an arm folder::

    arm_dir/step-00000040/
        config.json               \\ written by ``model.save_pretrained`` (plus generation_config.json,
        model.safetensors         /  or sharded weights with their index for large models)
        optimizer.safetensors     the optimizer's tensors (FP32 masters, Adam moments, step counts)
        trainer_state.json        {"format_version", "step", "state": the caller's JSON state}
        extra/...                 the caller's own files, if any (the asynchronous loop's pending
                                  rollouts, tracefp4.rl.staleness)
        CHECKSUMS.json            size and sha256 of every other file, written last
    arm_dir/step-00000050/
    arm_dir/.tmp-step-00000060-<pid>-<random>/   only while a save is under way (or after a kill)

Decisions (and why)
    * **Whole folders, published by one rename.** A checkpoint is built in a hidden temp folder in
      ``arm_dir`` (same file system, so ``os.rename`` is atomic), every file fsynced, the temp folder
      fsynced, renamed to ``step-XXXXXXXX``, then ``arm_dir`` fsynced. A kill at any moment leaves
      either the previous checkpoints alone or the new one complete; a leftover temp folder is never
      read (hidden names are not step folders) and is removed by the next save.
    * **Verified before use.** :func:`load_checkpoint` checks every file against ``CHECKSUMS.json``
      (size first, so a truncation is reported as such, then sha256), refuses missing, extra and
      linked files, and parses the optimizer tensors and the state from the very bytes it hashed. The
      model files are verified here and loaded by the caller from :attr:`Checkpoint.model_path`.
      Every problem is a :class:`CheckpointError` (a ``ValueError``) of one line naming the file.
    * **The caller's own files travel inside.** ``extra`` (relative names, bytes) is written under
      ``extra/`` and checksummed like every other file, and comes back in :attr:`Checkpoint.extra`
      from the very bytes that were verified, so what a run must resume with beside its weights is
      never older or newer than the weights it goes with.
    * **Keep the last good ones.** After a new checkpoint is in place, older step folders beyond the
      newest ``keep`` (default 2) are deleted; a folder only counts towards ``keep`` if its files have
      the sizes its checksums list (a cheap check; a full hash of old checkpoints on every save would
      cost a read of the whole model). So a damaged checkpoint never pushes a good one out.
    * **Abandoned timelines are replaced.** Saving step N while a step folder >= N exists means the run
      was resumed from an earlier checkpoint (the later one was damaged): those later folders belong to
      an abandoned history and are removed (renamed to a hidden name first, so the step is gone at once).
    * **One writer per arm folder.** Saves of one arm are not meant to run concurrently (the run folder
      lock in :mod:`tracefp4.rl.runfolder` keeps a second process out); stale hidden folders of a killed
      save are deleted without asking whose they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import safetensors.torch
import torch

from tracefp4.faults import crash_point
from tracefp4.files import fsync_dir, read_regular

__all__ = [
    "CHECKSUMS_NAME",
    "EXTRA_DIR",
    "FORMAT_VERSION",
    "OPTIMIZER_NAME",
    "STATE_NAME",
    "Checkpoint",
    "CheckpointError",
    "CheckpointWarning",
    "checkpoint_name",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "remove_stale",
    "save_checkpoint",
    "verify_checkpoint",
]

FORMAT_VERSION = 1
CHECKSUMS_NAME = "CHECKSUMS.json"
OPTIMIZER_NAME = "optimizer.safetensors"
STATE_NAME = "trainer_state.json"
EXTRA_DIR = "extra"
_STEP_RE = re.compile(r"^step-(\d{8})$")
_HIDDEN_PREFIXES = (".tmp-step-", ".old-step-")
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or damaged (one line naming the file)."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older one."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]
    optimizer_tensors: dict[str, torch.Tensor]
    skipped: tuple[str, ...] = field(default=())  # one line per newer checkpoint that failed to verify
    extra: dict[str, bytes] = field(default_factory=dict)  # the caller's files (save_checkpoint's extra), verified

    @property
    def model_path(self) -> Path:
        """The folder to give ``tracefp4.engines.model.load_model`` (it holds config.json + weights)."""
        return self.path


def checkpoint_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= 99_999_999:
        raise ValueError(f"checkpoint step must be an int in [0, 99999999], got {step!r}")
    return f"step-{step:08d}"


# --- writing -------------------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest_file(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _write_new(path: Path, data: bytes) -> dict[str, Any]:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _json_bytes(payload: Any) -> bytes:
    # No default=str: a state value JSON cannot round-trip must fail at save, not come back changed.
    return (json.dumps(payload, indent=2, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")


def _remove_tree(path: Path) -> None:
    # rmtree does not follow links inside; a hidden name that is itself a link is just unlinked.
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _retire(arm_dir: Path, path: Path) -> None:
    """Rename ``path`` to a hidden name (gone for readers at once), fsync, then delete it."""
    hidden = arm_dir / f".old-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(path, hidden)
    fsync_dir(arm_dir)
    _remove_tree(hidden)


def remove_stale(arm_dir: str | os.PathLike[str]) -> list[Path]:
    """Delete temp and retired folders left by a killed save or clean-up; returns what was removed."""
    arm_dir = Path(arm_dir)
    removed = []
    if not arm_dir.is_dir():
        return removed
    for p in arm_dir.iterdir():
        if p.name.startswith(_HIDDEN_PREFIXES):
            _remove_tree(p)
            removed.append(p)
    return removed


def save_checkpoint(
    arm_dir: str | os.PathLike[str],
    step: int,
    *,
    model: Any,
    optimizer_tensors: Mapping[str, torch.Tensor],
    state: Mapping[str, Any],
    keep: int = 2,
    extra: Mapping[str, bytes] | None = None,
) -> Path:
    """Write ``arm_dir/step-{step:08d}/`` as a whole (see the module docstring); returns its path.

    ``model`` is anything with ``save_pretrained(folder, safe_serialization=True)`` (a Hugging Face
    model); ``state`` must be JSON (ints, floats, strings, lists, dicts) and comes back equal, and so
    do the bytes of each ``extra`` file (a relative ``/``-separated name, without ``..``).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    name = checkpoint_name(step)
    extra = dict(extra or {})
    for rel in extra:
        _check_extra_name(rel)
    arm_dir = Path(arm_dir)
    arm_dir.mkdir(parents=True, exist_ok=True)
    remove_stale(arm_dir)
    tmp = arm_dir / f".tmp-{name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        sums: dict[str, dict[str, Any]] = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_symlink() or not (p.is_file() or p.is_dir()):
                raise CheckpointError(f"{p}: save_pretrained wrote something that is not a plain file")
            if p.is_file():
                _fsync_file(p)  # save_pretrained does not fsync
                sums[p.relative_to(tmp).as_posix()] = _digest_file(p)
        for reserved in (OPTIMIZER_NAME, STATE_NAME, CHECKSUMS_NAME):
            if reserved in sums:
                raise CheckpointError(f"{tmp / reserved}: save_pretrained wrote a file with a reserved name")
        if any(rel.split("/")[0] == EXTRA_DIR for rel in sums):
            raise CheckpointError(f"{tmp / EXTRA_DIR}: save_pretrained wrote into the reserved folder")
        for rel, data in sorted(extra.items()):
            (tmp / EXTRA_DIR / rel).parent.mkdir(parents=True, exist_ok=True)
            sums[f"{EXTRA_DIR}/{rel}"] = _write_new(tmp / EXTRA_DIR / rel, data)
        tensors = {k: v.detach().contiguous().cpu() for k, v in optimizer_tensors.items()}
        sums[OPTIMIZER_NAME] = _write_new(tmp / OPTIMIZER_NAME, safetensors.torch.save(tensors))
        sums[STATE_NAME] = _write_new(
            tmp / STATE_NAME, _json_bytes({"format_version": FORMAT_VERSION, "step": step, "state": dict(state)})
        )
        crash_point("checkpoint")  # every file but the checksums written, nothing renamed yet
        _write_new(tmp / CHECKSUMS_NAME, _json_bytes({"format_version": FORMAT_VERSION, "step": step, "files": sums}))
        for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, key=lambda d: len(d.parts), reverse=True):
            fsync_dir(d)
        for s, path in list_checkpoints(arm_dir):
            if s >= step:  # an abandoned later history (we were resumed from an earlier checkpoint)
                _retire(arm_dir, path)
        os.rename(tmp, arm_dir / name)
    except BaseException:
        _remove_tree(tmp)
        raise
    fsync_dir(arm_dir)
    _prune(arm_dir, keep)
    return arm_dir / name


def _check_extra_name(rel: object) -> None:
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or any(p in ("", ".", "..") for p in parts) or "\\" in rel:
        raise ValueError(f"extra file name {rel!r}: expected a relative '/'-separated path without '.' or '..' parts")


def _sizes_match(path: Path) -> bool:
    try:
        listed = _read_checksums(path)
        return all(_lstat_regular(path / rel).st_size == meta["size"] for rel, meta in listed.items())
    except (CheckpointError, OSError):
        return False


def _prune(arm_dir: Path, keep: int) -> None:
    kept = 0
    for _, path in reversed(list_checkpoints(arm_dir)):
        if kept >= keep:
            _retire(arm_dir, path)
        elif _sizes_match(path):
            kept += 1


# --- reading -------------------------------------------------------------------------------------


def list_checkpoints(arm_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every step folder in ``arm_dir``, oldest first (not verified)."""
    arm_dir = Path(arm_dir)
    if not arm_dir.is_dir():
        return []
    out = []
    for p in arm_dir.iterdir():
        m = _STEP_RE.match(p.name)
        if m and not p.is_symlink() and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _lstat_regular(path: Path) -> os.stat_result:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: not a regular file (links are not followed)")
    return st


def _read_bytes(path: Path) -> bytes:
    return read_regular(path, CheckpointError)


def _load_json(path: Path, data: bytes) -> Any:
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate keys")
        return dict(pairs)

    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: malformed JSON ({e})") from None


def _read_checksums(path: Path) -> dict[str, dict[str, Any]]:
    file = path / CHECKSUMS_NAME
    doc = _load_json(file, _read_bytes(file))
    if not isinstance(doc, dict) or doc.get("format_version") != FORMAT_VERSION:
        version = doc.get("format_version") if isinstance(doc, dict) else None
        raise CheckpointError(f"{file}: checkpoint format version {version!r}, expected {FORMAT_VERSION}")
    files = doc.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{file}: no 'files' table")
    for rel, meta in files.items():
        bad_name = rel.startswith("/") or ".." in Path(rel).parts or rel == CHECKSUMS_NAME
        if bad_name or not isinstance(meta, dict) or not isinstance(meta.get("size"), int) \
                or not isinstance(meta.get("sha256"), str):
            raise CheckpointError(f"{file}: bad entry for {rel!r}")
    for required in ("config.json", OPTIMIZER_NAME, STATE_NAME):
        if required not in files:
            raise CheckpointError(f"{file}: does not list {required}")
    if not any(rel.endswith(".safetensors") and rel != OPTIMIZER_NAME for rel in files):
        raise CheckpointError(f"{file}: lists no model weights (*.safetensors)")
    return files


def _check_file(path: Path, meta: Mapping[str, Any], data: bytes | None = None) -> None:
    size = _lstat_regular(path).st_size if data is None else len(data)
    if size != meta["size"]:
        how = "truncated" if size < meta["size"] else "too long"
        raise CheckpointError(f"{path}: {how} ({size} bytes, expected {meta['size']})")
    digest = hashlib.sha256(data).hexdigest() if data is not None else _digest_file(path)["sha256"]
    if digest != meta["sha256"]:
        raise CheckpointError(f"{path}: sha256 mismatch (the file is damaged)")


def verify_checkpoint(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Check every file of a checkpoint folder against its CHECKSUMS.json; returns the table."""
    return _verify(Path(path), skip=())


def _verify(path: Path, skip: tuple[str, ...], skip_extra: bool = False) -> dict[str, dict[str, Any]]:
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint folder not found (or not a plain folder)")
    files = _read_checksums(path)
    present = {p.relative_to(path).as_posix() for p in path.rglob("*") if not p.is_dir() or p.is_symlink()}
    extra = sorted(present - set(files) - {CHECKSUMS_NAME})
    if extra:
        raise CheckpointError(f"{path / extra[0]}: not listed in {CHECKSUMS_NAME}")
    for rel in sorted(files):
        if rel not in skip and not (skip_extra and rel.split("/")[0] == EXTRA_DIR):
            _check_file(path / rel, files[rel])
    return files


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Verify a checkpoint folder, then read its state and optimizer tensors (see the module docstring)."""
    path = Path(path)
    # the optimizer, the state and the extra files: checked on the bytes parsed, below
    files = _verify(path, skip=(OPTIMIZER_NAME, STATE_NAME), skip_extra=True)
    state_bytes = _read_bytes(path / STATE_NAME)
    _check_file(path / STATE_NAME, files[STATE_NAME], state_bytes)
    opt_bytes = _read_bytes(path / OPTIMIZER_NAME)
    _check_file(path / OPTIMIZER_NAME, files[OPTIMIZER_NAME], opt_bytes)

    doc = _load_json(path / STATE_NAME, state_bytes)
    if not isinstance(doc, dict) or doc.get("format_version") != FORMAT_VERSION \
            or not isinstance(doc.get("step"), int) or not isinstance(doc.get("state"), dict):
        raise CheckpointError(f"{path / STATE_NAME}: not a trainer state of format {FORMAT_VERSION}")
    m = _STEP_RE.match(path.name)
    if m and int(m.group(1)) != doc["step"]:
        raise CheckpointError(f"{path / STATE_NAME}: step {doc['step']} does not match the folder name")
    try:
        tensors = safetensors.torch.load(opt_bytes)
    except Exception as e:  # safetensors raises its own SafetensorError; the hash passed, so this is a bug upstream
        raise CheckpointError(f"{path / OPTIMIZER_NAME}: unreadable safetensors ({e})") from None
    extra = {}
    for rel in sorted(r for r in files if r.split("/")[0] == EXTRA_DIR):
        data = _read_bytes(path / rel)
        _check_file(path / rel, files[rel], data)  # parsed by the caller from these very bytes
        extra[rel.removeprefix(EXTRA_DIR + "/")] = data
    return Checkpoint(path=path, step=doc["step"], state=doc["state"], optimizer_tensors=tensors, extra=extra)


def latest_checkpoint(arm_dir: str | os.PathLike[str], *, fallback: bool = True) -> Checkpoint | None:
    """The newest checkpoint of ``arm_dir`` that verifies, loaded; None when there is none.

    With ``fallback`` a damaged newer checkpoint is skipped with a :class:`CheckpointWarning` (and
    listed in :attr:`Checkpoint.skipped`); if none verifies, the newest one's error is raised.
    Without ``fallback`` the newest checkpoint's error is raised.
    """
    found = list_checkpoints(arm_dir)
    skipped: list[str] = []
    first_error: CheckpointError | None = None
    for _, path in reversed(found):
        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as e:
            if not fallback:
                raise
            first_error = first_error or e
            skipped.append(str(e))
            warnings.warn(f"skipping damaged checkpoint: {e}", CheckpointWarning, stacklevel=2)
            continue
        return Checkpoint(ckpt.path, ckpt.step, ckpt.state, ckpt.optimizer_tensors, tuple(skipped), ckpt.extra)
    if first_error is not None:
        raise CheckpointError(f"no checkpoint in {arm_dir} verifies; newest: {first_error}")
    return None
