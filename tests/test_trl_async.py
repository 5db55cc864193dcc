"""TRACE inside TRL's asynchronous GRPO trainer (tracefp4.integrations.trl_async): the sample book,
the lag bound at the loss, records read at each sample's own policy version, the decoupled loss, the
sample keys through TRL's collator, the rollout server's weight sync and versions, refused options,
and a short run of the trainer itself on CPU."""

from __future__ import annotations

import os
import time

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (make setup installs trl==1.16.0)")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402
from trl_tiny import TOK, moe_config, prompts, reward, run_args, save_model  # noqa: E402

from tracefp4.engines.model import load_model  # noqa: E402
from tracefp4.guidance.store import StoreError, step_dir  # noqa: E402
from tracefp4.integrations import trl_async  # noqa: E402
from tracefp4.integrations.trl_async import (  # noqa: E402
    KeyedCollator,
    RolloutServer,
    SampleBook,
    TraceAsyncGRPOConfig,
    TraceAsyncGRPOTrainer,
    Trajectory,
    decoupled_loss,
    keyed_ids,
    queue_depth,
    records_by_version,
    split_by_lag,
    unsupported_async,
)
from tracefp4.pipeline.arms import integration_arm  # noqa: E402
from tracefp4.pipeline.metrics import Name, trl_name  # noqa: E402
from tracefp4.pipeline.steps import model_signature  # noqa: E402
from tracefp4.rl.tasks import hf_tokenizer  # noqa: E402

torch.set_num_threads(1)

LAYERS = 2


def length_reward(completions, **_):
    """A reward that differs within a group from the first step (the task's is 0 for an untrained model)."""
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_model(moe_config(LAYERS), tmp_path_factory.mktemp("trl-async-model"))


@pytest.fixture(scope="module")
def dataset():
    return prompts(32)


def config(tmp_path, **over) -> TraceAsyncGRPOConfig:
    return TraceAsyncGRPOConfig(**run_args(tmp_path, **{"max_steps": 3, "max_staleness": 1, "queue_maxsize": 8, **over}))


def traj(step: int, version: int, b: int = 0, n: int = 3) -> Trajectory:
    return Trajectory(f"t{step}-{b}", step, version, torch.arange(n + 2), 2, torch.zeros(n), 0.0, {})


# --- the book and the lag bound -----------------------------------------------------------------------------


def test_the_book_hands_each_sample_out_once_and_reports_finished_steps() -> None:
    book = SampleBook()
    k0 = book.add([traj(0, 1, 0), traj(0, 1, 1)])
    k1 = book.add([traj(1, 2, 0), traj(1, 2, 1)])
    assert k0 == [0, 1] and k1 == [2, 3] and book.open_steps() == [0, 1]
    got, done = book.take([1])
    assert [t.traj_id for t in got] == ["t0-1"] and done == []
    with pytest.raises(RuntimeError, match=r"sample keys \[1\] are not awaiting training"):
        book.take([1])
    got, done = book.take([0, 2])
    assert [t.traj_id for t in got] == ["t0-0", "t1-0"] and done == [0]  # step 0: both samples taken
    assert book.expire(2) == [] and book.expire(3) == [1]  # step 1's last sample (version 2) expires below 3
    with pytest.raises(RuntimeError, match="not awaiting training"):
        book.take([3])
    with pytest.raises(ValueError, match="one store step of one version"):
        book.add([traj(2, 3), traj(2, 4, 1)])
    book.add([traj(5, 6)])
    with pytest.raises(ValueError, match="step 5 is registered already"):
        book.add([traj(5, 6, 1)])


def test_the_lag_bound_is_applied_where_the_sample_is_trained() -> None:
    samples = [traj(0, 4), traj(1, 6), traj(2, 7), traj(3, 5)]
    fresh, stale = split_by_lag(samples, version_now=7, max_staleness=2)
    assert [t.version for t in fresh] == [6, 7, 5] and [t.version for t in stale] == [4]
    fresh, stale = split_by_lag(samples, version_now=7, max_staleness=0)
    assert [t.version for t in fresh] == [7]
    with pytest.raises(RuntimeError, match="of policy version 7, ahead of the trainer's 6"):
        split_by_lag(samples, version_now=6, max_staleness=3)


def test_the_rollout_queue_is_as_deep_as_the_lag_bound_allows(tmp_path) -> None:
    """(max_staleness - 2) optimizer steps of samples (a sample's own generation overlaps one step, the
    batch accelerate fetches ahead another), at least one group, at most queue_maxsize."""
    assert queue_depth(config(tmp_path, max_staleness=4, gradient_accumulation_steps=2, queue_maxsize=1024)) == 2 * 8
    assert queue_depth(config(tmp_path, max_staleness=1)) == 4  # one group of num_generations
    assert queue_depth(config(tmp_path, max_staleness=6, queue_maxsize=10)) == 10


# --- the decoupled loss ----------------------------------------------------------------------------------------


def test_the_decoupled_loss_weights_by_proximal_over_behaviour_and_clips_nothing_else() -> None:
    """One optimizer step per sample: the proximal policy is the forward's own weights, so the gradient
    of each token's log-prob is -w * A / N with w = min(pi_prox / pi_behav, cap) (readable reference,
    exact: N = 4 tokens, a power of two), whatever the clip range; TRL's clip of pi / pi_behav plays
    no part."""
    lp = [torch.tensor([-0.5, -1.0, -2.0], requires_grad=True), torch.tensor([-0.25], requires_grad=True)]
    behaviour = [torch.tensor([-0.5, -11.0, -1.75]), torch.tensor([-3.0])]  # w = 1, cap, exp(-0.25), cap
    adv = [0.75, -1.5]
    cap = 2.0
    for clip in (0.2, 1e-4):
        for t in lp:
            t.grad = None
        loss, stats = decoupled_loss(lp, behaviour, adv, clip_low=clip, clip_high=clip, is_mode="token-truncate",
                                     is_cap=cap)
        loss.backward()
        for t, b, a in zip(lp, behaviour, adv):
            w = torch.exp(t.detach() - b).clamp(max=cap)
            torch.testing.assert_close(t.grad, -w * a / 4, rtol=0, atol=0)
        assert stats["clip_frac"] == 0.0 and stats["is_truncated_frac"] == 0.5
    # the weight is the rollout's: another behaviour policy, another gradient (staleness is not hidden)
    for t in lp:
        t.grad = None
    decoupled_loss(lp, [t.detach() for t in lp], adv, clip_low=0.2, clip_high=0.2, is_mode="token-truncate",
                   is_cap=cap)[0].backward()
    torch.testing.assert_close(lp[0].grad, torch.full((3,), -0.75 / 4), rtol=0, atol=0)
    with pytest.raises(ValueError, match="sample 1 has"):
        decoupled_loss(lp, [behaviour[0], torch.zeros(2)], adv, clip_low=0.2, clip_high=0.2, is_mode="off", is_cap=2)


# --- the sample keys through TRL's collator -------------------------------------------------------------------


def test_the_sample_keys_follow_trls_row_order() -> None:
    """TRL's own collator packs a prefix tree; the keys it gets beside are in the row's sample order,
    which is its segment_id: every loss term of segment i predicts sample i's completion."""
    samples = []
    for key, completion in ((7, [9, 4]), (3, [9, 5, 6]), (11, [8])):
        ids = torch.tensor([1, 2, 3] + completion)
        samples.append({"input_ids": keyed_ids(ids, key), "completion_mask": torch.tensor([0, 0, 0] + [1] * len(completion)),
                        "old_log_probs": torch.zeros(ids.numel()), "advantage": 1.0, "group_id": 0, "metrics": {}})
    row = TreeRow()
    for s in samples:
        row.add(s)
    batch = KeyedCollator(DataCollatorForRollout(pad_token_id=0))([[row]])
    assert batch["trace_traj"].tolist() == [[7, 3, 11]]
    labels = batch["shift_labels"][0][batch["token_index"][0]]
    for i, s in enumerate(samples):
        got = labels[batch["segment_id"][0] == i].tolist()
        assert got == s["input_ids"].tolist()[3:]


# --- the rollout server: versions, weights, records -----------------------------------------------------------


def _drain(server: RolloutServer, n: int, timeout: float = 120.0) -> list:
    out, end = [], time.time() + timeout
    while len(out) < n:
        assert time.time() < end, "the rollout thread produced too little"
        server.check_health(timeout)
        try:
            out.append(server.rollout_buffer.get(timeout=1.0))
        except Exception:  # noqa: BLE001 - queue.Empty: poll again
            continue
    return out


def _sync(server: RolloutServer, policy: torch.nn.Module) -> None:
    server.pause()
    try:
        server.send_weights((n, p.detach()) for n, p in policy.named_parameters())
    finally:
        server.resume()


def test_the_rollout_server_tags_each_group_with_the_version_of_its_weights(folder, dataset, tmp_path) -> None:
    """Groups generated before a weight sync carry the old version, after it the new one; each group's
    store step holds exactly its samples' version (a sample claiming another is refused by the store);
    the sync copies every parameter and TRL's version numbering is checked against it."""
    policy = load_model(folder)
    server = RolloutServer(load_model(folder), dataset, [reward], num_generations=2, queue_maxsize=2)
    args = config(tmp_path)
    arm = integration_arm("nvfp4", "trace", "lsb", "all", LAYERS)
    signature = model_signature(policy, arm.plan)
    root = tmp_path / "store"
    root.mkdir()
    server.bind(tokenizer=hf_tokenizer(TOK), eos_token_ids=[TOK.EOS], arm=arm, root=root, signature=signature, args=args)
    with pytest.raises(RuntimeError, match="send_weights outside pause/resume"):
        server.send_weights(iter(()))
    with torch.no_grad():
        next(policy.parameters()).add_(0.5)  # the trainer's weights differ from the copy's
    _sync(server, policy)
    server.update_model_version(1)
    assert all(torch.equal(p, dict(policy.named_parameters())[n]) for n, p in server._model.named_parameters())
    server.start()
    try:
        first = _drain(server, 4)
        _sync(server, policy)
        with pytest.raises(RuntimeError, match="TRL named policy version 5 for the weights synced as version 2"):
            server.update_model_version(5)
        server.update_model_version(2)
        later = _drain(server, 8)
        versions = [s.model_version for s in first + later]
        assert versions[:4] == [1] * 4 and versions == sorted(versions) and versions[-1] == 2
        # every sample's record is in its group's step, at its version; another version is refused
        keys = [int(s.input_ids.trace_key) for s in first + later]
        trajs, _ = server.book.take(keys)
        assert [t.version for t in trajs] == versions and [t.step for t in trajs] == [s.group_id for s in first + later]
        records = records_by_version(root, signature, trajs)
        assert [next(iter(r.values())).shape[0] for r in records] == [t.token_ids.numel() for t in trajs]
        forged = Trajectory(trajs[-1].traj_id, trajs[-1].step, trajs[-1].version - 1, trajs[-1].token_ids,
                            trajs[-1].prompt_len, trajs[-1].logprobs, 0.0, {})
        with pytest.raises(StoreError, match="policy_version mismatch"):
            records_by_version(root, signature, [forged])
        server.pause()  # a sync that fails before resume: stopping must still end the thread
    finally:
        server.stop()
    # stopped without trace_keep_steps: no step of the run is left behind
    assert not list(root.glob(step_dir(root, 0).name.split("-")[0] + "-*"))
    bad = RolloutServer(load_model(folder), dataset, [reward], num_generations=2, queue_maxsize=2)
    bad.pause()
    with pytest.raises(RuntimeError, match="unsent"):
        bad.send_weights(iter([next(policy.named_parameters())]))


# --- refusals ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option, words", [
    (dict(max_staleness=0), "max_staleness=0"), (dict(dtype="float32"), "bfloat16"),
    (dict(weight_sync_steps=2), "weight_sync_steps=2"), (dict(token_budget=None), "token_budget=None"),
    (dict(router_aux_loss_coef=0.01), "router_aux_loss_coef"), (dict(top_k=5), "top_k=5"),
    (dict(gradient_checkpointing=True), "gradient_checkpointing"),
])
def test_options_the_integration_cannot_honour_are_refused(folder, dataset, tmp_path, option, words) -> None:
    args = config(tmp_path, **option)
    assert words in unsupported_async(args)
    with pytest.raises(ValueError, match=words):
        TraceAsyncGRPOTrainer(str(folder), reward, args=args, train_dataset=dataset, processing_class=hf_tokenizer(TOK))


def test_bad_inputs_are_refused(folder, dataset, tmp_path) -> None:
    args = config(tmp_path)
    assert unsupported_async(args) is None
    with pytest.raises(ValueError, match="rollout_worker is not supported"):
        TraceAsyncGRPOTrainer(str(folder), reward, args=args, train_dataset=dataset, rollout_worker=object())
    with pytest.raises(TypeError, match="TraceAsyncGRPOConfig"):
        TraceAsyncGRPOTrainer(str(folder), reward, args=trl.experimental.async_grpo.AsyncGRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False), train_dataset=dataset)
    with pytest.raises(TypeError, match="local folder"):
        TraceAsyncGRPOTrainer(load_model(folder), reward, args=args, train_dataset=dataset)
    with pytest.raises(ValueError, match="reward_funcs"):
        TraceAsyncGRPOTrainer(str(folder), None, args=args, train_dataset=dataset)
    with pytest.raises(ValueError, match="trace_is_mode = 'clip'"):
        config(tmp_path, trace_is_mode="clip")


# --- the trainer, on CPU --------------------------------------------------------------------------------------


def test_a_short_asynchronous_run_trains_on_versioned_records(folder, dataset, tmp_path, monkeypatch) -> None:
    """Three optimizer steps of TRL's asynchronous loop with our rollout server, full records on every
    layer: each trained sample's records come from its own version's store step, no trained sample is
    past max_staleness at the loss, the first step (every sample of version 1, consumed at version 1)
    reproduces every rollout code, the loss has a gradient, and no store step outlives the run."""
    consumed, read = [], []
    split, by_version = trl_async.split_by_lag, trl_async.records_by_version

    def recording_split(trajectories, version_now, max_staleness):
        fresh, stale = split(trajectories, version_now, max_staleness)
        consumed.extend((version_now, t.version) for t in fresh)
        return fresh, stale

    def recording_read(root, signature, trajectories):
        read.extend(t.version for t in trajectories)
        return by_version(root, signature, trajectories)

    monkeypatch.setattr(trl_async, "split_by_lag", recording_split)
    monkeypatch.setattr(trl_async, "records_by_version", recording_read)
    args = config(tmp_path, trace_mode="trace", trace_guidance="full@all")
    trainer = TraceAsyncGRPOTrainer(str(folder), length_reward, args=args, train_dataset=dataset,
                                    processing_class=hf_tokenizer(TOK))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 3 and trainer.model_version == 4  # the first sync, then one per step
    assert consumed and all(0 <= now - v <= 1 for now, v in consumed)
    assert read == [v for _, v in consumed]  # every trained sample's records, read at its own version
    codes, failures = trl_name(Name.CODE_MISMATCH), trl_name(Name.DECODE_FAILURES)
    rows = [r for r in trainer.state.log_history if codes in r]
    assert rows and rows[0][codes] == 0.0 and rows[0]["sample/staleness_max"] == 0
    assert all(r[failures] == 0 for r in rows)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    root = trainer._trace_root
    assert not list(root.glob(step_dir(root, 0).name.split("-")[0] + "-*"))
