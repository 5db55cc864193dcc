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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tracefp4.engines.capture import RolloutCapture  # noqa: E402
from tracefp4.engines.plan import PrecisionPlan  # noqa: E402
from tracefp4.engines.rollout import ForwardStep, assemble_records, row_versions  # noqa: E402
from tracefp4.engines.sink import UNKNOWN_VERSION, StoreTarget, pack_records, write_records  # noqa: E402
from tracefp4.engines.vllm.runtime import RUNTIME, StepRecord, install_step_recorder  # noqa: E402
from tracefp4.guidance.compact import GuidedMode  # noqa: E402

__all__ = ["TraceWorkerExtension", "map_steps"]


def map_steps(steps: list[StepRecord], owners: dict[str, tuple[int, str]], token_ids: list[torch.Tensor]) -> list[ForwardStep]:
    """Each forward's rows that belong to a trajectory, in chronological order; checks that every
    trajectory gets exactly positions ``0..T-1`` with its own tokens. Vectorised per forward (a
    rollout of 64 trajectories x 128 tokens has 8,000 (forward, request) pieces: small tensor ops
    per piece cost 5% of its generation)."""
    lengths = np.array([t.numel() for t in token_ids], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])  # trajectory b's tokens at starts[b]:starts[b+1]
    tokens = torch.cat(token_ids).numpy() if token_ids else np.empty(0, dtype=np.int64)
    out: list[ForwardStep] = []
    seen_b, seen_pos = [], []
    for st in steps:
        owned = [(j, owners.get(rid.rsplit("-", 1)[0])) for j, rid in enumerate(st.req_ids)]  # id = f"{ext}-{suffix}"
        owned = [(j, o) for j, o in owned if o is not None]
        if not owned:
            continue
        qsl = np.asarray(st.query_start_loc, dtype=np.int64)
        j = np.array([j for j, _ in owned], dtype=np.int64)
        b = np.array([o[0] for _, o in owned], dtype=np.int64)
        flush = np.array([o[1] == "flush" for _, o in owned])
        count = qsl[j + 1] - qsl[j]
        piece = np.repeat(np.arange(j.size), count)  # each row's piece
        rows = qsl[j][piece] + np.arange(piece.size) - np.repeat(np.cumsum(count) - count, count)
        pos = st.positions.numpy()[rows]
        T = lengths[b][piece]
        keep = np.where(flush[piece], pos == T - 1, pos < T)
        rows, pos, traj = rows[keep], pos[keep], b[piece][keep]
        if st.input_ids is not None:
            bad = np.nonzero(st.input_ids.numpy()[rows] != tokens[starts[traj] + pos])[0]
            if bad.size:
                raise RuntimeError(f"trajectory {int(traj[bad[0]])}: the engine ran other tokens than the trajectory's")
        seen_b.append(traj)
        seen_pos.append(pos)
        if rows.size:
            out.append(ForwardStep(torch.from_numpy(rows), torch.from_numpy(traj), st.record, st.version))
    traj = np.concatenate(seen_b) if seen_b else np.empty(0, dtype=np.int64)
    pos = np.concatenate(seen_pos) if seen_pos else np.empty(0, dtype=np.int64)
    order = np.argsort(traj, kind="stable")  # per trajectory, in the order the forwards recorded them
    counts = np.bincount(traj, minlength=len(token_ids))
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(token_ids) else np.empty(0, dtype=np.int64)
    expect = np.arange(order.size) - np.repeat(first, counts)
    wrong = (counts != lengths) | (np.bincount(traj[order][pos[order] != expect], minlength=len(token_ids)) > 0)
    if wrong.any():
        bb = int(np.nonzero(wrong)[0][0])
        got = pos[traj == bb]
        raise RuntimeError(
            f"trajectory {bb}: recorded positions {got.tolist()[:8]}... do not cover 0..{int(lengths[bb]) - 1} "
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
        # a new engine holds the checkpoint's weights, of unknown version: an engine built earlier in
        # this process (the runtime is per process) must not lend it the version of its last load
        RUNTIME.version = UNKNOWN_VERSION
        return install_step_recorder(self)

    def tracefp4_begin(self, plan: dict | None, guidance: str | None, diagnostics: list[int], n_layers: int) -> None:
        """Start recording one :meth:`VLLMEngine.generate`: its plan (``PrecisionPlan.to_dict()``
        or None = BF16), guidance mode name (None: routing only) and diagnostic layers."""
        mode = None if guidance is None else GuidedMode.parse(guidance)
        capture = RolloutCapture.of(mode, frozenset(int(i) for i in diagnostics), int(n_layers))
        RUNTIME.begin(None if plan is None else PrecisionPlan(**plan), capture)

    def tracefp4_finish(self, owners: dict[str, list], token_ids: list[list[int]], n_experts: int,
                        store: dict | None = None) -> bytes:
        """Stop recording; the records (and diagnostics) of the trajectories, and each row's policy
        version, as safetensors bytes. ``owners``: external request id -> (trajectory, "main" |
        "flush"). With ``store`` (``StoreTarget.to_dict()`` plus ``prompt_lens`` and the records'
        ``contract``) the records and versions are written into the guidance store from here, under
        that writer, and only the diagnostics come back."""
        capture = RUNTIME.capture
        steps = RUNTIME.end()
        ids = [torch.tensor(t, dtype=torch.long) for t in token_ids]
        mapped = map_steps(steps, {k: (int(v[0]), str(v[1])) for k, v in owners.items()}, ids)
        lengths = [t.numel() for t in ids]
        records, diagnostics = assemble_records(mapped, lengths, int(n_experts), capture)
        versions = row_versions(mapped, lengths)
        if store is not None:
            store = dict(store)
            prompt_lens, contract = store.pop("prompt_lens"), store.pop("contract")
            write_records(StoreTarget.from_dict(store), records, prompt_lens, versions=versions, contract=contract)
            records, versions = [{} for _ in records], []
        return pack_records(records, diagnostics, versions)

    def tracefp4_kv_cache_bytes(self) -> int:
        """Bytes of the KV cache tensors this worker allocated (every layer's, K and V, as laid out)."""
        return sum(t.numel() * t.element_size() for t in self.model_runner.kv_caches)

    def tracefp4_abort(self) -> None:
        RUNTIME.end()

    def tracefp4_reload(self, blob: bytes, version: int) -> int:
        """Weights in checkpoint names as safetensors bytes -> in-place ``reload_weights``; the forwards
        from then on stamp their rows with policy version ``version``."""
        from safetensors.torch import load

        named = load(blob)
        self.model_runner.reload_weights(weights_iterator=iter(named.items()))
        RUNTIME.version = int(version)
        return len(named)
