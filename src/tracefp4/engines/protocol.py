"""The contract between a rollout engine and its callers (the RL loop, the reports).

An engine samples completions with a precision plan and hands back, per trajectory, the records
the trainer needs: routing of every MoE layer always, and the guidance of the requested mode at
that mode's layers, nothing else. Full FP4 codes at a few diagnostic layers may be kept in memory
for code-mismatch metrics; they never reach the store or the trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.sink import StoreTarget
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.names import ROUTING, parse_name

__all__ = ["SamplingParams", "RolloutOutput", "RolloutEngine", "StoreTarget", "check_prompts", "check_top_logprobs"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How an engine samples. ``top_logprobs``: for every generated token also return the sampler's
    ``top_logprobs`` most likely tokens and their log-probs (0: none; at most the vocabulary): the
    distribution the token was drawn from, ``log_softmax(logits / temperature)`` (temperature 0: at
    temperature 1), as the sampled token's log-prob is (before top-p truncation in our engine, after
    it in vLLM's). Score Centering's loss needs them (:mod:`tracefp4.rl.score_centering`)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass
class RolloutOutput:
    """One batch of trajectories.

    token_ids[b]: int64 ``[T_b]``, prompt then completion.
    prompt_lens[b]: prompt length ``P_b``.
    logprobs[b]: float32 ``[T_b - P_b]``, log-prob of each sampled token under the rollout's
        temperature-scaled distribution, before top-p truncation.
    finish_reasons[b]: ``"stop"`` (sampled a stop token, which is kept) or ``"length"``.
    records[b]: store-ready, ``{name: Tensor [T_b, ...]}``: ``L{ll}.routing`` for every MoE layer and,
        with a guidance mode, that mode's tensors ``L{ll}.{site}.{field}`` at its layers. Empty when
        the engine wrote them into the store itself (``stored``).
    diagnostics[b]: full-code records ``L{ll}.{site}.codes/.scales/.global_amax`` at the diagnostic
        layers (``{}`` without any), in memory only.
    plan: the precision plan (None: BF16); guidance: the recorded mode (None: routing only).
    timings: seconds per phase (``prefill_s``, ``decode_s``, ``records_s``, ``store_write_s``).
    stored: the store writer the records went to (``generate(..., store=target)``), else None.
    top_ids[b], top_logprobs[b]: with ``SamplingParams.top_logprobs = k``, int64 and float32
        ``[T_b - P_b, k]``: the sampler's k most likely tokens at each generated position, most likely
        first, and their log-probs; empty lists otherwise.
    versions[b]: int64 ``[T_b]``, the policy version of the weights whose forward computed each row of
        the record (the engine's version at that forward: a weight update during the generation, or a
        K/V row written under older weights and attended to later, shows as it happened;
        :data:`~tracefp4.engines.sink.UNKNOWN_VERSION` where the engine did not know its version). Empty
        where the engine wrote them into the store with the records (``stored``), and from an engine
        that records nothing.
    """

    token_ids: list[torch.Tensor]
    prompt_lens: list[int]
    logprobs: list[torch.Tensor]
    finish_reasons: list[str]
    records: list[dict[str, torch.Tensor]]
    diagnostics: list[dict[str, torch.Tensor]]
    plan: PrecisionPlan | None
    guidance: GuidedMode | None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    stored: StoreTarget | None = None
    top_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)
    top_logprobs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    versions: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def completion(self, b: int) -> torch.Tensor:
        return self.token_ids[b][self.prompt_lens[b] :]

    def guidance_bytes(self) -> int:
        """Bytes of guidance (routing excluded) over the whole batch's records."""
        return sum(t.nbytes for rec in self.records for k, t in rec.items() if parse_name(k).site != ROUTING)


@runtime_checkable
class RolloutEngine(Protocol):
    """A rollout engine: ours (:class:`tracefp4.engines.rollout.HomeEngine`) or an adapter of another."""

    name: str  # "home", "vllm", ...: what reports and run configs call it

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
        """Sample; ``plan`` None is a BF16 rollout, ``guidance`` None records routing only. With
        ``store``, the engine writes the records into the store under that writer itself and returns
        none (:mod:`tracefp4.engines.sink`)."""
        ...

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Take the policy's weights (pushed after every optimizer step) as policy version ``version``:
        every forward from then on stamps its rows with it."""
        ...


def check_top_logprobs(sampling: SamplingParams, vocab: int) -> None:
    """A ``top_logprobs`` count above the vocabulary is a ValueError (every engine checks it alike)."""
    if sampling.top_logprobs > vocab:
        raise ValueError(f"top_logprobs = {sampling.top_logprobs} exceeds the vocabulary ({vocab} tokens)")


def check_prompts(prompts: Sequence[Sequence[int] | torch.Tensor], vocab: int) -> list[torch.Tensor]:
    """Prompts as int64 tensors; an empty prompt, an id outside ``[0, vocab)`` or no prompt at all is a
    ValueError naming the prompt (every engine checks its input the same way)."""
    out = []
    for b, p in enumerate(prompts):
        t = torch.as_tensor(p, dtype=torch.long).reshape(-1)
        if t.numel() == 0:
            raise ValueError(f"prompt {b} is empty")
        if int(t.min()) < 0 or int(t.max()) >= vocab:
            raise ValueError(f"prompt {b}: token ids outside [0, {vocab})")
        out.append(t)
    if not out:
        raise ValueError("no prompts given")
    return out
