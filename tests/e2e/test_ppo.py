"""PPO and its relatives end to end through the user's command: the critic, the reference policy (colocated or on
its own workers), KL in the loss or in the reward, and the loss options, on the demo task."""
import pytest

from helpers.runs import train

# Four steps of the PPO demo with checks of every stage's metrics and of the adaptive in-reward KL coefficient
# run in test_checkpoint_resume.py; REINFORCE++ runs end to end in test_countdown.py.


@pytest.mark.slow
def test_ppo_demo_learns_with_a_critic(tmp_path):
    """The whole demo (~2 minutes): the reward climbs to the target, the critic follows the returns and its loss
    falls from its peak as the policy settles."""
    stdout, rows, _ = train(tmp_path, config="demo_cpu_ppo")
    assert "Target mean reward 0.8 reached." in stdout
    assert rows[0]["reward/mean"] < 0.3 and len(rows) < 400
    vf_loss = [sum(r["critic/vf_loss"] for r in rows[i:i + 5]) / 5 for i in range(len(rows) - 4)]
    assert vf_loss[-1] < 0.8 * max(vf_loss)
    late = rows[len(rows) // 2:]
    assert abs(sum(r["critic/values/mean"] - r["critic/returns/mean"] for r in late) / len(late)) < 0.1
    assert max(r["mismatch/token_mult_prob_error"] for r in rows) <= 1.001


def test_separate_critic_and_reference_workers_with_every_loss_option(tmp_path, tiny_model_dir):
    """The critic and the reference on their own workers (one device each, their own process groups), KL loss,
    entropy bonus, dual-clip, truncated IS, a Dr.GRPO-normalised loss and one critic warm-up step; one mini-batch a
    step, so the old log-probs come from the actor's update."""
    _, rows, _ = train(
        tmp_path, config="demo_cpu_ppo", timeout=900, *(
            "trainer.total_steps=3", "trainer.target_reward=null", f"model.path={tiny_model_dir}",
            "model.random_init=false", "data.train_batch_size=16", "critic.placement=separate",
            "critic.tensor_model_parallel_size=1", "critic.n_gpus_per_node=1", "ref.placement=separate",
            "ref.tensor_model_parallel_size=1", "ref.n_gpus_per_node=1", "ray.num_cpus=4", "actor.use_kl_loss=true",
            "actor.kl_loss_type=low_var_kl", "actor.entropy_coeff=0.01", "actor.clip_ratio_c=3.0",
            "actor.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.rollout_is_cap=2.0", "critic.warmup_steps=1"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "actor/pg_loss" not in rows[0] and "critic/vf_loss" in rows[0]  # warm-up: the critic alone
    # The reference (loaded by its own workers at another layout) is the initial policy: the KL of the first
    # actor update's single mini-batch is zero; after it, the policy has moved away.
    assert abs(rows[1]["actor/kl_loss"]) < 1e-6 and rows[2]["actor/kl_loss"] > 0
    assert all(key in rows[2] for key in ("actor/entropy_loss", "actor/pg_clipfrac_lower", "critic/vf_clipfrac"))
    # One mini-batch a step (trainer/old_log_probs.py): the actor's updates give the old log-probs, with no pass of
    # their own, except in the warm-up (no update); the metrics that read them are there all the same.
    assert ["timing_s/old_log_prob" in r for r in rows] == [True, False, False]
    assert all({"mismatch/max_abs_logprob_diff", "rollout_corr/weight_mean", "actor/entropy"} <= set(r) for r in rows)
    assert all(r["actor/ppo_kl"] == 0 and r["mismatch/token_mult_prob_error"] <= 1.001 for r in rows[1:])
