"""The 2025 algorithms through the user's command, on the demo task with one worker (the trainer at TP=1, its engine
beside it) and 16 prompts a step: the reward rises under each registered policy loss, and with DAPO's dynamic
sampling, whose run also resumes exactly from a checkpoint (the data position counts every round's prompts)."""
import os

import pytest

from helpers.runs import assert_same_metrics, train
from rl_megatron.checkpoint.run import step_dir

SMALL = ("trainer.n_gpus_per_node=1", "actor.tensor_model_parallel_size=1", "data.train_batch_size=16",
         "actor.optim.lr=3e-3", "trainer.target_reward=null")


def mean_reward(rows, key="reward/mean") -> float:
    return sum(r[key] for r in rows) / len(rows)


# Each loss with what makes it act on the demo's one-token answers: Clip-Cov and KL-Cov select a share of the tokens
# (their defaults, 2e-4 and 2e-3, select none of 128).
@pytest.mark.parametrize("loss, options", [
    ("gspo", ()),
    ("cispo", ()),
    ("clip_cov", ("actor.clip_cov_ratio=0.05",)),
    ("kl_cov", ("actor.kl_cov_ratio=0.05",)),
])
def test_the_demo_learns_under_each_policy_loss(tmp_path, loss, options):
    _, rows, _ = train(tmp_path, *SMALL, f"actor.policy_loss={loss}", *options, "trainer.total_steps=30",
                       "trainer.save_every=-1")
    assert len(rows) == 30
    assert mean_reward(rows[-10:]) > mean_reward(rows[:5]) + 0.03, [r["reward/mean"] for r in rows]
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    if loss in ("clip_cov", "kl_cov"):  # the covariance selection picked tokens
        assert all(r["actor/pg_clipfrac"] > 0 for r in rows)


def test_dynamic_sampling_trains_on_groups_that_vary_and_resumes_exactly(tmp_path):
    run = (*SMALL, "algorithm.filter_groups.enable=true", "data.gen_batch_size=32", "trainer.total_steps=20",
           "trainer.save_every=19")
    _, rows, run_dir = train(tmp_path / "whole", *run)
    assert len(rows) == 20
    for r in rows:
        assert r["filter/prompts_used"] == 32 * r["filter/gen_batches"]
        assert r["filter/kept_groups"] == 16 and not r["filter/reached_cap"]  # the demo never needs 10 rounds
        assert 0 < r["reward/mean"] < 1  # only groups with right and wrong answers are trained on
    assert max(r["filter/gen_batches"] for r in rows) > 1  # more rounds were needed at the start
    assert mean_reward(rows[-10:], "filter/generated_reward/mean") > mean_reward(
        rows[:5], "filter/generated_reward/mean") + 0.03
    # Resumed from step 19's checkpoint in another folder, step 20 is the same.
    resumed_dir = tmp_path / "resumed"
    _, resumed, _ = train(resumed_dir, *run, f"trainer.resume={step_dir(os.path.join(run_dir, 'checkpoints'), 19)}")
    assert [r["step"] for r in resumed] == [20]
    assert_same_metrics(rows[-1], resumed[0], tolerance=1e-6)
