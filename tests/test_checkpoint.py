"""Arm checkpoints: bit-exact round trip, damage is named, kills leave nothing visible, keep-last-2."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from tracefp4.engines.model import from_config, load_model, tiny_config
from tracefp4.rl.checkpoint import (
    CHECKSUMS_NAME,
    OPTIMIZER_NAME,
    CheckpointError,
    CheckpointWarning,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(layers=2, experts=4, top_k=2, hidden=32, moe_intermediate=32, heads=2, kv_heads=1,
                      head_dim=16, vocab=32, max_positions=64)
    return from_config(cfg, seed=0)


def opt_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "master/w": torch.randn(4, 8, generator=g),
        "exp_avg/w": torch.randn(4, 8, generator=g),
        "exp_avg_sq/w": torch.rand(4, 8, generator=g),
        "step/w": torch.tensor([3.0]),
        "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
    }


def save(arm_dir, step, model, seed=0):
    return save_checkpoint(arm_dir, step, model=model, optimizer_tensors=opt_tensors(seed),
                           state={"arm": "trace", "step": step, "policy_version": step, "loss": 0.1 + 1e-17 * step})


def test_round_trip_is_bit_exact(tmp_path, model):
    path = save(tmp_path, 7, model)
    assert path == tmp_path / "step-00000007"
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", OPTIMIZER_NAME, "trainer_state.json", CHECKSUMS_NAME} <= files
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp folder left
    ck = load_checkpoint(path)
    assert ck.step == 7
    assert ck.state == {"arm": "trace", "step": 7, "policy_version": 7, "loss": 0.1 + 1e-17 * 7}
    want = opt_tensors()
    assert set(ck.optimizer_tensors) == set(want)
    for k, v in want.items():
        got = ck.optimizer_tensors[k]
        assert got.dtype == v.dtype and torch.equal(got.view(torch.uint8), v.view(torch.uint8)), k
    loaded = load_model(ck.model_path)
    ref, new = model.state_dict(), loaded.state_dict()
    assert set(ref) == set(new)
    for k in ref:
        assert ref[k].dtype == new[k].dtype and torch.equal(ref[k], new[k]), k


def test_flipped_byte_in_optimizer_is_named(tmp_path, model):
    path = save(tmp_path, 1, model)
    f = path / OPTIMIZER_NAME
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: sha256 mismatch"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors"):
        verify_checkpoint(path)


def test_truncated_model_file_is_named(tmp_path, model):
    path = save(tmp_path, 1, model)
    f = path / "model.safetensors"
    size = f.stat().st_size
    os.truncate(f, size // 2)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated \(\d+ bytes, expected \d+\)") as e:
        load_checkpoint(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("damage", ["missing", "bad_json", "extra", "checksums_json", "symlink"])
def test_other_damage_is_an_error(tmp_path, model, damage):
    path = save(tmp_path, 1, model)
    if damage == "missing":
        (path / "config.json").unlink()
        match = r"config\.json: missing"
    elif damage == "bad_json":
        # same size, still fails: the hash catches it before the JSON parser would
        f = path / "trainer_state.json"
        f.write_bytes(b"{" + f.read_bytes()[1:-2] + b"x\n")
        match = r"trainer_state\.json: sha256 mismatch"
    elif damage == "extra":
        (path / "model.safetensors.index.json").write_text("{}")
        match = r"model\.safetensors\.index\.json: not listed"
    elif damage == "checksums_json":
        (path / CHECKSUMS_NAME).write_text("{not json")
        match = r"CHECKSUMS\.json: malformed JSON"
    else:
        target = tmp_path / "elsewhere.json"
        target.write_bytes((path / "config.json").read_bytes())
        (path / "config.json").unlink()
        (path / "config.json").symlink_to(target)
        match = r"config\.json: not a regular file"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)


def test_killed_save_leaves_a_temp_folder_that_is_ignored_and_cleaned(tmp_path, model):
    save(tmp_path, 1, model)
    # what a SIGKILL in the middle of save_checkpoint(…, 2, …) leaves behind
    stale = tmp_path / ".tmp-step-00000002-99999-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert latest_checkpoint(tmp_path).step == 1
    save(tmp_path, 2, model)
    assert not stale.exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2]
    assert latest_checkpoint(tmp_path).step == 2


def test_failed_save_removes_its_temp_folder(tmp_path, model):
    with pytest.raises(TypeError):  # a state JSON cannot round-trip is refused, not stringified
        save_checkpoint(tmp_path, 3, model=model, optimizer_tensors=opt_tensors(), state={"x": object()})
    assert os.listdir(tmp_path) == []


def test_fallback_to_the_previous_good_checkpoint(tmp_path, model):
    save(tmp_path, 10, model, seed=1)
    newest = save(tmp_path, 20, model, seed=2)
    os.truncate(newest / OPTIMIZER_NAME, 10)
    with pytest.warns(CheckpointWarning, match=r"step-00000020/optimizer\.safetensors: truncated"):
        ck = latest_checkpoint(tmp_path)
    assert ck.step == 10 and len(ck.skipped) == 1
    assert torch.equal(ck.optimizer_tensors["master/w"], opt_tensors(1)["master/w"])
    with pytest.raises(CheckpointError, match=r"step-00000020/optimizer\.safetensors: truncated"):
        latest_checkpoint(tmp_path, fallback=False)
    # resumed from 10, the run saves 20 again: the damaged one of the abandoned history is replaced
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save(tmp_path, 20, model, seed=3)
        ck = latest_checkpoint(tmp_path)
    assert ck.step == 20 and torch.equal(ck.optimizer_tensors["master/w"], opt_tensors(3)["master/w"])


def test_nothing_verifies_is_an_error_and_empty_is_none(tmp_path, model):
    assert latest_checkpoint(tmp_path / "nope") is None
    assert latest_checkpoint(tmp_path) is None
    path = save(tmp_path, 5, model)
    (path / "config.json").unlink()
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="no checkpoint in"):
        latest_checkpoint(tmp_path)


def test_keeps_the_last_two(tmp_path, model):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, model)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_a_damaged_checkpoint_does_not_count_towards_keep(tmp_path, model):
    save(tmp_path, 1, model)
    p2 = save(tmp_path, 2, model)
    os.truncate(p2 / "model.safetensors", 100)
    save(tmp_path, 3, model)
    # 2 is damaged, so 1 is still one of the last two good ones
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2, 3]
    save(tmp_path, 4, model)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]


def test_step_mismatch_with_folder_name(tmp_path, model):
    path = save(tmp_path, 4, model)
    moved = tmp_path / "step-00000005"
    os.rename(path, moved)
    with pytest.raises(CheckpointError, match="step 4 does not match the folder name"):
        load_checkpoint(moved)


def test_checksums_written_last_and_complete(tmp_path, model):
    path = save(tmp_path, 1, model)
    table = json.loads((path / CHECKSUMS_NAME).read_text())
    listed = set(table["files"])
    assert listed == set(os.listdir(path)) - {CHECKSUMS_NAME}


def test_extra_files_round_trip_and_damage_is_named(tmp_path, model):
    extra = {"pending/step-00000004.safetensors": b"\x00\x01batch", "store/step-00000004/COMPLETE.json": b"{}"}
    path = save_checkpoint(tmp_path, 4, model=model, optimizer_tensors=opt_tensors(), state={"k": 1}, extra=extra)
    assert load_checkpoint(path).extra == extra
    assert latest_checkpoint(tmp_path).extra == extra  # the fallback search returns them too
    assert "extra/store/step-00000004/COMPLETE.json" in json.loads((path / CHECKSUMS_NAME).read_text())["files"]
    (path / "extra" / "pending" / "step-00000004.safetensors").write_bytes(b"\x00\x01batcH")
    with pytest.raises(CheckpointError, match=r"extra/pending/step-00000004.safetensors: sha256 mismatch"):
        load_checkpoint(path)
    (path / "extra" / "stray").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"extra/stray: not listed"):
        load_checkpoint(path)
    for bad in ("../x", "/abs", "a//b", "a/./b", ""):
        with pytest.raises(ValueError, match="extra file name"):
            save_checkpoint(tmp_path / "bad", 1, model=model, optimizer_tensors={}, state={}, extra={bad: b""})
    assert not (tmp_path / "bad").exists() or not list_checkpoints(tmp_path / "bad")
