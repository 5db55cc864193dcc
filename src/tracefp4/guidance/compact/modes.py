"""Named configurations: a guidance mode and the layers it guides (``<mode>[@all|@deeper|@last<n>]``)."""

from __future__ import annotations

import dataclasses
import re

from tracefp4.formats.constants import HintMode
from tracefp4.guidance.compact.spec import GuidanceSpec, mode_name, parse_hint_mode
from tracefp4.guidance.names import deeper_half, last_layers

__all__ = ["GuidedMode", "LAYER_SETS", "STANDARD_MODES"]

LAYER_SETS = ("all", "deeper", "last<n>")
_LAST_RE = re.compile(r"last([1-9][0-9]*)")


@dataclasses.dataclass(frozen=True)
class GuidedMode:
    """A guidance mode on a set of layers, named ``<mode>[@all|@deeper|@last<n>]``.

    Without a suffix, ``full`` guides every layer (the paper's full-information baseline) and every
    other mode the deeper half (the paper's default for its compact cache, so ``lsb`` *is* the
    paper's compact mode); a suffix is written only where it differs from that default.
    ``@last<n>`` (n >= 1) guides the last n layers only (the layer ablation); n must not exceed the
    model's layers (checked by :meth:`layer_indices`, the one place a model's depth is known).
    """

    mode: HintMode | GuidanceSpec
    layers: str

    def __post_init__(self) -> None:
        if self.layers not in LAYER_SETS[:2] and _LAST_RE.fullmatch(self.layers) is None:
            raise ValueError(f"layers must be one of {LAYER_SETS} (n >= 1), got {self.layers!r}")

    @staticmethod
    def default_layers(mode: HintMode | GuidanceSpec) -> str:
        return "all" if mode is HintMode.FULL else "deeper"

    @property
    def name(self) -> str:
        base = mode_name(self.mode)
        return base if self.layers == self.default_layers(self.mode) else f"{base}@{self.layers}"

    @classmethod
    def parse(cls, name: str) -> GuidedMode:
        base, _, layers = name.strip().partition("@")
        mode = parse_hint_mode(base)
        return cls(mode, layers or cls.default_layers(mode))

    def layer_indices(self, n_layers: int) -> frozenset[int]:
        """``all``: every layer; ``deeper``: :func:`tracefp4.guidance.names.deeper_half`; ``last<n>``:
        :func:`tracefp4.guidance.names.last_layers` (a ValueError if n > n_layers)."""
        if self.layers == "all":
            return frozenset(range(n_layers))
        if self.layers == "deeper":
            return deeper_half(n_layers)
        n = int(_LAST_RE.fullmatch(self.layers).group(1))
        try:
            return last_layers(n_layers, n)
        except ValueError as e:
            raise ValueError(f"guidance {self.name!r}: {e}") from None


#: The modes ``tracefp4 mismatch --sweep`` measures and ``tracefp4 plan`` sizes, references first.
STANDARD_MODES: tuple[str, ...] = (
    # the paper's two reference points, and each on the other layer set
    "full",
    "lsb",
    "lsb@all",
    "full@deeper",
    # two bits per element: lsb's record plus the bit that tells a code 1-2 codewords off the bracket
    "mod4",
    "mod4@all",
    # the per-row amax and the block scales, one knob at a time (elements: 1 bit)
    "lsb+amax:bf16",
    "lsb+amax:lo2",
    "lsb+amax:lo3",
    "lsb+amax:own",
    "lsb+parity",
    "lsb+scales:own",
    "lsb+parity+amax:lo3",
    "lsb+parity+amax:lo3@all",
    # sparse near-tie hints, as the brief names them, then with the cheap scales and amax
    "sparse(0.05)",
    "sparse(0.05)+parity",
    *(f"sparse({d})+parity+amax:lo3{at}" for at in ("", "@all") for d in ("0.01", "0.02", "0.05", "0.1")),
    # syndromes of the low-bit plane
    *(f"ldpc(1/{d})+parity+amax:lo3{at}" for at in ("", "@all") for d in (2, 4, 8, 16, 32)),
    *(f"ldpc(1/{d})+scales:ldpc(1/4)+amax:lo3@all" for d in (8, 16, 32)),
    "ldpc(1/16)+scales:ldpc(1/4)+amax:lo2@all",
    "ldpc(1/8)+scales:ldpc(1/4)+amax:ldpc(1/2)@all",
)
