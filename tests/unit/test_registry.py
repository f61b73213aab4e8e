"""The one Registry behind every by-name extension point (its entries, traits, overrides, the error for an unknown
name), the keys an extension owns (a user's loss with its own section, from a module of trainer.imports; a built-in
loss's keys under their former flat spelling; unknown keys refused naming the section), and `--help` showing every
key with its comment."""
import contextlib
import dataclasses
import io
import os

import pytest
import torch
from helpers.runs import REPO

from rl_megatron.algorithms import (ADV_ESTIMATORS, POLICY_LOSSES, AdvantageInputs, LossScale, compute_advantages,
                                    register_adv_estimator)
from rl_megatron.agents import AGENT_LOOPS
from rl_megatron.config import ConfigError, load, to_yaml
from rl_megatron.config.describe import field_comments
from rl_megatron.config.extensions import resolve_extension_keys
from rl_megatron.config.fields import checked, within
from rl_megatron.config.schema import ActorConfig, TrainerConfig
from rl_megatron.models.family import FAMILIES
from rl_megatron.preflight import load_config
from rl_megatron.registry import Registry
from rl_megatron.rewards import SCORERS
from rl_megatron.tracking.tracker import BACKENDS
from rl_megatron.train import main as train_main

DEMO = os.path.join(REPO, "configs", "demo_cpu.yaml")
DEMO_MODEL = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")


@dataclasses.dataclass
class Window:
    width: int = checked(3, within(1, 10), formerly="game.window_width")  # positions it looks at
    # how far it moves
    step: int = 1

    def check(self, section: str) -> None:
        if self.step > self.width:
            raise ConfigError(f"{section}.step={self.step} is above {section}.width={self.width}")


def games() -> Registry:
    return Registry("game", "game.name", "register yours with @register_game({name!r})")


# --- the Registry ---------------------------------------------------------------------------------------------------

def test_entries_register_by_name_with_their_traits():
    registry = games()

    @registry.register("chess", players=2)
    def chess():
        return "chess"

    registry.add("solitaire", len, players=1, timed=True)
    assert registry["chess"] is chess and registry.get("solitaire") is len and registry.get("go") is None
    assert "chess" in registry and list(registry) == ["chess", "solitaire"]
    assert registry.names() == ["chess", "solitaire"]
    assert registry.trait("chess", "players") == 2 and registry.trait("chess", "timed", False) is False
    assert registry.with_trait("timed") == {"solitaire"}
    registry.remove("solitaire")
    assert registry.names() == ["chess"]


def test_a_later_registration_overrides_unless_the_registry_is_unique():
    registry = games()
    registry.add("chess", 1, players=2)
    registry.add("chess", 2)
    assert registry["chess"] == 2 and registry.trait("chess", "players") is None  # the new entry's traits only
    unique = dataclasses.replace(games(), unique=True)
    unique.add("chess", 1)
    with pytest.raises(ValueError, match="the game 'chess' is registered twice"):
        unique.add("chess", 2)


def test_an_unknown_name_names_the_key_the_registered_names_and_how_to_add_one():
    registry = games()
    registry.add("go", 1)
    registry.add("chess", 2)
    with pytest.raises(ConfigError, match=r"^game.name='checkers' is not a registered game \(registered: chess, go\)\. "
                                          r"Use one of those, or register yours with @register_game\('checkers'\)\.$"):
        registry["checkers"]
    fixed = Registry("logger", "trainer.logger")
    with pytest.raises(ConfigError, match=r"\(registered: \)\. Use one of those\.$"):
        fixed.check("neptune")
    with pytest.raises(TypeError, match="non-empty name"):
        registry.add("", 3)
    with pytest.raises(TypeError, match="must be a dataclass"):
        registry.add("go", 1, config=dict)


def test_an_entry_gets_its_own_config_from_its_section():
    registry = games()
    registry.add("chess", lambda moves, config: (moves, config.width, config.step), config=Window)
    registry.add("go", lambda moves: moves)
    assert registry.section("chess") == "game.chess"
    assert registry.config_sections() == {"game.chess": ("chess", Window)}
    keys = {"game.chess.width": 5, "game.other.width": 9}
    assert registry.config("chess", keys) == Window(width=5) and registry.config("go", keys) is None
    assert registry.bound("chess", keys)(7) == (7, 5, 1) and registry.bound("go", keys)(7) == 7


def test_every_by_name_extension_point_is_a_registry():
    for registry, name in ((POLICY_LOSSES, "ppo"), (SCORERS, "arithmetic"), (AGENT_LOOPS, "tool_agent"),
                           (BACKENDS, "jsonl"), (FAMILIES, "qwen2")):
        assert isinstance(registry, Registry) and name in registry
    assert AGENT_LOOPS["single_turn"] is None
    with pytest.raises(ConfigError, match="rollout.agent_loop='chat'.*register_agent_loop.*'package.module:Class'"):
        AGENT_LOOPS["chat"]


# --- an extension's own keys ----------------------------------------------------------------------------------------

USER_LOSS = '''
from dataclasses import dataclass

from rl_megatron.algorithms import ppo_loss, register_policy_loss
from rl_megatron.config.fields import checked, within


@dataclass
class ScaledConfig:
    factor: float = checked(1.0, within(0, 10))  # multiplies PPO's loss
    note: str = "none"


@register_policy_loss("scaled_ppo", config=ScaledConfig)
def scaled_ppo(log_probs, old_log_probs, advantages, response_mask, *, actor, scale, importance_weights=None, config):
    loss, stats = ppo_loss(log_probs, old_log_probs, advantages, response_mask, actor=actor, scale=scale,
                           importance_weights=importance_weights)
    return loss * config.factor, stats
'''


@pytest.fixture
def user_loss(tmp_path, monkeypatch):
    """A module of the user's registering the loss scaled_ppo with its own key actor.scaled_ppo.factor."""
    monkeypatch.setattr(POLICY_LOSSES, "_entries", dict(POLICY_LOSSES._entries))
    path = tmp_path / "scaled_losses.py"
    path.write_text(USER_LOSS)
    return f"trainer.imports=[{path}]"


def load_demo(*overrides):
    return load_config(DEMO, [f"model.path={DEMO_MODEL}", *overrides])


def test_a_users_loss_reads_its_own_keys_from_the_section_named_after_it(user_loss):
    cfg = load_demo(user_loss, "actor.policy_loss=scaled_ppo", "actor.scaled_ppo.factor=2")
    assert cfg.extension_keys["actor.scaled_ppo.factor"] == 2.0  # typed as its field: a float
    assert cfg.extension_keys["actor.scaled_ppo.note"] == "none" and cfg.extension_keys["actor.clip_cov.ratio"] == 2e-4
    assert "  scaled_ppo:\n    factor: 2.0\n" in to_yaml(cfg)  # the run's config.yaml writes it as a YAML sets it
    log_probs = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    mask, advantages = torch.tensor([[0, 1, 1]]), torch.tensor([1.0])
    scale = LossScale(tokens=2, sequences=1, horizon=2)
    run = {name: POLICY_LOSSES.bound(name, cfg.extension_keys)(log_probs, log_probs.detach(), advantages, mask,
                                                                 actor=cfg.actor, scale=scale)[0]
           for name in ("ppo", "scaled_ppo")}
    torch.testing.assert_close(run["scaled_ppo"], 2 * run["ppo"])


def test_an_estimator_gets_its_own_keys_from_the_config(monkeypatch):
    monkeypatch.setattr(ADV_ESTIMATORS, "_entries", dict(ADV_ESTIMATORS._entries))

    @register_adv_estimator("scaled_rewards", config=Window)
    def scaled_rewards(inputs, config):
        return inputs.token_rewards * config.width, None

    inputs = AdvantageInputs(torch.ones(1, 2), torch.ones(1, 2), torch.zeros(1))
    keys = resolve_extension_keys({"algorithm.scaled_rewards.width": 4}, [ADV_ESTIMATORS])
    assert keys == {"algorithm.scaled_rewards.width": 4, "algorithm.scaled_rewards.step": 1}
    assert compute_advantages("scaled_rewards", inputs, keys)[0].tolist() == [[4.0, 4.0]]
    assert compute_advantages("scaled_rewards", inputs)[0].tolist() == [[3.0, 3.0]]  # its defaults
    # A former flat spelling is read as its key; the dataclass's own check sees the keys together.
    keys = resolve_extension_keys({"game.window_width": 5}, [ADV_ESTIMATORS])
    assert keys["algorithm.scaled_rewards.width"] == 5
    with pytest.raises(ConfigError, match="algorithm.scaled_rewards.step=6 is above algorithm.scaled_rewards.width=5"):
        resolve_extension_keys({"game.window_width": 5, "algorithm.scaled_rewards.step": 6}, [ADV_ESTIMATORS])


@pytest.mark.parametrize("override, words", [
    ("actor.scaled_ppo.factr=2", "Unknown config key 'actor.scaled_ppo.factr': actor.scaled_ppo holds the own keys "
                                 "of the policy loss scaled_ppo, which are factor, note."),
    ("actor.scaled_ppo.factor=20", "actor.scaled_ppo.factor=20.0 must be in [0, 10]."),
    ("actor.scaled_ppo.factor=big", "Config key 'actor.scaled_ppo.factor' has a bad value 'big'"),
    ("actor.scaled_loss.factor=2", "Unknown config key 'actor.scaled_loss.factor'"),
    ("actor.tensr_model_parallel_size=2", "Did you mean 'actor.tensor_model_parallel_size'?"),
])
def test_keys_no_extension_owns_or_bad_values_are_refused_naming_the_key(user_loss, override, words):
    with pytest.raises(ConfigError) as info:
        load_demo(user_loss, override)
    assert words in str(info.value)


def test_a_moved_key_is_read_under_its_former_flat_spelling(tmp_path):
    yaml = tmp_path / "old.yaml"
    yaml.write_text(f"model:\n  path: {DEMO_MODEL}\n  random_init: true\n"
                    "actor:\n  policy_loss: kl_cov\n  ppo_kl_coef: 0.3\n  kl_cov:\n    ratio: 0.01\n")
    cfg = load_config(str(yaml), ["actor.clip_cov_ub=7"])
    assert cfg.extension_keys["actor.kl_cov.kl_coef"] == 0.3 and cfg.extension_keys["actor.kl_cov.ratio"] == 0.01
    assert cfg.extension_keys["actor.clip_cov.ub"] == 7.0 and "actor.clip_cov_ub" not in cfg.extension_keys
    assert not hasattr(ActorConfig(), "clip_cov_ub")
    with pytest.raises(ConfigError, match="actor.clip_cov.lb=9.0 is above actor.clip_cov.ub=7.0.*Swap"):
        load_config(str(yaml), ["actor.clip_cov_ub=7", "actor.clip_cov.lb=9"])


def test_load_keeps_an_extension_sections_keys_as_given_for_resolve():
    cfg = load(None, ["model.path=m", "actor.clip_cov.ratio=0.5", "actor.my_loss.beta=1"])
    assert cfg.extension_keys == {"actor.clip_cov.ratio": 0.5, "actor.my_loss.beta": 1}
    with pytest.raises(ConfigError, match="Unknown config key 'actor.optim.beta1'"):  # a schema section's: at once
        load(None, ["model.path=m", "actor.optim.beta1=0.9"])


# --- --help -----------------------------------------------------------------------------------------------------------

def help_text(*argv) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        train_main(list(argv))
    return exited.value.code, out.getvalue() + err.getvalue()


def test_help_shows_every_key_with_its_type_default_and_comment():
    code, text = help_text("--help")
    assert code == 0 and "--config CONFIG" in text
    assert "  trainer.total_steps: int = 100\n      number of RL steps (generate -> score -> update -> sync) " \
           "(must be at least 1)\n" in text
    assert "  actor.recompute_granularity: full | selective or null = null\n" in text
    assert "  rollout.multi_turn: section\n      limits and tools of multi-turn agent loops\n" in text
    assert "  actor.clip_cov.ratio: float = 0.0002\n      fraction of a micro-batch's response tokens" in text
    # A comment above a key (its line has none) is its description.
    assert "  trainer.save_every: int = 0\n      save a checkpoint every this many steps" in text


def test_help_of_a_section_shows_its_keys_only():
    code, text = help_text("--help", "rollout")
    assert code == 0 and "  rollout.n: int = 8\n      samples per prompt (the GRPO group size)" in text
    assert "  trainer.total_steps:" not in text and "  actor.clip_cov" not in text
    code, text = help_text("--help", "actor.clip_cov")
    assert code == 0 and [line.split(":")[0].strip() for line in text.splitlines() if line.startswith("  actor.")] \
        == ["actor.clip_cov.ratio", "actor.clip_cov.lb", "actor.clip_cov.ub"]
    code, text = help_text("--help", "rollot")
    assert code == 2 and "--help rollot: no such config section" in text and "rollout" in text


def test_a_fields_comment_is_its_description():
    assert field_comments(Window) == {"width": "positions it looks at", "step": "how far it moves"}
    assert field_comments(TrainerConfig)["seed"] == "seeds model init, data order and sampling"
