"""The rules a single config value must follow, declared next to its key in schema.py, and the one check of them.

A number's range is a `Bound` in its field's metadata (`checked(default, at_least(1))`); a name's choices are its
`Literal` type, and a list's rule applies to each item (`list[Literal[...]]`). OmegaConf refuses other values as
they are merged, and `check_fields` again for configs built in code. Either way the message is the same, names the
key and says what to use.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal, Union

from rl_megatron.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Bound:
    """The numbers a key takes: `low` .. `high` (each end open or closed, either absent), and the `also` values
    outside that range that mean something of their own (-1: off)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[float, ...] = ()

    def admits(self, value: float) -> bool:
        if not math.isfinite(value):  # NaN compares false to everything: refuse it here, not by accident
            return False
        if value in self.also:
            return True
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def words(self) -> str:
        """The rule, as in "x=0 must <words>"."""
        if self.high is not None:
            rule = (f"be in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                    f"{')' if self.high_open else ']'}")
        elif self.low_open:
            rule = f"be > {self.low:g}"
        elif self.low == 0:
            rule = "not be negative"
        else:
            rule = f"be at least {self.low:g}"
        return rule + "".join(f" or {value:g}" for value in self.also)


def at_least(low: float, also: tuple[float, ...] = ()) -> Bound:
    return Bound(low=low, also=also)


def above(low: float) -> Bound:
    return Bound(low=low, low_open=True)


def within(low: float, high: float, low_open: bool = False) -> Bound:
    return Bound(low=low, high=high, low_open=low_open)


NOT_NEGATIVE = at_least(0)
POSITIVE = at_least(1)  # a count or size


def checked(default: Any, bound: Bound | None = None, hint: str = "", formerly: str | None = None) -> Any:
    """A schema field with a default, the range its value must lie in, and a `hint` that follows the rule in the
    message (what a special value means, an example). `formerly`: the dotted key it was set by before it moved into
    an extension's own section (actor.clip_cov_ratio, now actor.clip_cov.ratio), still read as this key."""
    return dataclasses.field(default=default, metadata={"bound": bound, "hint": hint, "formerly": formerly})


def extension_name(default: str) -> Any:
    """A key naming a registered extension (a policy loss, an advantage estimator): the extension's own keys live in
    the section named after it, next to this key (actor.policy_loss=clip_cov reads actor.clip_cov.ratio)."""
    return dataclasses.field(default=default, metadata={"names_extension": True})


def choices_of(annotation: Any) -> tuple | None:
    """The values a `Literal[...]` (or `Optional[Literal[...]]`) type allows; None for other types."""
    if typing.get_origin(annotation) is Union:
        inner = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        annotation = inner[0] if len(inner) == 1 else annotation
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else None


def list_item_type(annotation: Any) -> Any:
    """The type of a `list[...]` key's items; None for other types."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else None


def choice_error(key: str, value: Any, choices: tuple, hint: str = "") -> ConfigError:
    return ConfigError(f"{key}='{value}' is unknown: use one of {', '.join(map(str, choices))}"
                       f"{'; ' + hint if hint else ''}.")


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one key of the schema allows: the choices of a Literal type, a numeric `Bound`, and the hint; `each`:
    the key is a list, and the rule is its items' (`list[Literal[...]]`)."""

    key: str
    choices: tuple | None
    bound: Bound | None
    hint: str
    each: bool = False

    def check(self, value: Any) -> None:
        if value is None:  # an optional key left unset: its default is worked out elsewhere
            return
        if self.each and not isinstance(value, (list, tuple)):
            raise ConfigError(f"{self.key}={value!r} must be a list, e.g. {self.key}=[{value}].")
        hint = f"; {self.hint}" if self.hint else ""
        for item in value if self.each else [value]:
            if self.choices is not None and item not in self.choices:
                raise choice_error(self.key, item, self.choices, self.hint)
            if self.bound is not None and not self.bound.admits(item):
                raise ConfigError(f"{self.key}={item} must {self.bound.words()}{hint}.")


def schema_rules(cls: type, prefix: str = "") -> dict[str, Rule]:
    """The rule of every key of the dataclass `cls` (and its sections) that has one, by dotted key."""
    rules = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, annotation = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(annotation):
            rules.update(schema_rules(annotation, key + "."))
            continue
        item_type = list_item_type(annotation)
        choices, bound = choices_of(annotation if item_type is None else item_type), f.metadata.get("bound")
        if choices is not None or bound is not None:
            rules[key] = Rule(key, choices, bound, f.metadata.get("hint", ""), each=item_type is not None)
    return rules


def check_finite(key: str, value: Any) -> None:
    """A float (or a list's floats) must be a number: nan or inf would train on, or fail much later, unnoticed."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in values):
        raise ConfigError(f"{key}={value} must be a finite number, not nan or inf; set a real value (see its "
                          "default and comment in rl_megatron/config/schema.py).")


def check_fields(section: Any, rules: dict[str, Rule], prefix: str = "") -> None:
    """Every value of `section` (a schema dataclass, `prefix` its dotted key) finite and within its rule."""
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            check_fields(value, rules, key + ".")
            continue
        check_finite(key, value)
        if key in rules:
            rules[key].check(value)
