"""The trainer on N processes (FSDP2, gloo on CPU) against the trainer in one process.

Tolerances, and why. Both paths compute the same function from the same BF16 weights; what differs is
where BF16 rounding happens. (1) The sharded forward of the same inputs is bit-identical (FSDP2 gathers
the FP32 masters and casts them to BF16, the very weights the single process holds). (2) On different
inputs it is not: each rank packs only its half of a minibatch, and a trajectory's BF16 log-probs
depend slightly on what it is packed with (matmul blocking over the packed row count): a per-token
drift delta that depends on the machine's kernels. The test measures delta on both paths' actual
inputs and bounds the loss by what delta can do to it (see the test's docstring). (3) Gradients: in one process the
gradient of a parameter is one BF16 tensor over the minibatch; on two ranks each rank's BF16 partial is
summed in FP32 (a BF16 rounding is off by at most 2^-8 relative, a gradient element is rounded at most
twice on either path, so the two differ by at most ~2^-7 = 0.8%, plus the log-prob drift of (2)): the
grad norm agrees within 1%. (4) Weights after two GRPO steps, i.e.
``2 * updates_per_step`` Adam updates (4 in the killed-and-resumed run): Adam normalises each coordinate, so a near-zero gradient
whose sign differs between the paths can move one weight the other way by the most an Adam step can
move it. That is ``adam_step_bound(t) * lr`` at update t (Cauchy-Schwarz, whatever the gradients;
1.0 to 1.0056 for t = 1..4), so two runs from the same state end at most
``adam_drift_bound(4) * lr`` = 8.02 lr apart, plus the FP32 rounding of the masters themselves
(half an ulp of |w| per update). That bound holds on every machine; no smaller one does, since which
coordinates sit at the noise level depends on the machine's BF16 kernels. The mean difference
separates "the same update, up to noise-level coordinates" from "another update": for unrelated
updates of the same size it would be about the mean distance moved (mean |a - b| / mean |a| ~ 1 for
independent signs); we require under a quarter of it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from tracefp4.engines.model import from_config
from tracefp4.guidance.store import StoreReader, step_bytes
from tracefp4.pipeline import steps
from tracefp4.pipeline.arms import make_arm
from tracefp4.pipeline.steps import model_signature
from tracefp4.rl import update as update_mod
from tracefp4.rl.collect import ArmSetup, collect
from tracefp4.rl.config import ModelSpec, RLConfig
from tracefp4.rl.distributed import TrainerGroup, rank_share
from tracefp4.rl.grpo import pad_right
from tracefp4.rl.optim import BETAS, MasterWeightAdamW, adam_drift_bound, adam_step_bound
from tracefp4.rl.tasks import Reverse

MODEL = ModelSpec(hidden=32, layers=2, experts=4, top_k=2, moe_intermediate=32, heads=2, kv_heads=1)
TINY = dict(steps=2, warm_start_steps=3, prompts_per_step=2, group_size=4, max_new_tokens=4, eval_every=1,
            eval_size=4, updates_per_step=2, threads=2, lr=1e-3, model=MODEL)


def _setup(tmp_path, arm: str, **overrides) -> ArmSetup:
    cfg = RLConfig(**{**TINY, **overrides})
    task = Reverse()
    tok = task.make_tokenizer()
    model = from_config(cfg.model.hf_config(tok), seed=0)
    a = make_arm(arm, guidance=cfg.guidance, n_layers=cfg.model.layers)
    return ArmSetup(arm, a, model, task, tok, cfg, tmp_path / "store", model_signature(model, a.plan), None)


@pytest.mark.parametrize("kw, expected", [
    (dict(trainer_world_size=0), "trainer_world_size = 0: expected a value >= 1"),
    (dict(trainer_world_size=5, prompts_per_step=2, group_size=4, updates_per_step=2),
     "trainer_world_size = 5: expected at most the minibatch size"),
])
def test_trainer_world_size_is_validated(kw, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(")):
        RLConfig(**kw).validate()
    assert RLConfig().trainer_world_size == 1  # default: the update in this process, as before


def test_rank_share_is_a_partition():
    idx = [5, 2, 7, 0, 3]
    shares = [rank_share(idx, r, 2) for r in range(2)]
    assert shares == [[5, 7, 3], [2, 0]]
    assert sorted(sum(shares, [])) == sorted(idx)


def _logprobs(model, s: ArmSetup, b, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's log-probs of trajectories ``idx`` of batch ``b``, padded to the batch's width, and their mask."""
    mb = update_mod.select(b, idx)
    out = steps.trainer_logprobs(model, mb.token_ids, mb.prompt_lens, mb.records, s.arm, temperature=s.cfg.temperature)
    return pad_right(out.logprobs, b.width)


def _rank_drift(one_model, two_model, s: ArmSetup, b) -> dict:
    """What the loss of one update may differ by between one process and two ranks (module docstring
    (2)), measured on this machine: each path's log-probs of the step's single minibatch (one process
    packs it whole, each rank its share), the largest per-token difference ``delta``, and the bounds it
    implies (see the test)."""
    cfg = s.cfg
    order = torch.randperm(len(b.token_ids), generator=torch.Generator().manual_seed(cfg.seed + b.step)).tolist()
    with torch.no_grad():
        one, mask = _logprobs(one_model, s, b, order)
        two = torch.zeros_like(one)
        for r in range(2):
            share = rank_share(order, r, 2)
            two[[order.index(i) for i in share]] = _logprobs(two_model, s, b, share)[0]
    old, roll, adv = b.logp_old[order], b.logp_rollout[order], b.advantages[order]
    delta = float((one - two)[mask].abs().max())
    ratio = torch.exp(one - old)[mask]
    weight = torch.exp(old - roll).clamp(max=cfg.is_cap)[mask]
    lipschitz = float((weight * adv[:, None].expand_as(one)[mask].abs() * ratio).max())
    edges = torch.tensor([math.log(1 - cfg.clip_low), math.log1p(cfg.clip_high)])
    near_edge = int(((torch.log(ratio)[:, None] - edges).abs() <= delta).any(dim=1).sum())
    return {"delta": delta, "loss": lipschitz * math.exp(delta) * math.expm1(delta),
            "clip_frac": near_edge / int(mask.sum())}


@pytest.mark.slow
@pytest.mark.ray
def test_two_ranks_equal_one_process(tmp_path, monkeypatch):
    """Sharded forward == unsharded forward; same batch on N=2 and N=1: loss, grad norm, and the
    weights after two steps; each rank reads only its own records from the store.

    One update per step, so each step's update starts from weights this test can see on both paths
    (the driver's copy of the ranks' weights comes back after every step) and the loss bound can be
    derived from what the two forwards computed. The token-mean loss is a mean of per-token terms
    ``-w * min(r A, clip(r) A)`` with ``w`` (IS weight) and ``A`` the same on both paths and
    ``r = exp(logp - logp_old)``; as a function of r each term is Lipschitz with constant ``w |A|``,
    and a log-prob that differs by at most delta moves r by at most ``r e^delta expm1(delta)``, so
    the losses differ by at most ``max(w |A| r) e^delta expm1(delta)`` (plus FP32 summation, 1e-6
    relative). A token's clipped/unclipped state can only differ where its log-ratio lies within
    delta of a clip edge. The grad norm is a model rather than a proof (module docstring (3)): each
    gradient element's BF16 roundings (2^-8 relative each, ~2^-7 between the two paths) plus
    expm1(delta) from the per-token weights, under 1% with delta ~1e-3.
    """
    s = _setup(tmp_path, "trace-full", updates_per_step=1)  # guided fake quant on every layer, routing replay
    batches = [collect(s, step=0, version=0)]
    n = len(batches[0].token_ids)
    # an untrained policy's rewards tie: give it signal (not mean zero, so the loss is not ~0 either)
    adv = torch.tensor([1.0, -0.5] * (n // 2))
    for b in batches:
        b.advantages = adv
    base = copy.deepcopy(s.model)
    opt1 = MasterWeightAdamW(s.model, lr=s.cfg.lr, weight_decay=0.0, grad_clip=s.cfg.grad_clip)
    ref_t0 = {k: v.clone() for k, v in opt1.state_tensors().items()}

    with TrainerGroup(2, base, s.cfg, s.arm, opt1.state_tensors()) as group:
        # 1. the sharded forward sees the gathered [E, N, K] expert weights: identical log-probs
        ref = [lp.detach() for lp in update_mod.steps.trainer_logprobs(
            s.model, batches[0].token_ids, batches[0].prompt_lens, batches[0].records, s.arm, temperature=1.0).logprobs]
        for per_rank in group.logprobs(batches[0].token_ids, batches[0].prompt_lens, batches[0].records):
            assert all(torch.equal(a, b) for a, b in zip(per_rank, ref))

        # 2. two steps on the same batches, one process vs two ranks
        losses = []
        real_loss = update_mod.grpo_loss

        def spy(*a, **k):
            loss, st = real_loss(*a, **k)
            losses.append(float(loss))
            return loss, st

        monkeypatch.setattr(update_mod, "grpo_loss", spy)
        one, two, bounds = [], [], []
        for step in range(2):
            b = batches[0] if step == 0 else collect(s, step=1, version=1)
            if step:
                b.advantages = adv
            bounds.append(_rank_drift(s.model, base, s, b))  # both paths' weights, before this step's update
            one.append(update_mod.update(s.model, opt1, s.arm, s.cfg, b))
            one[-1]["loss"] = sum(losses[-s.cfg.updates_per_step:]) / s.cfg.updates_per_step
            two.append(group.update(b, s.store_root, s.signature, step, base))
            # 3. rank-local records: each rank read less than the step holds; together about the step
            with StoreReader(s.store_root, b.step, model_signature=s.signature, policy_version=step) as r:
                total = step_bytes(r)
            assert two[-1]["store/bytes_step"] == total
            per_rank = [two[-1][f"store/bytes_read_rank{r}"] for r in range(2)]
            assert all(0 < x < total for x in per_rank), (per_rank, total)
            assert two[-1]["store/bytes_read_rank"] == max(per_rank)
        tensors = group.optimizer_tensors()

    for a, b, bound in zip(one, two, bounds):
        print(f"loss {a['loss']:.8f} vs {b['loss']:.8f} (bound {bound['loss']:.2e}, delta {bound['delta']:.2e}); "
              f"grad norm {a['grad_norm']:.6f} vs {b['grad_norm']:.6f}")
        assert abs(b["loss"] - a["loss"]) <= bound["loss"] + 1e-6 * abs(a["loss"])  # see the docstring
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2)  # see the docstring
        assert abs(b["clip_frac"] - a["clip_frac"]) <= bound["clip_frac"] + 1e-6
    ref_t = opt1.state_tensors()
    assert set(tensors) == set(ref_t)  # the checkpoint's tensor names: a run resumes from either
    diff = moved = 0.0
    updates = 2 * s.cfg.updates_per_step  # two GRPO steps
    for name, p2 in base.named_parameters():
        m1, m2 = ref_t[f"master/{name}"], tensors[f"master/{name}"]
        assert (m1 - m2).abs().max() <= weight_bound(s.cfg.lr, updates, m1), name  # module docstring (4)
        diff += float((m1 - m2).abs().sum())
        moved += float((m1 - ref_t0[f"master/{name}"]).abs().sum())
        assert torch.equal(p2, m2.to(torch.bfloat16))  # the driver's model = bf16(masters)
    print(f"weights after 2 steps: mean |N=2 - N=1| / mean |moved| = {diff / moved:.2e}")
    assert diff < 0.25 * moved  # module docstring (4)


def weight_bound(lr: float, updates: int, weights: torch.Tensor) -> float:
    """How far apart two Adam runs from the same state can put one FP32 master weight after
    ``updates`` steps (module docstring, (4)): the optimizer's bound, plus half an FP32 ulp of the
    largest weight per update for the rounding of the masters themselves."""
    ulp = float(weights.abs().max()) * torch.finfo(torch.float32).eps
    return adam_drift_bound(updates) * lr + updates * ulp


def test_adam_bounds_hold_and_are_attained():
    """The bound the equivalence tests use: no gradient sequence moves a weight further per step than
    adam_step_bound (random and adversarial sequences, torch's own AdamW), and g_i ~ a_i / b_i attains it."""
    lr = 1e-3
    g = torch.Generator().manual_seed(0)
    for t in range(1, 9):
        b1, b2 = BETAS
        a = torch.tensor([(1 - b1) * b1 ** (t - i) / (1 - b1**t) for i in range(1, t + 1)], dtype=torch.float64)
        b = torch.tensor([(1 - b2) * b2 ** (t - i) / (1 - b2**t) for i in range(1, t + 1)], dtype=torch.float64)
        worst = (a / b).float()
        grads = torch.cat([worst[None], torch.randn(64, t, generator=g).exp() * torch.randn(64, t, generator=g)])
        w = torch.zeros(grads.shape[0], requires_grad=True)
        opt = torch.optim.AdamW([w], lr=lr, betas=BETAS, eps=0.0, weight_decay=0.0)
        for i in range(t):
            before = w.detach().clone()
            w.grad = grads[:, i].clone()
            opt.step()
        step = (w.detach() - before).abs() / lr
        bound = adam_step_bound(t)
        assert float(step.max()) <= bound * (1 + 1e-5), t  # FP32 arithmetic of the update itself
        assert float(step[0]) == pytest.approx(bound, rel=1e-5), t  # attained: no smaller bound holds
    assert adam_drift_bound(4) == pytest.approx(2 * sum(adam_step_bound(t) for t in range(1, 5)))
    assert 8.0 < adam_drift_bound(4) < 8.05


def _rows(run_dir, arm):
    return [json.loads(x) for x in (run_dir / "metrics" / f"{arm}.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.subprocess
def test_grpo_run_on_two_trainer_processes_killed_and_resumed(tmp_path):
    """Two arms with trainer_world_size = 2 against 1: the first step's grad norm agrees within 1% per
    arm; config.json records the world size; a run killed (SIGKILL, mid-run after its second update)
    resumes on two processes, from checkpoints in the format one process writes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from tracefp4.rl.loop import run

    common = dict(TINY, lr=1e-4, arms=("qat", "trace"), out=str(tmp_path), warm_start_steps=15)
    one = run(RLConfig(**{**common, "run_name": "one"}))
    two = tmp_path / "two"
    config = tmp_path / "two.json"
    plain = {**common, "model": dataclasses.asdict(MODEL), "arms": list(common["arms"]), "run_name": "two",
             "trainer_world_size": 2}
    config.write_text(json.dumps(plain))
    env = {k: v for k, v in os.environ.items() if k not in ("TRACEFP4_CRASH_AT", "TRACEFP4_DEBUG")}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env.update(PYTHONPATH=src, NUMBA_NUM_THREADS="1", TRACEFP4_CRASH_AT="updated:2")  # qat's step 1
    killed = subprocess.run([sys.executable, "-m", "tracefp4", "train", "--config", str(config)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert json.loads((two / "config.json").read_text())["trainer_world_size"] == 2
    assert json.loads((one / "config.json").read_text())["trainer_world_size"] == 1
    run(RLConfig(**{**common, "resume": str(two), "trainer_world_size": 2}))  # in this process, to step 2
    for arm in ("qat", "trace"):
        a = [r for r in _rows(one, arm) if r["kind"] == "train"]
        b = [r for r in _rows(two, arm) if r["kind"] == "train"]
        assert [r["step"] for r in b] == [0, 1]
        print(f"{arm}: first-step grad norm N=1 {a[0]['grad_norm']:.6f}  N=2 {b[0]['grad_norm']:.6f}")
        assert b[0]["grad_norm"] == pytest.approx(a[0]["grad_norm"], rel=1e-2)
        assert b[0]["reward_mean"] == a[0]["reward_mean"]  # the rollout is the driver's, as with N = 1
        assert 0 < b[1]["store/bytes_read_rank0"] < b[1]["store/bytes_step"]
        ck_a, ck_b = (d / "checkpoints" / arm / "step-00000002" for d in (one, two))
        ta, tb = load_file(ck_a / "optimizer.safetensors"), load_file(ck_b / "optimizer.safetensors")
        assert set(ta) == set(tb)
        for k in ta:
            if k.startswith("master/"):  # two GRPO steps of lr 1e-4, four Adam updates (module docstring (4))
                updates = 2 * common["updates_per_step"]
                assert (ta[k] - tb[k]).abs().max() <= weight_bound(common["lr"], updates, ta[k]), k
        assert json.loads((ck_b / "trainer_state.json").read_text())["state"]["policy_version"] == 2
