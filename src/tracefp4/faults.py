"""Crash points: named moments at which a process can be made to kill itself with SIGKILL.

Crash safety is a claim about every moment of a run; the tests make it checkable by killing a real
process at the moments that matter (mid-rollout, mid-store-write, after a seal, mid-checkpoint) and
resuming it. ``TRACEFP4_CRASH_AT=<point>:<n>`` makes the n-th call of ``crash_point(<point>)`` in
this process send SIGKILL to itself (no cleanup, no finally blocks, no buffered writes flushed, as
a power cut or the OOM killer would). Unset, a crash point is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["ENV", "crash_point"]

ENV = "TRACEFP4_CRASH_AT"

_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if ``TRACEFP4_CRASH_AT`` names this point and its count is reached."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, count = spec.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
