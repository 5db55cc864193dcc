"""Mixed precision: the model computes in BF16; AdamW keeps FP32 master weights.

The BF16 parameters are refreshed from the masters in place after every step, which also invalidates
the rollout's cache of quantized expert weights (keyed on the parameter version).
"""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

__all__ = ["BETAS", "MasterWeightAdamW", "adam_step_bound", "adam_drift_bound"]

#: Adam's (beta1, beta2) for every optimizer of the project (warm start and GRPO).
BETAS = (0.9, 0.99)


def adam_step_bound(step: int, betas: tuple[float, float] = BETAS) -> float:
    """The largest ``|delta w| / lr`` that bias-corrected Adam's ``step``-th update (1-based) can make to
    one weight, whatever the gradients were (eps and weight decay only make it smaller).

    With ``m_hat = sum_i a_i g_i`` and ``v_hat = sum_i b_i g_i^2`` over the steps so far
    (``a_i = (1 - beta1) beta1^(t-i) / (1 - beta1^t)``, ``b_i`` likewise with beta2), Cauchy-Schwarz
    gives ``|m_hat| / sqrt(v_hat) <= sqrt(sum_i a_i^2 / b_i)``, with equality for ``g_i ~ a_i / b_i``.
    It is 1 at the first step and grows slowly (1.0056 at step 4 with betas (0.9, 0.99)).
    """
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    b1, b2 = betas
    a = [(1 - b1) * b1 ** (step - i) / (1 - b1**step) for i in range(1, step + 1)]
    b = [(1 - b2) * b2 ** (step - i) / (1 - b2**step) for i in range(1, step + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b)))


def adam_drift_bound(updates: int, betas: tuple[float, float] = BETAS) -> float:
    """The largest ``|w_1 - w_2| / lr`` two Adam runs from the same weights and optimizer state can
    reach after ``updates`` steps on different gradients: each run moves a weight by at most
    :func:`adam_step_bound` per step, in opposite directions at worst (decoupled weight decay scales
    both by the same factor <= 1, which only shrinks the difference)."""
    return 2.0 * sum(adam_step_bound(t, betas) for t in range(1, updates + 1))


class MasterWeightAdamW:
    """AdamW on FP32 master copies of a BF16 model's parameters, with gradient-norm clipping."""

    def __init__(self, model: PreTrainedModel, *, lr: float, weight_decay: float, grad_clip: float):
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay, betas=BETAS)
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

