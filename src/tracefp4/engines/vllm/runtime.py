"""The worker-side state of the plugin: what the forward in progress computes and records.

vLLM runs the model inside its worker; the quant method's ``apply`` and the K/V wrapper read the
process-global :data:`RUNTIME` at run time:

* ``plan``: the precision plan of the forward (``None``: BF16). Outside a :class:`VLLMEngine`
  call it is the quantization config's plan (vLLM's warm-up forwards, a plain ``LLM.generate``);
  in a process whose engine has no ``tracefp4`` quantization config (vLLM's own BF16 engine, with
  our plugin loaded because it is installed) it is None, so the K/V wrapper leaves the cache BF16.
* ``capture``: a :class:`~tracefp4.engines.capture.RolloutCapture`: the same object our own engine
  hands its seams, so the recorded tensors are exactly what our engine records.
* ``steps``: while recording, one :class:`StepRecord` per model forward: the batch's rows mapped to
  (internal request id, position) plus that forward's :class:`~tracefp4.engines.capture.ForwardRecord`
  and the policy version its weights were (``version``: set by every weight load, so a load between two
  forwards of one generation shows in the rows of the second).

This module does not import vLLM. The runtime is per process, the worker's: the engine reaches it
through the worker extension's RPC methods (:mod:`.worker`), in-process or across processes alike.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch

from tracefp4.engines.capture import ForwardRecord, RolloutCapture
from tracefp4.engines.sites import ForwardState
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.sink import UNKNOWN_VERSION

__all__ = ["StepRecord", "WorkerRuntime", "RUNTIME", "layer_index", "install_step_recorder", "dummy_forward"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@functools.lru_cache(maxsize=4096)  # asked at every K/V site of every forward
def layer_index(name: str) -> int:
    """``model.layers.7.mlp.experts`` -> 7 (vLLM's module prefixes and attention layer names)."""
    m = _LAYER.search(name)
    if m is None:
        raise ValueError(f"cannot find a decoder layer index in {name!r}")
    return int(m.group(1))


@dataclasses.dataclass
class StepRecord:
    """One model forward: row ``i`` belongs to ``req_ids[j]`` for ``qsl[j] <= i < qsl[j+1]`` and sits
    at ``positions[i]``; ``record`` holds what the seams recorded over those rows."""

    req_ids: list[str]
    query_start_loc: list[int]
    positions: torch.Tensor
    input_ids: torch.Tensor | None
    record: ForwardRecord
    version: int = UNKNOWN_VERSION


class WorkerRuntime:
    def __init__(self) -> None:
        # set by TraceFP4Config when an engine is built with it; None (BF16) otherwise
        self.config_plan: PrecisionPlan | None = None
        self.call_plan: PrecisionPlan | None = None
        self.in_call = False  # a VLLMEngine.generate is in progress (call_plan applies)
        self.capture = RolloutCapture()
        self.recording = False
        self.steps: list[StepRecord] = []
        # vLLM's dummy forwards (memory profiling, compile warm-up) run on whatever the buffers hold:
        # their inputs may be NaN, which the quantizers rightly refuse, and their outputs are thrown away
        self.dummy = False
        self._state: ForwardState | None = None
        # the policy version of the weights the worker holds (set by every weight load; unknown before)
        self.version = UNKNOWN_VERSION

    @property
    def plan(self) -> PrecisionPlan | None:
        return self.call_plan if self.in_call else self.config_plan

    def site_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a site quantizes it: unchanged, except in a dummy forward, where non-finite
        values (garbage buffers) become 0 so that the forward still does all its work."""
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) if self.dummy else x

    def state(self) -> ForwardState:
        """What the seams of the forward in progress compute with and record into (one object while
        the plan and capture stay: asked at every site)."""
        plan, capture = self.plan, self.capture
        kept = self._state
        if kept is None or kept.plan is not plan or kept.path is not capture:
            kept = self._state = ForwardState(plan, capture)
        return kept

    def begin(self, plan: PrecisionPlan | None, capture: RolloutCapture) -> None:
        self.call_plan, self.capture, self.in_call, self.recording = plan, capture, True, True
        self.steps = []

    def end(self) -> list[StepRecord]:
        steps, self.steps = self.steps, []
        self.in_call, self.recording, self.call_plan = False, False, None
        self.capture = RolloutCapture()
        return steps


RUNTIME = WorkerRuntime()


def install_step_recorder(worker) -> str:
    """Wrap ``worker.model_runner._model_forward`` so every forward becomes one :class:`StepRecord`
    (or, when not recording, leaves nothing behind). ``collective_rpc`` target; idempotent."""
    runner = worker.model_runner
    if getattr(runner, "_tracefp4_recorder", False):
        return "already"
    orig = runner._model_forward

    def _model_forward(input_ids=None, positions=None, *args, **kwargs):
        RUNTIME.capture.take()  # start empty whatever a previous forward left
        try:
            return orig(input_ids, positions, *args, **kwargs)
        finally:
            record = RUNTIME.capture.take()
            if RUNTIME.recording:
                n = runner.input_batch.num_reqs
                RUNTIME.steps.append(
                    StepRecord(
                        req_ids=list(runner.input_batch.req_ids[:n]),
                        query_start_loc=runner.query_start_loc.cpu[: n + 1].tolist(),
                        positions=positions.detach().cpu().clone(),
                        input_ids=None if input_ids is None else input_ids.detach().cpu().clone(),
                        record=record,
                        version=RUNTIME.version,
                    )
                )

    runner._model_forward = _model_forward
    runner._tracefp4_recorder = True
    return "installed"


def dummy_forward(fn):
    """Wrap vLLM's ``_dummy_run`` so :attr:`WorkerRuntime.dummy` is set while it runs."""

    def wrapped(*args, **kwargs):
        RUNTIME.dummy = True
        try:
            return fn(*args, **kwargs)
        finally:
            RUNTIME.dummy = False

    wrapped._tracefp4_dummy = True
    return wrapped
