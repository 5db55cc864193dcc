"""GRPO with FP4 rollouts, side by side: BF16 rollout, vanilla FP4 QAT, and TRACE.

One loop, read top to bottom: ``rollout -> store -> train``. Each step samples a group of
completions per prompt with the rollout engine, writes its records (routing, and guidance where the
arm uses it) to the guidance store, reads them back as the trainer would in another process (policy
version and model signature checked), scores the completions, and makes a few clipped-surrogate
updates whose token-level importance weight against the rollout is truncated at ``is_cap``.

Arms (same seeds, same prompts, same sampling seeds):

* ``bf16``: BF16 rollout and BF16 trainer, the reference.
* ``qat``: FP4 rollout, trainer with vanilla round-to-nearest fake quantization.
* ``trace``: FP4 rollout recording compact ``lsb`` hints on the deeper half; guided trainer.
* ``trace-full``: FP4 rollout recording full hints on all layers; guided trainer.

Routing replay is on in every arm. Every FP4 rollout records *full* hints at its guided layers (the
deeper half, or all layers for ``trace-full``) so that the code mismatch can be measured the same way
in every arm. What reaches the store and the trainer is only what the arm uses: nothing for ``qat``,
the low bits for ``trace`` (derived from the full codes: the same bytes an ``lsb`` rollout records),
the full codes for ``trace-full``.

Mixed precision: the model computes in BF16; AdamW keeps FP32 master weights, and the BF16
parameters are refreshed from them in place after every step (which also invalidates the rollout's
cache of quantized expert weights, keyed on the parameter version).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig, PreTrainedModel

from tracefp4.rl import runlog
from tracefp4.files import atomic_write_json
from tracefp4.rl.grpo import LossAgg, group_advantages, grpo_loss, mismatch_metrics
from tracefp4.engines.model import TinyMoESpec, from_config, load_model, model_layers
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import generate
from tracefp4.formats.constants import HintMode
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.names import deeper_half
from tracefp4.guidance.store import StoreReader, StoreWriter, seal_step
from tracefp4.rl.tasks import CharTokenizer, Example, Task, make_task
from tracefp4.engines.trainer import code_mismatch, forward_logprobs

# --- configuration -------------------------------------------------------------------------------


@dataclasses.dataclass
class ModelSpec(TinyMoESpec):
    """A tiny Qwen3-MoE (every layer sparse). Ignored when ``RLConfig.checkpoint`` is given."""

    def hf_config(self, tok: CharTokenizer) -> PretrainedConfig:
        if self.vocab < tok.vocab_size:
            raise ValueError(f"model vocab {self.vocab} is smaller than the tokenizer's {tok.vocab_size}")
        return self.config(
            max_positions=128,
            norm_topk_prob=True, tie_word_embeddings=False,
            pad_token_id=tok.PAD, bos_token_id=tok.BOS, eos_token_id=tok.EOS,
        )


@dataclasses.dataclass
class RLConfig:
    task: str = "reverse"
    task_kwargs: dict = dataclasses.field(default_factory=dict)
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    checkpoint: str | None = None  # a local HF folder (config.json + safetensors) to start from
    arms: tuple[str, ...] = ("bf16", "qat", "trace", "trace-full")
    steps: int = 60
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_cap: float = 5.0
    loss_agg: str = LossAgg.TOKEN_MEAN.value
    normalize_std: bool = True
    updates_per_step: int = 2  # minibatches per rollout batch (one pass)
    warm_start_steps: int = 120
    warm_start_lr: float = 3e-3
    warm_start_batch: int = 64
    eval_every: int = 10
    eval_size: int = 64
    seed: int = 0
    out: str = "runs"
    run_name: str | None = None
    resume: str | None = None  # a run folder whose arm checkpoints to continue from
    threads: int = 2
    rollout_workers: int = 0  # > 0: that many Ray rollout worker processes (needs ray)

    @classmethod
    def from_dict(cls, d: dict) -> "RLConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known: {sorted(known)}")
        if "model" in d and isinstance(d["model"], dict):
            mk = {f.name for f in dataclasses.fields(ModelSpec)}
            bad = sorted(set(d["model"]) - mk)
            if bad:
                raise ValueError(f"unknown model keys {bad}; known: {sorted(mk)}")
            d["model"] = ModelSpec(**d["model"])
        if "arms" in d:
            d["arms"] = tuple(d["arms"])
        cfg = cls(**d)
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str) -> "RLConfig":
        text = Path(path).read_text()
        if path.endswith(".toml"):
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text)
        elif path.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ModuleNotFoundError:
                raise ValueError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use TOML") from None
            data = yaml.safe_load(text) or {}
        elif path.endswith(".json"):
            data = json.loads(text)
        else:
            raise ValueError(f"{path}: config must be .toml, .yaml/.yml or .json")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    def validate(self) -> None:
        for arm in self.arms:
            if arm not in ARMS:
                raise ValueError(f"unknown arm {arm!r}; available: {sorted(ARMS)}")
        LossAgg(self.loss_agg)
        if self.prompts_per_step * self.group_size % self.updates_per_step:
            raise ValueError("prompts_per_step * group_size must be divisible by updates_per_step")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2 for group-relative advantages")


@dataclasses.dataclass(frozen=True)
class Arm:
    rollout: str  # "bf16" (no precision plan) or "fp4" (the run's plan)
    trainer: str  # trainer.forward_logprobs mode
    guidance: str | None  # the GuidedMode the rollout records for the trainer; None: routing only


ARMS = {
    "bf16": Arm("bf16", "bf16", None),
    "qat": Arm("fp4", "qat", None),
    "trace": Arm("fp4", "trace", "lsb"),
    "trace-full": Arm("fp4", "trace", "full"),
}


# --- mixed-precision optimizer -------------------------------------------------------------------


class MasterWeightAdamW:
    """AdamW on FP32 master copies of a BF16 model's parameters, with gradient-norm clipping."""

    def __init__(self, model: PreTrainedModel, *, lr: float, weight_decay: float, grad_clip: float):
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
        self.grad_clip = grad_clip

    def step(self) -> float:
        for m, p in zip(self.master, self.params):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        norm = float(torch.nn.utils.clip_grad_norm_(self.master, self.grad_clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                p.copy_(m)  # in place: bumps the version counter the rollout's weight cache keys on
        return norm

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, (name, m) in enumerate(zip(self.names, self.master)):
            out[f"master/{name}"] = m.detach()
            st = self.opt.state.get(m, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    out[f"{k}/{name}"] = st[k]
            if "step" in st:
                out[f"step/{name}"] = st["step"].reshape(1).float()
        return out

    def load_state_tensors(self, t: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, m, p in zip(self.names, self.master, self.params):
                key = f"master/{name}"
                if key not in t:
                    raise ValueError(f"optimizer checkpoint lacks {key}")
                m.copy_(t[key])
                p.copy_(m)
                if f"exp_avg/{name}" in t:
                    self.opt.state[m] = {
                        "exp_avg": t[f"exp_avg/{name}"].clone(),
                        "exp_avg_sq": t[f"exp_avg_sq/{name}"].clone(),
                        "step": t[f"step/{name}"].reshape(()).clone(),
                    }


# --- helpers -------------------------------------------------------------------------------------


def model_signature(model: PreTrainedModel, plan: PrecisionPlan) -> str:
    cfg = json.dumps(model.config.to_diff_dict(), sort_keys=True, default=str)
    return hashlib.sha256(f"{cfg}|{plan}".encode()).hexdigest()[:16]


def encode_batch(tok: CharTokenizer, examples: Sequence[Example]):
    """Right-padded (ids, labels, attention mask) for supervised warm start: loss on answer + EOS."""
    seqs, plens = [], []
    for e in examples:
        p = tok.encode(e.prompt)
        seqs.append(p + tok.encode(e.answer, bos=False) + [tok.EOS])
        plens.append(len(p))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.PAD, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, p) in enumerate(zip(seqs, plens)):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        labels[i, p : len(s)] = torch.tensor(s[p:])
    return ids, labels, att


def warm_start(model: PreTrainedModel, task: Task, tok: CharTokenizer, cfg: RLConfig, progress=None) -> list[float]:
    """Short supervised fine-tuning (BF16 compute, FP32 master weights) so GRPO starts from a policy
    with non-trivial reward."""
    opt = MasterWeightAdamW(model, lr=cfg.warm_start_lr, weight_decay=0.0, grad_clip=1.0)
    rng = random.Random(cfg.seed + 7919)
    losses = []
    model.train()
    for step in range(cfg.warm_start_steps):
        ids, labels, att = encode_batch(tok, task.sample(rng, cfg.warm_start_batch))
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def evaluate(model: PreTrainedModel, arm: Arm, task: Task, tok: CharTokenizer, cfg: RLConfig, plan: PrecisionPlan):
    """Greedy decoding of the held-out set on the arm's serving path (BF16 or FP4 rollout engine)."""
    examples = task.eval_set(cfg.eval_size)
    out = generate(
        model,
        [tok.encode(e.prompt) for e in examples],
        SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0, stop_token_ids=(tok.EOS,)),
        plan=None if arm.rollout == "bf16" else plan,
    )
    rewards = [task.reward(e, tok.decode(out.completion(b).tolist())) for b, e in enumerate(examples)]
    return {
        "eval_accuracy": sum(r == 1.0 for r in rewards) / len(rewards),
        "eval_reward": sum(rewards) / len(rewards),
    }


def _pad(values: Sequence[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros(len(values), width)
    mask = torch.zeros(len(values), width, dtype=torch.bool)
    for b, v in enumerate(values):
        out[b, : v.numel()] = v
        mask[b, : v.numel()] = True
    return out, mask


def guidance_bytes_per_token(records: Sequence[dict[str, torch.Tensor]], generated: int) -> float:
    total = sum(t.nbytes for r in records for k, t in r.items() if not k.endswith(".routing"))
    return total / max(generated, 1)


# --- one arm -------------------------------------------------------------------------------------


class ArmRunner:
    """Runs GRPO for one arm; all state needed to resume lives in its checkpoint folder."""

    def __init__(self, name: str, model: PreTrainedModel, task: Task, tok: CharTokenizer, cfg: RLConfig,
                 run_dir: Path, plan: PrecisionPlan | None = None, pool=None):
        self.name, self.arm = name, ARMS[name]
        self.model, self.task, self.tok, self.cfg = model, task, tok, cfg
        self.plan = plan or PrecisionPlan()
        self.run_dir = run_dir
        self.store_root = run_dir / "store" / name
        self.opt = MasterWeightAdamW(model, lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)
        self.signature = model_signature(model, self.plan)
        self.version = 0
        self.step = 0
        # arms record only what they use: guidance in the arm's mode, full codes (in memory, for
        # code-mismatch metrics) at its guided layers or, without guidance, the deeper half
        n_layers, _ = model_layers(model)
        self.rollout_plan = None if self.arm.rollout == "bf16" else self.plan
        self.guidance = GuidedMode.parse(self.arm.guidance) if self.arm.guidance else None
        self.diagnostics = (
            frozenset() if self.rollout_plan is None
            else self.guidance.layer_indices(n_layers) if self.guidance is not None
            else deeper_half(n_layers)
        )
        self.log = runlog.MetricsLog(run_dir, name)
        self.pool = pool

    # one GRPO step: rollout -> store -> train
    def train_step(self) -> dict[str, Any]:
        cfg, arm, tok = self.cfg, self.arm, self.tok
        step = self.step
        rng = random.Random(cfg.seed * 1_000_003 + step)  # same prompts for every arm, resumable
        examples = self.task.sample(rng, cfg.prompts_per_step)
        batch = [e for e in examples for _ in range(cfg.group_size)]
        timings: dict[str, float] = {}

        ids = [f"s{step:06d}-{b:04d}" for b in range(len(batch))]
        prompts = [tok.encode(e.prompt) for e in batch]
        sampling = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, (tok.EOS,), seed=cfg.seed * 7_919 + step)
        if self.pool is not None:
            # worker processes: each writes its own shards; the driver seals the step
            self.pool.sync_weights(self.model, self.version)
            roll, writers, timings = self.pool.generate(
                prompts, sampling, group_size=cfg.group_size, plan=self.rollout_plan, guidance=arm.guidance,
                store_root=str(self.store_root), step=step, traj_ids=ids, signature=self.signature,
            )
            seal_step(self.store_root, step, writers)
        else:
            t0 = time.perf_counter()
            roll = generate(self.model, prompts, sampling, plan=self.rollout_plan, guidance=self.guidance,
                            diagnostics=self.diagnostics)
            timings["time/rollout_s"] = time.perf_counter() - t0
            # the store: records cross to the trainer as they would between processes
            t0 = time.perf_counter()
            with StoreWriter(self.store_root, step, "w0", model_signature=self.signature,
                             policy_version=self.version) as w:
                for tid, rec, p in zip(ids, roll.records, roll.prompt_lens):
                    w.add(tid, rec, prompt_len=p)
            seal_step(self.store_root, step, ["w0"])
            timings["time/store_write_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with StoreReader(self.store_root, step, model_signature=self.signature, policy_version=self.version) as r:
            records = r.batch(ids, [t.numel() for t in roll.token_ids])
        timings["time/store_read_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        completions = [tok.decode(roll.completion(b).tolist()) for b in range(len(batch))]
        rewards = torch.tensor([self.task.reward(e, c) for e, c in zip(batch, completions)])
        adv = group_advantages(rewards, cfg.group_size, normalize_std=cfg.normalize_std)
        # Code mismatch needs the rollout's full codes: in-process they are its diagnostics (in memory);
        # from worker processes only what reached the store (full guidance) has them.
        full_records = self.guidance is not None and self.guidance.mode is HintMode.FULL
        reference = roll.diagnostics if any(roll.diagnostics) else (records if full_records else None)
        measure = self.rollout_plan is not None and reference is not None
        with torch.no_grad():  # the policy before this step's updates, with the codes it picks
            old = forward_logprobs(
                self.model, roll.token_ids, roll.prompt_lens, records,
                mode=arm.trainer, plan=self.plan, temperature=max(cfg.temperature, 1e-6),
                capture_codes=self.diagnostics if measure else frozenset(),
            )
        width = max(lp.numel() for lp in roll.logprobs)
        logp_roll, mask = _pad(roll.logprobs, width)
        logp_old, _ = _pad([lp.detach() for lp in old.logprobs], width)
        metrics = mismatch_metrics(logp_roll, logp_old, mask)
        code_stats = self._code_mismatch(reference, old) if measure else {}

        # updates: minibatches over a fixed permutation of the batch
        order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(cfg.seed + step))
        stats_acc: dict[str, float] = {}
        norms = []
        self.model.train()
        for mb in order.chunk(cfg.updates_per_step):
            mb = mb.tolist()
            new = forward_logprobs(
                self.model, [roll.token_ids[b] for b in mb], [roll.prompt_lens[b] for b in mb],
                [records[b] for b in mb], mode=arm.trainer, plan=self.plan,
                temperature=max(cfg.temperature, 1e-6),
            )
            logp_new, m = _pad(new.logprobs, width)
            loss, st = grpo_loss(
                logp_new, logp_old[mb], logp_roll[mb], adv[mb], m, clip_low=cfg.clip_low,
                clip_high=cfg.clip_high, is_cap=cfg.is_cap, agg=cfg.loss_agg, max_new_tokens=cfg.max_new_tokens,
            )
            loss.backward()
            norms.append(self.opt.step())
            for k, v in st.items():
                stats_acc[k] = stats_acc.get(k, 0.0) + v / cfg.updates_per_step
        self.model.eval()
        self.version += 1
        timings["time/train_s"] = time.perf_counter() - t0

        generated = int(mask.sum())
        rec = {
            "kind": "train",
            "step": step,
            "policy_version": self.version,
            "reward_mean": float(rewards.mean()),
            "accuracy": float((rewards == 1.0).float().mean()),
            "response_length": generated / len(batch),
            # Monte Carlo entropy estimate over the sampled tokens: mean of -log pi_rollout
            "entropy": float(-(logp_roll[mask]).mean()),
            "grad_norm": sum(norms) / len(norms),
            "guidance_bytes_per_token": guidance_bytes_per_token(records, generated),
            "router_flip_rate": sum(old.router_flips.values()) / max(len(old.router_flips), 1),
            "guidance/decode_failures": old.decode_failures,
            **metrics,
            **code_stats,
            **stats_acc,
            **timings,
        }
        shutil.rmtree(self.store_root / f"step-{step:08d}", ignore_errors=True)  # consumed
        self.step += 1
        return rec

    def _code_mismatch(self, reference, old) -> dict[str, float]:
        """Share of FP4 codes at the guided sites that the trainer picked differently from the rollout."""
        sites = code_mismatch(old.codes, reference)
        total = sum(s.total for s in sites.values())
        mism = sum(s.mismatched for s in sites.values())
        one = sum(s.one_apart for s in sites.values())
        return {
            "code_mismatch_rate": mism / max(total, 1),
            "code_mismatch_one_apart_share": one / mism if mism else 1.0,
        }

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in self.opt.state_tensors().items()}, str(path / "optimizer.safetensors"))
        atomic_write_json(path / "trainer_state.json", {
            "arm": self.name, "step": self.step, "policy_version": self.version, "signature": self.signature,
        })

    def load(self, path: Path) -> None:
        state = json.loads((path / "trainer_state.json").read_text())
        if state["arm"] != self.name:
            raise ValueError(f"{path}: checkpoint of arm {state['arm']!r}, not {self.name!r}")
        if state["signature"] != self.signature:
            raise ValueError(f"{path}: model signature {state['signature']} differs from {self.signature}")
        self.opt.load_state_tensors(load_file(str(path / "optimizer.safetensors")))
        self.step, self.version = int(state["step"]), int(state["policy_version"])


# --- the whole run -------------------------------------------------------------------------------

SUMMARY_KEYS = [
    ("reward_mean", "reward"),
    ("train_rollout_logprob_abs_diff", "mean |Δlogp|"),
    ("train_rollout_logprob_abs_diff_max", "max |Δlogp|"),
    ("rollout_corr/k3_kl", "k3 KL"),
    ("code_mismatch_rate", "code mismatch"),
    ("guidance_bytes_per_token", "guidance B/token"),
    ("time/rollout_s", "rollout s"),
    ("time/train_s", "train s"),
]


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)


def run(cfg: RLConfig) -> Path:
    """Warm start once, then GRPO for every arm from the same weights; returns the run folder."""
    cfg.validate()
    torch.set_num_threads(cfg.threads)
    tok = CharTokenizer()
    task = make_task(cfg.task, **cfg.task_kwargs)
    run_dir = Path(cfg.resume) if cfg.resume else runlog.new_run_dir(cfg.out, cfg.run_name)
    atomic_write_json(run_dir / "config.json", dataclasses.asdict(cfg))
    base_dir = run_dir / "checkpoints" / "warm_start"

    if (base_dir / "config.json").exists():
        base = load_model(base_dir)
    else:
        if cfg.checkpoint:
            base = load_model(cfg.checkpoint)
        else:
            base = from_config(cfg.model.hf_config(tok), dtype=torch.bfloat16, seed=cfg.seed)
        if cfg.warm_start_steps > 0:
            with _progress(cfg.warm_start_steps, "warm start (SFT)") as bar:
                warm_start(base, task, tok, cfg, bar)
        base.save_pretrained(base_dir)

    pool = None
    if cfg.rollout_workers > 0:
        from tracefp4.rl.workers import RolloutPool

        pool = RolloutPool(base, cfg.rollout_workers)
    try:
        for name in cfg.arms:
            if pool is not None:
                pool.version = None  # every arm starts from the warm-start weights: resync
            _run_arm(name, base, task, tok, cfg, run_dir, pool)
    finally:
        if pool is not None:
            pool.shutdown()
    write_report(run_dir)
    return run_dir


def _run_arm(name: str, base: PreTrainedModel, task: Task, tok: CharTokenizer, cfg: RLConfig, run_dir: Path,
             pool) -> None:
    """GRPO for one arm from the warm-start weights (or its own checkpoint, when resuming)."""
    ckpt = run_dir / "checkpoints" / name
    resume = (ckpt / "trainer_state.json").exists()
    runner = ArmRunner(name, load_model(ckpt) if resume else copy.deepcopy(base), task, tok, cfg, run_dir, pool=pool)
    if resume:
        runner.load(ckpt)
    if runner.step == 0:
        runner.log.log({"kind": "eval", "step": 0, **evaluate(runner.model, runner.arm, task, tok, cfg, runner.plan)})
    with _progress(cfg.steps, f"GRPO {name:>10}") as bar:
        bar.update(runner.step)
        while runner.step < cfg.steps:
            rec = runner.train_step()
            runner.log.log(rec)
            bar.update(1)
            bar.set_postfix(reward=f"{rec['reward_mean']:.2f}",
                            dlogp=f"{rec['train_rollout_logprob_abs_diff']:.4f}")
            if runner.step % cfg.eval_every == 0 or runner.step == cfg.steps:
                runner.log.log({"kind": "eval", "step": runner.step,
                                **evaluate(runner.model, runner.arm, task, tok, cfg, runner.plan)})
                runner.save(ckpt)
    runner.log.close()


def write_report(run_dir: Path) -> str:
    """Plots and the summary table of a run folder (also usable on a finished or partial run)."""
    metrics = runlog.read_metrics(run_dir)
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    runlog.plot_metric(metrics, "train_rollout_logprob_abs_diff_max", plots / "logprob_gap_max.png",
                       title="max |Δlogp| (trainer vs rollout) per step", ylabel="max |Δlogp|", logy=True)
    runlog.plot_metric(metrics, "train_rollout_logprob_abs_diff", plots / "logprob_gap_mean.png",
                       title="mean |Δlogp| (trainer vs rollout) per step", ylabel="mean |Δlogp|", logy=True)
    runlog.plot_metric(metrics, "reward_mean", plots / "reward.png", title="training reward", ylabel="mean reward")
    runlog.plot_metric(metrics, "eval_accuracy", plots / "eval_accuracy.png", title="held-out greedy accuracy",
                       ylabel="accuracy", kind="eval")
    rows = runlog.summary_rows(metrics, SUMMARY_KEYS)
    columns = [("arm", "arm"), ("steps", "steps"), *SUMMARY_KEYS, ("eval_accuracy_first", "eval acc (start)"),
               ("eval_accuracy", "eval acc (end)")]
    table = runlog.markdown_table(rows, columns)
    (run_dir / "summary.md").write_text(
        f"# GRPO run `{run_dir.name}`\n\nMeans over the last 5 steps of each arm.\n\n{table}\n\n"
        "![max gap](plots/logprob_gap_max.png)\n![reward](plots/reward.png)\n"
        "![eval](plots/eval_accuracy.png)\n"
    )
    return table
