"""A decode step's work captured once in a CUDA graph and replayed: how a GPU rollout engine (vLLM's
CUDA graphs, gpt-fast's ``torch.compile(mode="reduce-overhead")``) runs a layer without per-kernel
launch cost. Capture requires that the work never synchronises with the host and allocates on the
capture stream only after a warm-up run off it; that is what the rollout path's device sites
(:mod:`tracefp4.engines.device_sites`) and the Triton experts are written for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["capture"]


def capture(run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """``(graph, eager, captured)``: ``run`` once eagerly on a side stream (the warm-up capture needs,
    its output ``eager``), then captured into ``graph``, which is replayed once so ``captured`` (the
    graph's own output tensor, rewritten on every replay) holds the replay's result."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    return graph, eager, captured
