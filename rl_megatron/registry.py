"""The one registry behind every name that a config key or a data row picks: policy losses (actor.policy_loss),
advantage estimators (algorithm.adv_estimator), reward scorers (a row's data_source), agent loops
(rollout.agent_loop), loggers (trainer.logger) and model families (config.json's model_type).

An entry is a value (a function, a class, a record) under a name, with its traits (what a caller must know of it
without calling it, e.g. an estimator's needs_critic) and, optionally, a dataclass of config keys of its own. Those
keys live in the section named after the entry, next to the key that names it: a loss registered with
`@register_policy_loss("clip_cov", config=ClipCovConfig)` reads actor.clip_cov.ratio, actor.clip_cov.lb, ... The
dataclass is flat and written as the schema's sections are (`checked` ranges, a comment per field, which --help
shows; a `check(section)` method for keys that go together); `rl_megatron.config.extensions` checks the keys once
trainer.imports has run, and `bound` hands the entry its own config as the keyword `config`.

Built-in entries register as their package is imported; a user's own from a module listed in trainer.imports,
which every process of a run (controller, workers, scorer processes) imports before it looks one up. A later
registration of a name replaces the earlier one (a user may override a built-in), unless the registry is `unique`.

A leaf module: it imports nothing of rl_megatron but `errors`, so that any package, the config floor included, can
hold or read a registry.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any, Generic, TypeVar

from rl_megatron.errors import ConfigError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Entry(Generic[T]):
    value: T
    traits: dict[str, Any]
    config: type | None  # the dataclass of the entry's own keys (None: it has none)


@dataclasses.dataclass
class Registry(Generic[T]):
    """Entries by name, for `key`: the config key (or data field) that names one. `how_to_add` ends the sentence
    "Use one of those, or ..." of the error for an unknown name, `{name}` standing for that name ("register yours
    with @rl_megatron.algorithms.register_policy_loss({name!r}) in a module listed in trainer.imports"); None for a
    fixed set."""

    kind: str  # what an entry is, e.g. "policy loss"
    key: str  # what names one, e.g. "actor.policy_loss"
    how_to_add: str | None = None
    unique: bool = False  # a name registered twice is an error (model families: one record per model_type)
    _entries: dict[str, Entry[T]] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def add(self, name: str, value: T, *, config: type | None = None, **traits: Any) -> T:
        """Register `value` under `name` with its `traits` and the dataclass of its own keys, `config`."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"a {self.kind} needs a non-empty name, got {name!r}")
        if config is not None and not dataclasses.is_dataclass(config):
            raise TypeError(f"the {self.kind} {name!r}: config={config!r} must be a dataclass of its own keys")
        if self.unique and name in self._entries:
            raise ValueError(f"the {self.kind} {name!r} is registered twice; register it once")
        self._entries[name] = Entry(value, dict(traits), config)
        return value

    def register(self, name: str, *, config: type | None = None, **traits: Any) -> Callable[[T], T]:
        """`add` as a decorator: `@registry.register(name, config=..., **traits)`."""
        return partial(self.add, name, config=config, **traits)

    def remove(self, name: str) -> None:
        """Undo a registration (a test's, or a user replacing a built-in by nothing)."""
        self._entries.pop(name, None)

    def check(self, name: str) -> None:
        """Raise ConfigError naming the key, the registered names and how to add one, unless `name` is registered."""
        if name in self._entries:
            return
        how = f", or {self.how_to_add.format(name=name)}" if self.how_to_add else ""
        raise ConfigError(f"{self.key}={name!r} is not a registered {self.kind} (registered: "
                          f"{', '.join(self.names())}). Use one of those{how}.")

    def __getitem__(self, name: str) -> T:
        self.check(name)
        return self._entries[name].value

    def get(self, name: str, default: T | None = None) -> T | None:
        entry = self._entries.get(name)
        return default if entry is None else entry.value

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def trait(self, name: str, trait: str, default: Any = None) -> Any:
        self.check(name)
        return self._entries[name].traits.get(trait, default)

    def with_trait(self, trait: str) -> set[str]:
        """The names whose `trait` is set (true)."""
        return {name for name, entry in self._entries.items() if entry.traits.get(trait)}

    def section(self, name: str) -> str:
        """Where the entry's own keys live: the section named after it, next to the key that names it."""
        parent = self.key.rpartition(".")[0]
        return f"{parent}.{name}" if parent else name

    def config_sections(self) -> dict[str, tuple[str, type]]:
        """{section: (name, dataclass)} of the entries that own keys."""
        return {self.section(name): (name, entry.config) for name, entry in self._entries.items()
                if entry.config is not None}

    def config(self, name: str, keys: Mapping[str, Any]) -> Any:
        """The entry's own config: its section's values in `keys` (dotted key -> value, as the config's
        extension_keys holds them, checked) over its dataclass's defaults; None for an entry without one."""
        self.check(name)
        cls = self._entries[name].config
        if cls is None:
            return None
        prefix = self.section(name) + "."
        return cls(**{key[len(prefix):]: value for key, value in keys.items() if key.startswith(prefix)})

    def bound(self, name: str, keys: Mapping[str, Any]) -> T:
        """The entry, its own config (`config`) bound as its keyword `config` where it has one."""
        own = self.config(name, keys)
        value = self._entries[name].value
        return value if own is None else partial(value, config=own)
