"""The keys that registered extensions own (a policy loss's, an advantage estimator's), checked against each one's
dataclass once trainer.imports has registered every extension (`resolve_extension_keys`, which
`rl_megatron.preflight.resolve` calls).

An entry registered with `config=` a dataclass (`rl_megatron.registry`) owns the keys of the section named after it
next to the key that names it: actor.clip_cov.ratio for the policy loss clip_cov. `rl_megatron.config.load` keeps
such keys as given (`Config.extension_keys`); here each is typed and range-checked as the schema's keys are (its
field's type, `checked` bound, the dataclass's own `check(section)` for keys that go together), a key's former
spelling (`checked(..., formerly=...)`: actor.clip_cov_ratio) read as the new one, and every section of every entry
filled in with its defaults.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rl_megatron.config.fields import check_fields, schema_rules
from rl_megatron.config.load import SCHEMA_KEYS, omegaconf_reason, unknown_key
from rl_megatron.errors import ConfigError
from rl_megatron.registry import Registry

WHERE = "the config (its YAML or the overrides)"


def extension_sections(registries: Iterable[Registry]) -> dict[str, tuple[Registry, str, type]]:
    """{section: (registry, entry name, dataclass)} of every registered entry that owns keys."""
    return {section: (registry, name, cls) for registry in registries
            for section, (name, cls) in registry.config_sections().items()}


def resolve_extension_keys(given: Mapping[str, Any], registries: Iterable[Registry]) -> dict[str, Any]:
    """Every own key of every entry of `registries` (dotted key -> value): `given`'s value, checked, or its default.
    ConfigError naming the key for a key no entry owns, a value of the wrong type or out of its range."""
    sections = extension_sections(registries)
    owned = {f"{section}.{f.name}": f for section, (_, _, cls) in sections.items() for f in dataclasses.fields(cls)}
    formerly = {f.metadata["formerly"]: key for key, f in owned.items() if f.metadata.get("formerly")}
    values: dict[str, dict[str, Any]] = {section: {} for section in sections}
    for key, value in given.items():
        key = formerly.get(key, key)
        section, _, name = key.rpartition(".")
        if key not in owned:
            raise _not_owned(key, sections.get(section), (*SCHEMA_KEYS, *owned))
        values[section][name] = value
    resolved = {}
    for section, (_, _, cls) in sections.items():
        own = _checked(cls, section, values[section])
        resolved.update({f"{section}.{f.name}": getattr(own, f.name) for f in dataclasses.fields(cls)})
    return resolved


def _not_owned(key: str, owner: tuple[Registry, str, type] | None, known: tuple[str, ...]) -> ConfigError:
    if owner is None:
        return unknown_key(key, WHERE, known)
    registry, name, cls = owner
    return ConfigError(f"Unknown config key '{key}': {key.rpartition('.')[0]} holds the own keys of the "
                       f"{registry.kind} {name}, which are {', '.join(f.name for f in dataclasses.fields(cls))}.")


def _checked(cls: type, section: str, values: dict[str, Any]) -> Any:
    """`cls` with `values` over its defaults: each value of its field's type (converted as OmegaConf converts the
    schema's), within its range, and the keys together as the dataclass's `check(section)` wants them."""
    node = OmegaConf.structured(cls)
    for name, value in values.items():
        try:
            OmegaConf.update(node, name, value, merge=False)
        except OmegaConfBaseException as err:
            raise ConfigError(f"Config key '{section}.{name}' has a bad value {value!r}: {omegaconf_reason(err)}. See "
                              f"its type with python -m rl_megatron.train --help {section}.") from None
    own = OmegaConf.to_object(node)
    check_fields(own, schema_rules(cls, section + "."), section + ".")
    if hasattr(own, "check"):
        own.check(section)
    return own
