"""Two computations of a quantizer's input that differ only in the order of their float32 additions.

No bound makes their codes equal: a value within the summation error of a rounding midpoint may
round either way. What is guaranteed, for ANY order (Higham eq. 4.4, every summation tree): each
float32 sum is within ``gamma_{n-1} * sum |t_i|`` of the exact sum, so a code may differ between two
orders only where the exact value lies within that bound of a code boundary (a midpoint, or 0 for
the sign bit), and everywhere else both orders give the code of the exact value. These tests check
exactly that against float64 references, with values planted on midpoints so that flips happen on
every machine (sequential float32 additions are IEEE-exact operations, the same on every CPU), and
with the machine's own ``torch.sum`` order as a third order that only has to meet the bound.
"""

from __future__ import annotations

import math

import pytest
import torch
from fp4data import S_ENC_ONE

from tracefp4.formats import quantize_fp8, quantize_nvfp4, unpack_fp4
from tracefp4.formats import reference as ref

N_TERMS = 48
ROWS, COLS = 64, 64


def test_boundaries_are_where_round_to_nearest_changes_code() -> None:
    """Just below and just above each midpoint (one float32 ulp) the reference rounding picks adjacent
    magnitude codes; the distance is 0 on a boundary and half a step on a codeword."""
    for element, round_, mags in (("e2m1", ref.round_to_e2m1, torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6])),
                                  ("e4m3", ref.round_to_e4m3, ref.e4m3_magnitudes())):
        mids = ref.rounding_midpoints(element).float()
        assert mids.numel() == mags.numel() - 1
        below = round_(torch.nextafter(mids, torch.zeros_like(mids))).long()
        above = round_(torch.nextafter(mids, torch.full_like(mids, 1e4))).long()
        assert torch.equal(below, torch.arange(mids.numel())) and torch.equal(above, below + 1)
        assert torch.equal(ref.boundary_distance(mids.double(), element), torch.zeros(mids.numel(), dtype=torch.float64))
        steps = mags[1:] - mags[:-1]  # codeword j >= 1: the step below it and the one above (none above the last)
        half_steps = torch.minimum(steps, torch.cat([steps[1:], steps[-1:]])) / 2
        assert torch.equal(ref.boundary_distance(mags[1:].double(), element), half_steps.double())
        assert torch.equal(ref.boundary_distance(-mags[1:].double(), element), half_steps.double())
    assert float(ref.boundary_distance(torch.tensor([-1e-30], dtype=torch.float64), "e2m1")) == 1e-30  # the sign


def _sequential(terms: torch.Tensor, reverse: bool) -> torch.Tensor:
    acc = torch.zeros(terms.shape[:-1], dtype=torch.float32)
    for j in (reversed(range(terms.shape[-1])) if reverse else range(terms.shape[-1])):
        acc = acc + terms[..., j]
    return acc


def _planted_terms(element: str, grid_max: float, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 terms ``[ROWS, COLS, N_TERMS]``: random sums, the grid's maximum at position 0 of every
    ``block`` as a single term (so the grid is exact in every order and scales z by exactly 1), and
    every midpoint of ``element`` planted with both signs as ``[m, a, a]`` (a = 0.3 float32 steps of m
    toward the side its tie does not take): left to right gives m itself (m + a rounds back to m), a
    tie; right to left gives m + 0.6 steps, rounded to the next float32, which rounds away from the
    tie. Returns the terms and the planted mask."""
    g = torch.Generator().manual_seed(seed)
    terms = torch.randn(ROWS, COLS, N_TERMS, generator=g) * 0.1
    terms[:, ::block] = 0
    terms[:, ::block, 0] = grid_max * torch.where(torch.rand(ROWS, COLS // block, generator=g) < 0.5, -1.0, 1.0)
    planted = torch.zeros(ROWS, COLS, dtype=torch.bool)
    free = [(r, c) for r in range(ROWS) for c in range(COLS) if c % block]
    mids = ref.rounding_midpoints(element).float()
    round_ = ref.round_to_e2m1 if element == "e2m1" else ref.round_to_e4m3
    for i, m in enumerate(mids.tolist()):
        m32 = torch.tensor(m, dtype=torch.float32)
        tie_goes_down = bool(round_(m32) == round_(torch.nextafter(m32, torch.tensor(0.0))))
        away = torch.nextafter(m32, torch.tensor(1e4 if tie_goes_down else 0.0))
        a = 0.3 * float(away - m32)
        for sign, (r, c) in zip((1.0, -1.0), free[2 * i: 2 * i + 2]):
            terms[r, c] = 0
            terms[r, c, :3] = sign * torch.tensor([m, a, a], dtype=torch.float32)
            planted[r, c] = True
    return terms, planted


def _fp8(x: torch.Tensor):
    q = quantize_fp8(x)
    return q.data.view(torch.uint8), q.scale, ref.round_to_e4m3


def _nvfp4(x: torch.Tensor):
    q = quantize_nvfp4(x, global_amax=S_ENC_ONE)
    return unpack_fp4(q.codes), q.scales.view(torch.uint8), ref.round_to_e2m1


@pytest.mark.parametrize(("quantize", "element", "grid_max", "block"),
                         [(_fp8, "e4m3", 448.0, COLS), (_nvfp4, "e2m1", 6.0, 16)], ids=["fp8", "nvfp4"])
def test_codes_differ_only_within_the_summation_bound_of_a_boundary(quantize, element, grid_max, block) -> None:
    """FP8 (row scale amax/448 = 1) and NVFP4 (S_enc = 1, every block scale 1): z is the sum itself.
    Three orders of the same float32 terms (left to right, right to left, this machine's torch.sum).
    Each order's z is within the bound of the exact sum (math.fsum, correctly rounded to float64: one
    more 2^-53 relative); two orders' codes differ only where the exact z is within that bound of a
    boundary, every planted midpoint flips between the two sequential orders, and every element
    farther than the bound from a boundary gets, in every order, the code of the exact value."""
    terms, planted = _planted_terms(element, grid_max, block, seed=0)
    exact = torch.tensor([math.fsum(t) for t in terms.reshape(-1, N_TERMS).double().tolist()],
                         dtype=torch.float64).reshape(ROWS, COLS)
    bound = ref.float32_sum_bound(terms.double().abs().sum(-1), N_TERMS) + 2.0**-53 * exact.abs()
    orders = {"forward": _sequential(terms, False), "reverse": _sequential(terms, True), "torch": terms.sum(-1)}
    codes, grids = {}, []
    for name, x in orders.items():
        assert torch.all((x.double() - exact).abs() <= bound), name  # the guarantee the rest rests on
        codes[name], grid, round_ = quantize(x)
        grids.append(grid)
    assert all(torch.equal(g, grids[0]) for g in grids)  # the planted maxima: one grid in every order
    assert torch.all(grids[0] == (1.0 if element == "e4m3" else 0x38))  # scale 1 (E4M3 0x38 is 1.0)
    near = ref.boundary_distance(exact, element) <= bound
    for name, c in codes.items():
        assert torch.equal(c[~near], round_(exact.float())[~near]), name
    flips = codes["forward"] != codes["reverse"]
    assert torch.all(flips[planted]) and int(planted.sum()) == 2 * ref.rounding_midpoints(element).numel()
    for a in codes:
        for b in codes:
            assert torch.all(near[codes[a] != codes[b]]), (a, b)
    # the bound is narrow: it singles out the planted values and few others, not the whole tensor
    assert int(near.sum()) < int(planted.sum()) + 0.01 * near.numel()
