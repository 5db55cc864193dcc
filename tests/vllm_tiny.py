"""What the vLLM engine tests share (test_vllm, test_vllm_packed, test_vllm_dense): the settings of one
in-process vLLM engine on CPU, the plan and prompts they roll out with, and a tiny checkpoint written for
vLLM to load."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams

#: the engine core in this process (the tests reach into its model), threads not pinned to cores (the
#: machine's cores are shared), 1 GiB of KV cache, one OpenMP thread
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
       "OMP_NUM_THREADS": "1"}
FP4 = PrecisionPlan()
PROMPTS = [[5, 17, 33, 81, 9, 100, 7], [42, 11, 250, 3], [7, 7, 19, 200, 31, 64, 128, 1, 2, 90, 11]]
#: what test_vllm_packed and test_vllm_dense roll out (test_vllm picks its sampling test by test)
SAMPLING = SamplingParams(max_new_tokens=8, seed=3)


def use_cpu_engine() -> None:
    """Set :data:`ENV` where the environment does not set it already (before the first engine starts),
    and this process's torch to one thread, as vLLM's."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    torch.set_num_threads(1)


def save_checkpoint(path: Path, config, seed: int, eos_token_ids: Sequence[int] = ()) -> str:
    """A BF16 model of ``config`` initialised after ``torch.manual_seed(seed)``, saved at ``path`` with
    ``eos_token_ids`` in its generation config (none: a rollout stops only where its sampling says)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos_token_ids)}))
    return str(path)
