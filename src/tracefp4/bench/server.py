"""A benchmark's vLLM engine in a process of its own, spoken to in JSON lines: the one engine server.

vLLM keeps process-wide state, so two vLLM engines cannot live in one process; with one process
each, their calls can be interleaved round by round (these machines drift by up to 2x over
minutes, so one engine's phase followed by another's would compare two different machines).
``python -m tracefp4.bench.server KIND CKPT`` builds the :class:`~tracefp4.pipeline.factory.EngineKind`
engine on the checkpoint from the first stdin line (``max_len``, ``max_seqs``, optional
``kv_bytes``), answers ``{"ready": true}``, then one JSON answer per JSON command:

* ``generate`` (``mode``, ``prompts``, ``new_tokens``): one generation, its seconds (``seconds``);
* ``decode`` (``modes``, ``batch``, ``context``, ``profile``, ``cfg``): a stepped decode cell
  (:func:`tracefp4.bench.decode.vllm_decode`);
* ``capacity_begin`` (``mode``, ``cfg``), ``capacity_steps`` (``seconds``), ``capacity_end``: the
  capacity run of one mode, stepped in turns (:class:`tracefp4.bench.decode.CapacityRun`);
* ``kv``: its cache's bytes, capacity in tokens and block size;
* ``quit``.

Libraries print to stdout at import, so the server sends everything else to stderr and marks its
answers; the client keeps the server's stderr to quote when it dies. :class:`EngineServer` is the
client's handle on one; :func:`start_servers` builds several side by side.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from tracefp4.pipeline.factory import EngineKind

__all__ = ["EngineServer", "serve", "start_servers"]

MARK = "@tracefp4-bench "
#: The kinds a server builds (vLLM's own BF16 and FP8-KV engines, our plugin's).
VLLM_KINDS = (EngineKind.VLLM_BF16, EngineKind.VLLM_FP8KV, EngineKind.VLLM)


class ServerProcess:
    """``python -m tracefp4.bench.server *args``, its stdin and marked stdout lines; ``name`` names it in errors."""

    def __init__(self, args: list[str], name: str, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")  # the server's stderr, quoted when it fails
        self.proc = subprocess.Popen([sys.executable, "-m", "tracefp4.bench.server", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})})

    def send(self, obj: Any) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        rc = self.proc.wait()
        self.log.seek(0)
        raise RuntimeError(f"bench server {self.name} exited ({rc}):\n{self.log.read()[-3000:]}")

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send({"cmd": "quit"})
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class EngineServer:
    """The client's handle on one server (see the module docstring). ``wait=False`` returns once the
    process is started; :meth:`ready` then waits for its engine to be built."""

    def __init__(self, kind: EngineKind, ckpt: str, build: Mapping[str, Any], *, wait: bool = True,
                 env: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self.server = ServerProcess([kind.value, ckpt], kind.value, env)
        self.server.send(dict(build))
        if wait:
            self.ready()

    def ready(self) -> EngineServer:
        self.server.read()
        return self

    def ask(self, cmd: str, **args: Any) -> dict:
        self.server.send({"cmd": cmd, **args})
        return self.server.read()

    def close(self) -> None:
        self.server.close()


def start_servers(kinds: Mapping[str, EngineKind], ckpt: str, build: Mapping[str, Any],
                  env: Mapping[str, str] | None = None) -> dict[str, EngineServer]:
    """An :class:`EngineServer` per entry (name -> kind: one kind may serve under several names), their
    processes started together and built side by side (a build is mostly single-threaded imports and
    set-up); returns once every one is ready. Nothing is timed while they build. If one fails, all
    are closed."""
    servers: dict[str, EngineServer] = {}
    try:
        for name, kind in kinds.items():
            servers[name] = EngineServer(kind, ckpt, build, wait=False, env=env)
        for srv in servers.values():
            srv.ready()
    except BaseException:
        for srv in servers.values():
            srv.close()
        raise
    return servers


# --- the server side --------------------------------------------------------------------------------------


def _answer_channel() -> Callable[[Any], None]:
    """From here on whatever writes to stdout goes to stderr; the returned function writes one marked
    JSON answer to the real stdout."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(obj: Any) -> None:
        print(MARK + json.dumps(obj), file=out, flush=True)

    return answer


def _generate(e, mode: str, prompts: list[list[int]], new_tokens: int) -> float:
    from tracefp4.bench.decode import generate_mode
    from tracefp4.bench.harness import timed
    from tracefp4.engines.protocol import SamplingParams

    s = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
    return timed(lambda: generate_mode(e, mode, prompts, s, e.plan))()


def serve(kind: EngineKind, ckpt: str) -> None:
    """The server: the build line, then commands until ``quit`` or end of input (module docstring)."""
    from tracefp4.bench.decode import VLLM_SERVES, CapacityRun, vllm_decode
    from tracefp4.pipeline.factory import make_engine
    from tracefp4.engines.plan import PrecisionPlan
    from tracefp4.engines.vllm.engine import engine_env

    engine_env()
    build = json.loads(sys.stdin.readline())
    answer = _answer_channel()
    extra = {"kv_cache_memory_bytes": int(build["kv_bytes"])} if build.get("kv_bytes") else {}
    if kind is EngineKind.VLLM:
        extra["plan"] = PrecisionPlan()
    e = make_engine(kind, checkpoint=ckpt, max_len=build["max_len"], max_num_seqs=build["max_seqs"], **extra)
    serves = [m for m, k in VLLM_SERVES.items() if k is kind]
    run: CapacityRun | None = None
    try:
        answer({"ready": True})
        for line in sys.stdin:
            cmd = json.loads(line)
            name = cmd.pop("cmd")
            if name == "quit":
                break
            if name in ("generate", "capacity_begin") and cmd["mode"] not in serves:
                raise ValueError(f"bench server {kind.value}: mode {cmd['mode']!r}; it serves {serves}")
            if name == "generate":
                ans = {"seconds": _generate(e, cmd["mode"], cmd["prompts"], cmd["new_tokens"])}
            elif name == "decode":
                ans = vllm_decode(e, cmd["modes"], cmd["batch"], cmd["context"], cmd["cfg"], cmd["profile"])
            elif name == "capacity_begin":
                if run is not None:
                    raise ValueError("bench server: a capacity run is already in progress")
                run, ans = CapacityRun(e, cmd["mode"], cmd["cfg"]), {}
            elif name == "capacity_steps":
                ans = {"done": run.advance(cmd["seconds"])}
            elif name == "capacity_end":
                run, ans = None, run.result()
            elif name == "kv":
                ans = {**e.kv_cache_size(), "block_size": int(e.llm.llm_engine.vllm_config.cache_config.block_size)}
            else:
                raise ValueError(f"bench server: unknown command {name!r}")
            answer(ans)
    finally:
        if run is not None:
            run.abandon()
        e.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(f"usage: python -m tracefp4.bench.server {'|'.join(k.value for k in VLLM_KINDS)} CKPT "
              "(then a build line and commands on stdin: see the module docstring)", file=sys.stderr)
        return 2
    kind = EngineKind.parse(args[0], "bench server kind")
    if kind not in VLLM_KINDS:
        print(f"bench server: {kind.value} is not a vLLM engine", file=sys.stderr)
        return 2
    serve(kind, args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
