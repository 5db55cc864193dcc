"""The guidance store's format 3: per-token policy versions, the quantizer contract, the reader's lag
window, format-2 steps read as version-uniform, and shards equal byte for byte across processes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tracefp4.guidance.store import FORMAT_VERSION, StoreError, StoreReader, StoreWriter, seal_step, step_dir
from tracefp4.guidance.store.writer import sorted_metadata

torch.set_num_threads(1)

SIG = "sig"
CONTRACT = "tracefp4.contract/1 weights=nvfp4 activations=nvfp4 kv_cache=nvfp4 guidance=lsb"
#: A step written by the format-2 writer (tracefp4 at commit 5211ce8), as :func:`v2_records` builds it:
#: writer w0, step 4, policy version 7, model signature "sig-v2".
V2_STEP = Path(__file__).parent / "data" / "store-v2"


def record(seed: int, length: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"L01.k.codes": torch.randint(0, 256, (length, 2, 4), generator=g, dtype=torch.uint8),
            "L01.routing": torch.randint(0, 8, (length, 2), generator=g, dtype=torch.uint8)}


def write_step(root: Path, rows: dict[str, torch.Tensor | None], *, step: int = 0, policy_version: int = 5,
               writer: str = "w0", contract: str = CONTRACT) -> None:
    """One writer's trajectories ``{traj id: per-token versions (None: the writer's policy_version)}``."""
    with StoreWriter(root, step, writer, model_signature=SIG, policy_version=policy_version, contract=contract) as w:
        for i, (tid, versions) in enumerate(rows.items()):
            n = 6 if versions is None else versions.numel()
            w.add(tid, record(i, n), prompt_len=2, versions=versions)


def reader(root: Path, step: int = 0, **kw) -> StoreReader:
    kw.setdefault("model_signature", SIG)
    return StoreReader(root, step, **kw)


def test_rows_keep_their_versions_and_the_manifest_the_newest(tmp_path):
    mixed = torch.tensor([3, 3, 3, 4, 4, 5])  # a prompt written under 3, an update, another mid-decode
    write_step(tmp_path, {"a": mixed, "b": torch.tensor([4, 4, 4, 4]), "c": None}, policy_version=4)
    seal_step(tmp_path, 0, ["w0"])
    manifest = json.loads((step_dir(tmp_path, 0) / "w0.manifest.json").read_text())
    assert manifest["version"] == FORMAT_VERSION == 3
    assert manifest["policy_version"] == 5  # the newest row, above the writer's default of 4
    assert manifest["contract"] == CONTRACT
    assert {t: v["versions"] for t, v in manifest["trajectories"].items()} == {"a": [3, 5], "b": [4, 4], "c": [4, 4]}
    seal = json.loads((step_dir(tmp_path, 0) / "COMPLETE.json").read_text())
    assert (seal["policy_version"], seal["oldest_policy_version"], seal["contract"]) == (5, 3, CONTRACT)
    with reader(tmp_path, policy_version=5, max_lag=2, contract=CONTRACT) as r:
        assert torch.equal(r.versions("a"), mixed) and r.versions("a").dtype == torch.int64
        assert torch.equal(r.versions("b"), torch.full((4,), 4))
        assert torch.equal(r.versions("c"), torch.full((6,), 4))
        assert r.version_range("a") == (3, 5)
        got = r.get("a")
        assert sorted(got) == ["L01.k.codes", "L01.routing"]  # the versions are not a record tensor
        assert all(torch.equal(got[k], record(0, 6)[k]) for k in got)


def test_the_lag_window_refuses_rows_newer_than_the_trainer_or_older_than_max_lag(tmp_path):
    write_step(tmp_path, {"old": torch.tensor([2, 2, 3]), "new": torch.tensor([5, 5, 5, 5])}, policy_version=5)
    seal_step(tmp_path, 0, ["w0"])
    with reader(tmp_path, policy_version=5, max_lag=3) as r:  # 2..5: everything
        assert len(r.batch(["old", "new"], [3, 4])) == 2
    with reader(tmp_path, policy_version=5) as r:  # the default: version 5 only
        assert torch.equal(r.versions("new"), torch.full((4,), 5))
        before = r.bytes_read
        msg = (r"step 0, writer 'w0', trajectory 'old': rows of policy version 2 \(lag 3\); the reader at policy "
               r"version 5 accepts version 5 only \(max_lag=0\)")
        with pytest.raises(StoreError, match=msg):
            r.get("old")
        with pytest.raises(StoreError, match=msg):  # checked before anything of the batch is read
            r.batch(["new", "old"], [4, 3])
        with pytest.raises(StoreError, match=msg):
            r.versions("old")
        assert r.bytes_read == before
    with reader(tmp_path, policy_version=6, max_lag=3) as r:  # 3..6: "old" begins at 2
        with pytest.raises(StoreError, match=r"trajectory 'old': rows of policy version 2 \(lag 4\); .* "
                                             r"accepts versions 3..6 \(max_lag=3\)"):
            r.get("old")
    with pytest.raises(StoreError, match=r"rows of version 5, newer than the reader's 4"):
        reader(tmp_path, policy_version=4, max_lag=8)
    with pytest.raises(StoreError, match=r"newest rows of the store are of version 5, older than the window: .* "
                                         r"accepts versions 7..8 \(max_lag=1\)"):
        reader(tmp_path, policy_version=8, max_lag=1)
    for bad in (-1, True, 1.0):
        with pytest.raises(StoreError, match="max_lag must be a non-negative int"):
            reader(tmp_path, policy_version=5, max_lag=bad)


def test_a_record_of_another_quantizer_contract_is_refused_naming_both(tmp_path):
    write_step(tmp_path, {"a": None})
    seal_step(tmp_path, 0, ["w0"])
    mine = CONTRACT.replace("guidance=lsb", "guidance=full")
    with pytest.raises(StoreError, match=r"quantizer contract mismatch: the records were computed under "
                                         r"'.*guidance=lsb', the reader expects '.*guidance=full'"):
        reader(tmp_path, policy_version=5, contract=mine)
    with reader(tmp_path, policy_version=5) as r:  # contract=None: unchecked
        assert r.get("a")


def test_writer_refuses_versions_that_are_not_one_int_per_row(tmp_path):
    with StoreWriter(tmp_path, 0, "w0", model_signature=SIG, policy_version=1, contract=CONTRACT) as w:
        for bad, msg in ((torch.tensor([1.0, 1.0, 1.0]), r"versions must be an integer tensor \[T=3\], got torch.float32"),
                         (torch.tensor([1, 1]), r"versions must be an integer tensor \[T=3\], got torch.int64 \[2\]"),
                         ([1, 1, 1], r"versions must be an integer tensor \[T=3\], got list"),
                         (torch.tensor([1, -1, 1]), r"row 1 has policy version -1; versions must be >= 0")):
            with pytest.raises(StoreError, match=rf"trajectory 'a': {msg}"):
                w.add("a", record(0, 3), prompt_len=1, versions=bad)
        w.add("a", record(0, 3), prompt_len=1, versions=torch.tensor([0, 1, 1], dtype=torch.int32))
    for bad in ("", "two\nlines", None):
        with pytest.raises(StoreError, match="contract must be a non-empty single-line str"):
            StoreWriter(tmp_path, 1, "w0", model_signature=SIG, policy_version=1, contract=bad)


def test_manifest_whose_versions_disagree_with_its_rows_is_refused(tmp_path):
    write_step(tmp_path, {"a": torch.tensor([4, 5, 5])})
    seal_step(tmp_path, 0, ["w0"])
    # a manifest edited to claim another range, its seal hash redone: the rows read back contradict it
    sdir = step_dir(tmp_path, 0)
    m = json.loads((sdir / "w0.manifest.json").read_text())
    m["trajectories"]["a"]["versions"] = [5, 5]
    data = (json.dumps(m, indent=1) + "\n").encode()
    (sdir / "w0.manifest.json").write_bytes(data)
    seal = json.loads((sdir / "COMPLETE.json").read_text())
    seal["writers"]["w0"]["manifest_sha256"] = hashlib.sha256(data).hexdigest()
    seal["oldest_policy_version"] = 5
    (sdir / "COMPLETE.json").write_text(json.dumps(seal))
    with reader(tmp_path, policy_version=5) as r, pytest.raises(
            StoreError, match=r"trajectory 'a', shard .*: per-token versions span 4..5, the manifest says 5..5"):
        r.get("a")
    m["policy_version"] = 4
    with pytest.raises(StoreError, match=r"policy_version 4 is not the newest version of its rows \(5\)"):
        from tracefp4.guidance.store import Manifest

        Manifest.from_json(m)


# --- format 2 -------------------------------------------------------------------------------------


def v2_records() -> dict[str, dict[str, torch.Tensor]]:
    """What :data:`V2_STEP` holds (the format-2 writer was given exactly these)."""
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": {"L01.k.codes": torch.randint(0, 256, (n, 2, 4), generator=g, dtype=torch.uint8),
                      "L01.routing": torch.randint(0, 8, (n, 2), generator=g, dtype=torch.uint8)}
            for i, n in enumerate((5, 3))}


def test_a_format_2_step_reads_as_version_uniform_and_has_no_contract_to_check(tmp_path):
    shutil.copytree(V2_STEP, tmp_path, dirs_exist_ok=True)
    want = v2_records()
    with StoreReader(tmp_path, 4, model_signature="sig-v2", policy_version=7) as r:
        assert r.format_version == 2
        for tid, rec in want.items():
            got = r.get(tid)
            assert all(torch.equal(got[k], rec[k]) for k in rec)
            # format 2 wrote one version per step and every writer had to agree on it: each row is at it
            assert torch.equal(r.versions(tid), torch.full((rec["L01.routing"].shape[0],), 7))
            assert r.version_range(tid) == (7, 7)
    with StoreReader(tmp_path, 4, model_signature="sig-v2", policy_version=9, max_lag=2) as r:
        assert torch.equal(r.versions("t1"), torch.full((3,), 7))
    with pytest.raises(StoreError, match=r"store format 2 recorded no quantizer contract, the reader expects "
                                         r"'tracefp4.contract/1 .*'; read it with contract=None"):
        StoreReader(tmp_path, 4, model_signature="sig-v2", policy_version=7, contract=CONTRACT)
    with pytest.raises(StoreError, match=r"rows of version 7, newer than the reader's 6"):
        StoreReader(tmp_path, 4, model_signature="sig-v2", policy_version=6, max_lag=3)


def test_a_format_2_step_is_not_sealed_again_by_this_code(tmp_path):
    shutil.copytree(V2_STEP, tmp_path, dirs_exist_ok=True)
    (step_dir(tmp_path, 4) / "COMPLETE.json").unlink()
    with pytest.raises(StoreError, match=r"manifests are of store format 2; this code seals format 3 only"):
        seal_step(tmp_path, 4, ["w0"])


# --- byte-identical shards -------------------------------------------------------------------------


def test_sorted_metadata_puts_the_metadata_in_key_order_and_changes_nothing_else():
    data = safetensors.torch.save({"t/L01.routing": torch.arange(6, dtype=torch.uint8).reshape(3, 2)},
                                  metadata={"writer_id": "w0", "format": "f", "step": "3"})
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    # however safetensors ordered it, the result holds the entries sorted, in safetensors' compact form
    out = sorted_metadata(data, "here")
    m = int.from_bytes(out[:8], "little")
    assert m == n and out[8 + n :] == data[8 + n :] and len(out) == len(data)
    assert out[8 : 8 + n].rstrip(b" ") == json.dumps(
        {"__metadata__": {"format": "f", "step": "3", "writer_id": "w0"},
         "t/L01.routing": header["t/L01.routing"]}, separators=(",", ":")).encode()
    assert safetensors.torch.load(out)["t/L01.routing"].tolist() == [[0, 1], [2, 3], [4, 5]]


_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_store_versions import write_same_step
write_same_step(sys.argv[1])
"""


def write_same_step(root: str) -> None:
    write_step(Path(root), {"a": torch.tensor([0, 1, 1, 1, 2, 2]), "b": None, "c": torch.tensor([2, 2, 2])},
               policy_version=2)


@pytest.mark.subprocess
@pytest.mark.slow
def test_processes_writing_the_same_records_write_the_same_bytes(tmp_path):
    # safetensors writes its metadata from a Rust hash map seeded per process: without the canonical
    # order, this process and two children would agree on the metadata's order with probability 1/36
    roots = [tmp_path / f"p{i}" for i in range(3)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(r), str(Path(__file__).parent)], env=env,
                              stderr=subprocess.PIPE, text=True) for r in roots[1:]]
    write_same_step(str(roots[0]))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    digests = []
    for r in roots:
        files = sorted(step_dir(r, 0).glob("w0*"))  # shards and the manifest (the lock is gone)
        assert [f.name for f in files] == ["w0-00000.safetensors", "w0.manifest.json"]
        digests.append({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files})
    assert digests[0] == digests[1] == digests[2]
