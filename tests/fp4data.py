"""Test data shared by the numerics, guidance and Triton tests: the hard cases for FP4 exactness."""

from __future__ import annotations

import torch

S_ENC_ONE = torch.tensor(448.0 * 6.0)  # a global amax for which S_enc == 1 exactly

KINDS = ["randn", "heavy_tailed", "zero_blocks", "subnormal_scales", "saturating", "tiny"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view, so that -0.0 != 0.0 and comparisons are exact."""
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.uint8)


def make_data(kind: str, dtype: torch.dtype, rows: int = 24, cols: int = 256, seed: int | None = None) -> torch.Tensor:
    """``rows x cols`` test data of one kind; the seed defaults to a fixed one per kind."""
    g = torch.Generator().manual_seed(KINDS.index(kind) if seed is None else seed)
    if kind == "randn":
        x = torch.randn(rows, cols, generator=g)
    elif kind == "heavy_tailed":  # magnitudes spanning 1e-6 .. 1e4 within rows and blocks
        mags = torch.exp(torch.empty(rows, cols).uniform_(-13.8, 9.2, generator=g))
        x = mags * torch.randn(rows, cols, generator=g).sign()
    elif kind == "zero_blocks":
        x = torch.randn(rows, cols, generator=g)
        x[:, 16:48] = 0.0
        x[::3] = 0.0
        x[1, 64:80] = -0.0
    elif kind == "subnormal_scales":  # blocks 2^-12 .. 2^-20 below the row amax: E4M3 subnormal scales
        x = torch.randn(rows, cols, generator=g)
        x[:, 0] = 1000.0
        decay = 2.0 ** -torch.arange(12, 12 + cols // 16).float().repeat_interleave(16)
        x[:, 16:] = x[:, 16:] * decay[16:]
    elif kind == "saturating":  # values far above a global amax the caller passes in
        x = torch.randn(rows, cols, generator=g) * 50
    elif kind == "tiny":  # float32/bf16 subnormals, and an S_enc so large that 1/S_enc is subnormal too:
        # bit-exact only where the device keeps float32 subnormals instead of flushing them to zero
        x = torch.randn(rows, cols, generator=g) * 1e-38
    else:
        raise AssertionError(kind)
    return x.to(dtype)


def rollout_and_trainer(seed: int, rows: int, cols: int, drift: float, dtype=torch.bfloat16):
    """A rollout activation and the trainer's version of it, relatively perturbed by ``drift``."""
    g = torch.Generator().manual_seed(seed)
    x_roll = (torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 10).to(dtype)
    noise = 1 + drift * torch.randn(rows, cols, generator=g)
    x_train = (x_roll.float() * noise).to(dtype)
    return x_roll, x_train
