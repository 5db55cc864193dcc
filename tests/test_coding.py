"""The generic codecs behind compact records: Rice-coded position streams, the LDPC graph, Gray codes."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from tracefp4.guidance import coding


def test_rice_bits_per_entry_is_the_geometric_expectation() -> None:
    rng = np.random.default_rng(0)
    for density in (0.01, 0.05, 0.3):
        mask = rng.random(400_000) < density
        pos = np.flatnonzero(mask)
        data = coding.stream_encode(pos, np.zeros(pos.size, np.uint8))
        per_entry = (len(data) - 4) * 8 / pos.size
        # 4,000 to 120,000 sampled gaps: the mean code length's relative standard error is under 0.3%
        # (geometric gaps, sd of a Rice code's length ~1 bit against a mean of 3-8 bits); 2% is > 6 sd
        assert per_entry == pytest.approx(coding.rice_bits_per_entry(density), rel=0.02)


def test_ldpc_graph_is_pinned() -> None:
    """The parity-check graph is part of the record format: both paths must build it identically."""
    var, chk = coding.ldpc_graph(4096, 256)
    assert var.size == 3 * 4096 and len(set(zip(var.tolist(), chk.tolist()))) == var.size
    digest = hashlib.sha256(np.stack([var, chk]).astype("<i8").tobytes()).hexdigest()[:16]
    assert digest == LDPC_GRAPH_DIGEST


LDPC_GRAPH_DIGEST = "5ad9ed6472f88c9a"


def test_gray_codes_round_trip_and_adjacent_values_differ_in_one_bit() -> None:
    v = torch.arange(8).reshape(1, 8)
    bits = coding.gray_bits(v, 3)
    assert bits.shape == (1, 24)
    assert torch.equal(coding.gray_decode(bits.reshape(1, 8, 3), 3), v)
    g = bits.reshape(8, 3).to(torch.int64)
    assert ((g - g.roll(1, 0)).abs().sum(-1) == 1).all()  # cyclic: 7 -> 0 too


def unsatisfiable_check(n: int, m: int) -> int:
    """A check of ``ldpc_graph(n, m)`` whose bit no flip pattern can set alone: one in the support of a
    left null vector y of H (y H = 0, so y . syndrome = 0 for every reachable syndrome). Square codes
    (rate 1) are rank-deficient, which is what makes such a check exist."""
    var, chk = coding.ldpc_graph(n, m)
    h = np.zeros((m, n), dtype=np.uint8)
    h[chk, var] ^= 1
    a = np.concatenate([h, np.eye(m, dtype=np.uint8)], axis=1)  # row-reduce [H | I]: [R | Y], R = Y H
    r = 0
    for c in range(n):
        pivots = np.flatnonzero(a[r:, c])
        if pivots.size == 0:
            continue
        a[[r, r + pivots[0]]] = a[[r + pivots[0], r]]
        others = np.flatnonzero(a[:, c])
        a[others[others != r]] ^= a[r]
        r += 1
        if r == m:
            break
    assert r < m, f"ldpc_graph({n}, {m}) has full rank: every syndrome is reachable"
    y = a[r, n:]
    assert not ((y.astype(np.int64) @ h) % 2).any()
    return int(np.flatnonzero(y)[0])


def test_bp_flips_gives_an_unsolvable_block_no_flips_and_says_so() -> None:
    """Two blocks (two trajectories of 16 tokens x 4 variables, one check per variable): block 1's
    syndrome comes from two flipped variables and is solved; block 0's has a check bit no flip
    pattern can produce, so it fails and keeps the caller's own bits (no flips), whatever BP tried."""
    layout = coding.ldpc_layout([16, 16], 4, 4)
    assert layout.n_blocks == 2 and layout.n_vars == 128
    truth = np.zeros(128, dtype=np.uint8)
    truth[[70, 101]] = 1
    syndrome = coding.ldpc_syndrome(layout, truth)
    syndrome[unsatisfiable_check(64, 64)] ^= 1  # block 0's checks are the first 64
    llr = np.full(128, 6.0)
    llr[[70, 101, 5, 9]] = 0.5  # the near-ties: two of block 1's flipped, two of block 0's
    flips, solved = coding.bp_flips(layout, syndrome, llr)
    assert solved.tolist() == [False, True]
    assert not flips[:64].any()
    assert np.flatnonzero(flips).tolist() == [70, 101]


def test_a_zero_syndrome_needs_no_flips_and_the_decoder_keeps_no_state() -> None:
    layout = coding.ldpc_layout([40], 8, 1)
    flips, solved = coding.bp_flips(layout, np.zeros(layout.n_checks, np.uint8), np.zeros(layout.n_vars))
    assert not flips.any() and solved.tolist() == [True]
    # the decoder's counts live in what it returns: no module-level counters to reset or race on
    assert not hasattr(coding, "decode_stats") and not hasattr(coding, "_STATS")
    mutable = (dict, list, set, bytearray)
    assert not [k for k, v in vars(coding).items() if isinstance(v, mutable) and not k.startswith("__")]
