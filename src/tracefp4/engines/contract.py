"""The quantizer contract: what a record means, as one id that writer and reader compare.

A rollout's record names codewords on a grid; it only means something to a trainer that quantizes the
same sites in the same format, with the same scale recipe, and reads the record in the same guidance
mode. The contract id says all of that in one stable, readable line, built from the precision plan's
fields (formats of the expert weights, activations and KV cache; NVFP4's block-scale recipe, MXFP4's
exponent rule and QUADS' compensated share: :meth:`~tracefp4.engines.plan.PrecisionPlan.to_dict`, in its
order) and the guidance mode's canonical name (layers included where they differ from the mode's
default)::

    tracefp4.contract/1 weights=nvfp4 activations=nvfp4 kv_cache=nvfp4 mx_scale_mode=floor nvfp4_scale=6 guidance=lsb
    tracefp4.contract/1 plan=bf16 guidance=none

The store keeps the writer's contract in every manifest and its seal, and a reader given the trainer's
refuses records of another one, naming both (:class:`~tracefp4.guidance.store.StoreReader`). The
``/1`` is the id's own format: a change in what the id covers changes it, so ids of different formats
never compare equal by accident.
"""

from __future__ import annotations

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.guidance.compact import GuidedMode

__all__ = ["CONTRACT_PREFIX", "quantizer_contract"]

#: The first word of every contract id (its format).
CONTRACT_PREFIX = "tracefp4.contract/1"


def quantizer_contract(plan: PrecisionPlan | None, guidance: GuidedMode | str | None) -> str:
    """The contract id of records computed under ``plan`` (None: a BF16 rollout) in ``guidance`` (a mode
    or its name; None: routing only). Equal plans and modes give equal ids, in any process."""
    if guidance is not None and not isinstance(guidance, GuidedMode):
        guidance = GuidedMode.parse(guidance)
    fields = ["plan=bf16"] if plan is None else [f"{k}={v}" for k, v in plan.to_dict().items()]
    mode = "none" if guidance is None else guidance.name
    return " ".join([CONTRACT_PREFIX, *fields, f"guidance={mode}"])
