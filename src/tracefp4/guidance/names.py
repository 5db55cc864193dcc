"""Record names: the one place a record tensor's name is built or parsed.

A trajectory's record is a flat ``{name: tensor}`` mapping (the guidance store's unit). Names are
``L{layer:02d}.{site}.{field}`` for a quantization site's guidance (fields such as ``bits``,
``codes``, ``scales``, ``global_amax``, or a compact record's ``packed__...``) and
``L{layer:02d}.routing`` for a MoE layer's routed expert indices. The layer is always written with
at least two digits and no extra leading zero, so two spellings can never name the same tensor.
"""

from __future__ import annotations

import enum
import functools
import re
from typing import NamedTuple

__all__ = [
    "Site",
    "EXPERT_SITES",
    "MLP_SITES",
    "KV_SITES",
    "ROUTING",
    "RecordName",
    "layer_tag",
    "record_prefix",
    "routing_key",
    "parse_name",
    "deeper_half",
    "last_layers",
]


class Site(str, enum.Enum):
    """Quantization sites per layer that carry guidance: a MoE layer's routed-expert GEMM inputs, a
    dense model's MLP GEMM inputs, and the KV cache."""

    EXPERT_IN = "expert_in"
    """Token hidden state entering the routed experts (per token)."""

    EXPERT_MID = "expert_mid"
    """Input of the down projection (per token and selected expert)."""

    MLP_IN = "mlp_in"
    """Hidden state entering a dense MLP's gate and up projections (per token)."""

    MLP_MID = "mlp_mid"
    """Input of a dense MLP's down projection (per token)."""

    K = "k"
    """Key cache entry (per token and KV head)."""

    V = "v"
    """Value cache entry (per token and KV head)."""


#: The sites of each kind of layer: a MoE layer's routed experts, a dense model's MLP, the KV cache.
EXPERT_SITES: tuple[Site, ...] = (Site.EXPERT_IN, Site.EXPERT_MID)
MLP_SITES: tuple[Site, ...] = (Site.MLP_IN, Site.MLP_MID)
KV_SITES: tuple[Site, ...] = (Site.K, Site.V)

#: The "site" part of a routing record's name.
ROUTING = "routing"

_SITES = tuple(s.value for s in Site)
_NAME_RE = re.compile(r"L(\d+)\.(?:(" + "|".join(_SITES) + r")\.([A-Za-z0-9_]+)|(routing))")


class RecordName(NamedTuple):
    """A parsed record name; ``site`` is a :class:`Site` value or ``"routing"`` (then ``field == ""``)."""

    layer: int
    site: str
    field: str

    @property
    def is_routing(self) -> bool:
        return self.site == ROUTING


def layer_tag(layer: int) -> str:
    """``L{layer:02d}``: how a layer is written in record names and per-layer metrics."""
    if layer < 0:
        raise ValueError(f"layer must be >= 0, got {layer}")
    return f"L{layer:02d}"


@functools.lru_cache(maxsize=4096)  # asked at every site of every forward
def record_prefix(layer: int, site: Site | str) -> str:
    """``L{layer:02d}.{site}``: the prefix of a site's record tensors (``.bits``/``.codes``/...)."""
    return f"{layer_tag(layer)}.{Site(site).value}"


def routing_key(layer: int) -> str:
    """``L{layer:02d}.routing``: the routed expert indices of a layer, ``[T, top_k]``."""
    return f"{layer_tag(layer)}.{ROUTING}"


def parse_name(name: str) -> RecordName:
    """``"L07.k.scales"`` -> ``(7, "k", "scales")``; ``"L07.routing"`` -> ``(7, "routing", "")``.

    Raises ValueError for anything else, including a non-canonical layer (``L7``, ``L007``).
    """
    m = _NAME_RE.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(
            f"record name {name!r} does not match 'L{{layer:02d}}.{{site}}.{{field}}' "
            f"(site in {list(_SITES)}) or 'L{{layer:02d}}.routing'"
        )
    layer = int(m.group(1))
    if m.group(1) != f"{layer:02d}":
        raise ValueError(
            f"record name {name!r}: the layer must be written as {layer:02d} (canonical 'L{{layer:02d}}'), "
            "so that names cannot alias"
        )
    if m.group(4):
        return RecordName(layer, ROUTING, "")
    return RecordName(layer, m.group(2), m.group(3))


def deeper_half(n_layers: int) -> frozenset[int]:
    """The deeper half of a model's layers, ``n_layers // 2 .. n_layers - 1``: the layers the paper's
    compact cache guides by default (the one place this rule is written)."""
    return frozenset(range(n_layers // 2, n_layers))


def last_layers(n_layers: int, n: int) -> frozenset[int]:
    """The last ``n`` layers, ``n_layers - n .. n_layers - 1`` (the layer ablation's rule); ``n`` must
    be between 1 and ``n_layers``."""
    if not 1 <= n <= n_layers:
        raise ValueError(f"last {n} layers: n must be between 1 and the model's {n_layers} layers")
    return frozenset(range(n_layers - n, n_layers))
