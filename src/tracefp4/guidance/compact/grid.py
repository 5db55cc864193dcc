"""The rollout's grid as the trainer recomputes it: z on the grid, round to nearest, E4M3 scale codes, BF16 amax.

The one module of the package that reads :mod:`tracefp4.formats.reference` (the NVFP4 encode scale
and factor, in the kernels' operation order), so moving those helpers is a one-line switch here.
"""

from __future__ import annotations

import torch

from tracefp4.formats import reference as ref
from tracefp4.formats.constants import E2M1_MAX, E2M1_MIDPOINTS, E4M3_MAX, NVFP4_BLOCK, Format
from tracefp4.formats.numerics import mx_scale_values

__all__ = ["global_encode_scale", "grid_z", "rtn_codes", "midpoint_distance", "unrounded_block_scale",
           "scale_candidates", "bf16_pattern", "nearest_with_residue", "check_bf16_exact"]

_MIDS = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float32)
# Midpoints whose tie goes up (to the even code above): 0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0.
_TIES_UP = _MIDS[1::2].clone()


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's ``S_enc`` of a global amax."""
    return ref.nvfp4_global_encode_scale(amax)


def grid_z(x: torch.Tensor, fmt: Format, scales: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    """float32 ``clamp(x * enc, +-6)`` on the grid ``(scales, amax)``, exactly as the kernels compute it."""
    block = fmt.block
    xb = x.to(torch.float32).reshape(*x.shape[:-1], -1, block)
    if fmt is Format.NVFP4:
        enc = ref.nvfp4_encode_factor(scales, global_encode_scale(amax))
    else:
        enc = torch.tensor(1.0) / mx_scale_values(scales)
    return torch.clamp(xb * enc.unsqueeze(-1), -E2M1_MAX, E2M1_MAX).reshape(x.shape)


def rtn_codes(z: torch.Tensor) -> torch.Tensor:
    """Unpacked round-to-nearest codes of float32 ``z`` (clamped); ties to the even code, sign = signbit."""
    a = z.abs()
    mag = torch.bucketize(a, _MIDS, right=False) + torch.isin(a, _TIES_UP).to(torch.int64)
    return (mag + torch.signbit(z).to(torch.int64) * 8).to(torch.uint8)


def midpoint_distance(z: torch.Tensor) -> torch.Tensor:
    """``|(|z|) - m|`` for the nearest rounding midpoint m (grid units): how near z is to a tie."""
    a = z.abs()
    i = torch.bucketize(a, _MIDS).clamp(max=len(E2M1_MIDPOINTS) - 1)
    below = _MIDS[(i - 1).clamp(min=0)]
    return torch.minimum((a - _MIDS[i]).abs(), (a - below).abs())


# --- E4M3 scale codes ----------------------------------------------------------------------------

#: The largest finite E4M3 code (0x7E = 448; 0x7F is NaN in float8_e4m3fn): a scale never rounds up past
#: it. Derived from ``E4M3_MAX`` because :mod:`tracefp4.formats.constants` names values, not codes.
_E4M3_MAX_CODE = int(torch.tensor(E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8))


def _e4m3_value(code: torch.Tensor) -> torch.Tensor:
    return code.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def unrounded_block_scale(x: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """``clamp(amax_b * (S_enc * (1/6)), 448)`` before the E4M3 cast (the reference's operation order)."""
    block_amax = x.to(torch.float32).abs().reshape(*x.shape[:-1], -1, NVFP4_BLOCK).amax(dim=-1)
    one_sixth = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(E2M1_MAX, dtype=torch.float32)
    return torch.clamp(block_amax * (s_enc * one_sixth), max=E4M3_MAX)


def scale_candidates(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For unrounded scales u: (own code, the neighbour u leans to, distance to the rounding midpoint
    in code steps). A u exactly on a code leans down (up from code 0)."""
    own = u.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    value = _e4m3_value(own)
    up = ((u > value) | (own == 0)) & (own < _E4M3_MAX_CODE)
    other = torch.where(up, own + 1, own - 1)
    step = (_e4m3_value(other) - value).abs()
    frac = torch.where(step > 0, (u - value).abs() / step, torch.zeros_like(u))
    return own, other, (0.5 - frac).clamp(min=0.0)


# --- BF16 amax patterns --------------------------------------------------------------------------


def bf16_pattern(a: torch.Tensor) -> torch.Tensor:
    return a.to(torch.bfloat16).view(torch.int16).to(torch.int64)


def nearest_with_residue(mine: torch.Tensor, residue: torch.Tensor, m: int) -> torch.Tensor:
    """The float32 value of the BF16 pattern nearest ``mine`` that is ``residue`` mod ``m``."""
    low = mine - ((mine - residue) % m)
    high = low + m
    pattern = torch.where(((high - mine) < (mine - low)) | (low < 0), high, low)
    return pattern.to(torch.int16).view(torch.bfloat16).to(torch.float32)


def check_bf16_exact(amax: torch.Tensor, knob: str) -> None:
    if not torch.equal(amax.to(torch.bfloat16).to(torch.float32), amax.to(torch.float32)):
        raise ValueError(
            f"amax:{knob} keeps the global amax as BF16, but this site's amax is not a BF16 value "
            "(non-BF16 activations?); use amax:fp32"
        )
