"""Record bytes per generated token, from manifest metadata only. See :mod:`tracefp4.guidance.store`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any



from tracefp4.guidance.store.common import ROUTING, StoreError, parse_name
from tracefp4.guidance.store.manifest import Manifest
from tracefp4.guidance.store.reader import StoreReader




def _as_manifests(source: object) -> list[Manifest]:
    if isinstance(source, StoreReader):
        return list(source.manifests)
    if isinstance(source, Manifest):
        return [source]
    if isinstance(source, Mapping):
        return [Manifest.from_json(source)]
    if isinstance(source, Iterable) and not isinstance(source, (str, bytes)):
        out: list[Manifest] = []
        for s in source:
            out.extend(_as_manifests(s))
        return out
    raise StoreError(f"bytes_per_token: cannot account for a {type(source).__name__}")


def bytes_per_token(
    source: StoreReader | Manifest | Mapping[str, Any] | Iterable[Manifest | Mapping[str, Any]],
    generated_tokens: int | None = None,
) -> dict[str, Any]:
    """Record bytes per generated token, from manifest metadata only (shapes x dtype sizes).

    Returns ``total_bytes``, ``guidance_bytes``, ``routing_bytes``, ``generated_tokens`` and, in
    bytes per generated token: ``total``, ``guidance``, ``routing``, ``by_site`` (guidance by site),
    ``by_layer`` (guidance by layer), ``routing_by_layer``. ``sum(by_site) == sum(by_layer) ==
    guidance`` and ``guidance + routing == total``. ``generated_tokens`` defaults to
    ``sum(T - prompt_len)`` over the trajectories.
    """
    manifests = _as_manifests(source)
    site_bytes: dict[str, int] = {}
    layer_bytes: dict[int, int] = {}
    routing_layer_bytes: dict[int, int] = {}
    gen = 0
    for m in manifests:
        for t in m.trajectories.values():
            gen += t.generated_tokens
            for name, tm in t.tensors.items():
                layer, site, _ = parse_name(name)
                if site == ROUTING:
                    routing_layer_bytes[layer] = routing_layer_bytes.get(layer, 0) + tm.nbytes
                else:
                    site_bytes[site] = site_bytes.get(site, 0) + tm.nbytes
                    layer_bytes[layer] = layer_bytes.get(layer, 0) + tm.nbytes
    if generated_tokens is not None:
        if not isinstance(generated_tokens, int) or isinstance(generated_tokens, bool):
            raise StoreError(f"generated_tokens must be an int, got {generated_tokens!r}")
        gen = generated_tokens
    if gen <= 0:
        raise StoreError(f"bytes_per_token: {gen} generated tokens, cannot divide")
    guidance = sum(site_bytes.values())
    routing = sum(routing_layer_bytes.values())
    return {
        "generated_tokens": gen,
        "total_bytes": guidance + routing,
        "guidance_bytes": guidance,
        "routing_bytes": routing,
        "total": (guidance + routing) / gen,
        "guidance": guidance / gen,
        "routing": routing / gen,
        "by_site": {s: b / gen for s, b in sorted(site_bytes.items())},
        "by_layer": {layer: b / gen for layer, b in sorted(layer_bytes.items())},
        "routing_by_layer": {layer: b / gen for layer, b in sorted(routing_layer_bytes.items())},
    }


def step_bytes(
    source: StoreReader | Manifest | Mapping[str, Any] | Iterable[Manifest | Mapping[str, Any]],
) -> int:
    """Size in bytes of a step's shard files (safetensors headers included), from manifests.

    The reference for ``StoreReader.bytes_read``: what one rank read of the whole step.
    """
    return sum(s.nbytes for m in _as_manifests(source) for s in m.shards.values())
