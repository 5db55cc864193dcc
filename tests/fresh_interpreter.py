"""Running a Triton test file again in a fresh Python process with Triton's interpreter enabled.

The interpreter (``TRITON_INTERPRET=1``) only takes effect if it is set before triton's first import;
when another test file imported triton first (torchao does), a Triton test file runs itself in a child
process instead. ``child_flag`` marks the child so it never recurses."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from child_process import Child

#: Children started ahead of their test (:func:`start_fresh_interpreter`), by test file.
_STARTED: dict[Path, Child] = {}


def _start(test_file: str, child_flag: str, ran_here: Sequence[str]) -> Child:
    assert os.environ.get(child_flag) != "1", "the fresh process could not enable the interpreter either"
    env = {**os.environ, "TRITON_INTERPRET": "1", child_flag: "1"}
    path = Path(test_file).resolve()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path),
           "-k", "not fresh_interpreter_process",
           # node ids are relative to the root directory (the child's working directory)
           *(f"--deselect={path.relative_to(path.parents[1]).as_posix()}::{name}" for name in ran_here)]
    return Child(cmd, env, cwd=path.parents[1])


def start_fresh_interpreter(test_file: str, child_flag: str, ran_here: Sequence[str] = ()) -> None:
    """Start ``test_file``'s child now (once), for :func:`run_in_fresh_interpreter` to wait for later:
    tests/conftest.py starts every selected one as the first Triton module begins, so that they run
    beside each other (one interpreter thread each) instead of one after the other."""
    path = Path(test_file).resolve()
    if path not in _STARTED:
        _STARTED[path] = _start(test_file, child_flag, ran_here)


def stop_started() -> None:
    """Kill the children no test waited for (their test failed before, or was not run)."""
    while _STARTED:
        _STARTED.popitem()[1].stop()


def run_in_fresh_interpreter(test_file: str, child_flag: str, timeout: float,
                             ran_here: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """pytest on ``test_file`` (all but its fresh-process test and the tests named in ``ran_here``) in
    a child process with the interpreter on; asserts the child could enable it and that its tests
    passed; returns the finished process. ``ran_here``: tests that never touch Triton, so that the
    interpreter changes nothing in them and the parent process has run them already. The child
    started by :func:`start_fresh_interpreter`, if it was, else one started now."""
    started = _STARTED.pop(Path(test_file).resolve(), None)
    proc = (started or _start(test_file, child_flag, ran_here)).result(timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    return proc
