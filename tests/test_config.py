"""Run configs: TOML, YAML and JSON files, every value checked with an error naming the field, the value
and what is expected, and a task that brings its own tokenizer."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
from rl_tiny import TINY

from tracefp4.rl.config import ModelSpec, RLConfig
from tracefp4.rl.loop import run
from tracefp4.rl.tasks import TASKS, CharTokenizer, Example


def test_config_files(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('task = "addition"\narms = ["bf16", "trace"]\nsteps = 5\n[model]\nhidden = 32\n')
    cfg = RLConfig.from_file(str(p))
    assert cfg.task == "addition" and cfg.arms == ("bf16", "trace") and cfg.model.hidden == 32
    p.write_text('stepz = 5\n')
    with pytest.raises(ValueError, match=r"c.toml: unknown config keys \['stepz'\]"):
        RLConfig.from_file(str(p))
    p.write_text('arms = ["fp3"]\n')
    with pytest.raises(ValueError, match="unknown arm 'fp3'"):
        RLConfig.from_file(str(p))
    p.write_text('steps = "ten"\n')
    with pytest.raises(ValueError, match=r"c.toml: steps = 'ten': expected an integer"):
        RLConfig.from_file(str(p))
    p.write_text('guidance = "ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all"\n')
    assert RLConfig.from_file(str(p)).guidance == "ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all"
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"model": {"hidden": 32, "depth": 3}}))
    with pytest.raises(ValueError, match=r"unknown model keys \['depth'\]"):
        RLConfig.from_file(str(j))



def test_yaml_config(tmp_path):
    pytest.importorskip("yaml", reason="PyYAML not installed")
    p = tmp_path / "c.yaml"
    p.write_text("task: reverse\narms: [qat]\nmodel: {hidden: 32}\n")
    cfg = RLConfig.from_file(str(p))
    assert cfg.arms == ("qat",) and cfg.model.hidden == 32



@pytest.mark.parametrize("field, value, expected", [
    ("steps", "ten", "expected an integer"),
    ("steps", -1, "expected a value >= 0"),
    ("steps", True, "expected an integer"),
    ("lr", "fast", "expected a number"),
    ("lr", 0, "expected a value > 0"),
    ("eval_every", 0, "expected a value >= 1"),
    ("threads", 0, "expected a value >= 1"),
    ("prompts_per_step", 0, "expected a value >= 1"),
    ("group_size", 1, "expected a value >= 2"),
    ("top_p", 1.5, "expected a value <= 1"),
    ("arms", "bf16", "expected a list of strings"),
    ("arms", (), "expected at least one of"),
    ("arms", ("bf16", "bf16"), "each arm at most once"),
    ("task", "sorting", "expected a registered task"),
    ("task_kwargs", {"digitz": 2}, "expected keyword arguments of task 'reverse'"),
    ("guidance", "lsbx", "expected a guidance mode"),
    ("guidance", "lsb@some", "expected a guidance mode"),
    ("loss_agg", "mean", "expected one of"),
    ("normalize_std", 1, "expected true or false"),
    ("run_name", 5, "expected a string or null"),
    ("updates_per_step", 3, "expected a divisor of prompts_per_step"),
    ("model.hidden", 40, "expected a multiple of 16"),
    ("model.head_dim", 8, "expected a value >= 16"),
    ("model.moe_intermediate", 24, "expected a multiple of 16"),
    ("model.top_k", 9, "expected at most model.experts"),
    ("model.kv_heads", 3, "expected a divisor of model.heads"),
])
def test_config_validation_names_field_value_and_expectation(field, value, expected):
    cfg = RLConfig()
    if field.startswith("model."):
        cfg.model = dataclasses.replace(cfg.model, **{field[len("model."):]: value})
    else:
        setattr(cfg, field, value)
    with pytest.raises(ValueError) as e:
        cfg.validate()
    msg = str(e.value)
    assert msg.startswith(f"{field} = {value!r}: ") and expected in msg and "\n" not in msg, msg
    with pytest.raises(ValueError, match="expected"):  # run() checks before any work: no run folder
        run(dataclasses.replace(cfg, out="/nonexistent/never-created"))
    assert not Path("/nonexistent/never-created").exists()



def test_config_accepts_ints_for_floats_and_every_documented_field():
    cfg = RLConfig.from_dict({"lr": 1, "arms": ["trace"], "guidance": "lsb+parity+amax:lo3"})
    assert cfg.lr == 1 and cfg.arms == ("trace",)
    for f in [*dataclasses.fields(RLConfig), *dataclasses.fields(ModelSpec)]:
        assert f.metadata.get("help"), f.name



class CopyTask:
    """A task over letters that the default character tokenizer does not know."""

    name = "copy"

    def make_tokenizer(self):
        return CharTokenizer("abc=")

    def sample(self, rng, n):
        return [Example(s + "=", s) for s in ("".join(rng.choice("abc") for _ in range(3)) for _ in range(n))]

    def reward(self, example, completion):
        return float(completion == example.answer)

    def eval_set(self, n=128):
        return self.sample(random.Random(1), n)



def test_a_task_brings_its_own_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setitem(TASKS, "copy", CopyTask)
    cfg = RLConfig(out=str(tmp_path), run_name="copy", task="copy", arms=("trace",),
                   **{**TINY, "steps": 1, "eval_every": 1})
    run_dir = run(cfg)
    rows = [json.loads(x) for x in (run_dir / "metrics" / "trace.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["eval", "train", "eval"]

