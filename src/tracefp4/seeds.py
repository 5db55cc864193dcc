"""Every seed derived from a run's seed, and every trajectory id, in one place.

A run has one seed (``RLConfig.seed``, TRL's ``args.seed``, a report's ``--seed``); each random stream
(the step's prompts, its sampler, a rollout worker's sampler, a minibatch order, ...) takes a seed
derived from it by :func:`derive`. Each :class:`Stream` keeps the formula its call site has always
used, so runs and stores written before this module existed are reproduced exactly; the multipliers
are primes so that two streams of one run never coincide for small steps.
"""

from __future__ import annotations

import enum

__all__ = ["Stream", "derive", "TrajectoryIds", "trajectory_ids"]


class Stream(enum.Enum):
    """A random stream of a run; the value names it, :func:`derive` holds its formula."""

    #: The step's prompts (``seed * 1_000_003 + step``): the same for every arm, so arms are compared
    #: on the same questions, and a resumed run draws what the interrupted one would have.
    PROMPTS = "prompts"
    #: The step's sampler in the RL loop (``seed * 7_919 + step``).
    SAMPLING = "sampling"
    #: Rollout worker ``i``'s sampler, from the step's sampling seed (``seed * 1009 + i``): the workers
    #: of one step sample independently.
    WORKER = "worker"
    #: One generation of the TRL integration on one process, ``(seed * 1_000_003 + step * 7_919 +
    #: rank * 104_729) mod 2**31`` (vLLM takes a 31-bit seed).
    GENERATION = "generation"
    #: The step's minibatch order (``seed + step``), the same on every trainer process.
    MINIBATCH = "minibatch"
    #: The supervised warm start's example order (``seed + 7919``).
    WARM_START = "warm_start"


def derive(seed: int, stream: Stream, *keys: int) -> int:
    """The seed of ``stream`` for the run seed ``seed`` and the stream's integer keys (the step; the
    worker; the step and the rank), by the stream's formula (see :class:`Stream`). A wrong number of
    keys is a ValueError naming the stream."""
    want = _ARITY[stream]
    if len(keys) != want:
        raise ValueError(f"seed stream {stream.value}: expected {want} integer key(s), got {len(keys)}: {keys}")
    k = [int(x) for x in keys]
    if stream is Stream.PROMPTS:
        return seed * 1_000_003 + k[0]
    if stream is Stream.SAMPLING:
        return seed * 7_919 + k[0]
    if stream is Stream.WORKER:
        return seed * 1009 + k[0]
    if stream is Stream.GENERATION:
        return (seed * 1_000_003 + k[0] * 7_919 + k[1] * 104_729) % (2**31)
    if stream is Stream.MINIBATCH:
        return seed + k[0]
    return seed + 7919  # WARM_START


_ARITY = {Stream.PROMPTS: 1, Stream.SAMPLING: 1, Stream.WORKER: 1, Stream.GENERATION: 2, Stream.MINIBATCH: 1,
          Stream.WARM_START: 0}


class TrajectoryIds(enum.Enum):
    """How each writer of the guidance store names its trajectories (the ids are the store's keys; the
    value is the pattern, over the step, the process rank and the trajectory's index ``b``)."""

    #: The RL loop: one step of the run.
    LOOP = "s{step:06d}-{b:04d}"
    #: The TRL integration: one generation of one process.
    TRL = "g{step:06d}-r{rank}-{b:05d}"
    #: A report's store round trip (one step per measured rollout).
    REPORT = "traj-{b:05d}"


def trajectory_ids(scheme: TrajectoryIds, n: int, *, step: int = 0, rank: int = 0) -> list[str]:
    """The ids of ``n`` trajectories of one step under ``scheme``."""
    return [scheme.value.format(step=step, rank=rank, b=b) for b in range(n)]
