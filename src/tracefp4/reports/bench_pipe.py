"""A benchmark's engine in a process of its own, spoken to over a pipe in JSON lines.

vLLM keeps process-wide state, so two vLLM engines cannot live in one process; with one process each,
their calls can be interleaved round by round (these machines drift by up to 2x over minutes, so one
engine's phase followed by another's would compare two different machines). The client sends one
line per request; the server answers each with one marked JSON line on its real stdout (libraries
print to stdout at import, so only marked lines count, and everything else is sent to stderr), which
the client keeps to quote when the server dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MARK", "ServerProcess", "answer_channel"]

MARK = "@tracefp4-bench "


class ServerProcess:
    """``python -m MODULE *args`` as a server (see the module docstring); ``name`` names it in errors."""

    def __init__(self, module: str, args: Sequence[str], name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")  # the server's stderr, quoted when it fails
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})})

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        rc = self.proc.wait()
        self.log.seek(0)
        raise RuntimeError(f"bench server {self.name} exited ({rc}):\n{self.log.read()[-3000:]}")

    def close(self, quit_line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send(quit_line)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def answer_channel() -> Callable[[Any], None]:
    """The server side: from here on whatever writes to stdout goes to stderr; the returned function
    writes one marked JSON answer to the real stdout."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(obj: Any) -> None:
        print(MARK + json.dumps(obj), file=out, flush=True)

    return answer
