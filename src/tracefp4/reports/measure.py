"""What the mismatch report and the guidance sweep both measure: the log-prob gap of a trainer against
its rollout, code-mismatch totals over a set of sites, and the guidance store round trip and its byte
accounting.

Both reports push their rollouts' records through the real store (written, sealed, read back with
checksums verified) so that the trainer consumes what a distributed run would hand it and the byte
figures are the store's own (``docs/contracts.md`` section 4).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tracefp4.engines.protocol import RolloutOutput
from tracefp4.engines.sink import StoreTarget, write_records
from tracefp4.engines.trainer import SiteMismatch, TrainerOutput
from tracefp4.guidance.names import layer_tag
from tracefp4.guidance.store import StoreReader, bytes_per_token, parse_name, seal_step
from tracefp4.metrics import code_mismatch_rate, logprob_gap, metric, mismatch_totals, one_apart_share

__all__ = [
    "POLICY_VERSION",
    "WRITER",
    "config_signature",
    "store_root",
    "gap",
    "aggregate",
    "same_rollout",
    "store_records",
    "store_bytes",
]

#: The reports never update the weights: every record belongs to policy version 0.
POLICY_VERSION = 0
#: The one writer of every store step a report writes.
WRITER = "mismatch-report"


def config_signature(prefix: str, config) -> str:
    """A store model signature from the full model config (the store refuses records of another model)."""
    return f"{prefix}:" + hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16]


@contextlib.contextmanager
def store_root(store_dir: str | os.PathLike[str] | None, prefix: str) -> Iterator[Path]:
    """``store_dir`` as given (kept), or a temporary folder removed on exit."""
    if store_dir is not None:
        yield Path(store_dir)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


# --- log-prob gap and code mismatch --------------------------------------------------------------

#: The log-prob gap metrics of :func:`gap`, in its keys' order (the reports' spellings of them).
GAP_METRICS = ("train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max", "rollout_corr/k3_kl",
               "rollout_corr/kl", "rollout_corr/log_ppl_diff")


def _padded(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(s.numel() for s in seqs)
    out = torch.zeros(len(seqs), width, dtype=torch.float32)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, s in enumerate(seqs):
        out[b, : s.numel()] = s.detach().float()
        mask[b, : s.numel()] = True
    return out, mask


def gap(rollout: RolloutOutput, trainer: TrainerOutput) -> dict[str, float]:
    """Trainer vs rollout log-probs over the completion tokens (``docs/contracts.md`` section 5)."""
    lr, mask = _padded(rollout.logprobs)
    lt, mask_t = trainer.padded()
    if not torch.equal(mask, mask_t):
        raise RuntimeError("trainer and rollout disagree on the completion lengths")
    m = logprob_gap(lr, lt.detach().float(), mask)
    return {**{metric(k).aliases["reports"]: m[k] for k in GAP_METRICS}, "tokens": int(mask.sum())}


def aggregate(stats: Mapping[str, SiteMismatch], keep: Callable[[int, str], bool]) -> dict[str, Any]:
    """Mismatch totals over the sites ``keep(layer, site)`` selects, their rate and adjacent share."""
    mis, one, tot = mismatch_totals(s for name, s in stats.items() if keep(*parse_name(name + ".codes")[:2]))
    return {
        "mismatched": mis,
        "one_apart": one,
        "total": tot,
        "rate": code_mismatch_rate(mis, tot),
        "adjacent_share": one_apart_share(one, mis),
    }


def same_rollout(a: RolloutOutput, b: RolloutOutput) -> bool:
    """Same tokens and same routing records (what the trainer's replay consumes)."""
    return all(torch.equal(x, y) for x, y in zip(a.token_ids, b.token_ids)) and all(
        torch.equal(x[k], y[k]) for x, y in zip(a.records, b.records) for k in x if k.endswith(".routing")
    )


# --- the store round trip ------------------------------------------------------------------------


def store_records(root: Path, step: int, rollout: RolloutOutput, signature: str) -> list[dict[str, torch.Tensor]]:
    """Write the rollout's records as one sealed store step, read them back (verified)."""
    ids = [f"traj-{b:05d}" for b in range(len(rollout.token_ids))]
    write_records(StoreTarget(str(root), step, WRITER, tuple(ids), signature, POLICY_VERSION), rollout.records,
                  rollout.prompt_lens)
    seal_step(root, step, [WRITER])
    with StoreReader(root, step, model_signature=signature, policy_version=POLICY_VERSION) as r:
        r.verify()
        # clone: the reader's handles are memory-mapped and closed on exit
        return [{k: v.clone() for k, v in rec.items()} for rec in r.batch(ids, [t.numel() for t in rollout.token_ids])]


def _guidance_split(reader: StoreReader) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """Guidance bytes (routing excluded) by site then layer, and by field, from the manifests."""
    by_site_layer: dict[str, dict[str, int]] = {}
    by_field: dict[str, int] = {}
    for m in reader.manifests:
        for t in m.trajectories.values():
            for name, tm in t.tensors.items():
                layer, site, fld = parse_name(name)
                if site == "routing":
                    continue
                d = by_site_layer.setdefault(site, {})
                d[layer_tag(layer)] = d.get(layer_tag(layer), 0) + tm.nbytes
                by_field[fld] = by_field.get(fld, 0) + tm.nbytes
    return by_site_layer, by_field


def store_bytes(root: Path, step: int, signature: str) -> dict[str, Any]:
    """The store's accounting, plus guidance bytes per token split by (site, layer) and by field."""
    with StoreReader(root, step, model_signature=signature, policy_version=POLICY_VERSION) as r:
        acc = bytes_per_token(r)
        by_site_layer, by_field = _guidance_split(r)
    gen = acc["generated_tokens"]
    if sum(sum(d.values()) for d in by_site_layer.values()) != acc["guidance_bytes"]:
        raise RuntimeError("store accounting: the (site, layer) split does not add up to the guidance bytes")
    acc["by_site_layer"] = {s: {k: b / gen for k, b in sorted(d.items())} for s, d in sorted(by_site_layer.items())}
    acc["by_field"] = {f: b / gen for f, b in sorted(by_field.items())}
    acc["by_layer"] = {layer_tag(k): v for k, v in acc["by_layer"].items()}
    acc["routing_by_layer"] = {layer_tag(k): v for k, v in acc["routing_by_layer"].items()}
    return acc
