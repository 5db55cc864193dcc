"""Mixed precision: the model computes in BF16; AdamW keeps FP32 master weights.

The BF16 parameters are refreshed from the masters in place after every step, which also invalidates
the rollout's cache of quantized expert weights (keyed on the parameter version).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


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

