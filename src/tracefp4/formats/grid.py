"""The FP4 grid in torch: NVFP4's global encode scale and per-block encode factor, E8M0 scale values,
``z`` (an element in grid units) and the one round-to-nearest of ``z`` with its midpoints.

Used wherever torch (not a kernel) puts values on a grid: Four over Six, compact guidance and the
trainer's checks. Every function runs on its input's device, in the operation order of the kernels
and the readable reference, so the bits are theirs.
"""

from __future__ import annotations

import numpy as np
import torch

from tracefp4.formats.constants import (
    E2M1_MAX,
    E2M1_MIDPOINTS,
    E2M1_SIGN_BIT,
    E2M1_VALUES,
    E4M3_MAX,
    E8M0_BIAS,
    FLOAT32_MAX,
    NVFP4_GLOBAL_NUMERATOR,
    Format,
)

__all__ = ["block_scale_unrounded", "encode_factor", "grid_z", "midpoint_distance", "mx_scale_values", "nvfp4_global_encode_scale",
           "rtn_e2m1", "mod4_choice", "mod4_e2m1"]

_F32 = torch.float32


def nvfp4_global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = 448*6/amax`` in float32, capped at FLT_MAX; amax 0 gives 1 (on amax's device)."""
    amax = amax.to(_F32)
    if amax.device.type == "cpu":  # numpy: the same IEEE float32 operations at a fraction of torch's per-op cost
        a = amax.detach().numpy()
        with np.errstate(divide="ignore", over="ignore"):
            s = np.minimum(np.float32(NVFP4_GLOBAL_NUMERATOR) / a, np.float32(FLOAT32_MAX))
        return torch.from_numpy(np.asarray(np.where((a == 0) | (s == 0), np.float32(1), s), dtype=np.float32))
    s_enc = torch.minimum(
        torch.tensor(NVFP4_GLOBAL_NUMERATOR, dtype=_F32, device=amax.device) / amax,
        torch.tensor(FLOAT32_MAX, dtype=_F32, device=amax.device),
    )
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def block_scale_unrounded(block_amax: torch.Tensor, s_enc: torch.Tensor, per_max: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """NVFP4's block scale before its E4M3 cast: ``min(amax_b * (S_enc * per_max), 448)``, ``per_max``
    ``1/6`` (the block maximum mapped to 6, the standard recipe; the float32 nearest 1/6) or any other
    float32 factor broadcast against ``S_enc`` (Four over Six's ``1/4``), in the reference's order."""
    if per_max is None:
        dev = s_enc.device
        per_max = torch.tensor(1.0, dtype=_F32, device=dev) / torch.tensor(E2M1_MAX, dtype=_F32, device=dev)
    return torch.clamp(block_amax * (s_enc * per_max), max=E4M3_MAX)


def encode_factor(s8: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-block multiplier ``min(1 / (float(s8) * (1/S_enc)), FLT_MAX)`` (a zero block scale
    gives FLT_MAX); ``s8`` E4M3 block scales, ``s_enc`` broadcast against them."""
    one = torch.tensor(1.0, dtype=_F32, device=s8.device)
    enc = one / (s8.to(_F32) * (one / s_enc))
    return torch.minimum(enc, torch.tensor(FLOAT32_MAX, dtype=_F32, device=s8.device))


def mx_scale_values(biased: torch.Tensor) -> torch.Tensor:
    """float32 ``2^(b - 127)`` of biased E8M0 exponents (exact, 2^-127 included)."""
    two = torch.tensor(2.0, dtype=torch.float64, device=biased.device)
    return torch.pow(two, biased.to(torch.float64) - E8M0_BIAS).to(_F32)


def grid_z(x: torch.Tensor, fmt: Format, scales: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    """float32 ``clamp(x * enc, +-6)`` on the grid ``(scales, amax)``, exactly as the kernels compute it
    (``scales``: E4M3 for NVFP4 with its global ``amax``, biased E8M0 bytes for MXFP4)."""
    xb = x.to(_F32).reshape(*x.shape[:-1], -1, fmt.block)
    if fmt is Format.NVFP4:
        enc = encode_factor(scales, nvfp4_global_encode_scale(amax).to(x.device))
    else:
        enc = torch.tensor(1.0, device=x.device) / mx_scale_values(scales)
    return torch.clamp(xb * enc.unsqueeze(-1), -E2M1_MAX, E2M1_MAX).reshape(x.shape)


def _midpoints(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounding midpoints and those whose tie goes up (to the even code above: 0.75 -> 1,
    1.75 -> 2, 3.5 -> 4), on ``device``."""
    mids = torch.tensor(E2M1_MIDPOINTS, dtype=_F32, device=device)
    return mids, mids[1::2]


def rtn_e2m1(z: torch.Tensor) -> torch.Tensor:
    """Unpacked E2M1 codes (uint8) of clamped float32 ``z``, round to nearest with ties to the even
    code; the sign bit is z's sign bit (so -0.0 and negatives rounding to zero give code 8)."""
    mids, ties_up = _midpoints(z.device)
    a = z.abs()
    mag = torch.bucketize(a, mids, right=False) + torch.isin(a, ties_up).to(torch.int64)
    return (mag + torch.signbit(z).to(torch.int64) * E2M1_SIGN_BIT).to(torch.uint8)


def midpoint_distance(z: torch.Tensor) -> torch.Tensor:
    """``|(|z|) - m|`` for the nearest rounding midpoint m (grid units): how near z is to a tie."""
    mids, _ = _midpoints(z.device)
    a = z.abs()
    i = torch.bucketize(a, mids).clamp(max=len(E2M1_MIDPOINTS) - 1)
    below = mids[(i - 1).clamp(min=0)]
    return torch.minimum((a - mids[i]).abs(), (a - below).abs())



def mod4_choice(z: torch.Tensor, rtn: torch.Tensor, sign_bit: int, rtn_value: torch.Tensor, residue: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, detected-miss bool) of ``mod4`` guidance on any element line whose adjacent
    magnitude codes are adjacent values (E2M1, E4M3): ``rtn`` the round-to-nearest codes of ``z``
    (sign bit ``sign_bit``, z's own), ``rtn_value`` their float32 values, ``residue`` the rollout's
    signed-line positions mod 4. The rule of :func:`~tracefp4.formats.reference.guided_choice_mod4`.

    The bracket comes from round to nearest instead of a table search: z on rtn's value is a
    codeword (a one-member bracket), above it the bracket is (rtn, rtn + 1), below it (rtn - 1, rtn),
    all on the signed line.
    """
    rtn = rtn.to(torch.int64)
    negative = torch.signbit(z)
    pos = torch.where(negative, -(rtn - sign_bit), rtn)  # rtn's sign bit is z's
    q_minus = torch.where(z < rtn_value, pos - 1, pos)
    q_plus = torch.where(z > rtn_value, pos + 1, pos)
    r = residue.to(torch.int64)
    names_minus = (q_minus & 3) == r  # two's complement & 3 is the floor mod 4 of a negative position
    names_plus = (q_plus & 3) == r
    chosen = torch.where(names_minus, q_minus, torch.where(names_plus, q_plus, pos))
    codes = chosen.abs() + negative.to(torch.int64) * sign_bit
    return codes.to(torch.uint8), ~(names_minus | names_plus)


def mod4_e2m1(z: torch.Tensor, residue: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unpacked E2M1 codes uint8, detected-miss bool) of clamped float32 ``z`` guided by ``mod4``
    residues: the reference's :func:`~tracefp4.formats.reference.guided_round_mod4`, vectorised."""
    rtn = rtn_e2m1(z).to(torch.int64)
    mags = torch.tensor(E2M1_VALUES, dtype=_F32, device=z.device)
    value = torch.where(rtn >= E2M1_SIGN_BIT, -mags[rtn & 7], mags[rtn & 7])
    return mod4_choice(z, rtn, E2M1_SIGN_BIT, value, residue)
