""":class:`VLLMEngine`: a :class:`~tracefp4.engines.protocol.RolloutEngine` on vLLM's offline ``LLM``.

vLLM samples; the plugin (:mod:`.plugin`, :mod:`.quant`) computes the routed experts and the KV cache
with our precision plan and records, per model forward, what our own engine records (same
:class:`~tracefp4.engines.capture.RolloutCapture`, same site function). This module maps the rows of
every forward to (trajectory, position) and assembles the records with our engine's
:func:`~tracefp4.engines.rollout.assemble_records`, so names, dtypes and layouts are exactly ours.

Decisions
    * **Eager by default, no prefix caching.** ``compilation`` picks how vLLM runs the model:
      ``"none"`` (default, ``enforce_eager=True``); ``"dynamo"``: the model is captured by Dynamo and
      run by the eager backend with vLLM's own CPU kernels (``custom_ops=["all"]``): the records are
      bit for bit those of ``"none"`` (tested); ``"inductor"``: vLLM's CPU default (Dynamo traced once,
      inductor, native ops), which fuses the non-MoE parts (norms, rope, residual adds) and changes
      their bf16 numerics, hence the FP4 codes: a trainer in eager PyTorch is further from it.
      Recording works the same in all three: the routed experts run inside vLLM's ``moe_forward``
      custom op and K/V inside its cache-update op, both opaque to the compiler (:mod:`.plugin`).
      ``enable_prefix_caching=False`` (a cached block is not recomputed: its rows would never be
      recorded, and stale blocks would survive a weight push).
    * **In-process or multiprocess.** Everything worker-side goes through the worker extension
      (:mod:`.worker`) by RPC name with plain arguments; records come back as safetensors bytes and
      are assembled in the worker. In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the default set
      here) weights are handed over as tensors; across processes as safetensors bytes.
    * **Records cover every position, the last token included.** vLLM never runs the last sampled
      token through the model. Each request therefore asks vLLM for ``max_new_tokens + 1`` tokens and
      the extra one is dropped (its forward is the last token's row; it is sampled from the request's
      own seeded generator, so the kept tokens are unchanged). A request that stops on a stop token
      earlier gets its last row from one extra prefill of the whole trajectory (``max_tokens=1``),
      of which only the last position's row is kept; that row's values come from a prefill instead
      of a decode (bf16-level differences), and it feeds no log-prob (row ``T-1`` predicts nothing).
      Every trajectory's recorded positions must be exactly ``0..T-1`` with the right input tokens,
      otherwise :class:`RuntimeError`: the trainer can never be handed misaligned records.
    * **Sampling.** One vLLM request per prompt, seeded with ``sampling.seed + b`` (vLLM's per-request
      generator: the tokens do not depend on the batch). Log-probs are vLLM's ``processed_logprobs``:
      ``log_softmax(logits / temperature)`` at the sampled token (temperature 0: greedy, log-probs at
      temperature 1), our definition; with ``top_p < 1`` vLLM computes them *after* the top-p
      truncation, unlike our engine (documented difference). ``SamplingParams.top_logprobs = k`` asks
      vLLM for ``logprobs=k`` (the engine allows up to the vocabulary: ``max_logprobs=-1``): the k most
      likely tokens of the same processed distribution at every generated position.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence

import torch

from tracefp4.engines.capture import RolloutCapture
from tracefp4.engines.plan import PrecisionPlan, check_supported, routed_expert_count
from tracefp4.engines.protocol import RolloutOutput, SamplingParams, check_prompts, check_top_logprobs
from tracefp4.engines.contract import quantizer_contract
from tracefp4.engines.sink import UNKNOWN_VERSION, StoreTarget, unpack_rollout
from tracefp4.engines.vllm.kv_layout import KVStore, resolve_kv_store
from tracefp4.engines.vllm.process import quiet_vllm_logging
from tracefp4.engines.vllm.runtime import RUNTIME
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.names import Site

__all__ = ["EnginePerPlan", "PlainVLLMEngine", "VLLMEngine", "checkpoint_names", "engine_env", "engine_for"]

_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # "0" would bind every OpenMP thread to CPU 0
    "NUMBA_THREADING_LAYER": "workqueue",
}

EXTENSION = "tracefp4.engines.vllm.worker.TraceWorkerExtension"

# How VLLMEngine(compilation=...) runs the model. "dynamo": traced once by Dynamo (CompilationMode
# DYNAMO_TRACE_ONCE = 2), eager backend, vLLM's CPU kernels for norms and rope as in eager mode, and
# no IR torch wrap (with it the CPU warm-up forward produced NaN hidden states in vLLM 0.32).
COMPILE_MODES: dict[str, dict] = {
    "none": {},
    "dynamo": {"mode": 2, "backend": "eager", "custom_ops": ["all"], "ir_enable_torch_wrap": False},
    "inductor": {},
}


def engine_env() -> bool:
    """The environment the engine needs (set where unset), vLLM's logging kept to warnings unless
    the user set it (:func:`~.process.quiet_vllm_logging`); True when vLLM runs in-process. Every
    path that builds a vLLM engine calls it first, before vLLM is imported where it can."""
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    quiet_vllm_logging()
    return os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def checkpoint_names(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """A transformers state dict (fused ``experts.gate_up_proj [E, 2I, H]``/``down_proj [E, H, I]``)
    under the per-expert checkpoint names vLLM's loader expects."""
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base, inter = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                yield f"{base}{e}.gate_proj.weight", v[e, :inter]
                yield f"{base}{e}.up_proj.weight", v[e, inter:]
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                yield f"{base}{e}.down_proj.weight", v[e]
        else:
            yield k, v


class _ClosedOnExit:
    """``with engine:`` closes the engine (``close()``) on the way out."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class VLLMEngine(_ClosedOnExit):
    """vLLM's offline engine with tracefp4's precision plan and records (see the module docstring).

    ``model``: a local checkpoint folder (transformers format, Qwen3-MoE). ``plan``: the plan the
    engine is built with (the quantization config's). ``keep_bf16``: False (the default) holds only
    that plan's prepared routed-expert weights (packed FP4 on the CPU) and no BF16 copy, so
    ``generate`` serves plans with the same weight quantizer (another activation or KV format is
    fine); True keeps the BF16 expert weights too, so any plan or BF16 can be served per call (one
    engine for every arm of a run). ``kv_store`` (:class:`~.kv_layout.KVStore`): ``"packed"`` holds
    K/V as packed FP4 rows (~3.3x the tokens per KV budget; calls with the plan's K/V format only),
    ``"values"`` the dequantized values in the model dtype (any plan per call); default packed for an
    NVFP4/MXFP4 K/V plan without ``keep_bf16``, values otherwise. ``compilation``: ``"none"``,
    ``"dynamo"`` or ``"inductor"`` (see the module docstring). ``llm_kwargs`` go to ``vllm.LLM`` (the
    fixed ones above cannot be overridden).
    """

    name = "vllm"

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        plan: PrecisionPlan | None = PrecisionPlan(),
        keep_bf16: bool = False,
        dtype: str = "bfloat16",
        max_model_len: int = 512,
        max_num_seqs: int = 16,
        seed: int = 0,
        compilation: str = "none",
        kv_store: KVStore | str | None = None,
        **llm_kwargs,
    ) -> None:
        self.in_process = engine_env()
        self.kv_store = resolve_kv_store(plan, keep_bf16, kv_store)
        from tracefp4.engines.vllm.plugin import register

        # Registers the plugin in this process without the entry point; a spawned worker registers it
        # when it imports the worker extension or unpickles the quant config (see :mod:`.worker`).
        register()
        from vllm import LLM

        if compilation not in COMPILE_MODES:
            raise ValueError(f"compilation = {compilation!r}: expected one of {sorted(COMPILE_MODES)}")
        if compilation == "dynamo":
            llm_kwargs["compilation_config"] = {**COMPILE_MODES["dynamo"], **(llm_kwargs.get("compilation_config") or {})}
        fixed = dict(
            enforce_eager=compilation == "none",
            enable_prefix_caching=False,
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
            quantization="tracefp4",
            worker_extension_cls=EXTENSION,
        )
        clash = sorted(set(fixed) & set(llm_kwargs))
        if clash:
            raise ValueError(f"VLLMEngine fixes {clash}; do not pass them")
        overrides = dict(llm_kwargs.pop("hf_overrides", None) or {})
        overrides["quantization_config"] = {"quant_method": "tracefp4", "plan": None if plan is None else plan.to_dict(),
                                            "keep_bf16": bool(keep_bf16), "kv_store": self.kv_store.value}
        # Seeded sampling + chunked prefill crashes vLLM 0.32 on CPU (generator offset rewind):
        # whole prompts per step unless the caller decides otherwise.
        llm_kwargs.setdefault("enable_chunked_prefill", False)
        llm_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 2048))
        llm_kwargs.setdefault("max_logprobs", -1)  # SamplingParams.top_logprobs up to the vocabulary (Score Centering)
        self._tmp = None  # engine_for's temporary checkpoint folder, removed by close()
        self.llm = LLM(
            model=os.fspath(model), dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            seed=seed, hf_overrides=overrides, **fixed, **llm_kwargs,
        )
        self.plan = plan
        self.keep_bf16 = bool(keep_bf16) or plan is None
        self.max_model_len = max_model_len
        self.version = UNKNOWN_VERSION  # of weights loaded from a checkpoint: unknown until load_weights
        self.llm.collective_rpc("tracefp4_install")
        cfg = self.llm.llm_engine.model_config.hf_config
        self.n_layers = int(cfg.num_hidden_layers)
        self.n_experts = routed_expert_count(cfg)  # 0: a dense model, no routing
        self.vocab = int(cfg.vocab_size)

    # --- RolloutEngine --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        plan: PrecisionPlan | None,
        guidance: GuidedMode | None,
        diagnostics: frozenset[int] = frozenset(),
        store: StoreTarget | None = None,
    ) -> RolloutOutput:
        """See :class:`~tracefp4.engines.protocol.RolloutEngine`. With ``store`` the records are
        written by the worker that recorded them, straight into the store; only the diagnostics (when
        asked for) come back with the tokens and log-probs."""
        if plan is None and (guidance is not None or diagnostics):
            raise ValueError("a BF16 rollout (plan=None) has no FP4 codes: no guidance or diagnostics")
        if not self.keep_bf16 and (plan is None or plan.weight_quantizer != self.plan.weight_quantizer):
            # refused before anything reaches vLLM (a request failing inside a forward stays scheduled)
            want = "BF16" if plan is None else f"expert weights quantized by {plan.weight_quantizer}"
            raise ValueError(f"this engine holds only its plan's prepared expert weights ({self.plan.weight_quantizer}); "
                             f"a call asking for {want} needs an engine built with keep_bf16=True")
        if self.kv_store is KVStore.PACKED and (plan is None or plan.kv_cache is not self.plan.kv_cache):
            raise ValueError(f"this engine's KV cache holds packed {self.plan.kv_cache.value} K/V rows; a call asking "
                             f"for {'BF16' if plan is None else f'{plan.site_format(Site.K)} K/V'} needs an engine "
                             "built with kv_store='values'")
        if guidance is not None and not isinstance(guidance, GuidedMode):
            raise ValueError(f"guidance must be a GuidedMode (GuidedMode.parse(name)), got {type(guidance).__name__}")
        check_supported(plan, guidance)
        prompt_ids = check_prompts(prompts, self.vocab)
        check_top_logprobs(sampling, self.vocab)
        if store is not None and len(store.traj_ids) != len(prompt_ids):
            raise ValueError(f"store target names {len(store.traj_ids)} trajectories for {len(prompt_ids)} prompts")
        longest = max(p.numel() for p in prompt_ids) + sampling.max_new_tokens + 1
        if longest > self.max_model_len:
            raise ValueError(
                f"prompt + max_new_tokens + 1 = {longest} exceeds the engine's max_model_len {self.max_model_len} "
                "(the +1 runs the last token through the model so that records cover it)"
            )
        RolloutCapture.of(guidance, frozenset(diagnostics), self.n_layers)  # validates the layers here
        self.llm.collective_rpc(
            "tracefp4_begin",
            args=(None if plan is None else plan.to_dict(), None if guidance is None else guidance.name,
                  sorted(int(i) for i in diagnostics), self.n_layers),
        )  # fmt: skip
        try:
            t0 = time.perf_counter()
            token_ids, logprobs, finish, need_flush, main_ids, top = self._sample(prompt_ids, sampling)
            t1 = time.perf_counter()
            flush_ids = self._flush([token_ids[b] for b in need_flush]) if need_flush else []
        except BaseException:
            self.llm.collective_rpc("tracefp4_abort")
            raise
        t2 = time.perf_counter()
        owners = {rid: [b, "main"] for b, rid in enumerate(main_ids)}
        owners.update({rid: [b, "flush"] for b, rid in zip(need_flush, flush_ids)})
        prompt_lens = [int(p.numel()) for p in prompt_ids]
        blob = self.llm.collective_rpc(
            "tracefp4_finish",
            args=(owners, [t.tolist() for t in token_ids], self.n_experts,
                  None if store is None else {**store.to_dict(), "prompt_lens": prompt_lens,
                                              "contract": quantizer_contract(plan, guidance)}),
        )[0]
        records, diag, versions = unpack_rollout(blob)
        t3 = time.perf_counter()
        return RolloutOutput(
            token_ids=token_ids,
            prompt_lens=prompt_lens,
            logprobs=logprobs,
            finish_reasons=finish,
            records=[] if store is not None else records,
            diagnostics=diag,
            plan=plan,
            guidance=guidance,
            timings={"generate_s": t1 - t0, "flush_s": t2 - t1, "records_s": t3 - t2},
            stored=store,
            top_ids=top[0],
            top_logprobs=top[1],
            versions=versions,
        )

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Push a transformers state dict into the running engine, without disk: vLLM's in-place
        ``reload_weights`` (which re-runs ``process_weights_after_loading``: the FP4 expert weights
        are re-quantized once), then ``reset_prefix_cache``. The worker's forwards from then on stamp
        their rows with policy version ``version``."""
        named = list(checkpoint_names(state))
        if self.in_process:  # the worker shares this process: hand it the tensors themselves

            def push(worker) -> int:
                worker.model_runner.reload_weights(weights_iterator=iter(named))
                RUNTIME.version = int(version)
                return len(named)

            self.llm.collective_rpc(push)
        else:  # across processes: safetensors bytes (a list of tensors does not pass vLLM's RPC)
            from safetensors.torch import save

            blob = save({k: v.detach().to("cpu").clone(memory_format=torch.contiguous_format) for k, v in named})
            self.llm.collective_rpc("tracefp4_reload", args=(blob, int(version)))
        self.llm.reset_prefix_cache()
        self.version = version

    def kv_cache_size(self) -> dict[str, int]:
        """The KV cache vLLM gave this engine: ``tokens``, the capacity it reports (blocks x block
        size), and ``bytes``, what its cache tensors hold (so bytes per token is the layout's own)."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        return {"tokens": int(cache.num_gpu_blocks * cache.block_size),
                "bytes": int(sum(self.llm.collective_rpc("tracefp4_kv_cache_bytes")))}

    def close(self) -> None:
        """Shut the engine down now (idempotent). vLLM's shutdown tears down process-wide state (its
        model-parallel groups), so an in-process engine must be closed before another is built in
        the same process, not left to the garbage collector, which may run it while the next one is
        in use."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        tmp, self._tmp = getattr(self, "_tmp", None), None
        if tmp is not None:
            tmp.cleanup()

    # --- internals ------------------------------------------------------------------------------

    def _run(self, prompt_ids: list[list[int]], params: list) -> list:
        from vllm.inputs import TokensPrompt

        return self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False
        )

    def _sample(self, prompt_ids: list[torch.Tensor], sampling: SamplingParams):
        from vllm import SamplingParams as VSP

        params = [
            VSP(
                n=1,
                max_tokens=sampling.max_new_tokens + 1,  # +1: the last kept token's row (see the docstring)
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                seed=sampling.seed + b,
                stop_token_ids=list(sampling.stop_token_ids),
                ignore_eos=True,  # stop on our stop tokens only, not on the checkpoint's generation-config EOS
                logprobs=sampling.top_logprobs,  # 0: the sampled token's only
                detokenize=False,
            )
            for b in range(len(prompt_ids))
        ]
        outs = self._run([p.tolist() for p in prompt_ids], params)
        stops = set(sampling.stop_token_ids)
        token_ids, logprobs, finish, need_flush, ids = [], [], [], [], []
        top_ids, top_lps = [], []
        for b, (p, out) in enumerate(zip(prompt_ids, outs)):
            comp = out.outputs[0]
            toks = list(comp.token_ids)[: sampling.max_new_tokens]
            lps = [comp.logprobs[i][t].logprob for i, t in enumerate(toks)]
            if sampling.top_logprobs:
                ti, tl = _top_k(comp.logprobs, len(toks), sampling.top_logprobs)
                top_ids.append(ti)
                top_lps.append(tl)
            stopped = bool(toks) and toks[-1] in stops
            if len(toks) == len(comp.token_ids):
                need_flush.append(b)  # no extra token (stop token): the last token's row was never computed
            token_ids.append(torch.cat([p, torch.tensor(toks, dtype=torch.long)]))
            logprobs.append(torch.tensor(lps, dtype=torch.float32))
            finish.append("stop" if stopped else "length")
            ids.append(out.request_id)
        return token_ids, logprobs, finish, need_flush, ids, (top_ids, top_lps)

    def _flush(self, seqs: list[torch.Tensor]) -> list[str]:
        from vllm import SamplingParams as VSP

        params = VSP(n=1, max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        return [o.request_id for o in self._run([s.tolist() for s in seqs], [params] * len(seqs))]


def _top_k(position_logprobs, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 and float32 ``[n, k]``: the k most likely tokens of each of the first n generated positions
    from vLLM's per-position ``{token: Logprob}`` (the sampled token plus ranks 1..k), most likely first."""
    ids, lps = torch.empty(n, k, dtype=torch.long), torch.empty(n, k, dtype=torch.float32)
    for i in range(n):
        best = sorted(position_logprobs[i].items(), key=lambda kv: (-kv[1].logprob, kv[1].rank))[:k]
        if len(best) < k:
            raise RuntimeError(f"vLLM returned {len(best)} log-probs at generated position {i}, {k} were asked for")
        ids[i] = torch.tensor([t for t, _ in best])
        lps[i] = torch.tensor([lp.logprob for _, lp in best])
    return ids, lps


class PlainVLLMEngine(VLLMEngine):
    """vLLM's own engine without our quantization config: its unquantized MoE path (prepacked BF16 CPU
    kernels), what a user would run instead of an FP4 rollout. The baseline of ``tracefp4 bench
    rollout``; it samples exactly as :class:`VLLMEngine` does (seeded requests, processed log-probs,
    eager mode, no prefix caching) but computes in BF16 and records nothing, so it cannot feed a
    TRACE trainer. (Our worker extension only adds methods by name, :meth:`kv_cache_size`'s.)
    ``kv_cache_dtype="fp8"`` gives vLLM's own FP8 KV cache."""

    name = "vllm"

    def __init__(self, model: str | os.PathLike[str], *, dtype: str = "bfloat16", max_model_len: int = 512,
                 max_num_seqs: int = 16, seed: int = 0, **llm_kwargs) -> None:
        self.in_process = engine_env()
        from vllm import LLM

        llm_kwargs.setdefault("enable_chunked_prefill", False)  # see VLLMEngine
        llm_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 2048))
        llm_kwargs.setdefault("max_logprobs", -1)
        self._tmp = None
        self.llm = LLM(model=os.fspath(model), dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       seed=seed, enforce_eager=True, enable_prefix_caching=False, logprobs_mode="processed_logprobs",
                       skip_tokenizer_init=True, worker_extension_cls=EXTENSION, **llm_kwargs)
        self.plan = None
        self.keep_bf16 = True
        self.max_model_len = max_model_len
        self.version = UNKNOWN_VERSION  # as VLLMEngine's: weights from a checkpoint, until load_weights
        cfg = self.llm.llm_engine.model_config.hf_config
        self.n_layers, self.vocab = int(cfg.num_hidden_layers), int(cfg.vocab_size)
        self.n_experts = routed_expert_count(cfg)  # 0: a dense model, no routing

    def generate(self, prompts, sampling: SamplingParams, *, plan: PrecisionPlan | None = None,
                 guidance: GuidedMode | None = None, diagnostics: frozenset[int] = frozenset(),
                 store: StoreTarget | None = None) -> RolloutOutput:
        if plan is not None or guidance is not None or diagnostics or store is not None:
            raise ValueError("PlainVLLMEngine is vLLM's own BF16 path: no precision plan, guidance, diagnostics or store")
        prompt_ids = check_prompts(prompts, self.vocab)
        check_top_logprobs(sampling, self.vocab)
        t0 = time.perf_counter()
        token_ids, logprobs, finish, _, _, top = self._sample(prompt_ids, sampling)
        return RolloutOutput(token_ids=token_ids, prompt_lens=[int(p.numel()) for p in prompt_ids], logprobs=logprobs,
                             finish_reasons=finish, records=[{} for _ in token_ids], diagnostics=[{} for _ in token_ids],
                             plan=None, guidance=None, timings={"generate_s": time.perf_counter() - t0},
                             top_ids=top[0], top_logprobs=top[1])

    def load_weights(self, state, version: int) -> None:
        raise NotImplementedError("PlainVLLMEngine is a benchmark baseline: build it from a checkpoint")


def engine_for(model, checkpoint: str | os.PathLike[str] | None, *, max_len: int, engine: type[VLLMEngine] = VLLMEngine,
               **kwargs) -> VLLMEngine:
    """An ``engine`` (:class:`VLLMEngine` or :class:`PlainVLLMEngine`) over ``model``'s weights: its
    checkpoint folder, or (a model built in memory) the model written to a temporary folder that lives as
    long as the engine. Without ``model``, over the ``checkpoint`` folder as it is (``max_len`` 0: the
    ``max_model_len`` of ``kwargs``, or the engine's default)."""
    if model is None:
        if checkpoint is None:
            raise ValueError("a vLLM engine needs a model or a checkpoint folder")
        if max_len:
            kwargs["max_model_len"] = _max_model_len(max_len)
        return engine(checkpoint, **kwargs)
    checkpoint, tmp, max_model_len = _engine_checkpoint(model, checkpoint, max_len)
    built = engine(checkpoint, max_model_len=max_model_len, **kwargs)
    built._tmp = tmp
    return built


def _max_model_len(max_len: int) -> int:
    # vLLM's CPU KV cache is paged in blocks of 16 tokens
    return max(64, -(-max_len // 16) * 16)


def _engine_checkpoint(model, checkpoint, max_len: int):
    """``(folder, temporary folder or None, max_model_len)`` for an engine over ``model``'s weights
    (refusing a head dim vLLM's CPU attention lacks before vLLM starts); without ``model``, the
    ``checkpoint`` folder as it is."""
    import tempfile

    if model is None:
        if checkpoint is None:
            raise ValueError("a vLLM engine needs a model or a checkpoint folder")
        return checkpoint, None, _max_model_len(max_len)
    engine_env()  # before the import below, the first of vLLM in a command's process: it configures vLLM's logging
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is far larger
    from vllm.platforms import current_platform

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise ValueError(f"vLLM's CPU attention supports head_dim in {sizes}, the model has {head_dim} (--head-dim 32)")
    tmp = None
    if checkpoint is None:
        tmp = tempfile.TemporaryDirectory(prefix="tracefp4-vllm-")
        model.save_pretrained(tmp.name)
        checkpoint = tmp.name
    return checkpoint, tmp, _max_model_len(max_len)


class EnginePerPlan(_ClosedOnExit):
    """A rollout engine that serves each call with a :class:`VLLMEngine` built for the call's plan,
    with that engine's default KV store (packed FP4 K/V for an NVFP4/MXFP4 plan), holding one engine at
    a time (vLLM allows one in-process engine): a call with another plan closes the held engine and
    builds the next. For reports that run a few arms one after the other on one set of weights
    (``tracefp4 mismatch --engine vllm``); weight pushes are not forwarded (build it on the weights)."""

    name = "vllm"

    def __init__(self, model, checkpoint: str | os.PathLike[str] | None, *, max_len: int, **kwargs) -> None:
        self.checkpoint, self._tmp, self.max_model_len = _engine_checkpoint(model, checkpoint, max_len)
        self.kwargs = kwargs
        self.held: VLLMEngine | None = None

    def generate(self, prompts, sampling: SamplingParams, *, plan: PrecisionPlan | None,
                 guidance: GuidedMode | None = None, diagnostics: frozenset[int] = frozenset(),
                 store: StoreTarget | None = None) -> RolloutOutput:
        if self.held is None or self.held.plan != plan:
            if self.held is not None:
                self.held.close()
            self.held = None  # a failed build must not leave the closed engine held
            self.held = VLLMEngine(self.checkpoint, plan=plan, max_model_len=self.max_model_len, **self.kwargs)
        return self.held.generate(prompts, sampling, plan=plan, guidance=guidance, diagnostics=diagnostics, store=store)

    def load_weights(self, state, version: int) -> None:
        raise NotImplementedError("EnginePerPlan serves the weights it was built on: build a new one")

    def close(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.close()
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            tmp.cleanup()
