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
    FORMAT_VERSION,
    Manifest,
    bytes_per_token,
    discard_step,
    parse_name,
    seal_step,
    step_bytes,
    step_dir,
)

torch.set_num_threads(1)

SIG = "toy-moe-4L-e8k2:sha256=0123abcd"
PV = 5
CONTRACT = "tracefp4.contract/1 weights=nvfp4 guidance=lsb"


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
        root, step, writer_id, model_signature=SIG, policy_version=PV, contract=CONTRACT, shard_bytes=shard_bytes
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
    # The files are plain safetensors with "{traj_id}/{name}" keys (no pickle, any reader works), and
    # each trajectory's per-token policy versions under "{traj_id}/policy_version".
    for shard in shard_files(tmp_path):
        loaded = safetensors.torch.load_file(shard)
        for key, t in loaded.items():
            tid, name = key.split("/")
            want = stored_versions(expected, tid) if name == "policy_version" else expected[tid][0][name]
            assert bit_equal(t, want)
    assert len(shard_files(tmp_path)) == 2


def stored_versions(expected: dict, tid: str) -> torch.Tensor:
    """What the shard holds as ``tid``'s per-token versions when the writer was given none: PV per row."""
    return torch.full((expected[tid][0]["L02.routing"].shape[0],), PV, dtype=torch.int64)


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


def test_seal_refuses_writers_that_disagree_on_model_or_contract(tmp_path):
    small_step(tmp_path, writers={"w0": 0})
    tid, rec, p = make_record(1, 0)
    with StoreWriter(tmp_path, 3, "w2", model_signature="other", policy_version=PV, contract=CONTRACT) as w:
        w.add(tid, rec, prompt_len=p)
    with pytest.raises(StoreError, match=r"disagree on model_signature"):
        seal_step(tmp_path, 3, ["w0", "w2"])
    with StoreWriter(tmp_path, 3, "w3", model_signature=SIG, policy_version=PV, contract=CONTRACT + "x") as w:
        w.add(tid, rec, prompt_len=p)
    with pytest.raises(StoreError, match=r"disagree on the quantizer contract: \{'w0': '.*lsb', 'w3': '.*lsbx'\}"):
        seal_step(tmp_path, 3, ["w0", "w3"])


def test_writers_of_different_versions_seal_one_step_spanning_them(tmp_path):
    # Each row carries its version: writers holding different weights may share a step (a pool whose
    # workers run ahead of the trainer); the seal records the step's newest and oldest versions.
    small_step(tmp_path, writers={"w0": 0})
    with StoreWriter(tmp_path, 3, "w1", model_signature=SIG, policy_version=PV + 1, contract=CONTRACT) as w:
        tid, rec, p = make_record(1, 0)
        w.add(tid, rec, prompt_len=p)
    seal = json.loads(seal_step(tmp_path, 3, ["w0", "w1"]).read_text())
    assert (seal["policy_version"], seal["oldest_policy_version"], seal["contract"]) == (PV + 1, PV, CONTRACT)
    with open_reader(tmp_path, policy_version=PV + 1, max_lag=1) as r:
        assert r.version_range(tid) == (PV + 1, PV + 1) and r.version_range("s0.traj-000") == (PV, PV)


def test_seal_is_idempotent_but_not_rewritable(tmp_path):
    small_step(tmp_path)
    path = seal_step(tmp_path, 3, ["w0", "w1"])
    before = path.read_bytes()
    assert seal_step(tmp_path, 3, ["w0", "w1"]) == path and path.read_bytes() == before
    with pytest.raises(StoreError, match="already sealed with different contents"):
        seal_step(tmp_path, 3, ["w0"])
    with pytest.raises(StoreError, match="already sealed"):
        StoreWriter(tmp_path, 3, "w9", model_signature=SIG, policy_version=PV, contract=CONTRACT)
    StoreWriter(tmp_path, 4, "w0", model_signature=SIG, policy_version=PV, contract=CONTRACT).close()
    with pytest.raises(StoreError, match="manifest for this writer already exists"):
        StoreWriter(tmp_path, 4, "w0", model_signature=SIG, policy_version=PV, contract=CONTRACT)


def test_writer_that_raised_leaves_no_visible_trace(tmp_path):
    small_step(tmp_path, writers={"w0": 0})
    with pytest.raises(RuntimeError, match="worker died"):
        with StoreWriter(
            tmp_path, 3, "w1", model_signature=SIG, policy_version=PV, contract=CONTRACT, shard_bytes=500
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
        if not bit_equal(t, stored_versions(expected, tid) if name == "policy_version" else expected[tid][0][name]):
            differs.append(tid)
    assert len(differs) == 1
    bad = differs[0]
    r = open_reader(tmp_path)
    # Detected when the trajectory holding the byte is read, without verify(); the message names
    # the trajectory and the shard. Other trajectories of that shard are still served exactly.
    msg = rf"trajectory {re.escape(repr(bad))}, shard {re.escape(str(victim))}: sha256 mismatch"
    with pytest.raises(StoreError, match=msg):
        r.get(bad)
    for tid in {t for t in loaded if not t.startswith(bad + "/")}:
        tid = tid.split("/")[0]
        assert_record_equal(r.get(tid), expected[tid][0])
    with pytest.raises(StoreError, match=rf"{re.escape(str(victim))}: sha256 mismatch"):
        r.verify()


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
        StoreError, match=r"policy_version mismatch: the store holds rows of version 5, newer than the "
                          r"reader's 4; the reader at policy version 4 accepts version 4 only \(max_lag=0\)"
    ):
        open_reader(root, policy_version=4)
    with pytest.raises(StoreError, match=r"the newest rows of the store are of version 5, older than the window: "
                                         r"the reader at policy version 7 accepts versions 6..7 \(max_lag=1\)"):
        open_reader(root, policy_version=7, max_lag=1)


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
    w = StoreWriter(tmp_path, 0, "w0", model_signature=SIG, policy_version=PV, contract=CONTRACT)
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
    r = StoreReader(tmp_path, 0, model_signature=SIG, policy_version=PV, contract=CONTRACT)
    for tid in ("t", "u"):
        want = torch.arange(12, dtype=torch.uint8).reshape(4, 3)
        assert torch.equal(r.get(tid)["L01.k.codes"], want)


# --------------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------------


def test_bytes_per_token_matches_hand_arithmetic(tmp_path):
    u8, f8 = torch.uint8, torch.float8_e4m3fn
    with StoreWriter(tmp_path, 1, "w0", model_signature=SIG, policy_version=PV, contract=CONTRACT) as w:
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
    with StoreWriter(tmp_path, 1, "w1", model_signature=SIG, policy_version=PV, contract=CONTRACT) as w:
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


# --------------------------------------------------------------------------------------------
# One writer per name, clean-up, discarding a step
# --------------------------------------------------------------------------------------------


def writer(root: Path, step: int = 3, wid: str = "w0", **kw) -> StoreWriter:
    return StoreWriter(root, step, wid, model_signature=SIG, policy_version=PV, contract=CONTRACT, **kw)


def test_second_writer_of_the_same_name_is_refused_at_creation(tmp_path):
    w = writer(tmp_path)
    sdir = step_dir(tmp_path, 3)
    lock = json.loads((sdir / "w0.lock").read_text())
    assert lock["pid"] == os.getpid() and len(lock["token"]) == 32
    msg = rf"another writer of this name holds the lock .*pid {os.getpid()}"
    with pytest.raises(StoreError, match=msg):
        writer(tmp_path)
    other = writer(tmp_path, wid="w1")  # other names are independent
    for i, ww in enumerate((w, other)):
        tid, rec, p = make_record(i, 0)
        ww.add(tid, rec, prompt_len=p)
        ww.close()
    assert not list(sdir.glob("*.lock")), "a finished writer keeps no lock"
    with pytest.raises(StoreError, match="manifest for this writer already exists"):
        writer(tmp_path)
    seal_step(tmp_path, 3, ["w0", "w1"])
    assert len(open_reader(tmp_path)) == 2


def test_writer_is_refused_at_close_if_its_manifest_appeared_or_it_lost_its_lock(tmp_path):
    sdir = step_dir(tmp_path, 3)
    w = writer(tmp_path, shard_bytes=500)
    for i in range(3):
        tid, rec, p = make_record(0, i)
        w.add(tid, rec, prompt_len=p)
    assert list(sdir.glob("w0-*.safetensors"))  # some shards already published
    manifest = sdir / "w0.manifest.json"
    manifest.write_bytes(b"written by someone else")  # appears while w0 is still writing
    with pytest.raises(StoreError, match=rf"manifest {re.escape(str(manifest))} already exists"):
        w.close()
    assert manifest.read_bytes() == b"written by someone else"  # not replaced
    assert sorted(p.name for p in sdir.iterdir()) == ["w0.manifest.json"]  # own files removed

    # A writer whose lock was taken over (removed, then created by another) publishes nothing and
    # deletes nothing: the files there are no longer its own.
    w = writer(tmp_path, wid="w1", shard_bytes=500)
    tid, rec, p = make_record(1, 0)
    w.add(tid, rec, prompt_len=p)  # flushed: one shard of w1 on disk
    (sdir / "w1.lock").unlink()
    thief = writer(tmp_path, wid="w1")
    with pytest.raises(StoreError, match="lost its lock"):
        w.close()
    assert not (sdir / "w1.manifest.json").exists()
    assert (sdir / "w1-00000.safetensors").exists() and (sdir / "w1.lock").exists()
    thief.abort()


def test_seal_removes_what_dead_and_unnamed_writers_left(tmp_path):
    expected = small_step(tmp_path)
    sdir = step_dir(tmp_path, 3)
    kept = sorted(p.name for p in sdir.iterdir()) + [COMPLETE_NAME]
    # A writer killed mid-way: a temp file, a published shard no manifest lists, its lock.
    dead = writer(tmp_path, wid="w2", shard_bytes=100)
    tid, rec, p = make_record(2, 0)
    dead.add(tid, rec, prompt_len=p)  # flushed at once: over shard_bytes
    del dead  # never closed: like SIGKILL
    (sdir / ".w2-00001.safetensors.123.abcdef.tmp").write_bytes(b"partial")
    (sdir / "w0-00099.safetensors").write_bytes(b"orphan")  # unreferenced shard of a named writer
    write_writer(str(tmp_path), 3, "late", 9, 2)  # a finished writer the driver did not name
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    (sdir / "junk").mkdir()
    (sdir / "junk" / "link").symlink_to(outside)
    (sdir / "link").symlink_to(outside)
    assert {"w2.lock", "w2-00000.safetensors", "late.manifest.json"} <= {
        p.name for p in sdir.iterdir()
    }
    seal_step(tmp_path, 3, ["w0", "w1"])
    assert sorted(p.name for p in sdir.iterdir()) == sorted(kept)
    assert outside.read_text() == "keep me"
    seal_step(tmp_path, 3, ["w0", "w1"])  # idempotent
    with open_reader(tmp_path) as r:
        r.verify()
        for tid, (rec, _) in expected.items():
            assert_record_equal(r.get(tid), rec)


def test_discard_step_removes_sealed_and_half_written_steps(tmp_path):
    small_step(tmp_path)
    seal_step(tmp_path, 3, ["w0", "w1"])
    with pytest.raises(StoreError, match=r"already sealed.*discard_step"):
        writer(tmp_path)
    assert discard_step(tmp_path, 3) is True
    assert not step_dir(tmp_path, 3).exists()
    assert discard_step(tmp_path, 3) is False  # idempotent
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no tombstone left
    expected = small_step(tmp_path)  # the step can be redone
    seal_step(tmp_path, 3, ["w0", "w1"])
    with open_reader(tmp_path) as r:
        for tid, (rec, _) in expected.items():
            assert_record_equal(r.get(tid), rec)

    # Half-written: a writer died holding its lock; a retry under its name is refused until the
    # step is discarded. The dead writer, should it wake up, cannot publish into the new step.
    dead = writer(tmp_path, step=4, shard_bytes=500)
    tid, rec, p = make_record(0, 0)
    dead.add(tid, rec, prompt_len=p)
    with pytest.raises(StoreError, match="holds the lock"):
        writer(tmp_path, step=4)
    assert discard_step(tmp_path, 4) is True
    write_writer(str(tmp_path), 4, "w0", 0, 4)
    with pytest.raises(StoreError, match="step folder was discarded or replaced"):
        dead.close()
    seal_step(tmp_path, 4, ["w0"])
    assert len(open_reader(tmp_path, 4)) == 4

    # An interrupted discard (renamed, not yet deleted) is finished by the next call.
    small_step(tmp_path, step=5)
    tomb = tmp_path / f".{step_dir(tmp_path, 5).name}.discarded-0123456789abcdef"
    step_dir(tmp_path, 5).rename(tomb)
    assert discard_step(tmp_path, 5) is False and not tomb.exists()


def test_discard_step_never_follows_links(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    small_step(elsewhere)
    before = sorted(p.name for p in step_dir(elsewhere, 3).iterdir())
    root = tmp_path / "root"
    root.mkdir()
    step_dir(root, 3).symlink_to(step_dir(elsewhere, 3), target_is_directory=True)
    assert discard_step(root, 3) is True
    assert not os.path.lexists(step_dir(root, 3))
    assert sorted(p.name for p in step_dir(elsewhere, 3).iterdir()) == before  # target untouched


# --------------------------------------------------------------------------------------------
# Links and malformed files
# --------------------------------------------------------------------------------------------


def test_symlinked_step_folder_or_files_are_refused(sealed):
    root, expected = sealed
    other = root / "other-root"
    other.mkdir()
    step_dir(other, 3).symlink_to(step_dir(root, 3), target_is_directory=True)
    with pytest.raises(StoreError, match="is a symbolic link"):
        open_reader(other)
    with pytest.raises(StoreError, match="is a symbolic link"):
        writer(other, wid="w9")
    with pytest.raises(StoreError, match="is a symbolic link"):
        seal_step(other, 3, ["w0", "w1"])

    sdir = step_dir(root, 3)
    victim = shard_files(root)[0]
    moved = root / "moved.safetensors"
    victim.rename(moved)
    victim.symlink_to(moved)
    r = open_reader(root)
    with pytest.raises(StoreError, match=rf"{re.escape(str(victim))} is a symbolic link"):
        r.get(_traj_in(r, victim))
    with pytest.raises(StoreError, match="is a symbolic link"):
        seal_step(root, 3, ["w0", "w1"])
    victim.unlink()
    moved.rename(victim)

    for name in ("w1.manifest.json", COMPLETE_NAME):
        f = sdir / name
        f.rename(root / name)
        f.symlink_to(root / name)
        with pytest.raises(StoreError, match=rf"{re.escape(str(f))} is a symbolic link"):
            open_reader(root)
        f.unlink()
        (root / name).rename(f)
    assert len(open_reader(root)) == len(expected)


def test_deeply_nested_json_is_a_store_error(tmp_path):
    nested = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(RecursionError):  # what json does with it
        json.loads(nested)
    small_step(tmp_path)
    manifest = step_dir(tmp_path, 3) / "w1.manifest.json"
    good = manifest.read_bytes()
    manifest.write_text(nested)
    msg = rf"{re.escape(str(manifest))}: not valid JSON \(RecursionError"
    with pytest.raises(StoreError, match=msg):
        seal_step(tmp_path, 3, ["w0", "w1"])
    manifest.write_bytes(good)
    seal = seal_step(tmp_path, 3, ["w0", "w1"])
    manifest.write_text(nested)
    with pytest.raises(StoreError, match=msg):
        open_reader(tmp_path)
    manifest.write_bytes(good)
    seal.write_text(nested)
    with pytest.raises(StoreError, match=rf"seal {re.escape(str(seal))}: not valid JSON"):
        open_reader(tmp_path)
    seal.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(StoreError, match="not valid JSON"):
        open_reader(tmp_path)


def test_format_version_1_is_refused_with_a_clear_message(sealed):
    root, _ = sealed
    sdir = step_dir(root, 3)
    assert FORMAT_VERSION == 3
    m = json.loads((sdir / "w0.manifest.json").read_text())
    m["version"] = 1
    msg = r"manifest format version 1, this code reads only versions 2, 3 \(version 1 has no per-traj"
    with pytest.raises(StoreError, match=msg):
        Manifest.from_json(m)
    seal = sdir / COMPLETE_NAME
    c = json.loads(seal.read_text())
    c["version"] = 1
    seal.write_text(json.dumps(c))
    with pytest.raises(StoreError, match=r"seal format version 1, this code reads only versions 2, 3"):
        open_reader(root)


# --------------------------------------------------------------------------------------------
# Verified reads from one open file; rank-local reads
# --------------------------------------------------------------------------------------------


def data_range(shard: Path, key: str) -> tuple[int, int]:
    """Absolute byte range of ``key``'s data in a safetensors file."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8 : 8 + n])[key]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def big_record(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {
        "L02.expert_in.codes": torch.randint(0, 256, (16, 512), generator=g, dtype=torch.uint8),
        "L02.expert_in.scales": _random_bits(g, (16, 32), torch.float8_e4m3fn),
        "L02.k.global_amax": _random_bits(g, (16, 2), torch.float32),
        "L02.routing": torch.randint(0, 8, (16, 2), generator=g, dtype=torch.int64),
    }


def test_rank_local_reads_count_bytes_and_verify_each_trajectory(tmp_path):
    with writer(tmp_path, shard_bytes=1 << 30) as w:
        for i in range(16):
            w.add(f"t{i}", big_record(i), prompt_len=4)
    seal_step(tmp_path, 3, ["w0"])
    (shard,) = shard_files(tmp_path)
    r = open_reader(tmp_path)
    assert r.bytes_read == 0  # opening the step reads no shard
    for i in (0, 1):
        assert_record_equal(r.get(f"t{i}"), big_record(i))
    (sm,) = r.manifests[0].shards.values()
    traj_bytes = r.manifests[0].trajectories["t0"].nbytes
    versions_bytes = 16 * 8  # each trajectory's per-token versions, int64 [T], read and hashed with it
    assert r.bytes_read == sm.header_bytes + 2 * (traj_bytes + versions_bytes)
    assert step_bytes(r) == shard.stat().st_size == sm.nbytes
    assert r.bytes_read < step_bytes(r) / 4
    assert bytes_per_token(r)["total_bytes"] == 16 * traj_bytes
    # Positions and names restrict what is returned, not what is read and checked.
    before = r.bytes_read
    got = r.get("t2", slice(3, 5), ["L02.routing"])
    assert bit_equal(got["L02.routing"], big_record(2)["L02.routing"][3:5])
    assert r.bytes_read - before == traj_bytes + versions_bytes
    r.verify()
    assert r.bytes_read - before == traj_bytes + versions_bytes + sm.nbytes
    r.close()

    # A flipped byte in trajectory 5's data: caught when t5 is read, t0 and t1 still fine.
    begin, end = data_range(shard, "t5/L02.expert_in.codes")
    data = bytearray(shard.read_bytes())
    data[(begin + end) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    r = open_reader(tmp_path)
    for i in (0, 1):
        assert_record_equal(r.get(f"t{i}"), big_record(i))
    with pytest.raises(
        StoreError,
        match=rf"trajectory 't5', shard {re.escape(str(shard))}: sha256 mismatch \(corrupted "
        r"trajectory data\)",
    ):
        r.get("t5")
    with pytest.raises(StoreError, match="sha256 mismatch"):
        r.batch(["t4", "t5"], [16, 16])


def test_a_file_swapped_in_after_opening_is_never_read(tmp_path):
    with writer(tmp_path, shard_bytes=1 << 30) as w:
        for i in range(4):
            w.add(f"t{i}", big_record(i), prompt_len=4)
    seal_step(tmp_path, 3, ["w0"])
    (shard,) = shard_files(tmp_path)
    begin, end = data_range(shard, "t1/L02.expert_in.codes")
    forged = bytearray(shard.read_bytes())
    forged[begin:end] = bytes(end - begin)  # same header, t1's data zeroed: still valid safetensors
    r = open_reader(tmp_path)
    assert_record_equal(r.get("t0"), big_record(0))  # header verified, descriptor held
    tmp = shard.with_name("swap.tmp")
    tmp.write_bytes(bytes(forged))
    os.replace(tmp, shard)  # swapped by path
    assert_record_equal(r.get("t1"), big_record(1))  # read from the verified file
    with pytest.raises(StoreError, match="trajectory 't1'.*sha256 mismatch"):
        open_reader(tmp_path).get("t1")  # a new reader opens the swapped file and refuses it

    # Changed in place (same file, after its header was verified): caught by the trajectory hash.
    r2 = open_reader(tmp_path)
    assert_record_equal(r2.get("t0"), big_record(0))
    with open(shard, "r+b") as f:
        f.seek(begin)
        f.write(b"\x01")
    with pytest.raises(StoreError, match="trajectory 't1'.*sha256 mismatch"):
        r2.get("t1")
