"""A two-path demonstration without a model: the same activation computed by two "engines".

The rollout and the trainer compute ``x = A @ B`` for the same bf16 A and B, but differently: the
rollout in one fp32 reduction, the trainer split-K with its partial sums kept in bf16 (as bf16 GEMM
epilogues and split-K kernels do). The two bf16 results differ by a few units in the last place;
after FP4 quantization some elements land on different codewords. We count how many
disagree under round-to-nearest (vanilla QAT) and under rollout-guided rounding (TRACE).
"""

from __future__ import annotations

import dataclasses

import torch

from tracefp4.formats.constants import HintMode
from tracefp4.guidance.hints import encode_hint, guided_quantize
from tracefp4.formats import quantize_nvfp4, signed_index, unpack_fp4


@dataclasses.dataclass
class TwoPathReport:
    elements: int
    bf16_differ: int
    #: rounding arm -> histogram {codeword distance: count} of trainer vs rollout codes
    distance: dict[str, dict[int, int]]
    hint_bytes: dict[str, int]

    def mismatches(self, arm: str) -> int:
        return sum(n for d, n in self.distance[arm].items() if d > 0)


def two_engine_activations(rows: int, k: int, inner: int, seed: int, chunk: int = 64):
    """(rollout, trainer) bf16 activations of one matmul computed in two reduction orders."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, inner, generator=g).to(torch.bfloat16)
    b = (torch.randn(inner, k, generator=g) / inner**0.5).to(torch.bfloat16)
    rollout = (a.float() @ b.float()).to(torch.bfloat16)
    acc = torch.zeros(rows, k, dtype=torch.float32)
    for s in range(0, inner, chunk):  # the trainer accumulates K in chunks, in bf16 as it goes
        acc = (acc + a[:, s : s + chunk].float() @ b[s : s + chunk].float()).to(torch.bfloat16).float()
    return rollout, acc.to(torch.bfloat16)


def run_two_path(rows: int = 512, k: int = 1024, inner: int = 1024, seed: int = 0) -> TwoPathReport:
    x_roll, x_train = two_engine_activations(rows, k, inner, seed)
    q_roll = quantize_nvfp4(x_roll, per_row=True)
    roll = signed_index(unpack_fp4(q_roll.codes))
    arms = {"round-to-nearest": quantize_nvfp4(x_train, per_row=True)}
    hint_bytes = {}
    for mode in HintMode:
        hint = encode_hint(q_roll, mode)
        hint_bytes[mode.value] = hint.nbytes
        arms[f"guided ({mode.value})"] = guided_quantize(x_train, hint)
    distance = {}
    for name, q in arms.items():
        d = (signed_index(unpack_fp4(q.codes)) - roll).abs()
        values, counts = torch.unique(d, return_counts=True)
        distance[name] = {int(v): int(c) for v, c in zip(values, counts)}
    return TwoPathReport(
        elements=x_roll.numel(),
        bf16_differ=int((x_roll != x_train).sum()),
        distance=distance,
        hint_bytes=hint_bytes,
    )


def format_report(rep: TwoPathReport) -> str:
    lines = [
        f"two engines, one matmul: {rep.elements:,} bf16 activations, "
        f"{rep.bf16_differ:,} ({rep.bf16_differ / rep.elements:.2%}) differ at bf16 level",
        "",
        f"{'trainer rounding':<22}{'codes != rollout':>18}{'rate':>10}   codeword distance histogram",
    ]
    for arm, hist in rep.distance.items():
        n = rep.mismatches(arm)
        hist_s = ", ".join(f"{d}:{c:,}" for d, c in sorted(hist.items()) if d > 0) or "-"
        lines.append(f"{arm:<22}{n:>18,}{n / rep.elements:>10.4%}   {hist_s}")
    lines.append("")
    full, lsb = rep.hint_bytes["full"], rep.hint_bytes["lsb"]
    lines.append(f"hint size: full {full:,} B, lsb {lsb:,} B ({full / lsb:.2f}x smaller)")
    return "\n".join(lines)
