"""Tests of the guidance store (``tracefp4.guidance.store``): round trips, sealing, corruption, bytes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tracefp4.guidance.store import (
    COMPLETE_NAME,
    StoreError,
    StoreReader,
    StoreWriter,
    bytes_per_token,
    parse_name,
    seal_step,
    step_dir,
)

torch.set_num_threads(1)

SIG = "toy-moe-4L-e8k2:sha256=0123abcd"
PV = 5


# --------------------------------------------------------------------------------------------
# Deterministic records: a spawned writer and the checking parent build the same data from a seed,
# so nothing but the seed crosses the process boundary; the data travels only through the store.
# --------------------------------------------------------------------------------------------


def _random_bits(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infs, subnormals included) reinterpreted as ``dtype``."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def make_record(seed: int, idx: int) -> tuple[str, dict[str, torch.Tensor], int]:
    g = torch.Generator().manual_seed(seed * 1000 + idx)
    length = 3 + (seed * 7 + idx * 5) % 13
    prompt_len = 1 + idx % 3
    record = {
        "L02.expert_in.codes": _random_bits(g, (length, 8), torch.uint8),
        "L02.expert_in.scales": _random_bits(g, (length, 1), torch.float8_e4m3fn),
        "L02.expert_in.global_amax": _random_bits(g, (length, 1), torch.float32).reshape(length),
        "L02.expert_mid.bits": _random_bits(g, (length, 2, 2), torch.uint8),
        "L02.expert_mid.scales": _random_bits(g, (length, 2, 2), torch.float8_e4m3fn),
        "L02.k.codes": _random_bits(g, (length, 2, 4), torch.uint8),
        "L02.v.scales": _random_bits(g, (length, 2, 1), torch.bfloat16),
        "L03.k.global_amax": _random_bits(g, (length, 2), torch.float32),
        "L02.routing": torch.randint(0, 8, (length, 2), generator=g, dtype=torch.int16),
        "L03.routing": torch.randint(0, 8, (length, 2), generator=g, dtype=torch.int64),
    }
    return f"s{seed}.traj-{idx:03d}", record, prompt_len


def write_writer(
    root: str, step: int, writer_id: str, seed: int, n: int, shard_bytes: int = 1500
) -> None:
    """Target of the spawned writer processes (top level, so 'spawn' can import it)."""
    torch.set_num_threads(1)
    with StoreWriter(
        root, step, writer_id, model_signature=SIG, policy_version=PV, shard_bytes=shard_bytes
    ) as w:
        for i in range(n):
            tid, rec, p = make_record(seed, i)
            w.add(tid, rec, prompt_len=p)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Compare bytes, not values: NaN != NaN, and -0.0 == 0.0 would hide a flipped sign bit.
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def assert_record_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert bit_equal(got[name], want[name]), name


def small_step(root: Path, step: int = 3, writers: dict[str, int] | None = None, **kw) -> dict:
    """Write (in process) ``writers`` = {writer_id: seed}, 4 trajectories each; return expected."""
    writers = writers or {"w0": 0, "w1": 1}
    expected = {}
    for wid, seed in writers.items():
        write_writer(str(root), step, wid, seed, 4, **kw)
        for i in range(4):
            tid, rec, p = make_record(seed, i)
            expected[tid] = (rec, p)
    return expected


def open_reader(root: Path, step: int = 3, **kw) -> StoreReader:
    kw.setdefault("model_signature", SIG)
    kw.setdefault("policy_version", PV)
    return StoreReader(root, step, **kw)


def shard_files(root: Path, step: int = 3) -> list[Path]:
    return sorted(step_dir(root, step).glob("*.safetensors"))


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


def test_round_trip_three_spawned_writers_any_order_any_microbatching(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    step, seeds, n = 7, {"w0": 10, "w1": 11, "w2": 12}, 5
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=write_writer, args=(str(tmp_path), step, wid, seed, n))
        for wid, seed in seeds.items()
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0, 0]

    # Each writer produced several shards (shard_bytes is small) and one JSON manifest.
    sdir = step_dir(tmp_path, step)
    for wid in seeds:
        manifest = json.loads((sdir / f"{wid}.manifest.json").read_text())
        assert manifest["writer_id"] == wid and len(manifest["trajectories"]) == n
        assert len(manifest["shards"]) > 1
    assert not list(sdir.glob(".*")), "temp files left behind"

    seal_step(tmp_path, step, list(seeds))
    expected = {}
    for seed in seeds.values():
        for i in range(n):
            tid, rec, p = make_record(seed, i)
            expected[tid] = (rec, p)

    reader = open_reader(tmp_path, step)
    assert sorted(reader.trajectories()) == sorted(expected)
    rng = random.Random(0)
    order = list(expected)
    rng.shuffle(order)
    seen = []
    while order:  # random micro-batch sizes over a shuffled order
        k = rng.randint(1, 4)
        mb, order = order[:k], order[k:]
        got = reader.batch(mb, [expected[t][0]["L02.routing"].shape[0] for t in mb])
        for tid, rec in zip(mb, got):
            assert_record_equal(rec, expected[tid][0])
            assert reader.prompt_len(tid) == expected[tid][1]
        seen += mb
    assert sorted(seen) == sorted(expected)

    # Position slices and name subsets read exactly the corresponding part.
    for tid, (rec, _) in expected.items():
        length = reader.length(tid)
        a = rng.randint(0, length)
        b = rng.randint(a, length)
        names = rng.sample(sorted(rec), 3)
        got = reader.get(tid, slice(a, b), names)
        assert list(got) == names
        for name in names:
            assert bit_equal(got[name], rec[name][a:b]), (tid, name, a, b)


def test_round_trip_in_process_and_shards_are_plain_safetensors(tmp_path):
    expected = small_step(tmp_path, shard_bytes=1 << 30)  # one shard per writer
    seal_step(tmp_path, 3, ["w0", "w1"])
    with open_reader(tmp_path) as r:
        r.verify()
        for tid, (rec, p) in expected.items():
            assert_record_equal(r.get(tid), rec)
            assert r.length(tid) == rec["L02.routing"].shape[0] and r.prompt_len(tid) == p
    # The files are plain safetensors with "{traj_id}/{name}" keys (no pickle, any reader works).
    for shard in shard_files(tmp_path):
        loaded = safetensors.torch.load_file(shard)
        for key, t in loaded.items():
            tid, name = key.split("/")
            assert bit_equal(t, expected[tid][0][name])
    assert len(shard_files(tmp_path)) == 2


def test_positions_must_lie_inside_the_record(tmp_path):
    expected = small_step(tmp_path)
    seal_step(tmp_path, 3, ["w0", "w1"])
    r = open_reader(tmp_path)
    tid, (rec, _) = next(iter(expected.items()))
    length = r.length(tid)
    assert r.get(tid, slice(length, length))["L02.k.codes"].shape == (0, 2, 4)
    assert bit_equal(r.get(tid, slice(None, 2))["L03.routing"], rec["L03.routing"][:2])
    for bad in (slice(0, length + 1), slice(-2, None), slice(0, length, 2), slice(3, 1)):
        msg = rf"trajectory {re.escape(repr(tid))}: positions .* outside"
        with pytest.raises(StoreError, match=msg):
            r.get(tid, bad)
    with pytest.raises(StoreError, match=r"no tensor\(s\) \['L09.k.codes'\]"):
        r.get(tid, names=["L09.k.codes"])


# --------------------------------------------------------------------------------------------
# Visibility and sealing
# --------------------------------------------------------------------------------------------


def test_unsealed_step_is_refused(tmp_path):
    small_step(tmp_path)
    msg = re.escape("step 3 is not sealed: writers present: ['w0', 'w1']")
    with pytest.raises(StoreError, match=msg):
        open_reader(tmp_path)


def test_seal_refuses_a_missing_manifest(tmp_path):
    small_step(tmp_path, writers={"w0": 0})
    msg = r"manifest of writer 'w1' is missing.*writers present: \['w0'\]"
    with pytest.raises(StoreError, match=msg):
        seal_step(tmp_path, 3, ["w0", "w1"])
    assert not (step_dir(tmp_path, 3) / COMPLETE_NAME).exists()


def test_seal_refuses_duplicate_trajectory_across_writers(tmp_path):
    small_step(tmp_path, writers={"w0": 0, "w1": 0})  # same seed -> same trajectory ids
    with pytest.raises(
        StoreError, match=r"trajectory id 's0.traj-000' written by both writer 'w0' and writer 'w1'"
    ):
        seal_step(tmp_path, 3, ["w0", "w1"])
    assert not (step_dir(tmp_path, 3) / COMPLETE_NAME).exists()


def test_seal_refuses_writers_that_disagree_on_policy_or_model(tmp_path):
    small_step(tmp_path, writers={"w0": 0})
    with StoreWriter(tmp_path, 3, "w1", model_signature=SIG, policy_version=PV + 1) as w:
        tid, rec, p = make_record(1, 0)
        w.add(tid, rec, prompt_len=p)
    with pytest.raises(StoreError, match=r"disagree on policy_version: \{'w0': 5, 'w1': 6\}"):
        seal_step(tmp_path, 3, ["w0", "w1"])
    with StoreWriter(tmp_path, 3, "w2", model_signature="other", policy_version=PV) as w:
        w.add(tid, rec, prompt_len=p)
    with pytest.raises(StoreError, match=r"disagree on model_signature"):
        seal_step(tmp_path, 3, ["w0", "w2"])


def test_seal_is_idempotent_but_not_rewritable(tmp_path):
    small_step(tmp_path)
    path = seal_step(tmp_path, 3, ["w0", "w1"])
    before = path.read_bytes()
    assert seal_step(tmp_path, 3, ["w0", "w1"]) == path and path.read_bytes() == before
    with pytest.raises(StoreError, match="already sealed with different contents"):
        seal_step(tmp_path, 3, ["w0"])
    with pytest.raises(StoreError, match="already sealed"):
        StoreWriter(tmp_path, 3, "w9", model_signature=SIG, policy_version=PV)
    StoreWriter(tmp_path, 4, "w0", model_signature=SIG, policy_version=PV).close()
    with pytest.raises(StoreError, match="manifest for this writer already exists"):
        StoreWriter(tmp_path, 4, "w0", model_signature=SIG, policy_version=PV)


def test_writer_that_raised_leaves_no_visible_trace(tmp_path):
    small_step(tmp_path, writers={"w0": 0})
    with pytest.raises(RuntimeError, match="worker died"):
        with StoreWriter(
            tmp_path, 3, "w1", model_signature=SIG, policy_version=PV, shard_bytes=500
        ) as w:
            for i in range(4):
                tid, rec, p = make_record(1, i)
                w.add(tid, rec, prompt_len=p)
            assert len(list(step_dir(tmp_path, 3).glob("w1-*.safetensors"))) >= 2  # flushed
            raise RuntimeError("worker died")
    sdir = step_dir(tmp_path, 3)
    assert sorted(p.name for p in sdir.iterdir() if p.name.startswith(("w1", ".w1"))) == []
    with pytest.raises(StoreError, match="manifest of writer 'w1' is missing"):
        seal_step(tmp_path, 3, ["w0", "w1"])
    # A retry of the same worker id then succeeds.
    write_writer(str(tmp_path), 3, "w1", 1, 4)
    seal_step(tmp_path, 3, ["w0", "w1"])
    assert len(open_reader(tmp_path).trajectories()) == 8


# --------------------------------------------------------------------------------------------
# Corruption
# --------------------------------------------------------------------------------------------


def _traj_in(reader: StoreReader, shard: Path) -> str:
    return next(
        t
        for m in reader.manifests
        for t, meta in m.trajectories.items()
        if meta.shard == shard.name
    )


def test_truncated_shard_is_reported_as_truncation(tmp_path):
    expected = small_step(tmp_path)
    seal_step(tmp_path, 3, ["w0", "w1"])
    victim = shard_files(tmp_path)[0]
    size = victim.stat().st_size
    os.truncate(victim, size - 7)
    r = open_reader(tmp_path)  # lazy: opening the step does not read shards
    tid = _traj_in(r, victim)
    msg = rf"{re.escape(str(victim))}: shard is truncated: {size - 7} bytes on disk, "
    msg += rf"manifest says {size}"
    with pytest.raises(StoreError, match=msg):
        r.get(tid)
    with pytest.raises(StoreError, match="truncated"):
        r.verify()
    # Trajectories in intact shards are still served exactly.
    other = next(t for t in expected if r._locate(t).meta.shard != victim.name)
    assert_record_equal(r.get(other), expected[other][0])


def test_one_flipped_byte_is_detected(tmp_path):
    expected = small_step(tmp_path)
    seal_step(tmp_path, 3, ["w0", "w1"])
    victim = shard_files(tmp_path)[-1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01  # last payload byte: the safetensors header stays valid
    victim.write_bytes(bytes(data))
    # Without checksums this would be silently wrong data: the file still parses.
    loaded = safetensors.torch.load_file(victim)
    differs = []
    for key, t in loaded.items():
        tid, name = key.split("/")
        differs.append(not bit_equal(t, expected[tid][0][name]))
    assert sum(differs) == 1
    r = open_reader(tmp_path)
    with pytest.raises(StoreError, match=rf"{re.escape(str(victim))}: sha256 mismatch"):
        r.get(_traj_in(r, victim))


def test_missing_or_edited_manifest_after_seal(tmp_path):
    small_step(tmp_path)
    seal_step(tmp_path, 3, ["w0", "w1"])
    manifest = step_dir(tmp_path, 3) / "w1.manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"prompt_len": 1', '"prompt_len": 0', 1))
    with pytest.raises(StoreError, match=r"writer 'w1': manifest .* changed after sealing"):
        open_reader(tmp_path)
    manifest.unlink()
    msg = rf"manifest of writer 'w1' is missing \({re.escape(str(manifest))}\)"
    with pytest.raises(StoreError, match=msg):
        open_reader(tmp_path)


def test_missing_shard_is_reported(tmp_path):
    small_step(tmp_path)
    seal_step(tmp_path, 3, ["w0", "w1"])
    victim = shard_files(tmp_path)[0]
    victim.unlink()
    r = open_reader(tmp_path)
    with pytest.raises(StoreError, match=rf"{re.escape(str(victim))}: shard file is missing"):
        r.get(_traj_in(r, victim))


# --------------------------------------------------------------------------------------------
# Disagreements between the store and the training batch
# --------------------------------------------------------------------------------------------


@pytest.fixture
def sealed(tmp_path):
    expected = small_step(tmp_path)
    seal_step(tmp_path, 3, ["w0", "w1"])
    return tmp_path, expected


def test_unknown_trajectory(sealed):
    root, expected = sealed
    r = open_reader(root)
    with pytest.raises(StoreError, match=r"step 3: unknown trajectory 'nope' \(8 trajectories"):
        r.get("nope")
    tid = next(iter(expected))
    with pytest.raises(StoreError, match="unknown trajectory 'nope'"):
        r.batch([tid, "nope"], [r.length(tid), 5])


def test_wrong_length(sealed):
    root, expected = sealed
    r = open_reader(root)
    tid = list(expected)[5]
    n = r.length(tid)
    with pytest.raises(
        StoreError,
        match=rf"writer 'w1', trajectory '{re.escape(tid)}': batch expects length {n + 1}, "
        rf"the store holds length {n}",
    ):
        r.batch([tid], [n + 1])
    with pytest.raises(StoreError, match="one length per trajectory"):
        r.batch([tid], [])


def test_wrong_trailing_shape(sealed):
    root, expected = sealed
    r = open_reader(root)
    tid = next(iter(expected))
    n = r.length(tid)
    assert len(r.batch([tid], [n], trailing_shapes={"L02.k.codes": (2, 4)})) == 1
    with pytest.raises(
        StoreError,
        match=r"tensor 'L02.k.codes': batch expects trailing shape \[4, 4\], "
        r"the store holds \[2, 4\]",
    ):
        r.batch([tid], [n], trailing_shapes={"L02.k.codes": (4, 4)})


def test_wrong_model_signature(sealed):
    root, _ = sealed
    with pytest.raises(
        StoreError,
        match=rf"model_signature mismatch: store has '{re.escape(SIG)}', "
        r"reader expects 'other-model'",
    ):
        open_reader(root, model_signature="other-model")


def test_wrong_policy_version(sealed):
    root, _ = sealed
    with pytest.raises(
        StoreError, match=r"policy_version mismatch: store has 5, reader expects 4"
    ):
        open_reader(root, policy_version=4)


# --------------------------------------------------------------------------------------------
# Writer-side validation and names
# --------------------------------------------------------------------------------------------


def test_parse_name():
    assert parse_name("L07.k.scales") == (7, "k", "scales")
    assert parse_name("L12.expert_mid.bits") == (12, "expert_mid", "bits")
    assert parse_name("L100.routing") == (100, "routing", "")
    bads = ("L7.k.codes", "L007.k.codes", "L07.q.codes", "L07.k", "07.k.codes", "L07.routing.x")
    for bad in bads:
        with pytest.raises(StoreError, match=re.escape(repr(bad))):
            parse_name(bad)


def test_add_validates_records(tmp_path):
    w = StoreWriter(tmp_path, 0, "w0", model_signature=SIG, policy_version=PV)
    ok = torch.zeros(4, 3, dtype=torch.uint8)
    cases = [
        ("t/1", {"L01.k.codes": ok}, 0, "invalid trajectory id 't/1'"),
        ("t", {"L01.k.codes": ok, "L01.v.codes": ok[:3]}, 0, "leading dim 3 differs from .* T=4"),
        ("t", {"L1.k.codes": ok}, 0, "'L1.k.codes'"),
        ("t", {"L01.k.codes": ok}, 5, r"prompt_len 5 not in \[0, T=4\]"),
        ("t", {"L01.routing": ok.float()}, 0, "routing indices need an integer dtype"),
        ("t", {"L01.k.codes": ok.view(torch.float4_e2m1fn_x2)}, 0, r"view\(torch.uint8\)"),
        ("t", {}, 0, "non-empty dict"),
    ]
    for tid, rec, p, msg in cases:
        with pytest.raises(StoreError, match=msg):
            w.add(tid, rec, prompt_len=p)
    src = torch.arange(12, dtype=torch.uint8).reshape(4, 3)
    w.add("t", {"L01.k.codes": src.t().contiguous().t()}, prompt_len=1)  # non-contiguous input
    w.add("u", {"L01.k.codes": src}, prompt_len=1)  # contiguous input
    src.fill_(0)  # the caller reuses its buffer: the writer must own a copy
    with pytest.raises(StoreError, match="duplicate trajectory id"):
        w.add("t", {"L01.k.codes": ok}, prompt_len=0)
    w.close()
    seal_step(tmp_path, 0, ["w0"])
    r = StoreReader(tmp_path, 0, model_signature=SIG, policy_version=PV)
    for tid in ("t", "u"):
        want = torch.arange(12, dtype=torch.uint8).reshape(4, 3)
        assert torch.equal(r.get(tid)["L01.k.codes"], want)


# --------------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------------


def test_bytes_per_token_matches_hand_arithmetic(tmp_path):
    u8, f8 = torch.uint8, torch.float8_e4m3fn
    with StoreWriter(tmp_path, 1, "w0", model_signature=SIG, policy_version=PV) as w:
        w.add(
            "a",
            {
                "L05.expert_in.codes": torch.zeros(10, 1024, dtype=u8),  # 10*1024*1 = 10240
                "L05.expert_in.scales": torch.zeros(10, 128, dtype=f8),  # 10*128*1  = 1280
                "L05.expert_in.global_amax": torch.zeros(10, dtype=torch.float32),  # 40
                "L05.k.codes": torch.zeros(10, 2, 32, dtype=u8),  # 640
                "L07.v.scales": torch.zeros(10, 2, 4, dtype=torch.bfloat16),  # 160
                "L05.routing": torch.zeros(10, 8, dtype=torch.int32),  # 320
            },
            prompt_len=4,  # 6 generated tokens
        )
    with StoreWriter(tmp_path, 1, "w1", model_signature=SIG, policy_version=PV) as w:
        w.add("b", {"L07.routing": torch.zeros(5, 8, dtype=torch.int16)}, prompt_len=3)  # 80, 2 gen
    seal_step(tmp_path, 1, ["w0", "w1"])
    gen = 6 + 2
    guidance = 10240 + 1280 + 40 + 640 + 160
    routing = 320 + 80
    want = {
        "generated_tokens": gen,
        "total_bytes": guidance + routing,
        "guidance_bytes": guidance,
        "routing_bytes": routing,
        "total": (guidance + routing) / gen,
        "guidance": guidance / gen,
        "routing": routing / gen,
        "by_site": {"expert_in": (10240 + 1280 + 40) / gen, "k": 640 / gen, "v": 160 / gen},
        "by_layer": {5: (10240 + 1280 + 40 + 640) / gen, 7: 160 / gen},
        "routing_by_layer": {5: 320 / gen, 7: 80 / gen},
    }
    reader = open_reader(tmp_path, 1)
    assert bytes_per_token(reader) == want
    # Pure function of the manifests' JSON: same answer without opening any shard.
    sdir = step_dir(tmp_path, 1)
    manifests = [json.loads((sdir / f"{w}.manifest.json").read_text()) for w in ("w0", "w1")]
    assert bytes_per_token(manifests) == want
    assert bytes_per_token(manifests, generated_tokens=4)["total"] == (guidance + routing) / 4
    # The paper's full-information NVFP4 figure: 4-bit codes + one 8-bit scale per 16 = 4.5 bits.
    in_bytes = 10 * (1024 + 128)
    assert in_bytes * 8 / (10 * 2048) == 4.5
    with pytest.raises(StoreError, match="0 generated tokens"):
        bytes_per_token(manifests, generated_tokens=0)
