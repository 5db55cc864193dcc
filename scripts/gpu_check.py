#!/usr/bin/env python
"""The device check: everything of ours that needs a GPU, in one command with its own timeouts
(sized for under 8 minutes on one H100/H200, not yet timed on one: every step is capped and the
whole run stops by ``--budget``, 450 s by default), writing
one JSON of figures (``--json``).

Steps, each in a process of its own (a step that hangs or crashes is reported and the next runs):

* ``kernels``: the Triton quantizers against the reference on the device, and their bandwidth (below);
* ``tests``: tests/test_triton.py and tests/test_triton_experts.py on CUDA (the Triton FP4 expert
  GEMM against the reference, the sites and routed experts without host reads) and the suite's
  tests marked ``cuda`` (no CUDA synchronisation in a decode layer, its CUDA-graph replay);
* ``graph``: a rollout's routed-experts layer (sites recorded, Triton GEMMs) at the bandwidth
  preset's shapes captured in a CUDA graph: replay bit for bit the eager layer, and both timed;
* ``mismatch``: ``tracefp4 mismatch --device cuda``: trace-full must leave no code mismatched;
* ``bench``: ``tracefp4 bench rollout --preset bandwidth --engines home --no-memory --device cuda``:
  our engine's fp4 / bf16 tokens per second at batches 8 and 32;
* ``vllm`` (``--vllm``, where vLLM's CUDA build is installed): the plugin on the GPU (below).

``--dry-run`` runs the parts a CPU can: the interpreter tests of the expert GEMM and the sync-free
layer (a subset), and the mismatch and bench commands on ``--device cpu`` at toy sizes, through the
same command lines and JSON parsing, so the script itself is checked before a device is lent.

What the ``kernels`` step checks:

The kernels are reached the way every caller reaches them: the public ops of ``tracefp4`` on CUDA
tensors (the one dispatch point, :mod:`tracefp4.formats.dispatch`, sends those to Triton).

Correctness: every kernel (NVFP4 quantize per tensor / per row / given amax, MXFP4 quantize floor and
rceil, NVFP4 and MXFP4 dequantize, guided quantize lsb and full for NVFP4 and MXFP4, lsb hint
packing) on several shapes, dtypes and data kinds (heavy-tailed,
zero blocks, subnormal block scales among them). Small shapes are compared with
:mod:`tracefp4.formats.reference` directly; large ones with the CPU kernels, which the test suite holds equal
to the reference (the reference's codeword search needs ~1 GB per 16M elements).

Bandwidth: each operation's time next to ``x.clone()`` of the same input, as ``clone / op`` (1.0 means
as fast as copying the input once), and as a fraction of the clone's bandwidth counting the bytes the
operation must move (input reads, code and scale writes).

vLLM (``--vllm``, where a CUDA build of vLLM is installed): the tracefp4 plugin on the GPU. A tiny
Qwen3-MoE checkpoint, a ``VLLMEngine`` (eager) rolling out W4A4 NVFP4 with full records on every layer;
checks that every trajectory's records cover its positions, that our trainer on CUDA, guided by those
records, reproduces every vLLM code (expert_in, expert_mid, K, V), that records written by the worker
into the store equal the returned ones, and times fp4 / trace / trace-full rollouts side by side.

Prints one flushed line as each step starts and one as it ends, and rewrites the JSON (``--json``)
after every step, whole each time (a temporary file renamed over it): a device that stops answering
mid-run still leaves the steps it finished, and the step it was in (``"running"``). Until the run
ends the JSON says ``"complete": false`` and has no top-level ``"ok"``, so a partial one is never
read as a passing run. Exit status: 0 every step passed, 1 a step failed (a mismatch, a failing
test, a timeout), 2 nothing could be checked (no CUDA device, or Triton missing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

NO_DEVICE = 2


def _fail_early(message: str) -> int:
    print(f"gpu_check: {message}; nothing was checked.", file=sys.stderr)
    return NO_DEVICE


def make_data(kind: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        x = torch.randn(*shape, generator=g)
    elif kind == "heavy_tailed":  # magnitudes 1e-6 .. 1e4 within rows and blocks
        x = torch.exp(torch.empty(*shape).uniform_(-13.8, 9.2, generator=g)) * torch.randn(*shape, generator=g).sign()
    elif kind == "zero_blocks":
        x = torch.randn(*shape, generator=g)
        x[..., 16:48] = 0.0
        x[..., ::3, :] = 0.0
    elif kind == "subnormal_scales":  # blocks far below the row amax: E4M3 subnormal block scales
        x = torch.randn(*shape, generator=g)
        x[..., 0] = 1000.0
        k = shape[-1]
        decay = 2.0 ** -(12 + torch.arange(k // 16).float() % 10).repeat_interleave(16)
        x[..., 16:] = x[..., 16:] * decay[16:]
    elif kind == "tiny":  # float32/bf16 subnormals, and an S_enc so large that 1/S_enc is subnormal too:
        # bit-exact only where the device keeps float32 subnormals instead of flushing them to zero
        x = torch.randn(*shape, generator=g) * 1e-38
    else:
        raise ValueError(kind)
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and torch.equal(a, b)


def check_correctness(tf, ref, big: tuple[int, int]) -> list[dict]:
    """One record per (kernel, shape, dtype, kind): ok or not, and against which oracle."""
    records = []
    shapes = [(1, 16), (7, 48), (33, 160), (3, 5, 256), (256, 4096), big]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    kinds = ["randn", "heavy_tailed", "zero_blocks", "subnormal_scales", "tiny"]
    for si, shape in enumerate(shapes):
        small = torch.Size(shape).numel() <= 1 << 16
        oracle = "reference" if small else "cpu kernels"
        for dtype in dtypes:
            for kind in kinds:
                x = make_data(kind, shape, dtype, seed=si)
                xd = x.cuda()
                base = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "kind": kind, "oracle": oracle}
                for label, kw in [("quantize_nvfp4", {}), ("quantize_nvfp4 per_row", {"per_row": True}),
                                  ("quantize_nvfp4 given amax", {"global_amax": torch.tensor(3.0)})]:
                    q = tf.quantize_nvfp4(xd, **kw)
                    deq = tf.dequantize_nvfp4(q)
                    if small:
                        codes, s8, amax = ref.quantize_nvfp4(x, global_amax=kw.get("global_amax"),
                                                             per_row=kw.get("per_row", False))
                        ok = _same(tf.unpack_fp4(q.codes.cpu()), codes) and _same(q.scales, s8)
                        ok = ok and _same(q.global_amax, amax)
                        ok_deq = _same(deq, ref.dequantize_nvfp4(codes, s8, amax))
                    else:
                        c = tf.quantize_nvfp4(x, **kw)
                        ok = _same(q.codes, c.codes) and _same(q.scales, c.scales) and _same(q.global_amax, c.global_amax)
                        ok_deq = _same(deq, tf.dequantize_nvfp4(c))
                    records.append({**base, "kernel": label, "ok": ok})
                    records.append({**base, "kernel": f"dequantize_nvfp4 ({label})", "ok": ok_deq})
                if shape[-1] % 32 == 0:
                    for mode in ("floor", "rceil"):
                        m = tf.quantize_mxfp4(xd, scale_mode=mode)
                        deq = tf.dequantize_mxfp4(m)
                        if small:
                            codes, scales = ref.quantize_mxfp4(x, mode)
                            ok = _same(tf.unpack_fp4(m.codes.cpu()), codes) and _same(m.scales, scales)
                            ok_deq = _same(deq, ref.dequantize_mxfp4(codes, scales))
                        else:
                            c = tf.quantize_mxfp4(x, scale_mode=mode)
                            ok = _same(m.codes, c.codes) and _same(m.scales, c.scales)
                            ok_deq = _same(deq, tf.dequantize_mxfp4(c))
                        records.append({**base, "kernel": f"quantize_mxfp4 {mode}", "ok": ok})
                        records.append({**base, "kernel": f"dequantize_mxfp4 {mode}", "ok": ok_deq})
                if kind != "randn" and not small:
                    continue  # guided checks on the big shape: one data kind is enough
                y = (x.float() * (1 + 0.02 * torch.randn(*shape, generator=torch.Generator().manual_seed(7)))).to(dtype)
                for fmt in ("nvfp4", "mxfp4"):
                    if fmt == "mxfp4" and shape[-1] % 32:
                        continue
                    q = tf.quantize_nvfp4(x, per_row=True) if fmt == "nvfp4" else tf.quantize_mxfp4(x)
                    for mode in ("lsb", "full"):
                        hint = tf.encode_hint(q, mode)
                        got = tf.guided_quantize(y.cuda(), hint)
                        if small:
                            rc = tf.unpack_fp4(q.codes)
                            kw = {"rollout_codes": rc} if mode == "full" else {"rollout_lsb": rc & 1}
                            if fmt == "nvfp4":
                                expect = ref.guided_quantize_nvfp4(y, q.scales, q.global_amax, **kw)
                            else:
                                expect = ref.guided_quantize_mxfp4(y, q.scales, **kw)
                            ok = _same(tf.unpack_fp4(got.codes.cpu()), expect)
                        else:
                            ok = _same(got.codes, tf.guided_quantize(y, hint).codes)
                        records.append({**base, "kernel": f"guided_quantize {fmt} {mode}", "ok": ok})
                    dq = tf.NVFP4(q.codes.cuda(), q.scales.cuda(), q.global_amax.cuda()) if fmt == "nvfp4" else \
                        tf.MXFP4(q.codes.cuda(), q.scales.cuda())
                    ok = _same(tf.encode_hint(dq, "lsb").data, tf.encode_hint(q, "lsb").data)
                    records.append({**base, "kernel": f"encode_hint lsb ({fmt})", "ok": ok})
    return records


def _cuda_time(fn, repeats: int) -> float:
    """Median seconds per call, by CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    from tracefp4.bench.harness import median

    return median(samples)


def measure_bandwidth(tf, rows: int, cols: int, repeats: int) -> dict:
    x = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
    y = (x.float() * (1 + 1e-3 * torch.randn_like(x, dtype=torch.float32))).to(torch.bfloat16)
    n_in = x.nbytes
    codes_b, scales_b = x.numel() // 2, x.numel() // 16
    q = tf.quantize_nvfp4(x, per_row=True)
    m = tf.quantize_mxfp4(x)
    hint_lsb, hint_full = tf.encode_hint(q, "lsb"), tf.encode_hint(q, "full")
    amax = x.float().abs().amax()
    # (label, callable, bytes it must move)
    ops = [
        ("x.clone()", lambda: x.clone(), 2 * n_in),
        ("quantize_nvfp4 (per tensor: amax pass + quantize)", lambda: tf.quantize_nvfp4(x), 2 * n_in + codes_b + scales_b),
        ("quantize_nvfp4 given amax (one pass)", lambda: tf.quantize_nvfp4(x, global_amax=amax), n_in + codes_b + scales_b),
        ("quantize_nvfp4 per_row", lambda: tf.quantize_nvfp4(x, per_row=True), 2 * n_in + codes_b + scales_b),
        ("quantize_mxfp4", lambda: tf.quantize_mxfp4(x), n_in + codes_b + scales_b // 2),
        ("dequantize_nvfp4 (fp32 out)", lambda: tf.dequantize_nvfp4(q), codes_b + scales_b + 2 * n_in),
        ("dequantize_mxfp4 (fp32 out)", lambda: tf.dequantize_mxfp4(m), codes_b + scales_b // 2 + 2 * n_in),
        ("guided_quantize lsb", lambda: tf.guided_quantize(y, hint_lsb), n_in + n_in // 16 + codes_b + 2 * scales_b),
        ("guided_quantize full", lambda: tf.guided_quantize(y, hint_full), n_in + 2 * codes_b + 2 * scales_b),
        ("encode_hint lsb", lambda: tf.encode_hint(q, "lsb"), codes_b + codes_b // 4 + 2 * scales_b),
    ]
    times = {label: _cuda_time(fn, repeats) for label, fn, _ in ops}
    clone_s = times["x.clone()"]
    clone_bw = 2 * n_in / clone_s
    out = {"shape": [rows, cols], "dtype": "bfloat16", "device": torch.cuda.get_device_name(), "ops": {}}
    for label, _, moved in ops:
        t = times[label]
        out["ops"][label] = {
            "seconds": t,
            "bytes_moved": moved,
            "clone_over_op": clone_s / t,
            "fraction_of_copy_bandwidth": (moved / t) / clone_bw,
        }
    out["copy_bandwidth_GBps"] = clone_bw / 1e9
    return out


def format_report(correct: list[dict], bw: dict | None) -> str:
    lines = []
    by_kernel: dict[str, list[dict]] = {}
    for r in correct:
        by_kernel.setdefault(r["kernel"], []).append(r)
    lines.append(f"{'kernel':<34}{'cases':>7}{'bit-exact':>11}")
    for kernel, rs in by_kernel.items():
        lines.append(f"{kernel:<34}{len(rs):>7}{sum(r['ok'] for r in rs):>11}")
    bad = [r for r in correct if not r["ok"]]
    for r in bad[:20]:
        lines.append(f"  MISMATCH {r['kernel']} shape={r['shape']} {r['dtype']} {r['kind']} (vs {r['oracle']})")
    if bw:
        lines.append("")
        lines.append(f"{'x'.join(map(str, bw['shape']))} bf16 on {bw['device']}; copy bandwidth "
                     f"{bw['copy_bandwidth_GBps']:.0f} GB/s (x.clone(), read + write)")
        lines.append(f"{'operation':<52}{'us':>9}{'clone/op':>10}{'of copy BW':>12}")
        for label, m in bw["ops"].items():
            lines.append(f"{label:<52}{m['seconds'] * 1e6:>9.1f}{m['clone_over_op']:>10.2f}"
                         f"{m['fraction_of_copy_bandwidth']:>12.2f}")
    return "\n".join(lines)


def check_vllm(workdir: str, batch: int = 16, new_tokens: int = 32, device: str = "cuda") -> dict:
    """The plugin on CUDA (see the module docstring); ``{"ok": bool, ...figures}``."""
    from transformers import AutoModelForCausalLM

    from tracefp4.engines.model import load_model, tiny_config
    from tracefp4.engines.plan import PrecisionPlan
    from tracefp4.engines.protocol import SamplingParams
    from tracefp4.engines.sink import StoreTarget
    from tracefp4.engines.trainer import code_mismatch, forward_rollout
    from tracefp4.engines.vllm import VLLMEngine
    from tracefp4.guidance.compact import GuidedMode
    from tracefp4.guidance.store import StoreReader, seal_step

    ckpt = os.path.join(workdir, "ckpt")
    torch.manual_seed(0)
    cfg = tiny_config(layers=4, experts=8, top_k=2, hidden=256, moe_intermediate=128, heads=4, kv_heads=2, head_dim=64,
                      vocab=512, init_std=0.05, max_positions=512)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(ckpt)
    plan, layers = PrecisionPlan(), frozenset(range(4))
    extra = {"gpu_memory_utilization": 0.3} if device == "cuda" else {}
    engine = VLLMEngine(ckpt, plan=plan, max_model_len=256, max_num_seqs=batch, **extra)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in torch.randint(8, 24, (batch,), generator=g)]
    sampling = SamplingParams(max_new_tokens=new_tokens, seed=3)
    out = engine.generate(prompts, sampling, plan=plan, guidance=GuidedMode.parse("full@all"), diagnostics=layers)
    covered = all(t.shape[0] == out.token_ids[b].numel() for b, r in enumerate(out.records) for t in r.values())
    trainer = load_model(ckpt).to(device)
    with torch.no_grad():
        tr = forward_rollout(trainer, out, mode="trace", capture_codes=layers)
        qat = forward_rollout(trainer, out, mode="qat", capture_codes=layers)
    stats, qstats = code_mismatch(tr.codes, out.diagnostics), code_mismatch(qat.codes, out.diagnostics)
    total = sum(x.total for x in stats.values())
    mism, qmism = sum(x.mismatched for x in stats.values()), sum(x.mismatched for x in qstats.values())
    with tempfile.TemporaryDirectory(dir=workdir) as root:
        ids = tuple(f"t{b}" for b in range(batch))
        engine.generate(prompts, sampling, plan=plan, guidance=GuidedMode.parse("full@all"),
                        store=StoreTarget(root, 0, "w0", ids, "sig", 0))
        seal_step(root, 0, ["w0"])
        with StoreReader(root, 0, model_signature="sig", policy_version=0) as r:
            back = r.batch(list(ids), [t.numel() for t in out.token_ids])
        stored_equal = all(sorted(a) == sorted(b) and all(torch.equal(a[k], b[k].cpu()) for k in b)
                           for a, b in zip(back, out.records))
    speeds = {}
    for mode, guidance in (("fp4", None), ("trace", GuidedMode.parse("lsb")), ("trace-full", GuidedMode.parse("full"))):
        t0 = time.perf_counter()
        o = engine.generate(prompts, sampling, plan=plan, guidance=guidance)
        speeds[mode] = sum(lp.numel() for lp in o.logprobs) / (time.perf_counter() - t0)
    ok = covered and total > 0 and mism == 0 and stored_equal
    return {"ok": ok, "records_cover_positions": covered, "codes_checked": total, "trace-full_mismatched": mism,
            "qat_mismatched": qmism, "store_equal": stored_equal, "tokens_per_s": speeds,
            "lsb_over_fp4": speeds["trace"] / speeds["fp4"], "full_over_fp4": speeds["trace-full"] / speeds["fp4"]}


def check_kernels(args) -> int:
    """The ``kernels`` step (in its own process): correctness and bandwidth of the quantizers."""
    import tracefp4 as tf
    from tracefp4.formats import reference as ref

    t0 = time.perf_counter()
    correct = check_correctness(tf, ref, big=(args.big_rows, args.big_cols))
    bw = None if args.skip_bandwidth else measure_bandwidth(tf, args.rows, args.cols, args.repeats)
    print(format_report(correct, bw))
    ok = all(r["ok"] for r in correct)
    _write_json(args.json, {"ok": ok, "cases": correct, "bandwidth": bw, "seconds": time.perf_counter() - t0})
    return 0 if ok else 1


def check_graph(args) -> int:
    """The ``graph`` step (in its own process): see the module docstring."""
    from tracefp4.engines import cuda_graph
    from tracefp4.engines.capture import RolloutCapture
    from tracefp4.engines.experts import gemm_named, routed_experts
    from tracefp4.engines.experts.base import SILU_GATE
    from tracefp4.engines.plan import PrecisionPlan
    from tracefp4.engines.sites import ForwardState
    from tracefp4.guidance.compact import GuidedMode

    tokens, e, top_k, hidden, inter = args.graph_tokens, 64, 8, 2048, 768  # the bandwidth preset's layer
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)]).cuda()
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).cuda()
    plan, gemm = PrecisionPlan(), gemm_named("triton_fp4")
    prepared = [gemm.prepare((torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16).cuda(), plan.weight_quantizer)
                for shape in ((e, 2 * inter, hidden), (e, hidden, inter))]
    state = ForwardState(plan, RolloutCapture.of(GuidedMode.parse("full@all"), frozenset(), 1))

    def run():
        return routed_experts(state, 0, x, ids, weights, *prepared, gemm, SILU_GATE)

    graph, eager, captured = cuda_graph.capture(run)
    same = torch.equal(captured.view(torch.int16), eager.view(torch.int16))
    state.path.checks.raise_if_any()
    eager_s, replay_s = _cuda_time(run, args.repeats), _cuda_time(graph.replay, args.repeats)
    out = {"ok": same, "tokens": tokens, "replay_equals_eager": same, "eager_s": eager_s, "replay_s": replay_s,
           "eager_over_replay": eager_s / replay_s}
    print(json.dumps(out))
    _write_json(args.json, out)
    return 0 if same else 1


def _write_json(path: str, payload) -> None:
    """``payload`` at ``path``, whole or not at all (the machine may be taken away right after):
    :func:`tracefp4.files.atomic_write_json`, keys in the report's order."""
    from tracefp4.files import atomic_write_json

    atomic_write_json(path, payload, sort_keys=False)


def _say(line: str) -> None:
    """One progress line, flushed at once: the log shows how far a run got even if it never ends."""
    print(f"gpu_check: {line}", flush=True)


ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    """A step's command in its own process: return code, seconds, the output's tail; a timeout is a failure."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=max(timeout, 1))
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = None, f"timed out after {timeout:.0f}s\n" + ((e.stdout or b"").decode(errors="replace")
                                                             if isinstance(e.stdout, bytes) else (e.stdout or ""))
    return {"cmd": " ".join(cmd), "rc": rc, "seconds": time.perf_counter() - t0, "tail": out[-3000:]}


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _self(step: str, args, json_path: str) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", step, "--json", json_path,
           "--repeats", str(args.repeats), "--rows", str(args.rows), "--cols", str(args.cols),
           "--big-rows", str(args.big_rows), "--big-cols", str(args.big_cols), "--graph-tokens", str(args.graph_tokens)]
    return cmd + (["--skip-bandwidth"] if args.skip_bandwidth else [])


def step_commands(args, tmp: str) -> list[tuple[str, float, list[str], dict, str]]:
    """(step, cap in seconds, command, environment, its JSON path) in the order they run."""
    py, device = sys.executable, "cpu" if args.dry_run else "cuda"
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    mismatch = [py, "-m", "tracefp4", "mismatch", "--device", device, "--quiet", "--json", f"{tmp}/mismatch.json"]
    bench = [py, "-m", "tracefp4", "bench", "rollout", "--preset", "bandwidth", "--engines", "home", "--no-memory",
             "--device", device, "--json", f"{tmp}/bench.json"]
    if args.dry_run:  # toy sizes through the same commands; the interpreter for the Triton tests
        interp = {"TRITON_INTERPRET": "1"}
        return [("tests", 300, pytest + ["tests/test_triton_experts.py", "-k", "decode_layer or edge_cases"], interp, ""),
                ("mismatch", 300, mismatch + ["--batch", "2", "--new-tokens", "4", "--layers", "2"], {}, f"{tmp}/mismatch.json"),
                ("bench", 300, bench + ["--layers", "1", "--hidden", "256", "--experts", "8", "--top-k", "2",
                                        "--expert-dim", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                                        "--batch", "2", "--new-tokens", "4"], {}, f"{tmp}/bench.json")]
    no_interp = {"TRITON_INTERPRET": "0"}
    return [("kernels", 150, _self("kernels", args, f"{tmp}/kernels.json"), no_interp, f"{tmp}/kernels.json"),
            ("tests", 150, pytest + ["tests/test_triton.py", "tests/test_triton_experts.py"], no_interp, ""),
            ("cuda_tests", 120, pytest + ["-m", "cuda", "tests"], no_interp, ""),
            ("graph", 60, _self("graph", args, f"{tmp}/graph.json"), no_interp, f"{tmp}/graph.json"),
            ("mismatch", 120, mismatch, no_interp, f"{tmp}/mismatch.json"),
            ("bench", 150, bench + ["--repeats", "2"], no_interp, f"{tmp}/bench.json")]


def figures(step: str, path: str) -> dict:
    """What a step's JSON at ``path`` says, and whether it passes (``ok``)."""
    if step == "bench":  # a results file of the rollout suite (tracefp4.bench.result)
        from tracefp4.bench.result import ResultError, load

        try:
            (run,), _ = load(path)
        except (ResultError, ValueError) as e:
            return {"ok": False, "why": str(e)}
        tps = {f"{r.mode}@b{r.shape['batch']}": r.value for r in run.find("rollout_tokens_per_s", "home")}
        rate = lambda mode, b: run.value("rollout_tokens_per_s", "home", mode, batch=b)  # noqa: E731
        ratios = {f"fp4/bf16@b{b}": rate("fp4", b) / rate("bf16", b) for b in run.config["batches"]}
        ratios.update({f"trace-full/fp4@b{b}": rate("trace-full", b) / rate("fp4", b) for b in run.config["batches"]})
        return {"ok": True, "tokens_per_s": tps, "ratios": ratios, "device": run.config.get("device")}
    data = _read(path)
    if data is None:
        return {"ok": False, "why": "no JSON written"}
    if step == "mismatch":
        full = data["mismatch_counts"]["trace-full"]
        return {"ok": full["total"] > 0 and full["mismatched"] == 0, "trace-full": full,
                "qat_rate": data["mismatch_rate"]["qat"], "fp4_rollouts_identical": data["fp4_rollouts_identical"]}
    return data


def _progress(args, report: dict, running: str | None) -> None:
    """The report so far at ``--json`` (see the module docstring): the steps finished, the one started."""
    _write_json(args.json, {**report, "complete": False, "running": running})


def run_steps(args) -> dict:
    """Every step within ``args.budget`` seconds in all; a step gets its cap or what is left. The JSON
    is rewritten as each step starts and ends."""
    deadline = time.perf_counter() + args.budget
    report: dict = {"torch": torch.__version__, "dry_run": args.dry_run,
                    "device": None if args.dry_run else torch.cuda.get_device_name(), "steps": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for step, cap, cmd, env, json_path in step_commands(args, tmp):
            left = deadline - time.perf_counter()
            if left < 10:
                report["steps"][step] = {"ok": False, "why": f"skipped: the {args.budget:.0f}s budget was spent"}
                _say(f"{step:<11}SKIPPED (the {args.budget:.0f}s budget was spent)")
                _progress(args, report, None)
                continue
            _say(f"{step:<11}started (at most {min(cap, left):.0f}s)")
            _progress(args, report, step)
            res = _run(cmd, min(cap, left), env)
            res["ok"] = res["rc"] == 0
            if json_path:
                fig = figures(step, json_path)
                res.update({k: v for k, v in fig.items() if k != "ok"}, ok=res["ok"] and fig["ok"])
            report["steps"][step] = res
            _say(f"{step:<11}{'ok' if res['ok'] else 'FAILED'} ({res['seconds']:.0f}s)")
            _progress(args, report, None)
            if not res["ok"]:
                print(res["tail"][-1500:], file=sys.stderr, flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="exit status: 0 ok, 1 a step failed, 2 no device")
    p.add_argument("--json", metavar="PATH", default="gpu_check.json", help="where to write the figures")
    p.add_argument("--budget", type=float, default=450, help="seconds for all the steps together")
    p.add_argument("--dry-run", action="store_true", help="the CPU-checkable parts (see the module docstring)")
    p.add_argument("--step", choices=("kernels", "graph"), help=argparse.SUPPRESS)  # one step, in its own process
    p.add_argument("--rows", type=int, default=8192, help="rows of the bandwidth tensor")
    p.add_argument("--cols", type=int, default=8192, help="columns of the bandwidth tensor (multiple of 32)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-bandwidth", action="store_true")
    p.add_argument("--big-rows", type=int, default=4096, help="rows of the largest correctness shape")
    p.add_argument("--big-cols", type=int, default=4096, help="columns of the largest correctness shape")
    p.add_argument("--graph-tokens", type=int, default=8, help="decode batch of the graph step")
    p.add_argument("--vllm", action="store_true", help="also check the tracefp4 vLLM plugin (needs vLLM's CUDA build)")
    args = p.parse_args(argv)

    if not args.dry_run:
        if not torch.cuda.is_available():
            return _fail_early("no CUDA device is available (torch.cuda.is_available() is False)")
        if os.environ.pop("TRITON_INTERPRET", None) not in (None, "", "0"):
            print("gpu_check: ignoring TRITON_INTERPRET: this script runs the compiled kernels", file=sys.stderr)
        try:
            from tracefp4.formats import triton_kernels  # noqa: F401 - fail early, clearly, without triton
        except ImportError as e:
            return _fail_early(f"Triton is not importable ({e})")
    if args.step:
        return {"kernels": check_kernels, "graph": check_graph}[args.step](args)

    t0 = time.perf_counter()
    report = run_steps(args)
    if args.vllm and not args.dry_run:
        _say("vllm       started")
        _progress(args, report, "vllm")
        t_vllm = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="gpu-check-vllm-") as workdir:
            report["vllm"] = check_vllm(workdir)
        _say(f"vllm       {'ok' if report['vllm']['ok'] else 'FAILED'} ({time.perf_counter() - t_vllm:.0f}s)")
        print(f"vLLM plugin on CUDA: {'ok' if report['vllm']['ok'] else 'FAILED'}; " + json.dumps(report["vllm"]),
              flush=True)
    ok = all(r["ok"] for r in report["steps"].values()) and (report.get("vllm") or {"ok": True})["ok"]
    report.update(ok=ok, seconds=time.perf_counter() - t0, complete=True, running=None)
    _write_json(args.json, report)
    print(f"{'every step passed' if ok else 'FAILURES (see above)'}; wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
