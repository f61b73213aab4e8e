"""Asynchronous RL through the user's command, on the demo with its engine on a worker of its own
(rollout.placement=separate, the trainer at TP=1): one-step-off learns the task and never trains on a batch more
than one version old, in a run killed with SIGKILL on the way and resumed exactly by the same command; partial
rollouts keep each token's version and log-prob, so the tokens the newest weights sampled agree with the trainer as
in synchronous RL, with the update landing at a fixed token of every answer; streaming learns the task with every
trained token within its bound, killed and resumed from the queue its checkpoint held."""
import json
import os
import signal
from collections import Counter

import pytest
import torch
from transformers import AutoTokenizer

from helpers.runs import (REPO, assert_same_metrics, latest_checkpoint, read_rows_if_any, start_until, train,
                          train_command)
from rl_megatron.checkpoint.run import ROLLOUTS_FILE, step_dir

# The demo one-step-off, its trainer on one device (DP 1): a mini-batch in one pass of 128, as the PPO and tool demos.
# Stale samples are clipped against the policy that sampled them by default (algorithm.rollout_correction.bypass_mode,
# docs/async.md).
ONE_STEP_OFF = ("trainer.n_gpus_per_node=1", "actor.tensor_model_parallel_size=1", "rollout.placement=separate",
                "trainer.rollout_staleness=1", "actor.micro_batch_size=128")
# float32 on both sides, summed in different orders (the synchronous demo's bound: tests/e2e/test_train_cli.py).
SAME_WEIGHTS_LOGPROB_DIFF = 5e-5
SYNC_AT = 24  # partial rollouts: the token of each 48-token answer where the update lands
# Issue 54's target: one-step-off within 1.25x the synchronous run's steps to 0.8. The synchronous demo at this
# layout (seed 0) took 155 steps with torch 2.13.0 on AVX2 (an AMD EPYC) and 144 on AVX512 (an Intel Xeon)
# (docs/benchmarks.md); the steps are a property of the machine's arithmetic (as the demo's reward trace,
# test_train_cli), so elsewhere only the bound before the target.
SYNCHRONOUS_STEPS = {("2.13.0", "AVX2"): 155, ("2.13.0", "AVX512"): 144}
LOOSE_STEP_BOUND = 250


# The one-step-off run is SIGKILLed once it has logged two steps past its first checkpoint (with the batch after it,
# generated ahead), then resumed by the same command to the target: the steps it logged past the checkpoint are the
# reference the resumed run must reproduce.
SAVE_EVERY = 40


@pytest.fixture(scope="module")
def one_step_off(tmp_path_factory):
    """(the killed run's records, the resumed run's stdout, every record of the run once resumed, the checkpoint it
    resumed from)."""
    log_dir = tmp_path_factory.mktemp("one_step_off")
    run = (*ONE_STEP_OFF, f"trainer.save_every={SAVE_EVERY}")
    killed = start_until(train_command(log_dir, *run), lambda: latest_checkpoint(log_dir, "demo_cpu") == SAVE_EVERY
                         and SAVE_EVERY + 2 in read_rows_if_any(log_dir, "demo_cpu"), start_new_session=True)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    before = read_rows_if_any(log_dir, "demo_cpu")
    checkpoint = step_dir(os.path.join(log_dir, "demo_cpu", "checkpoints"), SAVE_EVERY)
    assert os.path.isfile(os.path.join(checkpoint, ROLLOUTS_FILE))
    stdout, rows, _ = train(log_dir, *run)
    return before, stdout, rows, checkpoint


def test_one_step_off_learns_the_demo_within_its_bound(one_step_off):
    _, stdout, rows, _ = one_step_off
    assert "Target mean reward 0.8 reached." in stdout and len(rows) < LOOSE_STEP_BOUND
    synchronous = SYNCHRONOUS_STEPS.get((torch.__version__.split("+")[0], torch.backends.cpu.get_cpu_capability()))
    assert synchronous is None or len(rows) <= 1.25 * synchronous, (len(rows), synchronous)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert sum(r["reward/mean"] for r in rows[-5:]) / 5 >= 0.8
    # Batch 1 comes from the initial weights; every later batch from the weights one update behind the trainer.
    assert [r["async/staleness/max"] for r in rows] == [0.0] + [1.0] * (len(rows) - 1)
    assert [r["async/token_staleness/1"] for r in rows] == [0.0] + [1.0] * (len(rows) - 1)
    assert not any(r["async/dropped"] for r in rows)
    # Only batch 1 was sampled by the trainer's own version: there, trainer and engine agree.
    assert rows[0]["async/current_version_max_abs_logprob_diff"] < SAME_WEIGHTS_LOGPROB_DIFF
    assert not any("async/current_version_tokens" in r for r in rows[1:])
    assert all({"timing_s/wait_for_rollout", "timing_s/wait_for_train", "timing_s/gen"} <= set(r) for r in rows)


def test_a_killed_one_step_off_run_continues_exactly_where_it_stopped(one_step_off):
    """Killed (SIGKILL, the whole process group) two steps after its first checkpoint, whose folder holds the batch
    generated ahead; the same command resumes there and reproduces the killed run's next two steps."""
    before, stdout, rows, checkpoint = one_step_off
    assert f"Resumed from {checkpoint} (step {SAVE_EVERY})" in stdout
    rows = {r["step"]: r for r in rows}
    for step in (SAVE_EVERY + 1, SAVE_EVERY + 2):
        assert_same_metrics(before[step], rows[step], tolerance=1e-6)


# Streaming (trainer.async_mode=streaming, every token within 1 version): killed with SIGKILL past its first
# checkpoint, which holds the queue, and resumed by the same command to the target. Where a sync lands and which
# groups finish first is the engines' and the trainer's timing, so the run is not reproduced step for step: its
# learning is held to issue 54's streaming target, 1.5x the synchronous steps, where those were recorded.
STREAMING = (*ONE_STEP_OFF, "trainer.async_mode=streaming")
BATCH_GROUPS = 32  # the demo's data.train_batch_size


@pytest.fixture(scope="module")
def streaming(tmp_path_factory):
    """(the killed run's records, the resumed run's stdout and records, the queue its checkpoint held, the samples
    of every step as the resumed run wrote them)."""
    log_dir = tmp_path_factory.mktemp("streaming")
    samples_dir = os.path.join(log_dir, "samples")
    run = (*STREAMING, f"trainer.save_every={SAVE_EVERY}", f"trainer.rollout_data_dir={samples_dir}")
    killed = start_until(train_command(log_dir, *run), lambda: latest_checkpoint(log_dir, "demo_cpu") == SAVE_EVERY
                         and SAVE_EVERY + 2 in read_rows_if_any(log_dir, "demo_cpu"), start_new_session=True)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    before = read_rows_if_any(log_dir, "demo_cpu")
    queue = torch.load(os.path.join(step_dir(os.path.join(log_dir, "demo_cpu", "checkpoints"), SAVE_EVERY),
                                    ROLLOUTS_FILE), weights_only=False)
    stdout, rows, _ = train(log_dir, *run)
    return before, stdout, rows, queue, samples_dir


def test_streaming_learns_the_demo_with_every_trained_token_within_its_bound(streaming):
    _, stdout, rows, _, _ = streaming
    assert "Target mean reward 0.8 reached." in stdout and len(rows) < LOOSE_STEP_BOUND
    synchronous = SYNCHRONOUS_STEPS.get((torch.__version__.split("+")[0], torch.backends.cpu.get_cpu_capability()))
    assert synchronous is None or len(rows) <= 1.5 * synchronous, (len(rows), synchronous)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # each step once, across the kill
    assert all(r["async/staleness/max"] <= 1 for r in rows)
    assert all({key for key in r if key.startswith("async/token_staleness/")}
               == {"async/token_staleness/0", "async/token_staleness/1"} for r in rows)
    assert all(0 <= r["async/engine_idle_share"] <= 1 and r["async/queue_groups"] >= 0 and r["async/inflight_groups"]
               >= 0 and r["async/interrupted_requests"] >= 0 for r in rows)
    assert all({"timing_s/wait_for_rollout", "timing_s/wait_for_train", "timing_s/gen"} <= set(r) for r in rows)


def test_a_killed_streaming_run_trains_its_saved_queue_first(streaming):
    """The checkpoint held the groups ready and the prompts unfinished; the resumed run's first step trains the
    oldest groups of that queue as they were sampled (not generated again), and the steps before the checkpoint keep
    their records."""
    before, stdout, rows, queue, samples_dir = streaming
    assert f"(step {SAVE_EVERY})" in stdout
    by_step = {r["step"]: r for r in rows}
    for step in range(1, SAVE_EVERY + 1):
        assert_same_metrics(before[step], by_step[step], tolerance=0)
    assert queue.ready or queue.unfinished  # the engines run ahead of the trainer: something was queued or started
    if not queue.ready:  # every group saved was still in flight (a slow engine): generated again, nothing to compare
        return
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(REPO, "configs", "models", "tiny-qwen2-digits"))
    saved = Counter((tokenizer.decode(s.prompt_ids, skip_special_tokens=True),
                     tokenizer.decode(s.response_ids, skip_special_tokens=True))
                    for group in queue.ready[:BATCH_GROUPS] for s in group.samples)
    with open(os.path.join(samples_dir, f"{SAVE_EVERY + 1}.jsonl")) as f:
        trained = Counter((r["prompt"], r["response"]) for r in map(json.loads, f))
    assert not saved - trained, (saved, trained)


def test_partial_rollouts_continue_samples_across_updates_with_each_tokens_version(tmp_path):
    """Answers of exactly 48 tokens (rollout.ignore_eos), the update landing at token 24 of every answer
    (rollout.partial_rollout_sync_at_tokens: the engines wait there for it, however fast the trainer is); the
    update's ratio is taken against the log-prob each token was sampled with (bypass mode, the default)."""
    _, rows, _ = train(tmp_path, *ONE_STEP_OFF, "rollout.partial_rollout=true", "rollout.max_tokens=48",
                       "rollout.ignore_eos=true", f"rollout.partial_rollout_sync_at_tokens={SYNC_AT}",
                       "trainer.total_steps=5", "trainer.target_reward=null")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["response_length/mean"] == 48 and not r["async/dropped"] for r in rows)
    # Batch 1 comes from the initial weights, which train it; every later batch was started one update behind and
    # continued at token 24 with the trainer's current version: half of its tokens are of that version, and their
    # log-probs are the trainer's (the continuation's KV cache was recomputed with the new weights) while the
    # earlier half's are the older version's (what the correction weighs).
    assert [r["async/staleness/max"] for r in rows] == [0.0] + [1.0] * 4
    assert [r["async/partial_samples"] for r in rows] == [0.0] + [1.0] * 4
    assert [r["async/current_version_tokens"] for r in rows] == [1.0] + [0.5] * 4
    assert [(r["async/token_staleness/0"], r["async/token_staleness/1"]) for r in rows] == [(1.0, 0.0)] + [(0.5, 0.5)] * 4
    assert all(r["async/current_version_max_abs_logprob_diff"] < SAME_WEIGHTS_LOGPROB_DIFF for r in rows)
    assert all(r["mismatch/max_abs_logprob_diff"] > 1e-3 for r in rows[1:])
    assert not any(key.startswith("rollout_corr/") for r in rows for key in r)  # no weights: bypass mode
