"""The rollout's grid as the trainer recomputes it: E4M3 scale codes and BF16 amax patterns; z on the
grid, its round to nearest and midpoint distance are the formats' torch grid
(:mod:`tracefp4.formats.grid`), re-exported under the names the codecs use.
"""

from __future__ import annotations

import torch

from tracefp4.formats.constants import E4M3_MAX_CODE, NVFP4_BLOCK
from tracefp4.formats.grid import block_scale_unrounded, grid_z, midpoint_distance
from tracefp4.formats.grid import nvfp4_global_encode_scale as global_encode_scale
from tracefp4.formats.grid import rtn_e2m1 as rtn_codes

__all__ = ["global_encode_scale", "grid_z", "rtn_codes", "midpoint_distance", "unrounded_block_scale",
           "scale_candidates", "bf16_pattern", "nearest_with_residue", "check_bf16_exact"]

# --- E4M3 scale codes ----------------------------------------------------------------------------



def _e4m3_value(code: torch.Tensor) -> torch.Tensor:
    return code.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def unrounded_block_scale(x: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """``min(amax_b * (S_enc * (1/6)), 448)`` of each block of ``x``: its scale before the E4M3 cast."""
    block_amax = x.to(torch.float32).abs().reshape(*x.shape[:-1], -1, NVFP4_BLOCK).amax(dim=-1)
    return block_scale_unrounded(block_amax, s_enc)


def scale_candidates(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For unrounded scales u: (own code, the neighbour u leans to, distance to the rounding midpoint
    in code steps). A u exactly on a code leans down (up from code 0)."""
    own = u.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    value = _e4m3_value(own)
    up = ((u > value) | (own == 0)) & (own < E4M3_MAX_CODE)
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
