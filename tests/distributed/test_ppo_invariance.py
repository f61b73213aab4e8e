"""One PPO step (actor and critic) gives the same result whatever the layout: data, tensor and pipeline
parallelism and the micro-batch size only change how the work is split, never the update. Every loss option
that depends on global counts is on: seq-mean-token-mean aggregation (per-sequence means over the mini-batch),
the Dr.GRPO constant normaliser for the critic, KL loss, entropy bonus, dual-clip and truncated-IS weights."""
import dataclasses

import pytest
import torch
import torch.distributed as dist

from helpers.parity import BATCH, build_actor, config, family_model_dir, hf_reference, make_batch
from rl_megatron.algorithms import rollout_correction_weights
from rl_megatron.batch import TrainBatch
from helpers.worlds import run_distributed

PPO_OPTIONS = {"actor.loss_agg_mode": "seq-mean-token-mean", "actor.entropy_coeff": 0.01,
               "actor.use_kl_loss": "true", "actor.kl_loss_coef": 0.1, "actor.clip_ratio_c": 3.0,
               "algorithm.adv_estimator": "gae", "critic.loss_agg_mode": "seq-mean-token-sum-norm",
               "critic.cliprange_value": 0.2,
               # Adam's first step is ~lr * sign(gradient): blind to the gradient's scale, and it blows rounding in
               # near-zero gradients up to a full step. A large epsilon makes the step proportional to the gradient,
               # so the weights check the gradients themselves.
               "actor.optim.lr": 1e-2, "actor.optim.eps": 1e-2, "critic.optim.lr": 1e-2, "critic.optim.eps": 1e-2}


def ppo_batch(model_dir: str, temperature: float) -> TrainBatch:
    """Sequences with old/reference log-probs, rollout-time values and targets near the real ones, so that part
    of the tokens is clipped and every loss term has a gradient."""
    batch = make_batch(18)
    log_probs, _, _ = hf_reference(model_dir, batch, temperature)
    g = torch.Generator().manual_seed(2)
    noise = lambda scale: scale * torch.randn(log_probs.shape, generator=g)  # noqa: E731
    mask = batch.response_mask
    return TrainBatch(batch.input_ids, mask, batch.pad_id, batch.lengths, old_log_probs=(log_probs + noise(0.3)) * mask,
                      ref_log_probs=(log_probs + noise(0.5)) * mask, advantages=noise(1.0) * mask,
                      importance_weights=torch.rand(mask.shape, generator=g) + 0.5, values=noise(0.5) * mask,
                      returns=(noise(0.5) + 1.0) * mask)


def ppo_step(cfg, batch):
    """One actor update and one critic update, each data-parallel rank on its slice; then the critic's values."""
    from megatron.core import parallel_state

    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.workers.megatron_actor import MegatronActor
    from rl_megatron.workers.megatron_critic import MegatronCritic

    hf = read_hf_config(cfg.model.path)
    actor, critic = MegatronActor(cfg, hf, optimizer_steps=10), MegatronCritic(cfg, hf, optimizer_steps=10)
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    mine = batch.split(dp)[rank]
    metrics = {**actor.update(mine), **critic.update(mine)}
    values = critic.values(mine)
    return metrics, actor.hf_state_dict(), None if values is None else values.values


def run(model_dir, batch, world, tp, pp, micro):
    cfg = config(model_dir, tp, pp, **PPO_OPTIONS, **{"trainer.n_gpus_per_node": world,
                                                      "actor.micro_batch_size": micro})
    results = run_distributed(ppo_step, world, tp, pp, args=(cfg, batch))
    owners = [r for r in results if r[2] is not None]  # ranks that own data-parallel outputs, in DP order
    return owners[-1][0], results[0][1], torch.cat([r[2] for r in owners])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = family_model_dir(tmp_path_factory.mktemp("ppo") / "qwen2", "qwen2", tied=False)
    batch = ppo_batch(model_dir, temperature=0.7)
    return model_dir, batch, run(model_dir, batch, world=1, tp=1, pp=1, micro=4)


@pytest.mark.parametrize("world,tp,pp,micro", [(2, 1, 1, 4), (2, 2, 1, 4), (2, 1, 2, 4), (1, 1, 1, 1)],
                         ids=["dp2", "tp2", "pp2", "micro1"])
def test_one_ppo_step_is_independent_of_the_layout(setup, world, tp, pp, micro):
    model_dir, batch, (ref_metrics, ref_state, ref_values) = setup
    metrics, state, values = run(model_dir, batch, world, tp, pp, micro)
    for key in ("actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/grad_norm",
                "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"):
        assert abs(metrics[key] - ref_metrics[key]) <= 1e-5, key
    assert max((ref_state[n] - t).abs().max().item() for n, t in state.items()) <= 1e-5
    assert (values - ref_values).abs().max().item() <= 1e-5
    # The step did something: the clip and both loss options were active and the weights moved.
    assert 0 < ref_metrics["actor/pg_clipfrac"] < 1 and ref_metrics["critic/vf_clipfrac"] > 0
    initial = run_distributed(initial_state, 1, args=(config(model_dir, 1, 1),))[0]
    assert max((initial[n] - t).abs().max().item() for n, t in state.items()) > 1e-4
    assert values.shape == (BATCH, batch.input_ids.shape[1])


def initial_state(cfg):
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.workers.megatron_actor import MegatronActor

    return MegatronActor(cfg, read_hf_config(cfg.model.path)).hf_state_dict()


# The rollout correction on, its cap within the ratios' range: the on-policy update computes the weights itself.
CORRECTION = {"algorithm.rollout_correction.level": "token", "algorithm.rollout_correction.mode": "truncate",
              "algorithm.rollout_correction.threshold": 1.2}


def counted_passes(actor) -> list[bool]:
    """Each pass `actor` makes over its micro-batches from here on, as its forward_only flag."""
    passes, run = [], actor.run

    def counting(micros, loss_func, forward_only):
        passes.append(forward_only)
        return run(micros, loss_func, forward_only)

    actor.run = counting
    return passes


def old_log_probs_both_ways(cfg, batch):
    """One actor update from the same weights, two ways: after a forward pass of its own gave the old log-probs and
    entropy (and, from them, the rollout correction's weights, as the trainer computes them), and on-policy, its own
    forward pass giving them. Each way: the metrics, the old log-probs and entropy (where this rank owns them), the
    passes made, and the weights after."""
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    mine, correction = batch.split(dp)[rank], cfg.algorithm.rollout_correction
    separate, on_policy = build_actor(cfg), build_actor(cfg)
    separate_passes, on_policy_passes = counted_passes(separate), counted_passes(on_policy)
    owned = separate.log_probs(mine)
    shared = [None] * dist.get_world_size()  # the trainer sends every rank of a data-parallel slice the same
    dist.all_gather_object(shared, (rank, owned))
    old = next(outputs for owner, outputs in shared if owner == rank and outputs is not None)
    weights = rollout_correction_weights(old.log_probs, mine.rollout_log_probs, mine.response_mask, correction.level,
                                         correction.mode, correction.threshold)
    with_pass = separate.update(dataclasses.replace(mine, old_log_probs=old.log_probs, importance_weights=weights))
    update = on_policy.policy_update(mine)
    from_update = None if update.log_probs is None else (update.log_probs, update.entropy)
    return ((with_pass, None if owned is None else (owned.log_probs, owned.entropy), separate_passes,
             separate.hf_state_dict()),
            (update.metrics, from_update, on_policy_passes, on_policy.hf_state_dict()))


@pytest.mark.parametrize("world,tp,pp", [(2, 1, 1), (2, 1, 2)], ids=["dp2", "pp2"])
def test_an_on_policy_update_takes_the_old_log_probs_from_its_forward_pass(setup, world, tp, pp):
    """trainer/old_log_probs.py: one epoch of one mini-batch needs no log-prob pass of its own. Without it (one
    pass, the update's, instead of two) the update gives the same metrics, the same weights, and the same old
    log-probs and entropy for the step's metrics (mismatch/*, the rollout correction's, actor/entropy), with the
    KL loss, the entropy bonus, dual-clip and the rollout correction on."""
    model_dir, batch, _ = setup
    cfg = config(model_dir, tp, pp, **PPO_OPTIONS, **CORRECTION, **{"trainer.n_gpus_per_node": world})
    assert cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
    # The noisy old log-probs of the PPO batch play the engine's: the correction's weights vary, some capped.
    sent = dataclasses.replace(batch, old_log_probs=None, importance_weights=None,
                               rollout_log_probs=batch.old_log_probs)
    results = run_distributed(old_log_probs_both_ways, world, tp, pp, args=(cfg, sent))
    for (with_pass, separate_old, separate_passes, _), (metrics, old, passes, _) in results:
        assert separate_passes == [True, False] and passes == [False]  # the log-prob pass, then the update's
        assert set(metrics) == set(with_pass)
        for key, value in with_pass.items():
            assert abs(metrics[key] - value) <= 1e-6, key
        assert (separate_old is None) == (old is None)
        if old is not None:
            for theirs, ours in zip(separate_old, old):
                assert (theirs - ours).abs().max().item() <= 1e-6
    (*_, separate_state), (*_, state) = results[0]  # rank 0 holds the exported weights
    assert state and max((separate_state[n] - t).abs().max().item() for n, t in state.items()) <= 1e-6
    owners = [old for _, (_, old, _, _) in results if old is not None]
    assert len(owners) == world // pp  # every data-parallel slice came back, from its last pipeline stage
    # The step did something: the KL loss and the entropy bonus were on, the weights moved, some weights capped.
    metrics = results[-1][1][0]  # the last pipeline stage computes the losses
    assert metrics["actor/kl_loss"] > 0 and metrics["actor/entropy_loss"] > 0 and metrics["actor/ppo_kl"] == 0
    correction = cfg.algorithm.rollout_correction
    mask = batch.response_mask.bool()
    ratios = (torch.cat([old[0] for old in owners]) - batch.old_log_probs).exp()[mask]
    assert 0 < (ratios > correction.threshold).float().mean() < 1
