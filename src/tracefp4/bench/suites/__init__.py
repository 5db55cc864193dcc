"""The suites of ``tracefp4 bench``: each declares its command, its options, how a run is made and
printed, and the option values of its toy size (``tracefp4 bench all --size toy``: a check that the
suite runs, not a measurement)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Callable

from tracefp4.bench.result import Run

__all__ = ["SUITES", "Suite"]


@dataclasses.dataclass(frozen=True)
class Suite:
    """One suite. ``command``: the ``tracefp4 bench`` subcommand whose options it takes (the long
    suite is ``rollout --preset long``); ``full`` and ``toy``: that command's arguments for ``bench all``."""

    name: str
    command: str
    help: str
    full: tuple[str, ...] = ()
    toy: tuple[str, ...] = ()

    @property
    def _command(self):
        # imported on use: a suite's module imports torch, vLLM helpers and the engines
        return importlib.import_module(f"tracefp4.bench.suites.{self.command}")

    @property
    def add_arguments(self) -> Callable[[argparse.ArgumentParser], None]:
        return self._command.add_arguments

    @property
    def description(self) -> str:
        return self._command.__doc__.split("\n\n")[0]

    def run(self, args: argparse.Namespace) -> Run:
        return self._command.run(args)

    def format(self, run: Run) -> str:
        return getattr(importlib.import_module(f"tracefp4.bench.suites.{self.name}"), f"format_{self.name}")(run)


_TINY_MOE = ("--layers", "1", "--hidden", "64", "--experts", "4", "--top-k", "2", "--expert-dim", "32", "--heads", "2",
             "--kv-heads", "1", "--head-dim", "32")

#: Every suite, in the order ``bench all`` runs them.
SUITES = {s.name: s for s in (
    Suite("numerics", "numerics", "quantize / dequantize / hints / guided rounding vs a tensor copy and torchao",
          toy=("--rows", "64", "--cols", "256", "--repeats", "1")),
    Suite("system", "system", "guidance cost on a small MoE: rollout recording, the guided train step, the store",
          toy=("--batch", "2", "--new-tokens", "2", "--repeats", "1", "--tiny")),
    Suite("attention", "attention", "one decode step of FP4 paged attention vs vLLM's BF16 CPU attention",
          toy=("--context", "32", "--batch", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "64",
               "--repeats", "1")),
    Suite("rollout", "rollout", "rollout tokens/s and memory per engine (home, vllm) and mode",
          toy=("--preset", "bandwidth", "--engines", "home", *_TINY_MOE, "--batch", "2", "--new-tokens", "2",
               "--no-memory")),
    Suite("long", "rollout", "decode at long contexts, KV bytes and capacity (rollout --preset long)",
          full=("--preset", "long"),
          toy=("--preset", "long", "--engines", "home", *_TINY_MOE, "--contexts", "64", "--home-contexts", "64",
               "--batch", "1", "--new-tokens", "4", "--repeats", "1", "--profile-steps", "1")),
)}
