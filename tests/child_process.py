"""A child process a test starts ahead of its turn and checks later (tests/fresh_interpreter.py's
Triton children, tests/test_vllm.py's engine scripts): started, left to run beside other tests, then
waited for and read as ``subprocess.run(..., capture_output=True, text=True)`` would return it."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path


class Child:
    """A started child process; its stdout and stderr go to files in ``folder`` (nothing reads them
    before it has exited, so no pipe can fill and block it). Without ``folder``, a temporary one that
    is removed once the output is read or the child stopped."""

    def __init__(self, argv: list[str], env: dict[str, str], folder: Path | None = None,
                 cwd: Path | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="test-child-") if folder is None else None
        self.argv = argv
        self.folder = Path(folder if folder is not None else self._tmp.name)
        with (self.folder / "stdout").open("w") as out, (self.folder / "stderr").open("w") as err:
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err, text=True)

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """The finished process (killed, and TimeoutExpired raised, past ``timeout`` seconds)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        done = subprocess.CompletedProcess(self.argv, rc, (self.folder / "stdout").read_text(),
                                           (self.folder / "stderr").read_text())
        self._cleanup()
        return done

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
