"""The registered policy losses (gspo, cispo, clip_cov, kl_cov next to ppo) against hand-worked values and
gradients, their handling of padding and importance weights, and a user's own loss or estimator through the config.

Most tests use MASK: a prompt token before each response, rows of 3, 2 and 0 response tokens, padding after. Positions
outside the mask hold NaN wherever the result must not depend on them.
"""
import math
import os
import sys

import pytest
import torch
from helpers.runs import REPO

from rl_megatron.algorithms import (ADV_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, LossScale, cispo_loss,
                                    clip_cov_loss, gspo_loss, kl_cov_loss, ppo_loss)
from rl_megatron.algorithms.policy_losses import CISPOConfig, ClipCovConfig, KLCovConfig
from rl_megatron.config import ConfigError
from rl_megatron.preflight import load_config
from rl_megatron.bench.host_syncs import HostSyncCounter
from rl_megatron.config.schema import ActorConfig

NAN = float("nan")
MASK = torch.tensor([
    [0, 1, 1, 1],  # prompt of 1, response of 3
    [0, 1, 1, 0],  # prompt of 1, response of 2, padding of 1
    [0, 0, 0, 0],  # an empty response (a padding row)
])
TOKEN_MEAN_OF_5 = LossScale(tokens=5, sequences=3, horizon=4)
BUILT_IN = ("ppo", "gspo", "cispo", "clip_cov", "kl_cov")
DEMO = os.path.join(REPO, "configs", "demo_cpu.yaml")
DEMO_MODEL = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")


def on_mask(row_values: list[list[float]], fill: float = NAN) -> torch.Tensor:
    """A [3, 4] tensor with each row's values on its response positions of MASK and `fill` everywhere else."""
    out = torch.full(MASK.shape, fill)
    for row, values in enumerate(row_values):
        out[row, MASK[row].bool()] = torch.tensor(values, dtype=torch.float32)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor | list) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), atol=1e-5, rtol=0)


def with_ratios(old: torch.Tensor, ratios: list[list[float]]) -> torch.Tensor:
    """Log-probs (a leaf with gradient) whose ratio to `old` is `ratios` on the response tokens, NaN elsewhere."""
    return (old + on_mask(ratios).log()).requires_grad_()


def run(loss_fn, log_probs, old, advantages, mask=MASK, scale=TOKEN_MEAN_OF_5, importance_weights=None,
        config=None, **actor_keys):
    """The loss, its stats, and d loss / d log_probs; `config`: the loss's own keys, where it has them."""
    own = {} if config is None else {"config": config}
    loss, stats = loss_fn(log_probs, old, advantages, mask, actor=ActorConfig(**actor_keys), scale=scale,
                          importance_weights=importance_weights, **own)
    (gradient,) = torch.autograd.grad(loss, log_probs)
    return loss, stats, gradient


# --- gspo ----------------------------------------------------------------------------------------------------------

def test_gspo_clips_whole_sequences_by_their_geometric_mean_ratio():
    old = on_mask([[0.0] * 3, [0.0] * 2])
    log_probs = (old + on_mask([[0.3, -0.1, 0.1], [-0.2, 0.0]])).requires_grad_()
    advantages = torch.tensor([1.0, -2.0, 5.0])
    loss, stats, gradient = run(gspo_loss, log_probs, old, advantages, clip_ratio_low=0.2, clip_ratio_high=0.05)
    # Sequence ratios: s0 = exp(mean(0.3, -0.1, 0.1)) = e^0.1 = 1.105171; s1 = exp(mean(-0.2, 0)) = e^-0.1 = 0.904837
    # Range [0.8, 1.05]:
    #   row 0, A=+1: s0 above 1.05 -> max(-1.105171, -1.05) = -1.05 on each of its 3 tokens (clipped, no gradient)
    #   row 1, A=-2: s1 inside     -> 2 * 0.904837 = 1.809675 on each of its 2 tokens
    # sum = -3.15 + 3.619350 = 0.469350 over 5 tokens
    assert loss.item() == pytest.approx(0.469350 / 5, abs=1e-6)
    # d(-A s_i,t)/d logp_t = -A s_i: 2 * 0.904837 / 5 = 0.361935 on row 1's tokens
    assert_close(gradient, on_mask([[0.0] * 3, [0.361935] * 2], fill=0.0))
    assert stats.tokens.item() == 5.0
    assert stats.token_sums["pg_clipfrac"].item() == 3.0
    # -(0.3 - 0.1 + 0.1 - 0.2 + 0) = -0.1
    assert stats.token_sums["ppo_kl"].item() == pytest.approx(-0.1, abs=1e-6)
    # each token carries its sequence's ratio: 3 * 1.105171 + 2 * 0.904837 = 5.125186
    assert stats.token_sums["seq_ratio"].item() == pytest.approx(5.125186, abs=1e-5)


def test_gspo_sequence_ratio_is_the_geometric_mean_of_the_token_ratios():
    old = on_mask([[-1.0] * 3, [-1.0] * 2])
    log_probs = with_ratios(old, [[1.2, 0.9, 1.5], [2.0, 0.5]])
    _, stats, _ = run(gspo_loss, log_probs, old, torch.ones(3))
    # (1.2 * 0.9 * 1.5)^(1/3) = 1.62^(1/3) = 1.174337 for 3 tokens; (2 * 0.5)^(1/2) = 1 for 2 tokens
    assert stats.token_sums["seq_ratio"].item() == pytest.approx(3 * 1.62 ** (1 / 3) + 2 * 1.0, abs=1e-5)


def test_gspo_token_gradient_is_that_of_the_sequence_objective():
    # With one advantage per sequence and nothing clipped, GSPO-token under seq-mean-token-mean has the gradient
    # of GSPO's sequence objective mean_i(-A_i s_i): each token gets -A_i s_i / (|y_i| * sequences).
    old = on_mask([[-1.0] * 3, [-2.0] * 2])
    log_probs = with_ratios(old, [[1.2, 0.9, 1.1], [0.8, 1.1]])
    advantages = torch.tensor([1.5, -0.5, 0.0])
    _, _, gradient = run(gspo_loss, log_probs, old, advantages, loss_agg_mode="seq-mean-token-mean")

    clean = log_probs.detach().nan_to_num().requires_grad_()
    log_ratio = torch.where(MASK.bool(), clean - old.nan_to_num(), 0.0)
    sequence_ratio = torch.exp(log_ratio.sum(dim=1) / MASK.sum(dim=1).clamp(min=1))
    (expected,) = torch.autograd.grad((-advantages * sequence_ratio).sum() / 3, clean)
    assert_close(gradient, expected)
    # By hand, row 0: s0 = (1.2 * 0.9 * 1.1)^(1/3) = 1.188^(1/3) = 1.059105; -1.5 * 1.059105 / (3 * 3) = -0.176518
    assert_close(gradient[0, 1:], [-0.176518] * 3)


def test_gspo_with_one_response_token_is_ppo():
    mask = torch.tensor([[0, 1], [1, 0], [0, 1], [0, 1]])
    old = torch.tensor([[NAN, -1.0], [-2.0, NAN], [NAN, -0.5], [NAN, -3.0]])
    ratios = torch.tensor([[1.0, 1.5], [0.5, 1.0], [1.1, 1.1], [1.0, 0.7]])
    log_probs = (old + ratios.log()).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, 2.0, -0.5])
    scale = LossScale(tokens=4, sequences=4, horizon=2)
    gspo, gspo_stats, gspo_gradient = run(gspo_loss, log_probs, old, advantages, mask, scale)
    ppo, ppo_stats, ppo_gradient = run(ppo_loss, log_probs, old, advantages, mask, scale)
    torch.testing.assert_close(gspo, ppo)
    torch.testing.assert_close(gspo_gradient, ppo_gradient)
    for key in ("pg_clipfrac", "ppo_kl"):
        torch.testing.assert_close(gspo_stats.token_sums[key], ppo_stats.token_sums[key])
    # Range [0.8, 1.2]: r=1.5 with A>0, r=0.5 and r=0.7 with A<0 are clipped; r=1.1 is not
    assert gspo_stats.token_sums["pg_clipfrac"].item() == 3.0


# --- cispo ---------------------------------------------------------------------------------------------------------

def test_cispo_caps_the_weight_and_keeps_every_tokens_gradient():
    old = on_mask([[-1.0] * 3, [-1.0] * 2])
    log_probs = with_ratios(old, [[1.5, 0.5, 1.1], [2.0, 0.9]])
    advantages = torch.tensor([1.0, -1.0, 3.0])
    loss, stats, gradient = run(cispo_loss, log_probs, old, advantages, config=CISPOConfig(clip_high=0.2))
    # Weights sg[min(r, 1.2)]: row 0 [1.2 (capped), 0.5 (no lower cap), 1.1], row 1 [1.2 (capped), 0.9]
    # logp = -1 + log r: row 0 [-0.594535, -1.693147, -0.904690], row 1 [-0.306853, -1.105361]
    # per token -w A logp:
    #   row 0, A=+1:  0.713442 + 0.846574 + 0.995159 =  2.555175
    #   row 1, A=-1: -0.368224 - 0.994824            = -1.363048
    # sum = 1.192127 over 5 tokens
    assert loss.item() == pytest.approx(1.192127 / 5, abs=1e-6)
    # d/d logp = -w A / 5: the capped tokens keep a gradient, scaled by the capped weight 1.2
    assert_close(gradient, on_mask([[-1.2 / 5, -0.5 / 5, -1.1 / 5], [1.2 / 5, 0.9 / 5]], fill=0.0))
    assert stats.token_sums["pg_clipfrac"].item() == 2.0
    ppo_kl = -math.log(1.5 * 0.5 * 1.1 * 2.0 * 0.9)
    assert stats.token_sums["ppo_kl"].item() == pytest.approx(ppo_kl, abs=1e-5)
    # PPO (range [0.8, 1.2]) clips r=1.5 with A>0, which then has no gradient; CISPO keeps it
    _, _, ppo_gradient = run(ppo_loss, log_probs, old, advantages)
    assert ppo_gradient[0, 1].item() == 0.0 and gradient[0, 1].item() != 0.0


# --- clip_cov and kl_cov -------------------------------------------------------------------------------------------

# Log-probs row 0 [-1, -3, -2], row 1 [-4, 0]: mean -2, centred [1, -1, 0], [-2, 2].
# Advantages row 0 +2, row 1 -1 per token [2, 2, 2, -1, -1]: mean 0.8, centred [1.2, 1.2, 1.2], [-1.8, -1.8].
# Covariances: [1.2, -1.2, 0], [3.6, -3.6].
# Ratios row 0 [1.5, 1.1, 0.9], row 1 [1.1, 0.7]; PPO (range [0.8, 1.2]) per token and gradient (x 5 tokens):
#   t0: A=+2, r=1.5 -> -2.4 (clipped, no gradient)   t1: A=+2, r=1.1 -> -2.2 (grad -2.2)   t2: r=0.9 -> -1.8 (-1.8)
#   t3: A=-1, r=1.1 ->  1.1 (grad 1.1)                t4: A=-1, r=0.7 -> 0.8 (clipped, no gradient)
COV_LOG_PROBS = on_mask([[-1.0, -3.0, -2.0], [-4.0, 0.0]])
COV_RATIOS = [[1.5, 1.1, 0.9], [1.1, 0.7]]
COV_ADVANTAGES = torch.tensor([2.0, -1.0, 0.0])


def cov_inputs():
    old = COV_LOG_PROBS - on_mask(COV_RATIOS).log()
    return COV_LOG_PROBS.clone().requires_grad_(), old


def test_clip_cov_drops_the_drawn_token_from_the_loss_and_keeps_ppo_elsewhere():
    log_probs, old = cov_inputs()
    loss, stats, gradient = run(clip_cov_loss, log_probs, old, COV_ADVANTAGES,
                                config=ClipCovConfig(ratio=0.2, lb=1.0, ub=5.0))
    # In the band [1, 5]: t0 (1.2, but already clipped by PPO: not a candidate) and t3 (3.6).
    # max(1, floor(0.2 * 5)) = 1 token drawn: t3, whose term becomes 0.
    # sum = -2.4 - 2.2 - 1.8 + 0 + 0.8 = -5.6 over 5 tokens
    assert loss.item() == pytest.approx(-5.6 / 5, abs=1e-6)
    assert_close(gradient, on_mask([[0.0, -2.2 / 5, -1.8 / 5], [0.0, 0.0]], fill=0.0))
    _, _, ppo_gradient = run(ppo_loss, log_probs, old, COV_ADVANTAGES)
    assert_close(ppo_gradient, on_mask([[0.0, -2.2 / 5, -1.8 / 5], [1.1 / 5, 0.0]], fill=0.0))
    assert stats.token_sums["pg_clipfrac"].item() == 1.0  # drawn
    assert stats.token_sums["pg_clipfrac_ppo"].item() == 2.0  # t0 and t4
    assert stats.token_sums["pg_clipfrac_lower"].item() == 0.0


def test_clip_cov_draws_nothing_outside_the_band():
    log_probs, old = cov_inputs()
    loss, stats, _ = run(clip_cov_loss, log_probs, old, COV_ADVANTAGES, config=ClipCovConfig(lb=4.0, ub=5.0))
    # No covariance in [4, 5]: PPO's loss, (-5.6 + 1.1) / 5
    assert loss.item() == pytest.approx(-4.5 / 5, abs=1e-6)
    assert stats.token_sums["pg_clipfrac"].item() == 0.0


def random_batch(rows: int = 6, positions: int = 8, seed: int = 0):
    """Random log-probs, advantages and importance weights; responses of 0-7 tokens after a prompt token, NaN
    elsewhere (but in the log-probs, which have gradient)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 5, 0, 6, 3, 7])[:rows]
    mask = (torch.arange(positions) >= 1) & (torch.arange(positions) <= lengths[:, None])
    old = torch.where(mask, -torch.rand(rows, positions, generator=generator) * 3, NAN)
    log_probs = (old + 0.3 * torch.randn(rows, positions, generator=generator)).nan_to_num().requires_grad_()
    advantages = torch.where(mask, torch.randn(rows, positions, generator=generator), NAN)
    weights = torch.where(mask, torch.rand(rows, positions, generator=generator) * 2, NAN)
    return log_probs, old, advantages, weights, mask.long()


def drawn_tokens(log_probs, old, advantages, mask, config: ClipCovConfig) -> torch.Tensor:
    """Where clip_cov's gradient is 0 but PPO's is not: the tokens it drew."""
    scale = LossScale(tokens=mask.sum().item(), sequences=len(mask), horizon=mask.shape[1])
    _, _, gradient = run(clip_cov_loss, log_probs, old, advantages, mask, scale, config=config)
    _, _, ppo_gradient = run(ppo_loss, log_probs, old, advantages, mask, scale)
    return (gradient == 0) & (ppo_gradient != 0)


def test_clip_cov_draw_is_reproducible_and_leaves_the_global_rng_alone():
    log_probs, old, advantages, _, mask = random_batch()
    wide_band = ClipCovConfig(ratio=0.1, lb=-100.0, ub=100.0)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    drawn = drawn_tokens(log_probs, old, advantages, mask, wide_band)
    assert torch.equal(torch.get_rng_state(), state)
    # 28 response tokens: floor(0.1 * 28) = 2 drawn
    assert mask.sum().item() == 28 and drawn.sum().item() == 2
    torch.manual_seed(2)
    assert torch.equal(drawn_tokens(log_probs, old, advantages, mask, wide_band), drawn)
    # Other data draws other tokens: the seed comes from the old log-probs.
    shifted = drawn_tokens(log_probs, old - 1e-3, advantages, mask, wide_band)
    assert shifted.sum().item() == 2 and not torch.equal(shifted, drawn)


def test_clip_cov_rejects_an_empty_band():
    with pytest.raises(ValueError, match="actor.clip_cov.lb=5.0 is above actor.clip_cov.ub=1.0"):
        run(clip_cov_loss, *cov_inputs(), COV_ADVANTAGES, config=ClipCovConfig(lb=5.0, ub=1.0))


def test_kl_cov_penalises_the_top_covariance_tokens_only():
    log_probs, old = cov_inputs()
    loss, stats, gradient = run(kl_cov_loss, log_probs, old, COV_ADVANTAGES, config=KLCovConfig(ratio=0.4, kl_coef=0.5))
    # floor(0.4 * 5) = 2 tokens of the largest covariance: t3 (3.6) and t0 (1.2).
    # No clip: -A r = [-3.0, -2.2, -1.8], [1.1, 0.7], sum -5.2
    # penalties 0.5 * |log r|: t0 0.5 * log 1.5 = 0.202733, t3 0.5 * log 1.1 = 0.047655
    # sum = -5.2 + 0.250388 = -4.949612 over 5 tokens
    assert loss.item() == pytest.approx(-4.949612 / 5, abs=1e-6)
    # d/d logp: -A r, plus 0.5 * sign(log r) on t0 and t3: [-2.5, -2.2, -1.8], [1.6, 0.7], / 5
    assert_close(gradient, on_mask([[-0.5, -0.44, -0.36], [0.32, 0.14]], fill=0.0))
    assert stats.token_sums["pg_clipfrac"].item() == 2.0
    assert stats.token_sums["kl_cov_penalty"].item() == pytest.approx(math.log(1.5) + math.log(1.1), abs=1e-6)
    ppo_kl = -math.log(1.5 * 1.1 * 0.9 * 1.1 * 0.7)
    assert stats.token_sums["ppo_kl"].item() == pytest.approx(ppo_kl, abs=1e-5)


def test_kl_cov_picks_at_least_one_token():
    log_probs, old = cov_inputs()
    _, stats, gradient = run(kl_cov_loss, log_probs, old, COV_ADVANTAGES, config=KLCovConfig(kl_coef=0.5))
    # The default 2e-4 of 5 tokens rounds down to 0: one token, t3, the largest covariance
    assert stats.token_sums["pg_clipfrac"].item() == 1.0
    assert_close(gradient[1, 1], 1.6 / 5)


# --- what every loss shares ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BUILT_IN)
def test_importance_weights_multiply_each_tokens_loss(name):
    log_probs, old, advantages, weights, mask = random_batch()
    scale = LossScale(tokens=28, sequences=6, horizon=8)
    loss, _, gradient = run(POLICY_LOSSES.bound(name, {}), log_probs, old, advantages, mask, scale)
    tripled, _, _ = run(POLICY_LOSSES.bound(name, {}), log_probs, old, advantages, mask, scale,
                        importance_weights=torch.where(mask.bool(), 3.0, NAN))
    torch.testing.assert_close(tripled, 3 * loss)
    # Each token's loss has a gradient in its own log-prob only, so the weights scale the gradient token by token.
    _, _, weighted_gradient = run(POLICY_LOSSES.bound(name, {}), log_probs, old, advantages, mask, scale,
                                  importance_weights=weights)
    torch.testing.assert_close(weighted_gradient, torch.where(mask.bool(), weights * gradient, 0.0))


@pytest.mark.parametrize("name", BUILT_IN)
def test_garbage_outside_the_mask_reaches_neither_loss_nor_gradient(name):
    log_probs, old, advantages, weights, mask = random_batch()
    scale = LossScale(tokens=28, sequences=6, horizon=8)
    outside = ~mask.bool()
    clean = [torch.where(outside, 0.0, tensor.detach()) for tensor in (log_probs, old, advantages, weights)]
    clean[0].requires_grad_()
    garbage = [torch.where(outside, fill, tensor) for tensor, fill in zip(clean, (torch.inf, NAN, -torch.inf, NAN))]
    garbage[0] = garbage[0].detach().requires_grad_()
    results = [run(POLICY_LOSSES.bound(name, {}), *inputs[:3], mask, scale, importance_weights=inputs[3])
               for inputs in (clean, garbage)]
    (clean_loss, clean_stats, clean_gradient), (loss, stats, gradient) = results
    assert loss.isfinite() and gradient.isfinite().all() and (gradient[outside] == 0).all()
    torch.testing.assert_close(loss, clean_loss)
    torch.testing.assert_close(gradient, clean_gradient)
    for key, value in clean_stats.token_sums.items():
        torch.testing.assert_close(stats.token_sums[key], value)


MICRO_BATCHES = (slice(0, 2), slice(2, 6))  # uneven halves, the second with the empty row


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_micro_batch_losses_sum_to_the_mini_batch_loss(name, mode):
    log_probs, old, advantages, weights, mask = random_batch()
    actor = ActorConfig(loss_agg_mode=mode, clip_ratio_low=0.05, clip_ratio_high=0.05)
    scale = LossScale(tokens=28, sequences=6, horizon=8)
    loss = POLICY_LOSSES.bound(name, {"actor.cispo.clip_high": 0.1})

    def loss_of(rows):
        return loss(log_probs[rows], old[rows], advantages[rows], mask[rows], actor=actor,
                                   scale=scale, importance_weights=weights[rows])

    whole, whole_stats = loss_of(slice(None))
    parts, part_stats = zip(*(loss_of(rows) for rows in MICRO_BATCHES))
    torch.testing.assert_close(sum(parts), whole)
    assert whole_stats.token_sums["pg_clipfrac"] > 0  # the clip ranges do bind in this batch
    for key, value in whole_stats.token_sums.items():
        torch.testing.assert_close(sum(stats.token_sums[key] for stats in part_stats), value)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_every_registered_loss_runs_with_the_default_config(name):
    log_probs, old, advantages, weights, mask = random_batch()
    loss, stats = POLICY_LOSSES.bound(name, {})(log_probs, old, advantages, mask, actor=ActorConfig(),
                                                scale=LossScale(tokens=28, sequences=6, horizon=8),
                                                importance_weights=weights)
    loss.backward()
    assert loss.isfinite() and log_probs.grad.isfinite().all()
    assert stats.tokens == 28 and {"pg_clipfrac", "ppo_kl"} <= set(stats.token_sums)


# --- a user's own, through the config ------------------------------------------------------------------------------

@pytest.fixture
def restore_registries(monkeypatch):
    """What a test registers is gone after it."""
    for registry in (POLICY_LOSSES, ADV_ESTIMATORS):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))


def load_demo(*overrides):
    """The demo config, with its (repo-relative) model path made absolute so the tests run from any folder."""
    return load_config(DEMO, [f"model.path={DEMO_MODEL}", *overrides])


def imported_from(function, path) -> bool:
    return sys.modules[function.__module__].__file__ == str(path)


def test_a_users_policy_loss_registers_from_trainer_imports(tmp_path, restore_registries):
    path = tmp_path / "my_losses.py"
    path.write_text(
        "import rl_megatron.algorithms\n\n"
        "@rl_megatron.algorithms.register_policy_loss('my_loss')\n"
        "def my_loss(log_probs, old_log_probs, advantages, response_mask, *, actor, scale, importance_weights=None):\n"
        "    raise NotImplementedError\n")
    cfg = load_demo(f"trainer.imports=[{path}]", "actor.policy_loss=my_loss")
    assert cfg.actor.policy_loss == "my_loss"
    assert POLICY_LOSSES["my_loss"].__name__ == "my_loss" and imported_from(POLICY_LOSSES["my_loss"], path)


def test_an_unregistered_policy_loss_names_the_key_the_choices_and_the_decorator():
    with pytest.raises(ConfigError) as info:
        load_demo("actor.policy_loss=nope")
    message = str(info.value)
    assert "actor.policy_loss='nope'" in message and "register_policy_loss('nope')" in message
    assert all(name in message for name in BUILT_IN)


def test_a_users_advantage_estimator_registers_from_trainer_imports(tmp_path, restore_registries):
    path = tmp_path / "my_estimators.py"
    path.write_text(
        "from rl_megatron.algorithms import register_adv_estimator\n\n"
        "@register_adv_estimator('my_adv', needs_critic=False)\n"
        "def my_adv(inputs):\n"
        "    return inputs.token_rewards, None\n")
    cfg = load_demo(f"trainer.imports=[{path}]", "algorithm.adv_estimator=my_adv")
    assert cfg.algorithm.adv_estimator == "my_adv" and cfg.critic.enable is False
    assert imported_from(ADV_ESTIMATORS["my_adv"], path)

@pytest.mark.parametrize("name", BUILT_IN)
def test_no_loss_waits_on_the_host(name):
    """Every built-in loss, forward and backward, runs on the device without a host sync (Clip-Cov's draw and
    KL-Cov's top-k included): counted as a GPU run would sync, with the inputs as device tensors."""
    log_probs, old, advantages, weights, mask = random_batch()
    scale = LossScale(tokens=28, sequences=6, horizon=8)
    actor = ActorConfig()
    own_keys = {"actor.clip_cov.ratio": 0.1, "actor.clip_cov.lb": -100.0, "actor.clip_cov.ub": 100.0,
                "actor.kl_cov.ratio": 0.1}

    def step():
        loss, stats = POLICY_LOSSES.bound(name, own_keys)(log_probs, old, advantages, mask, actor=actor,
                                                          scale=scale, importance_weights=weights)
        loss.backward()

    with HostSyncCounter([log_probs, old, advantages, weights, mask], torch.device("cpu")) as counter:
        step()
    assert counter.count == 0, counter.report()
