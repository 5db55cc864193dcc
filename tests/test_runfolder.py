"""Run folders: a new run never lands in a used folder; a resume with another configuration is refused."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from tracefp4.rl.runfolder import (
    RunFolderError,
    check_model_folder,
    check_run_folder,
    config_differences,
    create_run_folder,
    lock_run_folder,
    open_for_resume,
)

CONFIG = {"task": "reverse", "lr": 1e-4, "steps": 60, "seed": 0, "threads": 2, "out": "runs", "run_name": "a",
          "resume": None, "arms": ("bf16", "trace"), "model": {"hidden": 64, "layers": 4}, "task_kwargs": {}}


def test_create_writes_config_and_refuses_a_used_folder(tmp_path):
    path = create_run_folder(tmp_path, "a", CONFIG)
    assert path == tmp_path / "a"
    saved = json.loads((path / "config.json").read_text())
    assert saved["arms"] == ["bf16", "trace"] and saved["lr"] == 1e-4
    assert (path / "metrics").is_dir() and (path / "plots").is_dir()
    assert not [p for p in os.listdir(path) if p.startswith(".")]
    with pytest.raises(RunFolderError, match=r"a is not empty: starting a new run in an existing run folder "
                                             r"without --resume is refused"):
        create_run_folder(tmp_path, "a", CONFIG)


def test_create_uses_an_existing_empty_folder_and_refuses_a_file(tmp_path):
    (tmp_path / "empty").mkdir()
    assert create_run_folder(tmp_path, "empty", CONFIG) == tmp_path / "empty"
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunFolderError, match="exists and is not a folder"):
        create_run_folder(tmp_path, "file", CONFIG)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(RunFolderError, match="not empty"):
        create_run_folder(tmp_path, "other", CONFIG)


def test_default_name_is_a_timestamp(tmp_path):
    path = create_run_folder(tmp_path, None, CONFIG)
    assert path.parent == tmp_path and path.name[:2] == "20"


def test_resume_with_a_changed_lr_names_lr_and_both_values(tmp_path):
    path = create_run_folder(tmp_path, "a", CONFIG)
    with pytest.raises(RunFolderError) as e:
        open_for_resume(path, {**CONFIG, "lr": 2e-4, "resume": str(path)})
    msg = str(e.value)
    assert "lr: 0.0001 -> 0.0002" in msg and "\n" not in msg and str(path) in msg
    assert "seed" not in msg


def test_resume_names_every_differing_key_nested_and_absent(tmp_path):
    path = create_run_folder(tmp_path, "a", CONFIG)
    new = {**CONFIG, "seed": 1, "model": {"hidden": 32, "layers": 4}, "guidance": "lsb"}
    with pytest.raises(RunFolderError) as e:
        open_for_resume(path, new)
    msg = str(e.value)
    assert "seed: 0 -> 1" in msg and "model.hidden: 64 -> 32" in msg and 'guidance: (absent) -> "lsb"' in msg


def test_resume_with_only_location_keys_changed_is_fine(tmp_path):
    path = create_run_folder(tmp_path, "a", CONFIG)
    new = {**CONFIG, "out": "elsewhere", "run_name": None, "resume": str(path), "arms": ["trace"]}
    assert open_for_resume(path, new) == path
    assert json.loads((path / "config.json").read_text())["out"] == "elsewhere"
    assert open_for_resume(path, new) == path  # twice is harmless


def test_threads_changes_numbers_so_it_is_refused_unless_allowed(tmp_path):
    path = create_run_folder(tmp_path, "a", CONFIG)
    with pytest.raises(RunFolderError, match="threads: 2 -> 1"):
        open_for_resume(path, {**CONFIG, "threads": 1})
    assert open_for_resume(path, {**CONFIG, "threads": 1}, allow={"threads"}) == path


def test_steps_may_grow_but_not_shrink(tmp_path):
    path = create_run_folder(tmp_path, "a", CONFIG)
    with pytest.raises(RunFolderError, match=r"steps: 60 -> 40 \(steps may only grow\)"):
        open_for_resume(path, {**CONFIG, "steps": 40})
    assert open_for_resume(path, {**CONFIG, "steps": 80}) == path
    assert json.loads((path / "config.json").read_text())["steps"] == 80
    with pytest.raises(RunFolderError, match="steps: 80 -> 60"):
        open_for_resume(path, CONFIG)


def test_resume_of_a_missing_or_configless_folder(tmp_path):
    with pytest.raises(RunFolderError, match=r"run folder .*nope to resume does not exist"):
        open_for_resume(tmp_path / "nope", CONFIG)
    (tmp_path / "bare").mkdir()
    with pytest.raises(RunFolderError, match=r"bare has no config\.json"):
        open_for_resume(tmp_path / "bare", CONFIG)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"lr": ')
    with pytest.raises(RunFolderError, match=r"config\.json: malformed JSON"):
        open_for_resume(tmp_path / "bad", CONFIG)


def test_config_differences_tuples_equal_lists():
    assert config_differences(CONFIG, json.loads(json.dumps(CONFIG))) == []
    assert config_differences({"task_kwargs": {}}, {}) == []


def test_check_run_folder(tmp_path):
    with pytest.raises(RunFolderError, match=r"run folder .*nope not found"):
        check_run_folder(tmp_path / "nope")
    (tmp_path / "x").mkdir()
    with pytest.raises(RunFolderError, match="is not a run folder"):
        check_run_folder(tmp_path / "x")
    path = create_run_folder(tmp_path, "r", CONFIG)
    assert check_run_folder(path) == path


def test_check_model_folder(tmp_path):
    with pytest.raises(RunFolderError, match=r"checkpoint folder .*nope not found \(only local folders"):
        check_model_folder(tmp_path / "nope")
    with pytest.raises(RunFolderError, match=r"checkpoint folder Qwen/Qwen3-30B-A3B not found"):
        check_model_folder("Qwen/Qwen3-30B-A3B")
    (tmp_path / "m").mkdir()
    with pytest.raises(RunFolderError, match=r"m has no config\.json"):
        check_model_folder(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(RunFolderError, match=r"m has no model weights"):
        check_model_folder(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    assert check_model_folder(tmp_path / "m") == tmp_path / "m"


def _try_lock(path, q, job=None):
    try:
        with lock_run_folder(path, job=job):
            q.put("locked")
    except RunFolderError as e:
        q.put(str(e))


def test_lock_refuses_a_second_process_and_is_released(tmp_path):
    path = create_run_folder(tmp_path, "a", CONFIG)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    with lock_run_folder(path):
        p = ctx.Process(target=_try_lock, args=(path, q))
        p.start()
        p.join()
        assert f"in use by another process (pid {os.getpid()})" in q.get()
    p = ctx.Process(target=_try_lock, args=(path, q))
    p.start()
    p.join()
    assert q.get() == "locked"


def test_job_locks_share_the_folder_but_not_a_job(tmp_path):
    """Two processes may run two arms of one folder; not the same arm, and not beside a whole-folder run."""
    path = create_run_folder(tmp_path, "a", CONFIG)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()

    def attempt(job=None):
        p = ctx.Process(target=_try_lock, args=(path, q, job))
        p.start()
        p.join()
        return q.get()

    with lock_run_folder(path, job="qat"):
        assert attempt("trace") == "locked"
        assert f"job 'qat' of run folder {path} is in use by another process (pid {os.getpid()})" in attempt("qat")
        # the pid named is the latest shared holder's (the child that ran "trace" above)
        assert f"run folder {path} is in use by another process (pid " in attempt()
    with lock_run_folder(path):
        assert "in use by another process" in attempt("trace")
    assert attempt("qat") == "locked"


# --- metrics log on resume ------------------------------------------------------------------------

from tracefp4.rl.runlog import MetricsLog, read_metrics  # noqa: E402


def _write_run(run_dir, steps_done, *, eval_every=2):
    """What the loop logs: eval at 0, a train row per step, eval (then a checkpoint) every eval_every."""
    log = MetricsLog(run_dir, "trace", tensorboard=False)
    log.log({"kind": "eval", "step": 0, "eval_accuracy": 0.0})
    for s in range(steps_done):
        log.log({"kind": "train", "step": s, "reward_mean": s / 10})
        if (s + 1) % eval_every == 0:
            log.log({"kind": "eval", "step": s + 1, "eval_accuracy": (s + 1) / 10})
    log.close()


def _steps(rows, kind):
    return [r["step"] for r in rows if r.get("kind", "train") == kind]


def test_resume_keeps_exactly_the_rows_before_the_checkpoint(tmp_path):
    _write_run(tmp_path, 5)  # killed after step 4's row; the last checkpoint is at step 4
    path = tmp_path / "metrics" / "trace.jsonl"
    with open(path, "a") as f:
        f.write('{"kind": "train", "step": 5, "rew')  # and in the middle of step 5's row
    log = MetricsLog(tmp_path, "trace", tensorboard=False, resume_step=4)
    rows = read_metrics(tmp_path)["trace"]
    assert _steps(rows, "train") == [0, 1, 2, 3] and _steps(rows, "eval") == [0, 2, 4]
    for s in range(4, 6):  # the resumed run continues
        log.log({"kind": "train", "step": s, "reward_mean": s / 10})
        if (s + 1) % 2 == 0:
            log.log({"kind": "eval", "step": s + 1, "eval_accuracy": (s + 1) / 10})
    log.close()
    rows = read_metrics(tmp_path)["trace"]
    assert _steps(rows, "train") == list(range(6)) and _steps(rows, "eval") == [0, 2, 4, 6]
    assert not [p for p in os.listdir(tmp_path / "metrics") if p.startswith(".")]


def test_resume_drops_an_eval_logged_just_before_a_checkpoint_that_was_not_saved(tmp_path):
    _write_run(tmp_path, 6)  # eval at 6 logged, killed before checkpoint 6: resumed from 4
    MetricsLog(tmp_path, "trace", tensorboard=False, resume_step=4).close()
    rows = read_metrics(tmp_path)["trace"]
    assert _steps(rows, "train") == [0, 1, 2, 3] and _steps(rows, "eval") == [0, 2, 4]


def test_resume_at_zero_starts_over(tmp_path):
    _write_run(tmp_path, 1)  # killed before the first checkpoint: the arm starts over, step-0 eval again
    MetricsLog(tmp_path, "trace", tensorboard=False, resume_step=0).close()
    assert read_metrics(tmp_path)["trace"] == []


def test_torn_last_line_is_tolerated_by_read_metrics(tmp_path):
    _write_run(tmp_path, 2)
    path = tmp_path / "metrics" / "trace.jsonl"
    with open(path, "a") as f:
        f.write('{"kind": "train", "st')
    rows = read_metrics(tmp_path)["trace"]
    assert _steps(rows, "train") == [0, 1]
    # appending without resume first drops the torn tail, so the next row is not glued to it
    log = MetricsLog(tmp_path, "trace", tensorboard=False)
    log.log({"kind": "train", "step": 2})
    log.close()
    assert _steps(read_metrics(tmp_path)["trace"], "train") == [0, 1, 2]


def test_a_bad_line_in_the_middle_is_an_error(tmp_path):
    _write_run(tmp_path, 2)
    path = tmp_path / "metrics" / "trace.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:10]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"trace\.jsonl:2: unreadable metrics row"):
        read_metrics(tmp_path)


def test_a_create_killed_before_config_json_does_not_block_the_folder(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / ".config.json.123.abcdef.tmp").write_text('{"lr": ')
    path = create_run_folder(tmp_path, "a", CONFIG)
    assert sorted(os.listdir(path)) == ["config.json", "metrics", "plots"]


def test_environment_recorded_and_resume_elsewhere_named(tmp_path):
    """environment.json keeps the environment a run was created in; a resume in another one (another
    CPU capability, thread count or library version) is recorded and named, key by key."""
    from tracefp4.provenance import environment
    from tracefp4.rl.runfolder import ENVIRONMENT_NAME, RunFolderError, record_environment

    env = environment()
    assert record_environment(tmp_path, env) == []
    assert record_environment(tmp_path, env) == []  # the same environment: nothing differs
    other_cap = "DEFAULT" if env["cpu_capability"] == "AVX2" else "AVX2"
    other = {**env, "cpu_capability": other_cap, "torch_threads": env["torch_threads"] + 1,
             "packages": {**env["packages"], "torch": "0.0"}}
    differs = record_environment(tmp_path, other)
    assert f"cpu_capability: {env['cpu_capability']} -> {other_cap}" in differs
    assert f"torch: {env['packages']['torch']} -> 0.0" in differs and len(differs) == 3
    saved = json.loads((tmp_path / ENVIRONMENT_NAME).read_text())
    assert saved["created"] == json.loads(json.dumps(env)) and len(saved["resumes"]) == 2
    (tmp_path / ENVIRONMENT_NAME).write_text("[1]")
    with pytest.raises(RunFolderError, match="not a JSON object"):
        record_environment(tmp_path, env)


def test_a_folder_saved_before_later_keys_resumes_at_their_defaults(tmp_path):
    """A config saved before a key existed resumes when the key is at its default (which reproduces
    the older run) and is refused when it is not; the registry's defaults are RLConfig's own."""
    import dataclasses

    from tracefp4.rl.config import RLConfig
    from tracefp4.rl.runfolder import LATER_KEYS_DEFAULTS, config_differences

    from tracefp4.rl.config import ModelSpec

    defaults = {f.name: f.default for f in dataclasses.fields(RLConfig)}
    defaults.update({f"model.{f.name}": f.default for f in dataclasses.fields(ModelSpec)})
    assert {k: defaults[k] for k in LATER_KEYS_DEFAULTS} == LATER_KEYS_DEFAULTS
    new = dataclasses.asdict(RLConfig())
    old = {k: v for k, v in new.items() if k not in LATER_KEYS_DEFAULTS}
    old["model"] = {k: v for k, v in new["model"].items() if f"model.{k}" not in LATER_KEYS_DEFAULTS}
    assert config_differences(old, new) == []
    assert config_differences(old, {**new, "sc_top_k": 16}) == ["sc_top_k: 128 -> 16"]
