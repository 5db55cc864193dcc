"""vLLM with a dense model (Qwen3): the plugin's linear method holds each MLP linear packed FP4 as one
expert with every row, records ``mlp_in`` / ``mlp_mid`` (and K/V) like our engine, and our trainer
reproduces every code it recorded."""

from __future__ import annotations


import pytest

vllm = pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from vllm_tiny import FP4, PROMPTS, SAMPLING, save_checkpoint, use_cpu_engine  # noqa: E402

use_cpu_engine()

import torch  # noqa: E402

from tracefp4.engines.model import load_model, tiny_dense_config  # noqa: E402
from tracefp4.engines.trainer import code_mismatch, forward_rollout  # noqa: E402
from tracefp4.guidance.compact import GuidedMode  # noqa: E402
from tracefp4.guidance.names import KV_SITES, MLP_SITES, parse_name, record_prefix  # noqa: E402

LAYERS = 3
ALL = frozenset(range(LAYERS))
# K = 512 and 1024: whole tiles of the packed layout (no padding in the bytes per parameter)
CONFIG = dict(layers=LAYERS, hidden=512, intermediate=1024, heads=4, kv_heads=2, head_dim=64, vocab=256,
              init_std=0.05, max_positions=512, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return save_checkpoint(tmp_path_factory.mktemp("vllm_dense") / "ckpt", tiny_dense_config(**CONFIG), seed=1)


@pytest.fixture(scope="module")
def packed(ckpt):
    """A full-record rollout of the engine holding packed MLP weights only, and what its MLP linears hold."""
    from tracefp4.engines.vllm import VLLMEngine
    from tracefp4.engines.vllm.quant import TraceFP4DenseMLPMethod

    def held(worker):
        model = worker.model_runner.get_model()
        return {name: {n: (str(p.dtype), p.numel(), p.nbytes) for n, p in m.named_parameters(recurse=False)}
                for name, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), TraceFP4DenseMLPMethod)}

    with VLLMEngine(ckpt, plan=FP4, keep_bf16=False, max_model_len=64, max_num_seqs=4) as e:
        out = e.generate(PROMPTS, SAMPLING, plan=FP4, guidance=GuidedMode.parse("full@all"), diagnostics=ALL)
        return out, e.llm.collective_rpc(held)[0]


def test_mlp_linears_are_held_packed(packed) -> None:
    """Every MLP linear of every layer holds the packed codes, scale bytes and a divisor in place of
    its BF16 weight: at most 0.8 bytes per MLP weight parameter (NVFP4: 0.5625 and the divisors)."""
    _, held = packed
    assert sorted(held) == sorted(f"model.layers.{i}.mlp.{n}" for i in ALL for n in ("gate_up_proj", "down_proj"))
    params = {"gate_up_proj": 2 * CONFIG["intermediate"] * CONFIG["hidden"], "down_proj": CONFIG["hidden"] * CONFIG["intermediate"]}
    for name, tensors in held.items():
        assert sorted(tensors) == ["divisor", "weight", "weight_scale"], name
        assert tensors["weight"][0] == "torch.uint8" and tensors["weight_scale"][0] == "torch.uint8"
        per_param = sum(nbytes for _, _, nbytes in tensors.values()) / params[name.rsplit(".", 1)[1]]
        assert 0.5625 <= per_param <= 0.8, (name, per_param)


def test_trainer_reproduces_every_code_of_the_dense_vllm_rollout(packed, ckpt) -> None:
    """The records name every dense-MLP and K/V site of every layer and no routing; our trainer with
    those full records picks vLLM's codeword at every site (the two differ at BF16 level: attention,
    vLLM's SiluAndMul, the order of the GEMMs' additions)."""
    out, _ = packed
    names = {parse_name(k) for k in out.records[0]}
    assert not any(n.is_routing for n in names)
    assert {record_prefix(n.layer, n.site) for n in names} == {record_prefix(i, s) for i in ALL for s in (*MLP_SITES, *KV_SITES)}
    hf = load_model(ckpt)
    with torch.no_grad():
        trained = forward_rollout(hf, out, mode="trace", capture_codes=ALL)
    stats = code_mismatch(trained.codes, out.diagnostics)
    assert sum(s.total for s in stats.values()) > 0
    assert sum(s.mismatched for s in stats.values()) == 0, stats
