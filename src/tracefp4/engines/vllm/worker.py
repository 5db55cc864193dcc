"""Worker-side calls of :class:`~tracefp4.engines.vllm.engine.VLLMEngine`, by name.

``LLM(worker_extension_cls="tracefp4.engines.vllm.worker.TraceWorkerExtension")`` mixes these
methods into vLLM's worker, so ``llm.collective_rpc("tracefp4_begin", args=...)`` reaches them in
the in-process engine and in the multiprocess one (engine core in its own process) alike, without
pickling functions. Arguments and results are plain data (dicts, lists, str, int, bytes); tensors
travel as safetensors bytes (dtypes such as float8_e4m3fn survive, which plain RPC does not keep).

The records are assembled here, in the worker's process, with our engine's
:func:`~tracefp4.engines.rollout.assemble_records`: every model forward's rows are mapped to
(trajectory, position) by the runner's request ids, ``query_start_loc`` and positions.
"""

from __future__ import annotations

# Imported by vLLM in every worker process (worker_extension_cls), before the worker's start-up scan
# that numba would crash without the shim: registering the plugin here makes a spawned worker
# self-sufficient even where the package's entry point is not installed.
from tracefp4.engines.vllm.plugin import register

register()

import torch  # noqa: E402

from tracefp4.engines.capture import RolloutCapture  # noqa: E402
from tracefp4.engines.plan import PrecisionPlan  # noqa: E402
from tracefp4.engines.rollout import ForwardStep, assemble_records  # noqa: E402
from tracefp4.engines.sink import StoreTarget, pack_records, write_records  # noqa: E402
from tracefp4.engines.vllm.runtime import RUNTIME, StepRecord, install_step_recorder  # noqa: E402
from tracefp4.guidance.compact import GuidedMode  # noqa: E402

__all__ = ["TraceWorkerExtension", "map_steps"]


def map_steps(steps: list[StepRecord], owners: dict[str, tuple[int, str]], token_ids: list[torch.Tensor]) -> list[ForwardStep]:
    """Each forward's rows that belong to a trajectory, in chronological order; checks that every
    trajectory gets exactly positions ``0..T-1`` with its own tokens."""
    out: list[ForwardStep] = []
    seen: list[list[torch.Tensor]] = [[] for _ in token_ids]
    for st in steps:
        rows, traj = [], []
        for j, rid in enumerate(st.req_ids):
            owner = owners.get(rid.rsplit("-", 1)[0])  # internal id = f"{external}-{random suffix}"
            if owner is None:
                continue
            b, kind = owner
            T = token_ids[b].numel()
            lo, hi = st.query_start_loc[j], st.query_start_loc[j + 1]
            r = torch.arange(lo, hi)
            pos = st.positions[lo:hi]
            keep = pos == T - 1 if kind == "flush" else pos < T
            r, pos = r[keep], pos[keep]
            if st.input_ids is not None and not torch.equal(st.input_ids[r], token_ids[b][pos]):
                raise RuntimeError(f"trajectory {b}: the engine ran other tokens than the trajectory's")
            rows.append(r)
            traj.append(torch.full((r.numel(),), b, dtype=torch.long))
            seen[b].append(pos)
        if rows and sum(r.numel() for r in rows):
            out.append(ForwardStep(torch.cat(rows), torch.cat(traj), st.record))
    for b, parts in enumerate(seen):
        pos = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
        if not torch.equal(pos, torch.arange(token_ids[b].numel())):
            raise RuntimeError(
                f"trajectory {b}: recorded positions {pos.tolist()[:8]}... do not cover 0..{token_ids[b].numel() - 1} "
                "exactly once in order (prefix caching, preemption?)"
            )
    return out


class TraceWorkerExtension:
    """Methods mixed into vLLM's worker (``self`` is the worker); see the module docstring."""

    def tracefp4_install(self) -> str:
        """Wrap the cache write of every attention backend the model uses (an unwrapped one would
        leave K/V silently unquantized and unrecorded: refused) and install the step recorder."""
        from tracefp4.engines.vllm.plugin import install_kv_wrapper

        model = self.model_runner.get_model()
        attn = [m for m in model.modules() if hasattr(m, "impl") and hasattr(m, "layer_name")]
        if not attn:
            raise NotImplementedError("tracefp4: the model has no attention layer with a vLLM backend impl")
        for cls in {type(m.impl) for m in attn}:
            install_kv_wrapper(cls)
        return install_step_recorder(self)

    def tracefp4_begin(self, plan: dict | None, guidance: str | None, diagnostics: list[int], n_layers: int) -> None:
        """Start recording one :meth:`VLLMEngine.generate`: its plan (``PrecisionPlan.to_dict()``
        or None = BF16), guidance mode name (None: routing only) and diagnostic layers."""
        mode = None if guidance is None else GuidedMode.parse(guidance)
        capture = RolloutCapture.of(mode, frozenset(int(i) for i in diagnostics), int(n_layers))
        RUNTIME.begin(None if plan is None else PrecisionPlan(**plan), capture)

    def tracefp4_finish(self, owners: dict[str, list], token_ids: list[list[int]], n_experts: int,
                        store: dict | None = None) -> bytes:
        """Stop recording; the records (and diagnostics) of the trajectories, as safetensors bytes.
        ``owners``: external request id -> (trajectory, "main" | "flush"). With ``store``
        (``StoreTarget.to_dict()`` plus ``prompt_lens``) the records are written into the guidance
        store from here, under that writer, and only the diagnostics come back."""
        capture = RUNTIME.capture
        steps = RUNTIME.end()
        ids = [torch.tensor(t, dtype=torch.long) for t in token_ids]
        mapped = map_steps(steps, {k: (int(v[0]), str(v[1])) for k, v in owners.items()}, ids)
        records, diagnostics = assemble_records(mapped, [t.numel() for t in ids], int(n_experts), capture)
        if store is not None:
            store = dict(store)
            prompt_lens = store.pop("prompt_lens")
            write_records(StoreTarget.from_dict(store), records, prompt_lens)
            records = [{} for _ in records]
        return pack_records(records, diagnostics)

    def tracefp4_abort(self) -> None:
        RUNTIME.end()

    def tracefp4_reload(self, blob: bytes) -> int:
        """Weights in checkpoint names as safetensors bytes -> in-place ``reload_weights``."""
        from safetensors.torch import load

        named = load(blob)
        self.model_runner.reload_weights(weights_iterator=iter(named.items()))
        return len(named)
