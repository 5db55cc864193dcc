"""``tracefp4 scaling``: how the train–rollout mismatch grows with depth, width and completion length.

The grid is a star around a centre model (:data:`CENTRE`: 8 layers, hidden 128, 64 new tokens): the
depth axis varies the layers (:data:`DEPTHS`, 2 to 24), the width axis the hidden size (:data:`WIDTHS`,
64 to 512; the expert dim follows the hidden size, the heads are ``hidden / 32`` of dim 32), the length
axis the completion length (:data:`LENGTHS`, 16 to 512 tokens), each with the other two at the centre.
Every point is measured twice, with **trained** weights and with **random** ones:

* ``trained``: the point's model (one per depth and width) fine-tuned from scratch on the ``count``
  task (:class:`tracefp4.rl.tasks.CountBy`, 33-token answers) for ``--sft-steps`` steps, prompted with
  the task's held-out prompts. Trained weights have other activation statistics than random ones
  (peaked attention, routers that prefer experts). Beyond the task's 33 tokens the completions are
  off the training distribution (sampling does not stop at the end-of-sequence token): the weights
  are still trained, the text is not the task's.
* ``random``: the same architecture with the mismatch report's random init (std 0.1) and random
  prompts, the regime of ``tracefp4 mismatch``.

At each point one batch of ``--batch`` prompts is rolled out (temperature 1, no stop token, so every
completion has exactly the point's length) and the trainer runs on the rollout's tokens in every arm
(:data:`SCALING_ARMS`): ``bf16`` (BF16 rollout, BF16 trainer: the floor), ``qat`` (FP4 rollout, vanilla
round-to-nearest QAT), ``trace`` (lsb hints on the deeper half, the paper's compact cache),
``trace-all`` (lsb hints on every layer), ``trace-ldpc`` (our compact LDPC record on every layer) and
``trace-full`` (full codes, every layer): the arm table's names (:mod:`tracefp4.pipeline.arms`); the
metrics go by the registry's names (:mod:`tracefp4.pipeline.metrics`: ``code_mismatch_rate``,
``train_rollout_logprob_abs_diff`` and its ``_p99`` and ``_max``). Recording never changes what an FP4 rollout computes, so every FP4 arm sees the same tokens;
the report checks it. Records go through the guidance store, as in the mismatch report.

Per arm and point: the FP4 code mismatch (trainer vs the rollout's full codes) per layer and per
completion-position bucket (:data:`BUCKETS`; the prompt is its own bucket) with the share one codeword
apart; mean, p99 and max |Δlogp| over completion tokens, per bucket too; the sequence-level log-ratio
``sum_t (log pi_train - log pi_rollout)`` (mean, mean |.|, max |.|); and for an importance-sampling cap
c in (2, 5) the share of tokens whose weight ``pi_train / pi_rollout`` exceeds c (truncated by a
token-level cap) and the share of sequences whose product of weights exceeds c (masked by a
sequence-level cap, TRL's ``sequence_mask``) or leaves ``[1/c, c]``.

The fit (:func:`fit`): for each arm and each positive quantity, least squares of
``g(q) = a + b_L log L + b_H log H + b_T log T`` over the trained (or random) points (``g`` the log,
or the logit for a share such as the code mismatch, so that a predicted share stays below 1), and the
prediction at the paper's shapes (:data:`TARGETS`: Qwen3-30B-A3B's 48 layers and hidden 2048, completions
of 8K-32K tokens) with a 95% prediction interval from the residual spread (Student t with n - 4
degrees of freedom). It is an extrapolation far outside the grid (2x the depth, 4x the width, 16-64x
the length) on tiny models with synthetic weights: a statement of the trend, with its uncertainty,
not a measurement. The guidance bytes per token at those shapes come from the capacity planner
(:func:`tracefp4.reports.capacity.plan`, the ``tracefp4 plan`` command).

Resumable: each point is written to ``<dir>/points/<name>.json`` (atomically) when done and each
trained model to ``<dir>/models/L<l>-H<h>/`` (a checkpoint folder, sealed by its checksums), and a
rerun skips what is there. ``--only NAME[,NAME]`` runs (or reruns, with ``--force``) chosen points, e.g.
to compare one point with the published results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from tracefp4.engines.model import from_config, load_model, model_layers, tiny_config
from tracefp4.engines.protocol import RolloutOutput, SamplingParams
from tracefp4.engines.trainer import SiteMismatch, TrainerOutput, code_mismatch, forward_logprobs
from tracefp4.files import atomic_write_json
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.names import parse_name
from tracefp4.pipeline.arms import DEFAULT_GUIDANCE, SCALING_ARMS, Arm, arm_style, make_arm
from tracefp4.pipeline.factory import EngineKind, make_engine
from tracefp4.pipeline.measure import config_signature, run_arms, same_rollout, store_root
from tracefp4.pipeline.metrics import Name, at_sites, gap_quantile, logprob_gap, mismatch_by, mismatch_summary

__all__ = [
    "CENTRE", "DEPTHS", "WIDTHS", "LENGTHS", "BUCKETS", "TARGETS", "Point", "grid",
    "point_config", "measure_point", "logprob_stats", "fit", "predict_at", "run_scaling", "format_scaling",
    "plot_scaling", "add_parser", "run_cli",
]  # fmt: skip

CENTRE = dict(layers=8, hidden=128, new_tokens=64)
DEPTHS = (2, 4, 8, 12, 16, 24)
WIDTHS = (64, 128, 256, 512)
LENGTHS = (16, 32, 64, 128, 256, 512)
WEIGHTS = ("trained", "random")
#: Completion-position buckets [lo, hi) of the per-position figures.
BUCKETS = ((0, 16), (16, 32), (32, 64), (64, 128), (128, 256), (256, 512))
CAPS = (2.0, 5.0)
#: The paper's shapes the fit predicts (Qwen3-30B-A3B: 48 layers, hidden 2048).
TARGETS = tuple(dict(layers=48, hidden=2048, new_tokens=t) for t in (8192, 16384, 32768))
#: Model dims every grid point shares; the hidden size sets the rest (see :func:`point_config`).
EXPERTS, TOP_K, HEAD_DIM = 8, 2, 32
RANDOM_INIT_STD = 0.1  # the mismatch report's peaked random init
SFT = dict(steps=300, batch=32, lr=2e-3)
#: The p99 of |Δlogp| (:func:`~tracefp4.pipeline.metrics.gap_quantile`).
P99 = gap_quantile(0.99)
#: Quantities the fit models: arm row key -> label. Shares (:data:`SHARES`) are fitted on the logit
#: scale, so a prediction stays a share; the others (positive, unbounded) on the log scale.
FITTED = {
    Name.CODE_MISMATCH: "FP4 code mismatch, all sites",
    Name.GAP_MEAN: "mean |Δlogp|",
    P99: "p99 |Δlogp|",
    Name.GAP_MAX: "max |Δlogp|",
    "seq_abs_mean": "mean |sequence log-ratio|",
}
SHARES = frozenset({Name.CODE_MISMATCH})
#: This report's key of the mean |sequence log-ratio| (the loop's ``Name.SEQ_LOG_RATIO``, per step).
SEQ_ABS_MEAN = "seq_abs_mean"
#: The code mismatch restricted to the deeper half of the layers, and to an arm's guided layers.
CODE_DEEPER_HALF, CODE_GUIDED = f"{Name.CODE_MISMATCH}_deeper_half", f"{Name.CODE_MISMATCH}_guided"


@dataclasses.dataclass(frozen=True)
class Point:
    layers: int
    hidden: int
    new_tokens: int
    weights: str  # "trained" | "random"

    @property
    def name(self) -> str:
        return f"L{self.layers}-H{self.hidden}-T{self.new_tokens}-{self.weights}"

    @property
    def model_key(self) -> str:
        return f"L{self.layers}-H{self.hidden}"

    @classmethod
    def parse(cls, name: str) -> Point:
        try:
            dims, weights = name.rsplit("-", 1)
            l_, h_, t_ = dims.split("-")
            if not (l_[0], h_[0], t_[0]) == ("L", "H", "T") or weights not in WEIGHTS:
                raise ValueError
            return cls(int(l_[1:]), int(h_[1:]), int(t_[1:]), weights)
        except (ValueError, IndexError):
            raise ValueError(f"bad grid point {name!r}: expected L<layers>-H<hidden>-T<tokens>-trained|random") from None


def grid(weights: Sequence[str] = WEIGHTS) -> list[Point]:
    """The star: each axis through the centre, the centre once; trained points first."""
    dims: list[tuple[int, int, int]] = []
    for layers in DEPTHS:
        dims.append((layers, CENTRE["hidden"], CENTRE["new_tokens"]))
    for hidden in WIDTHS:
        dims.append((CENTRE["layers"], hidden, CENTRE["new_tokens"]))
    for t in LENGTHS:
        dims.append((CENTRE["layers"], CENTRE["hidden"], t))
    unique = list(dict.fromkeys(dims))
    return [Point(*d, w) for w in weights for d in unique]


def point_config(layers: int, hidden: int, new_tokens: int, *, init_std: float = 0.02, vocab: int = 32):
    """The Qwen3-MoE config of a grid point: ``hidden / 32`` heads of dim 32, half as many KV heads,
    8 experts top-2 with expert dim = hidden, positions for prompt + completion; otherwise as the RL
    runs build their models (normalised top-k weights, untied embeddings, the task tokenizer's specials)."""
    from tracefp4.rl.tasks import CharTokenizer

    heads = max(1, hidden // HEAD_DIM)
    return tiny_config(
        layers=layers, experts=EXPERTS, top_k=TOP_K, hidden=hidden, moe_intermediate=hidden, heads=heads,
        kv_heads=max(1, heads // 2), head_dim=HEAD_DIM, vocab=vocab, init_std=init_std,
        max_positions=max(512, 2 * (new_tokens + 64)), norm_topk_prob=True, tie_word_embeddings=False,
        pad_token_id=CharTokenizer.PAD, bos_token_id=CharTokenizer.BOS, eos_token_id=CharTokenizer.EOS,
    )  # fmt: skip


# --- models and prompts ---------------------------------------------------------------------------


def _trained_model(root: Path, p: Point, sft: Mapping[str, Any], seed: int, say: Callable[[str], None]):
    """The point's fine-tuned model: loaded from ``root/models/<key>`` if sealed there, else trained
    from scratch on the count task and saved (one model serves every length of its depth and width)."""
    from tracefp4.rl.checkpoint import latest_checkpoint, save_checkpoint
    from tracefp4.rl.config import RLConfig
    from tracefp4.rl.tasks import CountBy
    from tracefp4.rl.warm_start import warm_start

    folder = root / "models" / p.model_key
    ck = latest_checkpoint(folder)
    if ck is not None:
        if ck.state.get("sft") != dict(sft) or ck.state.get("seed") != seed:
            raise ValueError(f"{folder}: that model was fine-tuned with {ck.state.get('sft')}, seed "
                             f"{ck.state.get('seed')}; asked for {dict(sft)}, seed {seed}: use another --dir")
        return load_model(ck.model_path), ck.state
    task = CountBy()
    tok = task.make_tokenizer()
    model = from_config(point_config(p.layers, p.hidden, max(LENGTHS)), seed=seed)
    cfg = RLConfig.from_dict(dict(task="count", warm_start_steps=sft["steps"], warm_start_batch=sft["batch"],
                                  warm_start_lr=sft["lr"], seed=seed))  # fmt: skip
    say(f"{p.model_key}: fine-tuning on the count task, {sft['steps']} steps of {sft['batch']}")
    t0 = time.perf_counter()
    losses = warm_start(model, task, tok, cfg, progress=_Bar(f"SFT {p.model_key}", sft["steps"]))
    state = {"task": "count", "sft": dict(sft), "seed": seed, "final_loss": _tail_mean(losses),
             "seconds": time.perf_counter() - t0}  # fmt: skip
    save_checkpoint(folder, 0, model=model, optimizer_tensors={}, state=state)
    return model, state


def _tail_mean(losses: Sequence[float], n: int = 20) -> float | None:
    """Mean of the last ``n`` losses (the SFT's end point without one step's noise)."""
    tail = list(losses)[-n:]
    return sum(tail) / len(tail) if tail else None


class _Bar:
    """The warm start's progress (``update`` / ``set_postfix``), as a tqdm bar on stderr."""

    def __init__(self, desc: str, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)

    def update(self, n: int) -> None:
        self._bar.update(n)
        if self._bar.n >= self._bar.total:
            self._bar.close()

    def set_postfix(self, **kw: Any) -> None:
        self._bar.set_postfix(**kw)


def _prompts(p: Point, batch: int, seed: int, vocab: int) -> list[torch.Tensor]:
    """Trained points: the count task's held-out prompts; random points: random ids of 6-12 tokens."""
    if p.weights == "trained":
        from tracefp4.rl.tasks import CountBy

        task = CountBy()
        tok = task.make_tokenizer()
        return [torch.tensor(tok.encode(e.prompt)) for e in task.eval_set(batch)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(n),), generator=g) for n in torch.randint(6, 13, (batch,), generator=g)]


# --- measurement ----------------------------------------------------------------------------------


def _bucket_of(pos: int) -> str:
    for lo, hi in BUCKETS:
        if lo <= pos < hi:
            return f"{lo}-{hi}"
    return f">={BUCKETS[-1][1]}"


def _bucket_names(new_tokens: int) -> list[str]:
    return ["prompt"] + [f"{lo}-{hi}" for lo, hi in BUCKETS if lo < new_tokens]


def logprob_stats(rollout_logprobs: Sequence[torch.Tensor], trainer_logprobs: Sequence[torch.Tensor],
                  caps: Sequence[float] = CAPS) -> dict[str, Any]:
    """|Δlogp| statistics over completion tokens, per position bucket, the sequence-level log-ratio
    and the shares an IS cap would truncate or mask (see the module docstring); ``d = log pi_train -
    log pi_rollout``, in float64."""
    ds = [(t.detach().double() - r.detach().double()) for r, t in zip(rollout_logprobs, trainer_logprobs)]
    if any(d.numel() == 0 for d in ds) or not ds:
        raise ValueError("logprob_stats: every sequence needs at least one completion token")
    flat = torch.cat(ds)
    seq = torch.stack([d.sum() for d in ds])
    lengths = torch.tensor([d.numel() for d in ds])
    mask = torch.arange(int(lengths.max())) < lengths[:, None]
    lr, lt = (pad_sequence([x.detach().double() for x in xs], batch_first=True)
              for xs in (rollout_logprobs, trainer_logprobs))
    g = logprob_gap(lr, lt, mask, quantiles=(0.99,))
    out: dict[str, Any] = {
        "tokens": flat.numel(),
        "sequences": len(ds),
        Name.GAP_MEAN: g[Name.GAP_MEAN],
        P99: g[P99],
        Name.GAP_MAX: g[Name.GAP_MAX],
        "mean": -g[Name.KL],  # the registry's KL is mean(rollout - train); this report's d is its negation
        "seq_mean": float(seq.mean()),
        "seq_abs_mean": float(seq.abs().mean()),
        "seq_abs_max": float(seq.abs().max()),
    }
    for c in caps:
        lc = math.log(c)
        out[f"tokens_truncated_cap{c:g}"] = float((flat > lc).double().mean())
        out[f"sequences_masked_cap{c:g}"] = float((seq > lc).double().mean())
        out[f"sequences_outside_cap{c:g}"] = float((seq.abs() > lc).double().mean())
    by_bucket: dict[str, dict[str, float]] = {}
    for lo, hi in BUCKETS:
        part = [d[lo:hi] for d in ds if d.numel() > lo]
        if part:
            x = torch.cat(part).abs()
            by_bucket[f"{lo}-{hi}"] = {"tokens": x.numel(), Name.GAP_MEAN: float(x.mean()), Name.GAP_MAX: float(x.max())}
    out["by_bucket"] = by_bucket
    return out


def _position_bucket(pos: int, prompt_len: int) -> str:
    """A row's position bucket: the prompt, or its completion-position bucket (:data:`BUCKETS`)."""
    return "prompt" if pos < prompt_len else _bucket_of(pos - prompt_len)


def _rates(counts: Mapping[str, SiteMismatch]) -> dict[str, dict[str, float | None]]:
    return {k: {name: s[name] for name in (Name.CODE_MISMATCH, Name.ONE_APART)} for k, s in mismatch_by(counts).items()}


def _merged_codes(out: TrainerOutput, qat: TrainerOutput, guided: frozenset[int]) -> list[dict[str, torch.Tensor]]:
    """A guided trainer's codes at its guided layers, vanilla QAT's below them: below the first guided
    layer the guided trainer *is* QAT on identical inputs (the sweep's rule), so the merge is exact."""
    merged = []
    for mine, plain in zip(out.codes, qat.codes):
        row = {k: v for k, v in plain.items() if parse_name(f"{k}.codes")[0] not in guided}
        row.update({k: v for k, v in mine.items() if parse_name(f"{k}.codes")[0] in guided})
        merged.append(row)
    return merged


def _arm_row(rollout: RolloutOutput, trainer: TrainerOutput, codes, reference, guided: frozenset[int] | None,
             n_layers: int) -> dict[str, Any]:
    row: dict[str, Any] = logprob_stats(rollout.logprobs, trainer.logprobs)
    if codes is None:  # bf16: no FP4 codes
        return row
    stats = code_mismatch(codes, reference)
    everywhere = mismatch_summary(stats.values())
    row[Name.CODE_MISMATCH] = everywhere[Name.CODE_MISMATCH]
    row[Name.ONE_APART] = everywhere[Name.ONE_APART]
    deeper = at_sites(stats, lambda layer, site: layer >= n_layers // 2)
    row[CODE_DEEPER_HALF] = mismatch_summary(deeper)[Name.CODE_MISMATCH]
    if guided is not None:
        in_guided = at_sites(stats, lambda layer, site: layer in guided)
        row[CODE_GUIDED] = mismatch_summary(in_guided)[Name.CODE_MISMATCH]
        row["guided_layers"] = sorted(guided)
    diffs = code_mismatch(codes, reference, by=("layer", "position"), prompt_lens=rollout.prompt_lens,
                          position_key=_position_bucket)
    row["code_by_layer"] = _rates(diffs["layer"])
    row["code_by_bucket"] = _rates(diffs["position"])
    row[Name.DECODE_FAILURES] = trainer.decode.failed_blocks
    return row


def scaling_arms(n_layers: int) -> dict[str, Arm]:
    """The arms of :data:`SCALING_ARMS` that roll out on their own, from the arm table: ``bf16``, then the
    guided ones (``trace-full`` first: the reference every FP4 arm's codes are compared with). ``qat`` is
    measured on the ``trace-full`` rollout (recording changes nothing an FP4 rollout computes)."""
    guided = sorted((k for k, m in SCALING_ARMS.items() if m not in (None, "bf16")), key=lambda k: k != _REFERENCE)
    return {name: make_arm(name, guidance=DEFAULT_GUIDANCE, n_layers=n_layers) for name in ("bf16", *guided)}


_REFERENCE = "trace-full"  # the arm whose rollout records the full codes at every layer


def measure_point(model, prompts: Sequence[torch.Tensor], sampling: SamplingParams, *,
                  say: Callable[[str], None] = lambda m: None, engine=None) -> dict[str, Any]:
    """Every arm of :data:`SCALING_ARMS` on one model and batch; JSON-ready. ``engine``: another rollout engine
    over the same weights (vLLM); None: ours."""
    n_layers, _ = model_layers(model)
    t0 = time.perf_counter()
    with store_root(None, "tracefp4-scaling-") as root:
        runs = run_arms(model, prompts, sampling, scaling_arms(n_layers), root, config_signature("scaling", model.config),
                        engine=engine)
    ref = runs[_REFERENCE].rollout
    with torch.no_grad():
        qat = forward_logprobs(model, ref.token_ids, ref.prompt_lens, ref.records, mode="qat", plan=ref.plan,
                               capture_codes=frozenset(range(n_layers)))  # fmt: skip
    arms: dict[str, Any] = {"bf16": _arm_row(runs["bf16"].rollout, runs["bf16"].trainer, None, None, None, n_layers),
                            "qat": _arm_row(ref, qat, qat.codes, ref.records, None, n_layers)}
    say(f"  bf16, qat: mean|dlogp| {arms['bf16'][Name.GAP_MEAN]:.4f}, {arms['qat'][Name.GAP_MEAN]:.4f}")
    for key, run in runs.items():
        if key == "bf16":
            continue
        if not same_rollout(run.rollout, ref):
            raise RuntimeError(f"{key}: the rollout sampled other tokens or routing than the full-code one")
        guided = run.arm.diagnostics
        arms[key] = _arm_row(run.rollout, run.trainer, _merged_codes(run.trainer, qat, guided), ref.records, guided,
                             n_layers)
        say(f"  {key}: code mismatch {arms[key][Name.CODE_MISMATCH]:.3%}, mean|dlogp| {arms[key][Name.GAP_MEAN]:.4f}")
    return {"arms": arms, "buckets": _bucket_names(sampling.max_new_tokens), "seconds": time.perf_counter() - t0}


# --- the grid -------------------------------------------------------------------------------------


def _point_path(root: Path, p: Point, engine: EngineKind) -> Path:
    return root / "points" / (p.name + ("" if engine is EngineKind.HOME else f"-{engine.value}") + ".json")


def _run_point(root: Path, p: Point, *, batch: int, seed: int, sft: Mapping[str, Any], engine: EngineKind,
               say: Callable[[str], None]) -> dict[str, Any]:
    if p.weights == "trained":
        model, state = _trained_model(root, p, sft, seed, say)
        origin = {"weights": "trained", "task": "count", "sft": state.get("sft"), "sft_final_loss": state.get("final_loss")}
    else:
        model = from_config(point_config(p.layers, p.hidden, p.new_tokens, init_std=RANDOM_INIT_STD), seed=seed)
        origin = {"weights": "random", "init_std": RANDOM_INIT_STD}
    prompts = _prompts(p, batch, seed, model.config.vocab_size)
    sampling = SamplingParams(max_new_tokens=p.new_tokens, temperature=1.0, seed=seed)
    eng = None
    if engine is EngineKind.VLLM:
        eng = make_engine(engine, model, max_len=max(len(x) for x in prompts) + p.new_tokens + 2, keep_bf16=True)
    try:
        result = measure_point(model, prompts, sampling, say=say, engine=eng)
    finally:
        if eng is not None and hasattr(eng, "close"):
            eng.close()
    return {"point": dataclasses.asdict(p), "name": p.name, "engine": engine.value, "model": origin,
            "batch": batch, "seed": seed, **result}  # fmt: skip


def run_scaling(root: str | Path, points: Sequence[Point], *, batch: int = 16, seed: int = 0,
                sft: Mapping[str, Any] = SFT, engine: str | EngineKind = EngineKind.HOME, force: bool = False,
                say: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Measure every point not already in ``root/points`` (all of them with ``force``); return the
    report over every point found there (see the module docstring)."""
    root, engine = Path(root), EngineKind.parse(engine)
    (root / "points").mkdir(parents=True, exist_ok=True)
    todo = [p for p in points if force or not _point_path(root, p, engine).exists()]
    say(f"{len(points) - len(todo)} of {len(points)} points already measured; {len(todo)} to go")
    for i, p in enumerate(todo):
        say(f"[{i + 1}/{len(todo)}] {p.name} ({engine.value})")
        row = _run_point(root, p, batch=batch, seed=seed, sft=sft, engine=engine, say=say)
        atomic_write_json(_point_path(root, p, engine), row, sort_keys=False)
        say(f"[{i + 1}/{len(todo)}] {p.name}: {row['seconds']:.0f}s")
    return assemble(root)


def _on_home(row: Mapping[str, Any]) -> bool:
    """Whether a measured point ran on our engine (the fits and plots use those; vLLM's rows are a check)."""
    return EngineKind.parse(row["engine"]) is EngineKind.HOME


def assemble(root: str | Path) -> dict[str, Any]:
    """Every measured point under ``root/points``, the fits and the predictions."""
    rows = [json.loads(f.read_text()) for f in sorted(Path(root, "points").glob("*.json"))]
    rows.sort(key=lambda r: (r["engine"], r["point"]["weights"], r["point"]["layers"], r["point"]["hidden"],
                             r["point"]["new_tokens"]))  # fmt: skip
    home = [r for r in rows if _on_home(r)]
    fits = {w: fit([r for r in home if r["point"]["weights"] == w]) for w in WEIGHTS}
    return {
        "grid": {"centre": CENTRE, "depths": list(DEPTHS), "widths": list(WIDTHS), "lengths": list(LENGTHS),
                 "arms": dict(SCALING_ARMS), "buckets": [f"{lo}-{hi}" for lo, hi in BUCKETS], "caps": list(CAPS),
                 "experts": EXPERTS, "top_k": TOP_K, "head_dim": HEAD_DIM},
        "points": rows,
        "fit": fits,
        "bytes_at_targets": _bytes_at_targets(),
    }  # fmt: skip


# --- the fit --------------------------------------------------------------------------------------


def _lstsq(x: list[list[float]], y: list[float]) -> tuple[list[float], list[list[float]], float, int]:
    """Ordinary least squares: coefficients, (X^T X)^-1, residual standard deviation, degrees of freedom."""
    X = torch.tensor(x, dtype=torch.float64)
    Y = torch.tensor(y, dtype=torch.float64)
    xtx_inv = torch.linalg.pinv(X.T @ X)
    beta = xtx_inv @ X.T @ Y
    df = X.shape[0] - X.shape[1]
    resid = Y - X @ beta
    s = float(torch.sqrt((resid @ resid) / df)) if df > 0 else float("nan")
    return beta.tolist(), xtx_inv.tolist(), s, df


def _features(layers: int, hidden: int, new_tokens: int) -> list[float]:
    return [1.0, math.log(layers), math.log(hidden), math.log(new_tokens)]


def fit(rows: Sequence[Mapping[str, Any]], targets: Sequence[Mapping[str, int]] = TARGETS) -> dict[str, Any]:
    """Per arm and quantity of :data:`FITTED`: the fit of ``g(q) = a + b_L log L + b_H log H + b_T log T``
    over ``rows`` (one weights kind), ``g`` the log or, for a share, the logit ``log(q / (1 - q))``
    (a power law in the odds, which for small shares is the power law in the share itself), and its
    predictions at ``targets`` (default :data:`TARGETS`) with 95% prediction intervals mapped back
    through ``g``'s inverse."""
    from tracefp4.stats import t_quantile_975

    out: dict[str, Any] = {}
    for arm in SCALING_ARMS:
        for key in FITTED:
            share = key in SHARES
            pts = [(r["point"], r["arms"][arm].get(key)) for r in rows if arm in r["arms"]]
            pts = [(p, v) for p, v in pts if v is not None and v > 0 and (not share or v < 1)]
            if len(pts) < 6:
                continue  # too few usable points for four coefficients and a spread
            g = (lambda v: math.log(v / (1.0 - v))) if share else math.log
            g_inv = (lambda z: 1.0 / (1.0 + math.exp(-z))) if share else math.exp
            x = [_features(p["layers"], p["hidden"], p["new_tokens"]) for p, _ in pts]
            beta, inv, s, df = _lstsq(x, [g(v) for _, v in pts])
            t = t_quantile_975(df)
            preds = []
            for tgt in targets:
                f = torch.tensor(_features(**tgt), dtype=torch.float64)
                mean = float(f @ torch.tensor(beta, dtype=torch.float64))
                half = t * s * math.sqrt(1.0 + float(f @ torch.tensor(inv, dtype=torch.float64) @ f))
                preds.append({**tgt, "predicted": g_inv(mean), "interval95": [g_inv(mean - half), g_inv(mean + half)]})
            out.setdefault(arm, {})[key] = {
                "scale": "logit" if share else "log",
                "exponents": {"layers": beta[1], "hidden": beta[2], "new_tokens": beta[3]},
                "exponent_se": {k: s * math.sqrt(inv[i][i]) for i, k in ((1, "layers"), (2, "hidden"), (3, "new_tokens"))},
                "residual_sd": s, "points": len(pts), "predictions": preds,
            }  # fmt: skip
    return out


def predict_at(report: Mapping[str, Any], arm: str, key: str, *, layers: int, hidden: int, new_tokens: float,
               weights: str = "trained") -> dict[str, Any] | None:
    """The fit of ``key`` (one of :data:`FITTED`) for the scaling arm ``arm``, refitted from a scaling
    report's own points (``report``: :func:`assemble`'s, e.g. ``docs/results/scaling.json``; our engine's
    points of ``weights``, as the report's fits) and predicted at one shape: ``{"layers", "hidden",
    "new_tokens", "predicted", "interval95", "points", "weights"}`` with the 95% prediction interval.
    ``new_tokens`` may be a mean length (the fit is continuous in log T). None when the report has too
    few usable points for the arm and key (:func:`fit` skips them)."""
    if key not in FITTED:
        raise ValueError(f"predict_at: key must be one of {sorted(FITTED)}, got {key!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"predict_at: weights must be one of {list(WEIGHTS)}, got {weights!r}")
    if not (layers >= 1 and hidden >= 1 and new_tokens > 0):
        raise ValueError(f"predict_at: a shape needs layers, hidden and new_tokens > 0, got {layers}, {hidden}, "
                         f"{new_tokens}")
    rows = [r for r in report["points"] if _on_home(r) and r["point"]["weights"] == weights]
    target = {"layers": layers, "hidden": hidden, "new_tokens": new_tokens}
    f = fit(rows, [target]).get(arm, {}).get(key)
    if f is None:
        return None
    return {**f["predictions"][0], "points": f["points"], "weights": weights}


def _bytes_at_targets() -> dict[str, Any]:
    """Guidance bytes per token for the arms' modes at Qwen3-30B-A3B's shapes (the capacity planner)."""
    from tracefp4.reports.capacity import PRESETS, ModelDims, plan

    dims = ModelDims.from_config(PRESETS["qwen3-30b-a3b"], "qwen3-30b-a3b")
    modes = [m for m in SCALING_ARMS.values() if m not in (None, "bf16")]
    p = plan(dims, prompts=32, samples=8, tokens=16384, modes=modes)
    return {"model": "qwen3-30b-a3b", "batch": p["batch"],
            "bytes_per_token": {GuidedMode.parse(m).name: p["modes"][GuidedMode.parse(m).name]["bytes_per_token"]
                                for m in modes}}  # fmt: skip


# --- presentation ---------------------------------------------------------------------------------


def _axis_rows(rep: Mapping[str, Any], weights: str) -> list[tuple[str, Mapping[str, Any]]]:
    """(axis label, row) for each home-engine point of one weights kind, in axis order."""
    c = rep["grid"]["centre"]
    out = []
    for r in rep["points"]:
        p = r["point"]
        if not _on_home(r) or p["weights"] != weights:
            continue
        on = [k for k in ("layers", "hidden", "new_tokens") if p[k] != c[k]]
        out.append(((on[0] if on else "centre"), r))
    return out


def format_scaling(rep: Mapping[str, Any]) -> str:
    lines = []
    for weights in WEIGHTS:
        rows = _axis_rows(rep, weights)
        if not rows:
            continue
        lines.append(f"{weights} weights: code mismatch (all sites) / mean |dlogp| / mean |seq log-ratio| / "
                     "seqs masked at cap 5")
        lines.append(f"{'point':<24}" + "".join(f"{a:>28}" for a in SCALING_ARMS))
        for _, r in rows:
            cells = []
            for arm in SCALING_ARMS:
                a = r["arms"][arm]
                cm = f"{a[Name.CODE_MISMATCH]:.2%}" if a.get(Name.CODE_MISMATCH) is not None else "-"
                cells.append(f"{cm}/{a[Name.GAP_MEAN]:.4f}/{a['seq_abs_mean']:.2f}/{a['sequences_masked_cap5']:.0%}")
            lines.append(f"{r['name']:<24}" + "".join(f"{c:>28}" for c in cells))
        lines.append("")
        for arm, fits in rep["fit"].get(weights, {}).items():
            for key in (Name.CODE_MISMATCH, Name.GAP_MEAN, "seq_abs_mean"):
                f = fits.get(key)
                if not f:
                    continue
                e, se = f["exponents"], f["exponent_se"]
                pr = f["predictions"]
                lines.append(
                    f"fit {weights} {arm:<10} {key:<30} ~ L^{e['layers']:.2f}±{se['layers']:.2f} "
                    f"H^{e['hidden']:.2f}±{se['hidden']:.2f} T^{e['new_tokens']:.2f}±{se['new_tokens']:.2f}; at "
                    + ", ".join(f"L{q['layers']} T{q['new_tokens']}: {q['predicted']:.3g} "
                                f"[{q['interval95'][0]:.2g}, {q['interval95'][1]:.2g}]" for q in pr)
                )  # fmt: skip
        lines.append("")
    b = rep["bytes_at_targets"]
    lines.append(f"guidance bytes per token at {b['model']}: "
                 + ", ".join(f"{k} {v:.0f}" for k, v in b["bytes_per_token"].items()))
    return "\n".join(lines)


def plot_scaling(rep: Mapping[str, Any], path: str | Path) -> list[Path]:
    """``path``: code mismatch, mean |Δlogp| and mean |sequence log-ratio| against each axis (trained
    weights solid, random dashed); ``<stem>_layers.png``: per-layer code mismatch of the deepest
    trained model; ``<stem>_positions.png``: per-bucket mean |Δlogp| of the longest completions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {arm: arm_style(arm)["color"] for arm in SCALING_ARMS}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _plot_axes(rep, path, plt, colors)
    return [path, *_plot_details(rep, path, plt, colors)]


def _plot_axes(rep: Mapping[str, Any], path: Path, plt, colors: Mapping[str, str | None]) -> None:
    """The three metrics against each axis of the star, one panel each."""
    c = rep["grid"]["centre"]
    axes_keys = (("layers", "layers"), ("hidden", "hidden size"), ("new_tokens", "completion tokens"))
    metrics = ((Name.CODE_MISMATCH, "FP4 code mismatch (all sites)"), (Name.GAP_MEAN, "mean |Δlogp|"),
               ("seq_abs_mean", "mean |sequence log-ratio|"))  # fmt: skip
    fig, axs = plt.subplots(len(metrics), len(axes_keys), figsize=(13, 10), squeeze=False)
    for j, (axis, label) in enumerate(axes_keys):
        others = [k for k, _ in axes_keys if k != axis]
        for weights, ls in (("trained", "-"), ("random", "--")):
            rows = [r for r in rep["points"] if _on_home(r) and r["point"]["weights"] == weights
                    and all(r["point"][k] == c[k] for k in others)]  # fmt: skip
            rows.sort(key=lambda r: r["point"][axis])
            for i, (key, title) in enumerate(metrics):
                ax = axs[i][j]
                for arm in SCALING_ARMS:
                    xs = [r["point"][axis] for r in rows if (r["arms"][arm].get(key) or 0) > 0]
                    ys = [r["arms"][arm][key] for r in rows if (r["arms"][arm].get(key) or 0) > 0]
                    if xs:
                        ax.plot(xs, ys, ls, marker="o", ms=3, color=colors[arm],
                                label=f"{arm}" if weights == "trained" else None)  # fmt: skip
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel(label)
                ax.set_title(title, fontsize=9)
                ax.grid(alpha=0.3)
    # the |Δlogp| panel has every arm (BF16 and the zero-mismatch arms have no point on the log-scale code panel)
    if axs[1][0].get_legend_handles_labels()[0]:  # labels come from trained points; a random-only grid has none
        axs[1][0].legend(fontsize=7, title="solid: trained, dashed: random", title_fontsize=7)
    fig.suptitle("train–rollout mismatch against depth, width and completion length (star grid)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_details(rep: Mapping[str, Any], path: Path, plt, colors: Mapping[str, str | None]) -> list[Path]:
    """Per-layer code mismatch of the deepest trained model, per-bucket |Δlogp| of the longest one."""
    c = rep["grid"]["centre"]
    out: list[Path] = []
    trained = [r for r in rep["points"] if _on_home(r) and r["point"]["weights"] == "trained"]
    if trained:
        deepest = max(trained, key=lambda r: (r["point"]["layers"], -abs(r["point"]["new_tokens"] - c["new_tokens"])))
        longest = max(trained, key=lambda r: (r["point"]["new_tokens"], -abs(r["point"]["layers"] - c["layers"])))
        for suffix, row, field, xlab, ylab in (
            ("layers", deepest, "code_by_layer", "layer", "FP4 code mismatch"),
            ("positions", longest, "by_bucket", "completion positions", "mean |Δlogp|"),
        ):
            fig, ax = plt.subplots(figsize=(8, 4))
            for arm in SCALING_ARMS:
                a = row["arms"][arm]
                table = a.get(field) or {}
                keys = list(table)
                ys = [table[k][Name.CODE_MISMATCH if field == "code_by_layer" else Name.GAP_MEAN] for k in keys]
                pairs = [(k, y) for k, y in zip(keys, ys) if y]
                if pairs:
                    ax.plot([k for k, _ in pairs], [y for _, y in pairs], marker="o", ms=3, color=colors[arm], label=arm)
            ax.set_yscale("log")
            ax.set_xlabel(xlab)
            ax.set_ylabel(ylab)
            ax.tick_params(axis="x", labelsize=7, rotation=45)
            ax.set_title(f"{row['name']}: {ylab} per {xlab}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            p = path.with_name(f"{path.stem}_{suffix}.png")
            fig.savefig(p, dpi=100)
            plt.close(fig)
            out.append(p)
    return out


# --- command line ---------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "scaling",
        help="the train-rollout mismatch over a grid of depth, width and completion length, with a fit",
        description="Measure the mismatch report's quantities for every arm over a star grid of model depth "
        f"{DEPTHS}, width {WIDTHS} and completion length {LENGTHS} (trained and random weights), fit how "
        "they grow and predict them at Qwen3-30B-A3B's shapes. Resumable: points already measured under "
        "--dir are kept.",
    )
    p.add_argument("--dir", default="runs/scaling", help="run folder: measured points and trained models")
    p.add_argument("--json", metavar="PATH", help="write the report (every point, fits, predictions) as JSON")
    p.add_argument("--plot", metavar="PATH", help="write the plots (PATH and PATH's _layers/_positions siblings)")
    p.add_argument("--only", metavar="NAMES", help="comma-separated points (e.g. L8-H128-T64-trained) instead of the grid")
    p.add_argument("--weights", default="trained,random", help="trained, random or both (default)")
    p.add_argument("--force", action="store_true", help="re-measure points already under --dir")
    p.add_argument("--batch", type=int, default=16, help="prompts per point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=SFT["steps"], help="fine-tuning steps of a trained point's model")
    p.add_argument("--engine", choices=EngineKind.names(serving=True), default=EngineKind.HOME.value, help="the rollout engine")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run_cli)
    return p


def _selected(args: argparse.Namespace) -> list[Point]:
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    if not weights or set(weights) - set(WEIGHTS):
        raise SystemExit(f"tracefp4 scaling: --weights {args.weights!r}: expected trained, random or both")
    if args.only:
        try:
            return [Point.parse(n.strip()) for n in args.only.split(",") if n.strip()]
        except ValueError as e:
            raise SystemExit(f"tracefp4 scaling: --only: {e}") from None
    return grid(weights)


def run_cli(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.sft_steps < 1:
        raise SystemExit("tracefp4 scaling: --batch and --sft-steps must be >= 1")
    points = _selected(args)
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[scaling {time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    rep = run_scaling(args.dir, points, batch=args.batch, seed=args.seed, sft={**SFT, "steps": args.sft_steps},
                      engine=args.engine, force=args.force, say=say)  # fmt: skip
    print(format_scaling(rep))
    if args.json:
        atomic_write_json(args.json, rep, sort_keys=False)
        print(f"wrote {args.json}")
    if args.plot:
        for p in plot_scaling(rep, args.plot):
            print(f"wrote {p}")
    return 0
