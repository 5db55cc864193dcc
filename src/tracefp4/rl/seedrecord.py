"""A seed's record: the small text files of one finished seed of an experiment, kept in the results
tree so that they survive a move to a new machine (run folders, with their checkpoints, do not).

Layout of ``<results>/records/<experiment>/seed-<s>/``::

    config.json            the seed's run config, as its run folder saved it
    environment.json       the run folder's environment.json (created in, resumed in)
    warm_start.json        {"weights_sha256", "source", "warm_start_steps"}: the weights every arm started from
    metrics/<arm>.jsonl    each arm's metrics log, byte for byte
    MANIFEST.json          format, experiment, seed, steps, arms, and size and sha256 of every other file

Decisions (and why)
    * **The unit is the seed, never the arm.** An experiment's summary pairs its arms seed by seed
      (the same warm start, the same prompts and sampling seeds), so an arm's numbers are only usable
      beside the other arms of its seed that started from the same weights. A lone arm's record could
      not be completed on a new machine: its siblings would have to start from its warm start, whose
      checkpoint lives in the run folder that did not move, and a warm start rebuilt on another CPU
      has other weights. So a record is written once every arm of its seed has finished, holds them
      all and the digest of the weights they started from (``warm_start.json``); an unfinished seed
      leaves nothing in the results tree and is run again whole.
    * **Whole or not at all.** A record is built in a hidden temp folder beside its place, every file
      and the folder fsynced, then renamed into place (one ``rename``: a reader sees the whole record
      or none); ``MANIFEST.json`` is written last inside it. Replacing an older record (a seed
      extended with more steps) moves the old one to a hidden name first, then the new one in, then
      deletes the old: a kill in between leaves no record, never a mixed one, and the run folder the
      new record comes from is still there to write it again. Hidden leftovers are never read. A
      record is only replaced by one of the same warm start (the same seed continued: more steps, a
      resume's environment); a run folder of the seed from other weights (run again on another
      machine) is refused, so a committed result is never silently swapped for another run's.
    * **Verified before use.** :func:`read_seed_record` checks every file against the manifest (size,
      then sha256), refuses a missing, an unlisted, a linked or a changed file, and parses the very
      bytes it hashed. Every problem is a :class:`SeedRecordError` (a ``ValueError``) of one line naming
      the file.
    * **Written, not committed.** The runner writes the record; committing it (``git add
      docs/results/records/<experiment>/``) is the caller's, right after the record appears.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracefp4.faults import crash_point
from tracefp4.files import atomic_write_json, fsync_dir, read_regular
from tracefp4.rl.runfolder import CONFIG_NAME, ENVIRONMENT_NAME
from tracefp4.rl.runlog import parse_metrics_lines

__all__ = [
    "MANIFEST_NAME",
    "RECORDS",
    "RECORD_FORMAT",
    "SeedRecord",
    "SeedRecordError",
    "WARM_START_NAME",
    "read_seed_record",
    "record_dir",
    "warm_start_info",
    "write_seed_record",
]

#: The folder of the records under the results tree. Not ``runs``: the repository ignores every
#: ``runs/`` folder (run folders), and a record must be committed.
RECORDS = "records"
MANIFEST_NAME = "MANIFEST.json"
WARM_START_NAME = "warm_start.json"
#: The layout version of a record; a reader refuses any other.
RECORD_FORMAT = 1


class SeedRecordError(ValueError):
    """A seed record that is torn, altered or not the one asked for (one line naming the file)."""


@dataclass(frozen=True)
class SeedRecord:
    """A verified seed record, parsed."""

    path: Path
    #: the seed's run config, as its run folder saved it
    config: dict[str, Any]
    #: ``{"created": {...}, "resumes": [...]}``, the run folder's environment.json
    environment: dict[str, Any]
    #: the warm start every arm started from (:func:`warm_start_info`)
    warm_start: dict[str, Any]
    #: each recorded arm's metrics rows
    metrics: dict[str, list[dict]]
    #: the GRPO steps every arm finished
    steps: int


def record_dir(results_dir: str | os.PathLike[str], experiment: str, seed: int) -> Path:
    """Where the record of ``seed`` of ``experiment`` lives under the results tree."""
    return Path(results_dir) / RECORDS / experiment / f"seed-{seed}"


def warm_start_info(run_dir: Path) -> dict[str, Any]:
    """The digest and source of the weights a run folder's arms started from (all None before its warm
    start is saved)."""
    from tracefp4.provenance import weights_digest
    from tracefp4.rl.checkpoint import latest_checkpoint
    from tracefp4.rl.loop import warm_start_dir

    ck = latest_checkpoint(warm_start_dir(run_dir))
    if ck is None:
        return {"weights_sha256": None, "source": None}
    warm = {"weights_sha256": ck.state.get("weights_sha256"), "source": ck.state.get("source", "built"),
            "warm_start_steps": ck.state.get("warm_start_steps")}
    if warm["weights_sha256"] is None:  # a run folder from before the digest was recorded
        from safetensors.torch import load_file

        warm["weights_sha256"] = weights_digest(load_file(str(ck.model_path / "model.safetensors")))
    return warm


def _record_files(run_dir: Path, arms: list[str]) -> dict[str, bytes]:
    files = {}
    for name in (CONFIG_NAME, ENVIRONMENT_NAME, *(f"metrics/{a}.jsonl" for a in arms)):
        src = run_dir / name
        if not src.is_file():
            raise SeedRecordError(f"{src}: missing; a seed record needs it (is {run_dir} a finished run folder?)")
        files[name] = src.read_bytes()
    files[WARM_START_NAME] = _json_bytes(warm_start_info(run_dir))
    return files


def _json_bytes(payload: Any) -> bytes:
    # key order kept: the summary shows the warm start as the run folder gives it
    return (json.dumps(payload, indent=2, allow_nan=False) + "\n").encode("utf-8")


def _manifest(files: dict[str, bytes], experiment: str, seed: int, arms: list[str], steps: int) -> dict[str, Any]:
    return {"format": RECORD_FORMAT, "experiment": experiment, "seed": seed, "steps": steps, "arms": list(arms),
            "files": {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                      for name, data in sorted(files.items())}}


def write_seed_record(run_dir: str | os.PathLike[str], dest: str | os.PathLike[str], *, experiment: str, seed: int,
                      arms: list[str], steps: int) -> bool:
    """Write the record of the finished seed in ``run_dir`` (every arm of ``arms`` at ``steps``) to
    ``dest``; False when ``dest`` holds that very record already (nothing is written)."""
    run_dir, dest = Path(run_dir), Path(dest)
    files = _record_files(run_dir, list(arms))
    manifest = _manifest(files, experiment, seed, list(arms), steps)
    try:
        old = read_seed_record(dest, experiment=experiment, seed=seed) if dest.exists() else None
    except SeedRecordError:
        old = None  # a damaged record: replaced by a whole one from the run folder
    if old is not None:
        if json.loads((dest / MANIFEST_NAME).read_text(encoding="utf-8")) == manifest:
            return False
        digest, before = json.loads(files[WARM_START_NAME])["weights_sha256"], old.warm_start.get("weights_sha256")
        if digest != before:
            raise SeedRecordError(f"{dest}: records seed {seed} from warm start {before}, the run folder {run_dir} "
                                  f"holds one from {digest}: another run of the seed, which would replace a result "
                                  "that may be committed; keep one (delete the record or the run folder)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(dest)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
        for name, data in files.items():
            _write_durable(tmp / name, data)
        fsync_dir(tmp / "metrics")
        crash_point("record-files")  # every file but the manifest, in the hidden folder
        atomic_write_json(tmp / MANIFEST_NAME, manifest)  # last: its presence says every file is in
        _publish(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return True


def _write_durable(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, dest: Path) -> None:
    # rename() cannot replace a non-empty folder: the old record moves aside (hidden, never read) first
    old = dest.parent / f".{dest.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.rename(dest, old)
        fsync_dir(dest.parent)
        crash_point("record-aside")  # the old record hidden, the new one not in place yet
    except FileNotFoundError:  # no record yet (or another writer moved it aside just now)
        old = None
    try:
        os.rename(tmp, dest)
    except OSError as e:
        # another process (--summary-only beside the running experiment) published this seed's record
        # from the same run folder meanwhile: theirs stands, ours is dropped by the caller
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old)


def _remove_leftovers(dest: Path) -> None:
    # hidden temp or old folders of a write that was killed: never read, so safe to drop, unless the
    # process named in them is alive (a concurrent write of the same record is under way there)
    for p in dest.parent.glob(f".{dest.name}.*"):
        pid = p.name.rsplit("-", 2)[-2] if p.name.count("-") >= 2 else ""
        if p.is_dir() and not p.is_symlink() and not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours are from an earlier call of this process, which has returned
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_seed_record(path: str | os.PathLike[str], *, experiment: str, seed: int) -> SeedRecord:
    """The record at ``path``, verified (the module docstring) and checked to be ``seed`` of
    ``experiment``; a :class:`SeedRecordError` naming the file otherwise."""
    path = Path(path)
    manifest_file = path / MANIFEST_NAME
    data = read_regular(manifest_file, SeedRecordError, missing=f"missing; {path} is not a complete seed record "
                        "(delete the folder to run the seed again)")
    manifest = _json_object(manifest_file, data)
    if manifest.get("format") != RECORD_FORMAT:
        raise SeedRecordError(f"{manifest_file}: format {manifest.get('format')!r}, expected {RECORD_FORMAT}")
    if manifest.get("experiment") != experiment or manifest.get("seed") != seed:
        raise SeedRecordError(f"{manifest_file}: the record of seed {manifest.get('seed')!r} of experiment "
                              f"{manifest.get('experiment')!r}, expected seed {seed} of {experiment!r}")
    listed, arms, steps = manifest.get("files"), manifest.get("arms"), manifest.get("steps")
    if (not isinstance(listed, dict) or not isinstance(arms, list) or not all(isinstance(a, str) for a in arms)
            or not isinstance(steps, int)):
        raise SeedRecordError(f"{manifest_file}: expected 'files' (an object), 'arms' (a list of names) and "
                              "'steps' (an integer)")
    needed = {CONFIG_NAME, ENVIRONMENT_NAME, WARM_START_NAME, *(f"metrics/{a}.jsonl" for a in arms)}
    if needed - set(listed):
        raise SeedRecordError(f"{manifest_file}: does not list {sorted(needed - set(listed))}")
    present = {p.relative_to(path).as_posix() for p in path.rglob("*") if not p.is_dir() or p.is_symlink()}
    unlisted = sorted(present - set(listed) - {MANIFEST_NAME})
    if unlisted:
        raise SeedRecordError(f"{path / unlisted[0]}: not listed in {MANIFEST_NAME}, not part of the record")
    data = {name: _verified(path / name, entry, manifest_file) for name, entry in sorted(listed.items())}
    return SeedRecord(
        path=path,
        config=_json_object(path / CONFIG_NAME, data[CONFIG_NAME]),
        environment=_json_object(path / ENVIRONMENT_NAME, data[ENVIRONMENT_NAME]),
        warm_start=_json_object(path / WARM_START_NAME, data[WARM_START_NAME]),
        metrics={a: parse_metrics_lines(data[f"metrics/{a}.jsonl"].decode("utf-8"), path / "metrics" / f"{a}.jsonl")
                 for a in arms},
        steps=steps,
    )


def _verified(file: Path, entry: Any, manifest_file: Path) -> bytes:
    if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)):
        raise SeedRecordError(f"{manifest_file}: the entry of {file.name} is not {{'size': int, 'sha256': str}}")
    data = read_regular(file, SeedRecordError, missing=f"missing (listed in {manifest_file.name}); the record is torn")
    if len(data) != entry["size"]:
        raise SeedRecordError(f"{file}: {len(data)} bytes, {manifest_file.name} lists {entry['size']}; the record "
                              "is torn or was edited")
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise SeedRecordError(f"{file}: sha256 {digest} differs from {manifest_file.name}'s {entry['sha256']}; "
                              "the file was changed")
    return data


def _json_object(file: Path, data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise SeedRecordError(f"{file}: malformed JSON ({e})") from None
    if not isinstance(value, dict):
        raise SeedRecordError(f"{file}: not a JSON object")
    return value
