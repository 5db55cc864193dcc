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
