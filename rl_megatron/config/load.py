"""Reading a config: YAML + `key=value` overrides merged onto the typed schema, every key and type checked as it
is merged (an unknown key gets the closest known one suggested). A key of a section that holds registered extensions'
own sections (actor: actor.clip_cov.ratio), not declared by the schema, is kept as given in `Config.extension_keys`,
for `rl_megatron.config.extensions` to check once trainer.imports has registered every extension."""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rl_megatron.config.schema import RULES, Config
from rl_megatron.errors import ConfigError, one_line


def _schema_keys(cls, prefix: str = "") -> dict[str, Any]:
    """Every dotted key the schema declares, mapped to its field type (dataclass for sections)."""
    keys = {}
    for f in dataclasses.fields(cls):
        dotted = prefix + f.name
        keys[dotted] = f.type
        if f.metadata.get("names_extension"):
            _EXTENDED_SECTIONS.add(prefix.rstrip("."))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            _SECTIONS.add(dotted)
            keys.update(_schema_keys(type(default), dotted + "."))
    return keys


_SECTIONS: set[str] = set()  # dotted keys that hold a section (trainer, actor.optim, ...), filled by _schema_keys
_EXTENDED_SECTIONS: set[str] = set()  # sections with a key naming an extension (actor), filled by _schema_keys
_KEYS = _schema_keys(Config)
SCHEMA_KEYS = tuple(_KEYS)  # every key the schema declares, sections included
# YAML 1.1 reads these words unquoted as booleans; a text key (trainer.resume=off) means the word.
_YAML_BOOLEAN_WORDS = {"y", "yes", "n", "no", "true", "false", "on", "off"}


def _text_key(key: str) -> bool:
    return _KEYS.get(key) in ("str", "Optional[str]")


def omegaconf_reason(err: OmegaConfBaseException) -> str:
    """The first line of an OmegaConf error: its reason, without the full_key/reference_type trailer."""
    text = str(getattr(err, "msg", None) or err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def unknown_key(dotted: str, where: str, known: Sequence[str] = SCHEMA_KEYS) -> ConfigError:
    close = difflib.get_close_matches(dotted, list(known), n=1, cutoff=0.6)
    hint = f" Did you mean '{close[0]}'?" if close else " See rl_megatron/config/schema.py for the keys."
    return ConfigError(f"Unknown config key '{dotted}' in {where}.{hint}")


def _extension_key(dotted: str) -> bool:
    """Whether `dotted` may be a registered extension's own key: in a section with a key naming an extension, under
    a name the schema does not declare there (actor.clip_cov.ratio; or a key's former spelling,
    actor.clip_cov_ratio)."""
    section, _, rest = dotted.rpartition(".")
    while section:
        if section in _EXTENDED_SECTIONS:
            return f"{section}.{rest.split('.')[0]}" not in _KEYS
        section, _, head = section.rpartition(".")
        rest = f"{head}.{rest}"
    return False


def _extension_leaves(tree: Any, dotted: str, where: str) -> list[tuple[str, Any, str]]:
    if not isinstance(tree, dict):
        return [(dotted, tree, where)]
    return [leaf for key, value in tree.items() for leaf in _extension_leaves(value, f"{dotted}.{key}", where)]


def _leaves(tree: dict, where: str, prefix: str = "") -> list[tuple[str, Any, str]]:
    """Flatten a (nested) mapping into (dotted key, value, where) settings, rejecting what the schema lacks (but for
    extensions' own keys, kept for `rl_megatron.config.extensions`)."""
    settings = []
    for key, value in tree.items():
        dotted = prefix + str(key)
        if dotted not in _KEYS:
            if not _extension_key(dotted):
                raise unknown_key(dotted, where)
            settings += _extension_leaves(value, dotted, where)
            continue
        if dotted in _SECTIONS:
            if value is None:  # an empty section (`trainer:` with every key commented out)
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"Config key '{dotted}' (in {where}) is a section, not a value: set its keys "
                                  f"instead, e.g. {dotted}.<key>=... (see rl_megatron/config/schema.py).")
            settings += _leaves(value, where, dotted + ".")
        elif isinstance(value, dict):
            raise ConfigError(f"Config key '{dotted}' (in {where}) takes a single value, not a mapping of "
                              f"{sorted(map(str, value))}.")
        else:
            settings.append((dotted, value, where))
    return settings


def _read_yaml(path: str) -> dict:
    if not os.path.exists(path):
        raise ConfigError(f"Config file '{path}' does not exist. Pass an existing YAML, e.g. configs/demo_cpu.yaml.")
    if not os.path.isfile(path):
        raise ConfigError(f"Config file '{path}' is not a file. Pass a YAML file, e.g. configs/demo_cpu.yaml.")
    try:
        tree = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as err:  # yaml.YAMLError and friends: report them all the same way
        problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        detail = f"{problem}{where}" if problem else one_line(err)
        raise ConfigError(f"Config file '{path}' is not valid YAML: {detail}. Fix the YAML syntax there.") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"Config file '{path}' must hold a mapping of sections (trainer:, model:, ...), "
                          f"not a {type(tree).__name__}.")
    return tree


def _parse_override(item: str) -> list[tuple[str, Any, str]]:
    where = "the command-line overrides"
    if "=" not in item:
        raise ConfigError(f"Override '{item}' is not of the form key=value (e.g. trainer.total_steps=5).")
    key, value = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"Override '{item}' has no key before '=' (e.g. trainer.total_steps=5).")
    if key not in _KEYS and not _extension_key(key):
        raise unknown_key(key, where)
    try:  # parse the value as YAML, the way OmegaConf does: 5 -> int, 1e-3 -> float, [a, b] -> list, null -> None
        tree = OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}={value}"]))
    except Exception as err:
        raise ConfigError(f"Override '{item}': the value of '{key}' is not valid YAML "
                          f"({getattr(err, 'problem', None) or one_line(err)}). Quote it or fix its brackets.") from None
    if _text_key(key) and value.strip().lower() in _YAML_BOOLEAN_WORDS:
        return [(key, value.strip(), where)]
    return _leaves(tree, where)


def load(path: str | None, overrides: Sequence[str] = ()) -> Config:
    """Merge `path` (YAML) and `overrides` (`a.b=value`) onto the schema: the values as given, typed. Values are
    checked by `rl_megatron.preflight`, derived ones filled in by `rl_megatron.preflight.resolve`."""
    settings = _leaves(_read_yaml(path), f"'{path}'") if path is not None else []
    for item in overrides:
        settings += _parse_override(item)
    merged = OmegaConf.structured(Config)
    extension_keys = {}
    for key, value, where in settings:  # one key at a time, so that a bad value is reported with its key
        if key not in _KEYS:
            extension_keys[key] = value
            continue
        if _text_key(key) and isinstance(value, bool):  # only a YAML file's unquoted off/on/yes/no gets here
            raise ConfigError(f"Config key '{key}' (in {where}) takes text, but YAML read an unquoted word as the "
                              f"boolean {value}: quote it, e.g. {key.rsplit('.', 1)[-1]}: 'off'.")
        try:
            OmegaConf.update(merged, key, value, merge=False)
            continue
        except OmegaConfBaseException as err:
            reason = omegaconf_reason(err)
        if key in RULES and RULES[key].choices is not None:  # the message of every choice (or list of choices)
            RULES[key].check(value)
        raise ConfigError(f"Config key '{key}' (in {where}) has a bad value {value!r}: {reason}. See its type in "
                          "rl_megatron/config/schema.py.")
    try:
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            hint = " (a Hugging Face model folder)" if missing[0] == "model.path" else ""
            raise ConfigError(f"Config key '{missing[0]}' must be set{hint}: in the YAML or as {missing[0]}=...")
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:  # e.g. an interpolation ${...} that does not resolve
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"Config key '{key}' has a bad value: {omegaconf_reason(err)}.") from None
    cfg.extension_keys.update(extension_keys)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(to_dict(cfg))


def to_dict(cfg: Config) -> dict:
    """`cfg` as nested plain dicts (e.g. the run's config for wandb and MLflow), the extensions' own keys in their
    sections (actor: clip_cov: ratio), as a YAML sets them."""
    tree = OmegaConf.to_container(OmegaConf.structured(dataclasses.replace(cfg, extension_keys={})))
    del tree["extension_keys"]
    for dotted, value in cfg.extension_keys.items():
        *sections, name = dotted.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    return tree
