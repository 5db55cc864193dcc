"""The vLLM plugin: ``register()`` is the ``vllm.general_plugins`` entry point ``tracefp4``.

vLLM calls it in every process that builds an engine or a worker (``load_general_plugins``), possibly
several times; it is idempotent. It

1. selects numba's ``workqueue`` threading layer unless the user chose one: numba's default ``omp``
   layer shares the OpenMP runtime with vLLM's CPU kernels, and a numba thread-count change then
   breaks vLLM's CPU attention (``thread_num`` check). :mod:`tracefp4.formats.kernels` makes the same
   choice;
2. installs :func:`install_numba_shim` before anything imports numba: vLLM's worker start-up scans
   every module namespace with ``vars(obj).get("kernel")`` (``triton_utils/dispatcher.py`` on a
   platform without a Triton backend), and ``llvmlite.binding.ffi.lib`` answers ``__dict__`` with a
   function wrapper, which crashes that scan;
3. registers the ``tracefp4`` quantization config (:mod:`.quant`);
4. wraps the attention backend's ``do_kv_cache_update`` (the CPU backend's here, any other backend's
   when the worker finds it: :func:`install_kv_wrapper`) so K and V are quantized per token and KV
   head (``plan.quantizer("k"/"v")``) before they enter the cache, stored as the dequantized FP4
   values in the cache's dtype (as our ``FP4KVCache`` stores them), and recorded. The CPU attention reads K/V only from the cache (prefill too), so
   every position attends to FP4 K/V, as in our transformers path. vLLM calls that method from its
   ``unified_kv_cache_update`` custom op, so it runs eagerly in compiled mode too. (The quantization
   config's ``kv_store="values"``; with ``"packed"`` the layers use :mod:`.kv_backend`, which
   quantizes into a packed cache itself and is left unwrapped);
5. makes the MoE layers whose routed experts use our method call vLLM's ``moe_forward`` custom op
   (:func:`install_moe_custom_op`), as vLLM does on GPU: on CPU vLLM calls the plain Python MoE
   forward, which ``torch.compile`` traces into, and our method (numba kernels, recording into Python
   objects, data-dependent expert counts) cannot be traced. Inside the opaque op it runs eagerly,
   in eager and in compiled mode alike, so both record through the same code;
6. marks vLLM's dummy forwards (memory profiling and compile warm-up run on uninitialised buffers,
   whose NaNs our quantizers refuse): there the sites zero non-finite inputs
   (:func:`install_dummy_run_guard`); every real forward is checked as everywhere else.
"""

from __future__ import annotations

from tracefp4.engines.vllm.process import prepare_process

__all__ = ["register", "install_kv_wrapper", "install_moe_custom_op", "install_dummy_run_guard", "kv_site"]

_registered = False


def kv_site(layer_name: str, key, value):
    """K and V ``[tokens, kv_heads, head_dim]`` of attention layer ``layer_name``
    (``model.layers.N.self_attn.attn``) as the cache must store them under the forward's plan:
    quantized per token and KV head (rows ``token x head``) by ``plan.quantizer("k"/"v")`` through
    :func:`tracefp4.engines.model.quantize_site`, and recorded by the forward's capture."""
    from tracefp4.engines.sites import quantize_site
    from tracefp4.engines.vllm.runtime import RUNTIME, layer_index
    from tracefp4.guidance.names import Site

    state = RUNTIME.state()
    if state.plan is None:
        return key, value
    i = layer_index(layer_name)
    key, value = RUNTIME.site_input(key), RUNTIME.site_input(value)
    return quantize_site(state, i, Site.K, key), quantize_site(state, i, Site.V, value)


def install_kv_wrapper(impl_cls=None) -> None:
    """Quantize K/V (and record them) where an attention backend writes its cache: every vLLM V1
    backend of standard attention implements ``do_kv_cache_update(layer, key, value, kv_cache,
    slot_mapping)`` and vLLM calls it from its ``unified_kv_cache_update`` custom op. Without
    ``impl_cls``: the CPU backend's class (wrapped at registration, before the warm-up forwards);
    the worker wraps the class of whatever backend its attention layers use. Idempotent."""
    import inspect

    if impl_cls is None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as impl_cls
    if getattr(impl_cls, "_tracefp4_kv", False):
        return
    orig = getattr(impl_cls, "do_kv_cache_update", None)
    params = list(inspect.signature(orig).parameters)[1:] if orig is not None else []
    if params[:5] != ["layer", "key", "value", "kv_cache", "slot_mapping"]:
        raise NotImplementedError(
            f"tracefp4: attention backend {impl_cls.__name__} has no do_kv_cache_update(layer, key, value, kv_cache, "
            f"slot_mapping) to quantize K/V in (found {params or 'none'}; MLA and other layouts are not supported)"
        )

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
        key, value = kv_site(layer.layer_name, key, value)
        return orig(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs)

    impl_cls.do_kv_cache_update = do_kv_cache_update
    impl_cls._tracefp4_kv = True


def install_moe_custom_op() -> None:
    """Route MoE layers with :class:`~.quant.TraceFP4MoEMethod` experts through vLLM's registered
    ``moe_forward`` custom op (opaque to ``torch.compile``); idempotent."""
    import torch
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from tracefp4.engines.vllm.quant import TraceFP4MoEMethod

    if getattr(MoERunner, "_tracefp4_op", False):
        return
    orig = MoERunner._select_forward

    def _select_forward(self):
        if isinstance(getattr(self.routed_experts, "quant_method", None), TraceFP4MoEMethod):
            return torch.ops.vllm.moe_forward if self._shared_experts is None else torch.ops.vllm.moe_forward_shared
        return orig(self)

    MoERunner._select_forward = _select_forward
    MoERunner._tracefp4_op = True


def install_dummy_run_guard() -> None:
    """Mark vLLM's dummy forwards (memory profiling, compile warm-up: garbage inputs, discarded
    outputs) so the sites zero non-finite inputs there instead of refusing them; idempotent."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from tracefp4.engines.vllm.runtime import dummy_forward

    if not getattr(GPUModelRunner._dummy_run, "_tracefp4_dummy", False):
        GPUModelRunner._dummy_run = dummy_forward(GPUModelRunner._dummy_run)


def register() -> None:
    global _registered
    if _registered:
        return
    prepare_process()
    import tracefp4.engines.vllm.quant  # noqa: F401  (registers the "tracefp4" quantization config)

    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        install_kv_wrapper()
    install_moe_custom_op()
    install_dummy_run_guard()
    _registered = True
