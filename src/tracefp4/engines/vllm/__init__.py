"""TRACE inside vLLM: a vLLM plugin that runs tracefp4's precision plan in vLLM's engine, and
:class:`VLLMEngine`, a :class:`~tracefp4.engines.protocol.RolloutEngine` on top of it.

Only this subpackage imports vLLM, and only when one of its modules is used: importing
``tracefp4`` or ``tracefp4.engines`` never does. Modules:

* :mod:`.plugin`: ``register()``, the ``vllm.general_plugins`` entry point (numba shim, threading
  layer, the ``tracefp4`` quantization config, the K/V wrapper);
* :mod:`.quant`: the quantization config and the routed-experts method (our numerics);
* :mod:`.kv_layout`, :mod:`.kv_backend`: the packed FP4 KV cache (its layout, and the attention
  backend that writes and reads it);
* :mod:`.runtime`: the worker-side state (plan of the forward in progress, capture, step records);
* :mod:`.engine`: :class:`VLLMEngine`.

See ``docs/dev/vllm-engine.md``.
"""

from __future__ import annotations

__all__ = ["VLLMEngine"]


def __getattr__(name: str):
    if name == "VLLMEngine":
        from tracefp4.engines.vllm.engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
