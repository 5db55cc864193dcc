"""Timing decode steps, and where their time goes: the long preset's measurements that our engine's
cell (:mod:`tracefp4.reports.bench_long`) and the vLLM servers (:mod:`tracefp4.reports.long_server`)
share, so both count a rate and a time share the same way."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["REGIONS", "median_rate", "profiled", "random_prompts", "run_lengths", "share_of_events"]

#: Profiler region names per category, innermost wins (a site inside the experts is a site).
REGIONS = {"sites": ("tracefp4::site",),
            # vLLM's own BF16 experts run as one op outside moe_forward; ours inside it (router included)
            "experts": ("vllm::moe_forward", "_C::cpu_fused_moe", "tracefp4::experts"),
            "attention": ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update",
                          "tracefp4::attention")}


def share_of_events(events, wall_s: float) -> dict[str, float]:
    """``{experts, attention, sites, rest}`` fractions of ``wall_s`` from a profiler's events: each
    event's own (self) CPU time goes to the innermost enclosing region of a category; ``rest`` is the
    wall time the categories do not account for."""
    names = {n: cat for cat, ns in REGIONS.items() for n in ns}
    acc = dict.fromkeys(REGIONS, 0.0)
    for ev in events:
        node, cat = ev, None
        while node is not None and cat is None:
            cat = names.get(node.name)
            node = node.cpu_parent
        if cat is not None:
            acc[cat] += ev.self_cpu_time_total / 1e6
    share = {k: v / wall_s for k, v in acc.items()}
    share["rest"] = max(0.0, 1.0 - sum(share.values()))
    return share


def profiled(step: Callable[[], None], steps: int) -> dict[str, float]:
    """:func:`share_of_events` of ``steps`` calls of ``step`` under the profiler (the sites' regions on)."""
    from torch.profiler import ProfilerActivity, profile

    from tracefp4.engines.sites import site_regions

    with site_regions(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - t0
    return share_of_events(prof.events(), wall)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` random tokens (ids 3 and up: clear of the special ones), the
    same for the same arguments in every process."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + length * 31 + batch)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def run_lengths(n: int, repeats: int) -> list[int]:
    """The steps of each of ``repeats`` runs that alternate the modes of a cell: ``n // repeats``
    each, the last taking the remainder."""
    size = n // repeats
    return [size] * (repeats - 1) + [n - size * (repeats - 1)]


def median_rate(step_times: list[float], tokens_per_step: int, repeats: int) -> float:
    """Tokens/s of ``repeats`` equal runs of consecutive steps, median."""
    size = len(step_times) // repeats
    runs = [step_times[i * size:(i + 1) * size] for i in range(repeats)]
    return statistics.median(tokens_per_step * len(r) / sum(r) for r in runs)
