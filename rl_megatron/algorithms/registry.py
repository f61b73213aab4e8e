"""Named registries of the algorithm's parts (policy losses, advantage estimators) that a config key picks.

The built-in ones register themselves when `rl_megatron.algorithms` is imported; a user's own register from a module
listed in `trainer.imports`, which every process of a run (controller, workers) imports before it looks one up:

    from rl_megatron.algorithms import register_policy_loss

    @register_policy_loss("my_loss")
    def my_loss(log_probs, old_log_probs, advantages, response_mask, *, actor, scale, importance_weights=None):
        ...

and `actor.policy_loss=my_loss trainer.imports=[my_pkg.losses]`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rl_megatron.errors import ConfigError

Fn = TypeVar("Fn", bound=Callable)


@dataclass
class Registry(Generic[Fn]):
    """Functions by name, for the config key `key`; `decorator` is how a user adds one (named in errors)."""
    kind: str  # what an entry is, e.g. "policy loss"
    key: str  # the config key that names one
    decorator: str  # the import path of the register decorator
    entries: dict[str, Fn] = field(default_factory=dict)
    traits: dict[str, dict[str, Any]] = field(default_factory=dict)  # what the trainer must know of an entry

    def register(self, name: str, **traits) -> Callable[[Fn], Fn]:
        """Register the decorated function under `name` (a later registration of a name replaces the earlier one:
        a user may override a built-in); `traits` are read back with `trait`."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"a {self.kind} needs a non-empty name, got {name!r}")

        def add(fn: Fn) -> Fn:
            self.entries[name], self.traits[name] = fn, dict(traits)
            return fn

        return add

    def names(self) -> list[str]:
        return sorted(self.entries)

    def check(self, name: str) -> None:
        """Raise ConfigError naming the key, the registered names and how to add one, unless `name` is registered."""
        if name not in self.entries:
            raise ConfigError(f"{self.key}={name!r} is not a registered {self.kind} (registered: "
                              f"{', '.join(self.names())}). Pick one of those, or register yours with "
                              f"@{self.decorator}({name!r}) in a module listed in trainer.imports.")

    def __getitem__(self, name: str) -> Fn:
        self.check(name)
        return self.entries[name]

    def trait(self, name: str, trait: str, default: Any = None) -> Any:
        self.check(name)
        return self.traits[name].get(trait, default)
