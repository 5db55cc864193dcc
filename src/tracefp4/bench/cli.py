"""``tracefp4 bench``: a subcommand per suite's command, and ``all``, which runs every suite."""

from __future__ import annotations

import argparse
import sys

from tracefp4.bench.result import Run, save
from tracefp4.bench.suites import SUITES

__all__ = ["add_bench_commands"]

#: ``bench all``'s sizes: ``full`` runs each suite at its defaults (the long suite alone takes ~25
#: minutes on 2 cores); ``toy`` at the smallest shapes each runs, our engine only: a check that
#: every suite runs and writes valid results, not a measurement.
SIZES = ("full", "toy")


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="also write the run as a results file (tracefp4.bench.result)")


def _command_line(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The command as it could be typed again: the options that differ from their defaults."""
    words = [p.prog]
    for action in p._actions:  # argparse has no public walk of a parser's options
        if not action.option_strings or action.dest in ("help", "json"):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if value is True:
            words.append(flag)
        else:
            words += [w for v in (value if isinstance(value, list) else [value]) for w in (flag, str(v))]
    return " ".join(words)


def _write(path: str | None, runs: list[Run]) -> None:
    if path:
        save(path, runs)
        print(f"wrote {path}")


def _run_one(p: argparse.ArgumentParser, args: argparse.Namespace) -> Run:
    suite = SUITES["long" if getattr(args, "preset", None) == "long" else args.bench]
    run = suite.run(args)
    run.config["command"] = _command_line(p, args)
    return run


def add_bench_commands(bsub) -> None:
    """Add each suite's command and ``all`` to a ``bench`` subparsers object (the ``tracefp4`` CLI's)."""
    for suite in SUITES.values():
        if suite.command != suite.name:
            continue  # its options are another command's (the long suite: rollout --preset long)
        b = bsub.add_parser(suite.name, help=suite.help, description=suite.description)
        suite.add_arguments(b)
        _add_json(b)

        def cmd(args: argparse.Namespace, p: argparse.ArgumentParser = b) -> int:
            run = _run_one(p, args)
            print(SUITES[run.suite].format(run))
            _write(args.json, [run])
            return 0

        b.set_defaults(func=cmd)
    a = bsub.add_parser("all", help="every suite (" + ", ".join(SUITES) + "), into one results file",
                        description="Runs every suite in turn, each at its own defaults (--size full) or at a toy "
                        "size (--size toy: a check that each runs, not a measurement), and writes one results "
                        "file of their runs.")
    a.add_argument("--size", choices=SIZES, default="full")
    _add_json(a)
    a.set_defaults(func=cmd_all)


def cmd_all(args: argparse.Namespace) -> int:
    runs = []
    for suite in SUITES.values():
        p = argparse.ArgumentParser(prog=f"tracefp4 bench {suite.command}")
        suite.add_arguments(p)
        sub = p.parse_args(list(suite.toy if args.size == "toy" else suite.full))
        sub.bench = suite.command
        print(f"== {suite.name} ({' '.join(suite.toy if args.size == 'toy' else suite.full) or 'defaults'})",
              file=sys.stderr, flush=True)
        run = _run_one(p, sub)
        print(suite.format(run))
        runs.append(run)
    _write(args.json, runs)
    return 0
