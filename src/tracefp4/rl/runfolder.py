"""Run folders that never mix two runs, and resumes that reproduce the run they continue.

A run folder is created once (:func:`create_run_folder`: refused if the folder exists and is not
empty) and continued only with ``--resume`` (:func:`open_for_resume`: refused if the configuration
differs in anything that can change a number of the run). Every refusal is a :class:`RunFolderError`
(a ``ValueError``) of one line that names the path, and for a configuration, each differing key with
its old and new value.

Which configuration keys may differ on resume (and why)
    A resumed run must end with the same weights, bit for bit, and the same metrics rows as an
    uninterrupted one. So only keys that cannot change any number may differ:

    * ``out``, ``run_name``, ``resume``: where the run folder is and how it was found.
    * ``arms``: which arms this invocation runs (a subset to finish one arm, more to add one). Every
      arm starts from the same warm start with seeds that depend only on the step, never on the
      other arms, so an arm's numbers do not depend on which other arms ran before it (checked by
      killing runs in one arm and resuming after the others finished: bit-identical).
    * ``steps`` may grow (to extend a finished run); the steps already taken are the same steps.
      It may not shrink: the run has taken (or checkpointed) steps a shorter run never takes.

    Everything else is refused, including keys one might expect to be harmless:

    * ``threads``: the CPU thread count changes results. With MKL/OpenMP a float32 matmul, a bf16
      matmul and a ``sum`` of a long vector all differ in the last bits between 1 and 2 threads
      (measured on our machines), so a step recomputed with another thread count is not the same
      step. A caller that accepts this can pass ``allow={"threads"}``.
    * ``rollout_workers``: worker processes split the batch differently and the code mismatch is
      measured from different records, so both rollouts and metrics can change.
    * ``eval_every``, ``eval_size``: they change the metrics rows (evaluation rows), if not the weights.
    * Keys missing on one side (a configuration written by another version of the code) are
      differences too: a new key's default is not known to reproduce the old run.

    Nested tables (``model``, ``task_kwargs``) are compared key by key and named with dots
    (``model.hidden``). Values are compared as JSON (tuples and lists are the same).

What else determines a run's numbers (CPU kernels, threads, library versions,
:mod:`tracefp4.provenance`) is recorded in ``environment.json`` when the folder is created;
:func:`record_environment` adds each resume's environment and names what differs (a resume on
another machine or library set continues the run, but its remaining steps are not the steps an
uninterrupted run would have taken there).

A run folder is used by one process at a time: :func:`lock_run_folder` takes an advisory
``flock`` on ``.lock`` in the folder (released by the kernel when the process dies, so a killed run
never leaves a stale lock behind).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from tracefp4.files import atomic_write_json, fsync_dir

__all__ = [
    "CONFIG_NAME",
    "ENVIRONMENT_NAME",
    "GROWABLE_KEYS",
    "LOCK_NAME",
    "RESUME_NEUTRAL_KEYS",
    "RunFolderError",
    "check_model_folder",
    "check_new_run_folder",
    "check_run_folder",
    "config_differences",
    "create_run_folder",
    "lock_run_folder",
    "open_for_resume",
    "record_environment",
]

CONFIG_NAME = "config.json"
ENVIRONMENT_NAME = "environment.json"
LOCK_NAME = ".lock"
RESUME_NEUTRAL_KEYS = frozenset({"out", "run_name", "resume", "arms"})
GROWABLE_KEYS = frozenset({"steps"})
#: Keys added after run folders existed: absent from an older saved config means this default.
#: Each default reproduces what a run did before its key existed (the baselines' knobs only act in
#: their own arms), so an older folder resumes under a newer version.
LATER_KEYS_DEFAULTS = {"trainer_world_size": 1, "sc_top_k": 128, "sc_is_cap": 2.0, "quads_fraction": 0.5,
                       "is_mode": "token-truncate", "model.max_positions": 128, "max_staleness": 0,
                       "staleness_schedule": "fixed", "guidance_max_lag": None, "model.dense": False,
                       "warm_start_prefixes": 0, "warm_start_prefix_tokens": 64}
_MISSING = object()


class RunFolderError(ValueError):
    """A run folder that cannot be created, resumed or read as asked (one line naming the path)."""


def _json_normal(config: Mapping[str, Any]) -> dict[str, Any]:
    # The form the config has once saved: tuples become lists, non-JSON values their str().
    return json.loads(json.dumps(dict(config), default=str))


def _config_bytes(config: Mapping[str, Any]) -> bytes:
    text = json.dumps(_json_normal(config), indent=2, sort_keys=True, allow_nan=False) + "\n"
    return text.encode("utf-8")


_NOT_EMPTY = "run folder {path} is not empty: starting a new run in an existing run folder without --resume is refused"


def check_new_run_folder(out: str | os.PathLike[str], name: str | None) -> Path:
    """The path a new run would get (a timestamp when ``name`` is None); refused if already in use.

    Only a check (nothing is created); :func:`create_run_folder` checks again and claims the folder.
    """
    path = Path(out) / (name or time.strftime("%Y%m%d-%H%M%S"))
    if path.exists() and not path.is_dir():
        raise RunFolderError(f"run folder {path} exists and is not a folder")
    if path.is_dir() and any(not _is_config_temp(p) for p in path.iterdir()):
        raise RunFolderError(_NOT_EMPTY.format(path=path))
    return path


def _is_config_temp(p: Path) -> bool:
    return p.name.startswith(f".{CONFIG_NAME}.") and p.name.endswith(".tmp") and p.is_file() and not p.is_symlink()


def create_run_folder(out: str | os.PathLike[str], name: str | None, config: Mapping[str, Any]) -> Path:
    """Create ``out/name`` (a timestamp when ``name`` is None) for a new run and write its config.json.

    An existing empty folder is used; an existing non-empty one is refused, so two runs never share
    a folder. The config is published with ``link``, which fails if config.json appeared meanwhile,
    so of two processes creating the same folder at once exactly one succeeds.
    """
    path = check_new_run_folder(out, name)
    path.mkdir(parents=True, exist_ok=True)
    refused = RunFolderError(_NOT_EMPTY.format(path=path))
    for p in path.iterdir():
        if not _is_config_temp(p):
            raise refused
        p.unlink(missing_ok=True)  # left by a create that was killed before config.json was published
    tmp = path / f".{CONFIG_NAME}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write(_config_bytes(config))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path / CONFIG_NAME)
        except FileExistsError:
            raise refused from None
    finally:
        tmp.unlink(missing_ok=True)
    (path / "metrics").mkdir(exist_ok=True)
    (path / "plots").mkdir(exist_ok=True)
    fsync_dir(path)
    return path


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):  # an empty table is the same as no table
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _show(value: Any) -> str:
    return "(absent)" if value is _MISSING else json.dumps(value, sort_keys=True)


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any], *, allow: Iterable[str] = ()) -> list[str]:
    """``"key: old -> new"`` for every difference between two configs that would change the run."""
    allowed = RESUME_NEUTRAL_KEYS | set(allow)
    a, b = _flatten(_json_normal(old)), _flatten(_json_normal(new))
    diffs = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, LATER_KEYS_DEFAULTS.get(key, _MISSING)), b.get(key, LATER_KEYS_DEFAULTS.get(key, _MISSING))
        if key in allowed or key.split(".")[0] in allowed or va == vb:
            continue
        if key in GROWABLE_KEYS and isinstance(va, int) and isinstance(vb, int) and vb >= va:
            continue
        note = f" ({key} may only grow)" if key in GROWABLE_KEYS else ""
        diffs.append(f"{key}: {_show(va)} -> {_show(vb)}{note}")
    return diffs


def _read_config(path: Path) -> dict[str, Any]:
    if not (path / CONFIG_NAME).is_file():
        raise RunFolderError(
            f"{path} has no {CONFIG_NAME}: not a run folder (or its creation was interrupted); cannot resume it"
        )
    return _read_json(path / CONFIG_NAME)


def _read_json(file: Path) -> dict[str, Any]:
    try:
        saved = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:
        raise RunFolderError(f"{file}: malformed JSON ({e})") from None
    except OSError as e:
        raise RunFolderError(f"{file}: cannot be read ({e.strerror})") from None
    if not isinstance(saved, dict):
        raise RunFolderError(f"{file}: not a JSON object")
    return saved


def open_for_resume(path: str | os.PathLike[str], config: Mapping[str, Any], *, allow: Iterable[str] = ()) -> Path:
    """Check that run folder ``path`` can be continued with ``config``; returns the path.

    Refused: a missing folder, one without config.json, and a config that differs from the saved one
    in a key that changes the run (see the module docstring; ``allow`` adds keys the caller accepts
    to differ). When the configs differ only in allowed keys the new config replaces the saved one
    (atomically), so a later resume compares against the latest. Calling it twice is harmless.
    """
    path = Path(path)
    if not path.exists():
        raise RunFolderError(f"run folder {path} to resume does not exist")
    if not path.is_dir():
        raise RunFolderError(f"run folder {path} to resume is not a folder")
    saved = _read_config(path)
    diffs = config_differences(saved, config, allow=allow)
    if diffs:
        raise RunFolderError(
            f"resuming {path} with a different configuration is refused (the run would not be reproduced): "
            + "; ".join(diffs)
        )
    new = _json_normal(config)
    if new != saved:
        atomic_write_json(path / CONFIG_NAME, new)
    return path


def record_environment(path: str | os.PathLike[str], env: Mapping[str, Any]) -> list[str]:
    """Record the environment this process runs the folder's run in: as the run's own on the first
    call, as a resume after that (``{"created": ..., "resumes": [...]}``, rewritten atomically).
    Returns what differs from the environment the run was created in (empty: same numerics)."""
    from tracefp4.provenance import environment_differences

    file = Path(path) / ENVIRONMENT_NAME
    if not file.exists():
        atomic_write_json(file, {"created": dict(env), "resumes": []})
        return []
    saved = _read_json(file)
    created = saved.get("created")
    if not isinstance(created, dict) or not isinstance(saved.get("resumes"), list):
        raise RunFolderError(f"{file}: expected {{'created': {{...}}, 'resumes': [...]}}")
    atomic_write_json(file, {"created": created, "resumes": [*saved["resumes"], dict(env)]})
    return environment_differences(created, env)


def check_run_folder(path: str | os.PathLike[str]) -> Path:
    """A run folder to read (``tracefp4 report``): it exists and has a ``metrics/`` folder."""
    path = Path(path)
    if not path.exists():
        raise RunFolderError(f"run folder {path} not found")
    if not path.is_dir():
        raise RunFolderError(f"run folder {path} is not a folder")
    if not (path / "metrics").is_dir():
        raise RunFolderError(f"{path} is not a run folder (it has no metrics/ folder)")
    return path


def check_model_folder(path: str | os.PathLike[str], what: str = "checkpoint") -> Path:
    """A local model folder to give ``load_model``: it exists, has config.json and safetensors weights.

    Without this check a wrong path reaches ``from_pretrained``, which reports it as an invalid
    Hugging Face hub repository name; we only ever load local folders.
    """
    path = Path(path)
    if not path.exists():
        raise RunFolderError(f"{what} folder {path} not found (only local folders are loaded, never a hub name)")
    if not path.is_dir():
        raise RunFolderError(f"{what} {path} is not a folder (a folder with config.json and *.safetensors is expected)")
    if not (path / "config.json").is_file():
        raise RunFolderError(f"{what} folder {path} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise RunFolderError(f"{what} folder {path} has no model weights (*.safetensors)")
    return path


@contextlib.contextmanager
def lock_run_folder(path: str | os.PathLike[str], *, job: str | None = None) -> Iterator[Path]:
    """Hold an advisory lock on run folder ``path`` for the enclosed block.

    Without ``job``: the whole folder, exclusively; a second process (a second ``--resume`` of the
    same folder) is refused with a RunFolderError naming the holder's pid. With ``job`` (the warm
    start or one arm, run in its own process beside the folder's other jobs: they write disjoint
    files): the folder shared and that job exclusively, so two processes may run two arms of one
    folder at once, while a whole-folder run or a second process on the same job is refused. The
    kernel drops the locks when the holder dies, however it dies.
    """
    path = Path(path)
    with _flock(path / LOCK_NAME, shared=job is not None, what=f"run folder {path}"):
        if job is None:
            yield path
            return
        with _flock(path / f"{LOCK_NAME}-{job}", shared=False, what=f"job {job!r} of run folder {path}"):
            yield path


@contextlib.contextmanager
def _flock(file: Path, *, shared: bool, what: str) -> Iterator[None]:
    import fcntl

    fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            raise RunFolderError(f"{what} is in use by another process (pid {holder})") from None
        os.ftruncate(fd, 0)  # with shared holders: the latest one's pid, which a refusal names
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
