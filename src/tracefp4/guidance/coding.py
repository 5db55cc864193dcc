"""How bits are coded: the generic, spec-independent codecs behind compact guidance records.

Nothing here knows about guidance specs, sites or the store; :mod:`tracefp4.guidance.compact` builds its
records from these pieces (and fixes the record format by the constants below).

**Bit packing**: :func:`int_bits` / :func:`bits_int` spread small ints into fixed-width bit fields,
least significant bit first; :func:`pack_bits` / :func:`unpack_bits` pack bit strings into bytes
(bit i is bit i%8 of byte i//8).

**Gray codes**: :func:`gray_bits` / :func:`gray_decode` (adjacent values differ in one bit, so a
one-step drift of a value flips exactly one bit).

**LDPC syndromes** (Slepian-Wolf coding of a bit plane): :func:`ldpc_graph` builds a fixed pseudo-random
sparse parity-check graph (each variable in ``LDPC_COLUMN_WEIGHT`` checks, chosen by a splitmix64
hash of ``LDPC_SEED``, so every machine builds the same graph); :func:`ldpc_layout` cuts a batch of
trajectories into code blocks of whole tokens (:func:`ldpc_blocks`, at least ``LDPC_BLOCK``
variables each) and :func:`ldpc_checks` is the check count per token at rate 1/d;
:func:`ldpc_syndrome` computes the check bits; :func:`bp_flips` (sum-product belief propagation, with
per-variable log-likelihood ratios from :func:`prior_llr`) finds the most likely flip pattern that
explains a syndrome difference and says which blocks it solved; a block it cannot solve gets no flips
(the caller keeps its own bits there and counts the failure: the decoder keeps no state of its own).

**Sparse position streams**: :func:`stream_encode` / :func:`stream_decode` code a sorted list of
positions, each with one bit: LEB128 entry count (:func:`leb128`), one byte Rice parameter k
(:func:`best_rice_k`), then per entry the gap to the previous position Rice-coded (unary quotient, a
terminating 0, k remainder bits) and its bit. :func:`rice_bits_per_entry` is the expected cost per
entry of i.i.d. positions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numba
import numpy as np
import torch

__all__ = [
    "LDPC_SEED",
    "LDPC_COLUMN_WEIGHT",
    "LDPC_BLOCK",
    "LDPC_ITERATIONS",
    "int_bits",
    "bits_int",
    "pack_bits",
    "unpack_bits",
    "gray_bits",
    "gray_decode",
    "LdpcLayout",
    "ldpc_graph",
    "ldpc_blocks",
    "ldpc_layout",
    "ldpc_checks",
    "ldpc_syndrome",
    "prior_llr",
    "bp_flips",
    "leb128",
    "best_rice_k",
    "stream_encode",
    "stream_decode",
    "rice_bits_per_entry",
]

#: Format constants of ``ldpc`` records: both paths must build the same parity-check graph.
LDPC_SEED = 0x7ACE_F4
LDPC_COLUMN_WEIGHT = 3
#: Smallest code block, in variables: a trajectory is cut into as many blocks of whole tokens as keep
#: every block at least this long (a shorter trajectory is one block).
LDPC_BLOCK = 4096
#: Decoder settings (the trainer's side only; they change no stored byte).
LDPC_ITERATIONS = 60


# --- bit packing ---------------------------------------------------------------------------------


def int_bits(v: np.ndarray, nbits: int) -> np.ndarray:
    """``[..., n]`` small non-negative ints -> ``[..., n * nbits]`` bits, least significant first."""
    return ((v[..., None].astype(np.int64) >> np.arange(nbits)) & 1).astype(np.uint8).reshape(*v.shape[:-1], -1)


def bits_int(bits: np.ndarray, nbits: int) -> np.ndarray:
    """Inverse of :func:`int_bits`: ``[..., n * nbits]`` bits -> ``[..., n]`` int64."""
    b = bits.reshape(*bits.shape[:-1], -1, nbits).astype(np.int64)
    return (b << np.arange(nbits)).sum(axis=-1)


def pack_bits(bits: np.ndarray) -> np.ndarray:
    """``[..., nbits]`` bits -> ``[..., ceil(nbits / 8)]`` uint8: bit i is bit i%8 of byte i//8."""
    return np.packbits(bits, axis=-1, bitorder="little")


def unpack_bits(packed: np.ndarray, nbits: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: the first ``nbits`` bits of each ``[..., bytes]`` row."""
    return np.unpackbits(packed, axis=-1, count=nbits, bitorder="little")


# --- Gray codes ----------------------------------------------------------------------------------


def gray_bits(values: torch.Tensor, nbits: int) -> torch.Tensor:
    """``[T, n]`` ints in ``[0, 2**nbits)`` -> ``[T, n * nbits]`` bits of their Gray codes, least
    significant first (adjacent values differ in one bit)."""
    r = values.to(torch.int64)
    g = r ^ (r >> 1)
    return ((g.unsqueeze(-1) >> torch.arange(nbits)) & 1).to(torch.uint8).reshape(r.shape[0], -1)


def gray_decode(bits: torch.Tensor, nbits: int) -> torch.Tensor:
    """``[..., nbits]`` Gray-code bits, least significant first -> ``[...]`` int64 values (inverse of
    :func:`gray_bits`)."""
    g = (bits.to(torch.int64) << torch.arange(nbits)).sum(-1)
    value = g.clone()
    for shift in range(1, nbits):  # Gray -> binary
        value ^= g >> shift
    return value


# --- LDPC syndromes ------------------------------------------------------------------------------

_U64 = np.uint64


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        return z ^ (z >> _U64(31))


@functools.lru_cache(maxsize=512)
def ldpc_graph(n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Edges (variable, check) of one code block: each of n variables in ``min(3, m)`` distinct checks
    out of m, chosen by a fixed hash (so every machine and numpy version builds the same graph)."""
    w = min(LDPC_COLUMN_WEIGHT, m)
    i = np.arange(n, dtype=np.uint64)
    checks = np.empty((n, w), dtype=np.int64)
    for k in range(w):
        c = (_splitmix64(i * _U64(w) + _U64(k) + _U64(LDPC_SEED)) % _U64(m)).astype(np.int64)
        while True:
            dup = np.zeros(n, dtype=bool)
            for j in range(k):
                dup |= checks[:, j] == c
            if not dup.any():
                break
            c = np.where(dup, (c + 1) % m, c)
        checks[:, k] = c
    var = np.repeat(np.arange(n, dtype=np.int64), w)
    return var, checks.reshape(-1)


@dataclasses.dataclass(frozen=True)
class LdpcLayout:
    """The union of the code blocks of a batch of trajectories: edges and the block of each node."""

    var: np.ndarray
    chk: np.ndarray
    var_block: np.ndarray
    chk_block: np.ndarray
    n_vars: int
    n_checks: int
    n_blocks: int


def ldpc_blocks(length: int, per_token: int) -> list[tuple[int, int]]:
    """Token ranges of a trajectory's code blocks: as many as keep each at least ``LDPC_BLOCK``
    variables (one, for a shorter trajectory), as equal as whole tokens allow. Short codes are weak
    codes, so no block is left with a short remainder."""
    n = max(1, min(length, length * per_token // LDPC_BLOCK))
    bounds = [length * i // n for i in range(n + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def ldpc_layout(segments: Sequence[int], per_token: int, checks_per_token: int) -> LdpcLayout:
    """The code of a batch of concatenated trajectories (token lengths ``segments``), each cut into
    :func:`ldpc_blocks`, with ``per_token`` variables and ``checks_per_token`` checks per token."""
    var, chk, vb, cb = [], [], [], []
    token = block = 0
    for length in segments:
        for start, stop in ldpc_blocks(length, per_token):
            nt = stop - start
            v, c = ldpc_graph(nt * per_token, nt * checks_per_token)
            var.append(v + (token + start) * per_token)
            chk.append(c + (token + start) * checks_per_token)
            vb.append(np.full(nt * per_token, block, dtype=np.int64))
            cb.append(np.full(nt * checks_per_token, block, dtype=np.int64))
            block += 1
        token += length
    empty = np.zeros(0, dtype=np.int64)
    return LdpcLayout(
        np.concatenate(var) if var else empty,
        np.concatenate(chk) if chk else empty,
        np.concatenate(vb) if vb else empty,
        np.concatenate(cb) if cb else empty,
        token * per_token,
        token * checks_per_token,
        block,
    )


def ldpc_checks(per_token: int, rate: int | None) -> int:
    """Check bits per token for ``per_token`` variables at rate 1/d: ``ceil(per_token / d)``."""
    assert rate is not None
    return -(-per_token // rate)


def ldpc_syndrome(layout: LdpcLayout, bits: np.ndarray) -> np.ndarray:
    """Check bits ``H bits`` (mod 2) of a flat bit plane of ``layout.n_vars`` variables."""
    return (np.bincount(layout.chk, weights=bits[layout.var], minlength=layout.n_checks).astype(np.int64) & 1).astype(
        np.uint8
    )


def prior_llr(distance: np.ndarray, prior: tuple[float, float]) -> np.ndarray:
    """Log-likelihood ratio log((1 - p) / p) of no flip, for a flip probability
    ``p = p0 * exp(-distance / sigma)`` with ``prior = (p0, sigma)``."""
    p0, sigma = prior
    p = np.clip(p0 * np.exp(-distance / sigma), 1e-12, 0.5 - 1e-9)
    return np.log1p(-p) - np.log(p)


def bp_flips(layout: LdpcLayout, syndrome: np.ndarray, llr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Most likely flip pattern e with ``H e = syndrome`` (sum-product belief propagation), and which
    blocks it solved: ``(flips bool [n_vars], solved bool [n_blocks])``.

    Per block, the answer is the first iterate that satisfies every check. A block that no iterate
    satisfies within ``LDPC_ITERATIONS`` gets no flips at all: an iterate that left checks unsatisfied
    is not a codeword, and a half-converged one can be further from the truth than the caller's own
    bits, so the caller keeps its own bits there and counts the block as failed.
    """
    var, chk = layout.var, layout.chk
    sign = 1.0 - 2.0 * syndrome.astype(np.float64)

    def unsatisfied_per_block(hard: np.ndarray) -> np.ndarray:
        bad = ldpc_syndrome(layout, hard.astype(np.uint8)) != syndrome
        return np.bincount(layout.chk_block, weights=bad, minlength=layout.n_blocks)

    flips = np.zeros(layout.n_vars, dtype=bool)
    solved = unsatisfied_per_block(flips) == 0
    v2c = llr[var].copy()
    iterations = 0
    while not solved.all() and iterations < LDPC_ITERATIONS:
        iterations += 1
        t = np.tanh(np.clip(v2c, -40.0, 40.0) / 2.0)
        mag = np.log(np.maximum(np.abs(t), 1e-300))
        neg = (t < 0).astype(np.int64)
        sum_mag = np.bincount(chk, weights=mag, minlength=layout.n_checks)
        sum_neg = np.bincount(chk, weights=neg, minlength=layout.n_checks).astype(np.int64)
        # product over the check's other edges, signed by the check's target parity
        prod = np.exp(sum_mag[chk] - mag) * (1 - 2 * ((sum_neg[chk] - neg) & 1)) * sign[chk]
        c2v = 2.0 * np.arctanh(np.clip(prod, -1 + 1e-15, 1 - 1e-15))
        total = llr + np.bincount(var, weights=c2v, minlength=layout.n_vars)
        hard = total < 0
        newly = (unsatisfied_per_block(hard) == 0) & ~solved
        if newly.any():
            take = newly[layout.var_block]
            flips[take] = hard[take]
            solved |= newly
        v2c = total[var] - c2v
    return flips, solved


# --- sparse position streams (Rice-coded gaps) ---------------------------------------------------


def leb128(n: int) -> bytes:
    """Unsigned LEB128: 7 bits per byte, least significant first, high bit set on all but the last."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def best_rice_k(gaps: np.ndarray) -> int:
    """The Rice parameter k (0-24) that codes ``gaps`` in the fewest bits."""
    if gaps.size == 0:
        return 0
    costs = [int((gaps >> k).sum()) + gaps.size * (k + 1) for k in range(25)]
    return int(np.argmin(costs))


def stream_encode(positions: np.ndarray, bits: np.ndarray) -> bytes:
    """The sparse stream of one trajectory: count, k, then (Rice gap, low bit) per recorded element."""
    gaps = np.diff(positions, prepend=-1) - 1
    k = best_rice_k(gaps)
    q = gaps >> k
    length = q + k + 2  # unary quotient, its terminating 0, k remainder bits, the low bit
    start = np.cumsum(length) - length
    out = np.zeros(int(length.sum()), dtype=np.uint8)
    ones = np.repeat(start, q) + (np.arange(int(q.sum())) - np.repeat(np.cumsum(q) - q, q))
    out[ones] = 1
    rem = start + q + 1
    for b in range(k):
        out[rem + b] = (gaps >> b) & 1
    out[rem + k] = bits
    return leb128(int(positions.size)) + bytes([k]) + pack_bits(out).tobytes()


@numba.njit(cache=True)
def _rice_decode(bits: np.ndarray, count: int, k: int, n_total: int, positions: np.ndarray, lsb: np.ndarray) -> int:
    """Parse ``count`` entries; returns 0, or -1 if the stream ends early or runs past ``n_total``."""
    i = 0
    pos = -1
    n = bits.shape[0]
    for e in range(count):
        q = 0
        while i < n and bits[i] == 1:
            q += 1
            i += 1
        if i + k + 2 > n:
            return -1
        i += 1
        r = 0
        for b in range(k):
            r |= np.int64(bits[i + b]) << b
        i += k
        pos += (q << k) + r + 1
        if pos >= n_total:
            return -1
        positions[e] = pos
        lsb[e] = bits[i]
        i += 1
    return 0


def stream_decode(data: bytes, n_total: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`stream_encode` (positions below ``n_total``); ``where`` names it in errors."""
    count, shift, i = 0, 0, 0
    while True:
        if i >= len(data) or shift > 56:
            raise ValueError(f"{where}: truncated or corrupt sparse stream header")
        byte = data[i]
        count |= (byte & 0x7F) << shift
        shift += 7
        i += 1
        if not byte & 0x80:
            break
    if i >= len(data) or count > n_total:
        raise ValueError(f"{where}: sparse stream claims {count} entries for {n_total} elements")
    k = data[i]
    payload = unpack_bits(np.frombuffer(data[i + 1 :], dtype=np.uint8), 8 * (len(data) - i - 1))
    positions = np.empty(count, dtype=np.int64)
    lsb = np.empty(count, dtype=np.uint8)
    if k > 30 or _rice_decode(payload, count, int(k), n_total, positions, lsb) != 0:
        raise ValueError(
            f"{where}: corrupt sparse stream (a sparse record covers a whole trajectory: read it without "
            "a positions slice)"
        )
    return positions, lsb


def rice_bits_per_entry(density: float) -> float:
    """Expected bits per recorded element of a sparse stream whose entries are an i.i.d. share
    ``density`` of the elements (geometric gaps), at the best Rice parameter: ``k + 2 + E[g >> k]``
    with ``E[g >> k] = q^(2^k) / (1 - q^(2^k))``, ``q = 1 - density`` (the 2 = terminator + low bit)."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    q = 1.0 - density
    best = math.inf
    for k in range(25):
        qm = q ** (2**k)
        best = min(best, k + 2 + (qm / (1 - qm) if qm < 1 else math.inf))
    return best
