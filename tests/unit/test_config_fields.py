"""The one check of every key's range (`checked` in schema.py) and choices (`Literal` in schema.py): a bad value
of any key gives the same message, naming the key, the rule and what to use. No processes: well under a second."""
import dataclasses
import typing

import pytest

from rl_megatron.config import ConfigError, load
from rl_megatron.config.fields import Bound, at_least, check_fields, choices_of
from rl_megatron.config.schema import RULES, Config


def field_error(cfg: Config) -> str:
    with pytest.raises(ConfigError) as info:
        check_fields(cfg, RULES)
    return str(info.value)


def with_value(key: str, value) -> Config:
    """The schema's defaults with one dotted key changed (built in code, past OmegaConf's own type checks)."""
    cfg = Config()
    *sections, name = key.split(".")
    section = cfg
    for part in sections:
        section = getattr(section, part)
    setattr(section, name, value)
    return cfg


@pytest.mark.parametrize("key, value, words", [
    ("trainer.total_steps", 0, "trainer.total_steps=0 must be at least 1."),
    ("critic.optim.lr", -1.0, "critic.optim.lr=-1.0 must not be negative."),
    ("trainer.keep_last", -1, "trainer.keep_last=-1 must not be negative; 0 turns it off."),
    ("rollout.top_p", 1.5, "rollout.top_p=1.5 must be in (0, 1]; use 1.0 to disable nucleus sampling."),
    ("algorithm.lam", -0.5, "algorithm.lam=-0.5 must be in [0, 1]."),
    ("rollout.top_k", 0, "rollout.top_k=0 must be at least 1 or -1; -1 disables top-k sampling."),
    ("moe.capacity_factor", 0.0, "moe.capacity_factor=0.0 must be > 0; e.g. 1.25, or null to drop no tokens."),
    ("ref.micro_batch_size", 0, "ref.micro_batch_size=0 must be at least 1."),
])
def test_a_value_out_of_range_names_the_key_and_the_range(key, value, words):
    assert field_error(with_value(key, value)) == words


@pytest.mark.parametrize("key, value, choices", [
    ("critic.placement", "remote", "colocated, separate"),
    ("moe.router_dtype", "fp16", "fp32, fp64"),
    ("model.dtype", "float16", "float32, bfloat16"),
    ("reward.gsm8k_match", "bogus", "exact, numeric"),
    ("reward.math_match", "bogus", "exact, numeric"),
])
def test_an_unknown_name_names_the_key_and_the_choices(key, value, choices):
    expected = f"{key}='{value}' is unknown: use one of {choices}."
    assert field_error(with_value(key, value)) == expected
    # Merged from an override, OmegaConf refuses the value against the Literal type: with the same message.
    with pytest.raises(ConfigError) as info:
        load(None, ["model.path=m", f"{key}={value}"])
    assert str(info.value) == expected


def test_unset_optional_keys_and_the_defaults_pass():
    check_fields(Config(), RULES)
    assert RULES["rollout.max_model_len"].check(None) is None  # unset: derived later


def test_one_rule_covers_a_section_used_twice():
    """The actor's and the critic's optimizer are one OptimConfig: one set of rules, each named by its own key."""
    assert {key for key in RULES if key.endswith("optim.lr")} == {"actor.optim.lr", "critic.optim.lr"}
    assert RULES["actor.optim.lr"].bound == RULES["critic.optim.lr"].bound
    assert "critic.optim.weight_decay=-1" in field_error(with_value("critic.optim.weight_decay", -1))


def test_every_numeric_key_with_a_range_has_a_default_inside_it():
    for key, rule in RULES.items():
        *sections, name = key.split(".")
        section = Config()
        for part in sections:
            section = getattr(section, part)
        rule.check(getattr(section, name))


def test_choices_of_reads_literal_and_optional_literal_types():
    assert RULES["actor.optim.lr_decay_style"].choices == ("constant", "linear", "cosine")
    assert RULES["moe.token_dispatcher"].choices == ("allgather", "alltoall")
    assert choices_of(int) is None


def test_bound_words():
    assert Bound(low=0, high=1, low_open=True).words() == "be in (0, 1]"
    assert at_least(-1).words() == "be at least -1"
    assert Bound(low=1, low_open=True).words() == "be > 1"


def _float_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every dotted key whose value is a float or holds floats (Adam's betas), read off the schema's types."""
    keys = []
    for f in dataclasses.fields(cls):
        annotation = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(annotation):
            keys += _float_keys(annotation, prefix + f.name + ".")
        elif float in (annotation, *typing.get_args(annotation)):
            keys.append(prefix + f.name)
    return keys


FLOAT_KEYS = _float_keys()


def test_the_float_keys_are_found():
    assert {"actor.optim.lr", "actor.optim.eps", "actor.optim.betas", "trainer.target_reward", "algorithm.gamma",
            "reward.timeout_s"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_refuses_nan_and_inf(key, bad):
    """NaN compares false to every bound, so it is refused by its own rule, and so is a key without a range."""
    value = (bad, 0.999) if key.endswith("betas") else bad
    assert field_error(with_value(key, value)).startswith(f"{key}={value} must be a finite number")


def test_nan_in_an_override_is_refused_with_its_key():
    with pytest.raises(ConfigError, match=r"actor.optim.lr=nan must be a finite number"):
        check_fields(load(None, ["model.path=x", "actor.optim.lr=nan"]), RULES)


def test_bound_refuses_what_is_not_finite():
    assert not at_least(0).admits(float("nan")) and not Bound(low=0, high=1).admits(float("nan"))
    assert not at_least(0).admits(float("inf")) and not at_least(0, also=(-1,)).admits(-float("inf"))
