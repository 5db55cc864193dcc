"""``guidance_bracket_miss_rate``: the rollout's code against the two codewords around the trainer's value.

Planted cases on grids whose encode factor is exactly known (so the z the reference computes is
written down here), checked against distances counted by hand on the E2M1 line (0, 0.5, 1, 1.5, 2, 3,
4, 6 at positions 0..7, the negatives mirrored): a code inside the bracket, one and two codewords out
on either side, a value sitting on a codeword (a one-member bracket), and both zeros. Then one case
per other grid (MXFP4, FP8), the errors, and the trainer's captured values against its own codes.
"""

from __future__ import annotations

import pytest
import torch

from tracefp4.engines.model import from_config, tiny_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.trainer import TrainerSpec, forward_logprobs
from tracefp4.formats import pack_fp4
from tracefp4.formats import reference as ref
from tracefp4.formats.constants import E2M1_SIGN_BIT
from tracefp4.pipeline.metrics import METRICS, Name, bracket_distances, bracket_miss, bracket_miss_summary

torch.set_num_threads(1)

NEG = E2M1_SIGN_BIT  # the sign bit of a 4-bit code: code 8 + m is -value(m)

#: (trainer's z, rollout's 4-bit code, codewords outside the bracket), counted by hand.
PLANTED = [
    # z = 2.5: bracket {2 (pos 4), 3 (pos 5)}
    (2.5, 4, 0), (2.5, 5, 0), (2.5, 6, 1), (2.5, 7, 2), (2.5, 3, 1), (2.5, 2, 2),
    (2.5, NEG + 1, 5),  # -0.5 at position -1: five codewords below 2
    # z = -1.2: bracket {-1 (pos -2), -1.5 (pos -3)}
    (-1.2, NEG + 2, 0), (-1.2, NEG + 3, 0), (-1.2, NEG + 4, 1), (-1.2, NEG + 1, 1), (-1.2, 0, 2),
    # z on a codeword: the bracket is that codeword alone, its neighbours are one out
    (3.0, 5, 0), (3.0, 4, 1), (3.0, 6, 1), (3.0, 7, 2),
    (-6.0, NEG + 7, 0), (-6.0, NEG + 6, 1),
    # both zeros: +0 and -0 are one position; a value of either sign on zero has a one-member bracket
    (0.0, 0, 0), (0.0, NEG, 0), (-0.0, 0, 0), (-0.0, NEG, 0), (0.0, 1, 1), (-0.0, NEG + 1, 1), (-0.0, 1, 1),
    # just below zero: the bracket is {-0.5, 0}; +0.5 is one out, -1 one out the other way
    (-0.2, NEG + 1, 0), (-0.2, 0, 0), (-0.2, NEG, 0), (-0.2, 1, 1), (-0.2, NEG + 2, 1),
    # beyond the grid: z clamps to 6
    (7.5, 7, 0), (7.5, 6, 1),
]  # fmt: skip


def nvfp4_record(z: list[float], codes: list[int], enc: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the trainer's values, a one-row NVFP4 full-code record) for planted ``z`` on a grid whose
    encode factor is ``enc``: global amax 2688 (S_enc = 448*6/2688 = 1) and every block scale 1/enc
    (a power of two, exact in E4M3), so z = x * enc exactly."""
    n = len(z)
    width = -(-n // 16) * 16  # whole blocks; the padding is z = 0 with code 0 (inside its bracket)
    zs = torch.zeros(width, dtype=torch.float32)
    zs[:n] = torch.tensor(z, dtype=torch.float32)
    c = torch.zeros(width, dtype=torch.uint8)
    c[:n] = torch.tensor(codes, dtype=torch.uint8)
    x = (zs / enc)[None]
    record = {
        "L00.k.codes": pack_fp4(c[None]),
        "L00.k.scales": torch.full((1, width // 16), 1.0 / enc).to(torch.float8_e4m3fn),
        "L00.k.global_amax": torch.tensor([[2688.0]]),
    }
    return x, record


@pytest.mark.parametrize("enc", [1.0, 4.0, 0.5])
def test_planted_distances_on_nvfp4(enc: float) -> None:
    z, codes, want = zip(*PLANTED)
    x, record = nvfp4_record(list(z), list(codes), enc)
    # the reference's z is the planted one (exact: a power-of-two factor), signs of zeros included
    got_z = ref.nvfp4_z(x, record["L00.k.scales"], record["L00.k.global_amax"])[0, : len(z)]
    assert torch.equal(got_z, torch.clamp(torch.tensor(z), -6, 6))
    assert torch.equal(torch.signbit(got_z), torch.signbit(torch.tensor(z)))
    d = bracket_distances(x, record, "L00.k")[0, : len(z)]
    assert d.tolist() == list(want)


def test_the_rate_counts_elements_outside_and_one_out() -> None:
    z, codes, want = zip(*PLANTED)
    x, record = nvfp4_record(list(z), list(codes), 1.0)
    counts = bracket_miss([{"L00.k": x}, {"L00.k": x}], [record, record])
    padded = x.numel()
    misses = sum(1 for w in want if w > 0)
    one = sum(1 for w in want if w == 1)
    assert (counts["L00.k"].misses, counts["L00.k"].one_out, counts["L00.k"].total) == (2 * misses, 2 * one, 2 * padded)
    s = bracket_miss_summary(counts.values())
    assert s[Name.BRACKET_MISS] == misses / padded
    assert (s["bracket_misses"], s["bracket_one_out"], s["bracket_elements"]) == (2 * misses, 2 * one, 2 * padded)
    assert bracket_miss_summary([])[Name.BRACKET_MISS] is None
    assert bracket_miss_summary([], empty_rate=0.0)[Name.BRACKET_MISS] == 0.0
    assert Name.BRACKET_MISS in METRICS


def test_mxfp4_and_fp8_grids() -> None:
    # MXFP4: biased exponent 126 -> scale 1/2, so z = 2x; z = 1.25 has the bracket {1, 1.5}
    x = torch.zeros(1, 32)
    x[0, 0] = 0.625
    codes = torch.zeros(1, 32, dtype=torch.uint8)
    codes[0, 0] = 4  # value 2: one codeword above 1.5
    rec = {"L01.q.codes": pack_fp4(codes), "L01.q.scales": torch.tensor([[126]], dtype=torch.uint8)}
    d = bracket_distances(x, rec, "L01.q")
    assert int(d[0, 0]) == 1 and int(d.sum()) == 1
    # FP8: row scale 1, z = x; 1.0 is E4M3 code 0x38, so 0x38 is in its one-member bracket, 0x3A two out
    x8 = torch.tensor([[1.0, 1.0, -1.03]])
    c8 = torch.tensor([[0x38, 0x3A, 0xB8]], dtype=torch.uint8)  # -1.03: bracket {-1, -1.125}: -1 in it
    rec8 = {"L02.v.codes": c8, "L02.v.scales": torch.ones(1, 1)}
    assert bracket_distances(x8, rec8, "L02.v").tolist() == [[0, 2, 0]]


def test_errors_name_the_trajectory_and_the_site() -> None:
    x, record = nvfp4_record([1.0], [2], 1.0)
    with pytest.raises(ValueError, match=r"trajectory 1, L00\.k: the rollout kept no full codes"):
        bracket_miss([{"L00.k": x}, {"L00.k": x}], [record, {}])
    with pytest.raises(ValueError, match=r"L00\.k: the trainer's values \(1, 32\) vs the rollout's codes \(1, 16\)"):
        bracket_distances(torch.zeros(1, 32), record, "L00.k")
    with pytest.raises(ValueError, match="2 trajectories of values for 1"):
        bracket_miss([{}, {}], [record])
    no_amax = {k: v for k, v in record.items() if not k.endswith("global_amax")}
    with pytest.raises(ValueError, match="without its global amax"):
        bracket_distances(x, no_amax, "L00.k")


def test_captured_values_are_what_the_trainer_quantized() -> None:
    """A QAT forward's captured values, rounded on its own captured grid by the reference, are its codes
    (atol=0: the kernels equal the reference on the same input); values need capture layers."""
    model = from_config(tiny_config(layers=2, experts=4, top_k=2, hidden=32, moe_intermediate=32, heads=2,
                                    kv_heads=1, head_dim=16, vocab=32), seed=0)
    ids = [torch.arange(3, 12), torch.arange(5, 10)]
    out = forward_logprobs(model, ids, [4, 2], None, TrainerSpec("qat", PrecisionPlan(), replay_routing=False,
                                                                  capture_codes=frozenset({1}), capture_values=True))
    assert len(out.values) == 2 and out.values[0].keys() == out.codes[0].keys() and out.values[0]
    for values, codes, grids in zip(out.values, out.codes, out.grids):
        for name, x in values.items():
            scales, amax = grids[name]
            assert torch.equal(pack_fp4(ref.round_to_e2m1(ref.nvfp4_z(x, scales, amax))), codes[name]), name
    with pytest.raises(ValueError, match="capture_values reports the values at the capture_codes layers"):
        TrainerSpec("qat", capture_values=True)
