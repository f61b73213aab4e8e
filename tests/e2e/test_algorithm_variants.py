"""The 2025 algorithms through the user's command, on the demo task with one worker (the trainer at TP=1, its engine
beside it) and 16 prompts a step: the reward rises under each registered policy loss, and with DAPO's dynamic
sampling (each round judged by the policy and scored by a reward model on a worker of its own).

In CI one run serves both: KL-Cov with dynamic sampling. The other losses' runs are `slow` (RL_MEGATRON_SLOW=1): on
the demo's one-token answers GSPO's sequence ratio is the token ratio, so it is PPO there, and CISPO differs from
PPO only where a ratio passes its cap; their math is pinned by tests/unit/test_policy_losses.py, and a user's
GSPO-based loss runs through the workers in tests/e2e/test_train_cli.py (three-token answers, interleaved pipeline)."""
import os

import pytest

from helpers.reward_models import reward_model_dir
from helpers.runs import train

# Two optimizer steps a step, so that the second mini-batch is off-policy and the losses' ratios, clips and penalties act.
SMALL = ("trainer.n_gpus_per_node=1", "actor.tensor_model_parallel_size=1", "data.train_batch_size=16",
         "actor.ppo_mini_batch_size=8", "actor.optim.lr=3e-3", "trainer.target_reward=null")


def mean_reward(rows, key="reward/mean") -> float:
    return sum(r[key] for r in rows) / len(rows)


# Clip-Cov and KL-Cov with a larger share of the tokens than their defaults (2e-4: one token of a micro-batch), and
# Clip-Cov's band opened to every positive covariance (the demo's one-token answers rarely reach the default 1).
KL_COV = ("actor.policy_loss=kl_cov", "actor.kl_cov_ratio=0.05")


@pytest.mark.parametrize("loss, options", [
    pytest.param("gspo", (), marks=pytest.mark.slow),
    pytest.param("cispo", (), marks=pytest.mark.slow),
    pytest.param("clip_cov", ("actor.clip_cov_ratio=0.05", "actor.clip_cov_lb=0.0"), marks=pytest.mark.slow),
    pytest.param("kl_cov", KL_COV[1:], marks=pytest.mark.slow),
])
def test_the_demo_learns_under_each_policy_loss(tmp_path, loss, options):
    _, rows, _ = train(tmp_path, *SMALL, f"actor.policy_loss={loss}", *options, "trainer.total_steps=30",
                       "trainer.save_every=-1")
    assert len(rows) == 30
    assert mean_reward(rows[-10:]) > mean_reward(rows[:5]) + 0.03, [r["reward/mean"] for r in rows]
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    if loss in ("clip_cov", "kl_cov"):  # the covariance selection picked tokens
        assert sum(r["actor/pg_clipfrac"] > 0 for r in rows) > len(rows) / 2
    if loss == "kl_cov":  # and the picked tokens of the off-policy mini-batch were penalised
        assert all(r["actor/kl_cov_penalty"] > 0 for r in rows)


# The policy judging its own answers beside the rule (a small weight: the rule's signal leads), each round of
# dynamic sampling judged before the filter reads its rewards.
SELF_JUDGE = ("judge.enable=true", "judge.prompt_template='{prompt}{response}='", "judge.max_tokens=2",
              "judge.coef=0.01", "rollout.max_model_len=32")


# A reward model on a worker of its own (a random one: its scores are noise, at a small weight) scores each round too.
def separate_reward_model(folder) -> tuple[str, ...]:
    return (f"reward_model.model.path={reward_model_dir(str(folder))}", "reward_model.placement=separate",
            "reward_model.coef=0.01")


def test_dynamic_sampling_trains_on_groups_that_vary_and_the_reward_rises_under_kl_cov(tmp_path):
    _, rows, run_dir = train(tmp_path, *SMALL, *KL_COV, "algorithm.filter_groups.enable=true",
                             "data.gen_batch_size=32", *SELF_JUDGE, *separate_reward_model(tmp_path / "reward_model"),
                             "trainer.total_steps=20", "trainer.save_every=-1")
    assert len(rows) == 20
    for r in rows:
        assert r["filter/prompts_used"] == 32 * r["filter/gen_batches"]
        assert r["filter/kept_groups"] == 16 and not r["filter/reached_cap"]  # the demo never needs 10 rounds
        assert 0 < r["reward/mean"] < 1  # only groups with right and wrong answers are trained on
        # Every round was judged, and the verdicts entered the rewards trained on (the rule's score is its acc).
        assert r["judge/too_long"] == 0 and r["timing_s/judge"] > 0
        assert r["reward/score"] == pytest.approx(
            r["reward/acc"] + 0.01 * (r["judge/score/mean"] + r["reward_model/score/mean"]), abs=1e-6)
        assert r["actor/pg_clipfrac"] > 0 and r["actor/kl_cov_penalty"] > 0  # KL-Cov's share got the penalty
    assert os.path.isfile(os.path.join(run_dir, "logs", "worker_reward_model_0.log"))  # on a worker of its own
    # ... and the rewards the filter read: the verdicts of every round generated, the rejected groups' too.
    assert any(r["filter/generated_reward/mean"] > r["filter/generated_acc/mean"] for r in rows)
    assert max(r["filter/gen_batches"] for r in rows) > 1  # more rounds were needed at the start
    assert mean_reward(rows[-10:], "filter/generated_reward/mean") > mean_reward(
        rows[:5], "filter/generated_reward/mean") + 0.03
