"""Every config key described, for `python -m rl_megatron.train --help [SECTION]`: its type, default, rule, and the
comment it carries in the source. That comment (on the field's line, else the comment lines right above it) is the
one description of a key: the schema's, and each registered extension's dataclass's (`rl_megatron.registry`).
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from rl_megatron.config.fields import list_item_type
from rl_megatron.config.schema import Config

WIDTH = 120


@dataclasses.dataclass(frozen=True)
class KeyDescription:
    key: str  # dotted: actor.optim.lr
    type: str  # in words: float, int or null, list of console | tensorboard | ...; "section" for a section
    default: str  # as a YAML would write it (empty for a section)
    text: str  # its comment, then its rule


def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment} of the dataclass `cls`, read from its source: the comment on the field's line(s),
    else the comment lines right above it (none where the source cannot be read)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[str, str] = {}
    code: list[tokenize.TokenInfo] = []
    trailing: list[str] = []
    above: list[str] = []
    depth, previous = 0, None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        kind = token.type
        if kind == tokenize.INDENT:
            depth += 1
        elif kind == tokenize.DEDENT:
            depth -= 1
        elif kind == tokenize.COMMENT:
            (trailing if code else above).append(token.string.lstrip("#").strip())
        elif kind == tokenize.NL:
            if not code and previous != tokenize.COMMENT:  # a blank line: what was above belongs to nothing below
                above = []
        elif kind == tokenize.NEWLINE:
            is_field = depth == 1 and len(code) > 1 and code[0].type == tokenize.NAME and code[1].string == ":"
            if is_field:
                comments[code[0].string] = " ".join(trailing or above)
            code, trailing, above = [], [], []
        else:
            code.append(token)
        previous = kind
    return comments


def type_words(annotation: Any) -> str:
    """A key's type as --help shows it: float, int or null, list of a | b."""
    item = list_item_type(annotation)
    if item is not None:
        return f"list of {type_words(item)}"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union:
        words = " or ".join(type_words(arg) for arg in args if arg is not type(None))
        return words + " or null" if type(None) in args else words
    if origin is Literal:
        return " | ".join(map(str, args))
    if origin is None:
        return getattr(annotation, "__name__", str(annotation))
    return str(annotation).replace("typing.", "")  # tuple[float, float]


def value_words(value: Any) -> str:
    """A value as a YAML (or an override) writes it: null, true, [a, b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(value_words, value)) + "]"
    return str(value)


def describe(cls: type, prefix: str) -> list[KeyDescription]:
    """Every key of the dataclass `cls` (its sections' keys too), `prefix` their section ("actor." for ActorConfig)."""
    hints, keys = typing.get_type_hints(cls), []
    # A section's keys may come from a base dataclass (RefConfig's and TeacherConfig's from FrozenModelConfig), whose
    # source holds their comments.
    comments = {name: text for base in reversed(cls.__mro__) if dataclasses.is_dataclass(base)
                for name, text in field_comments(base).items()}
    for f in dataclasses.fields(cls):
        key, annotation = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(annotation):
            keys += [KeyDescription(key, "section", "", comments[f.name])] if comments.get(f.name) else []
            keys += describe(annotation, key + ".")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        bound, hint = f.metadata.get("bound"), f.metadata.get("hint")
        rule = f"must {bound.words()}" if bound else ""
        rule = "; ".join(part for part in (rule, hint) if part)
        text = comments.get(f.name, "") + (f" ({rule})" if rule else "")
        keys.append(KeyDescription(key, type_words(annotation), value_words(default), text.strip()))
    return keys


def describe_config(extension_sections: Mapping[str, type]) -> list[KeyDescription]:
    """Every key a config takes: each section's of the schema, followed by those of the extension sections it holds
    (`extension_sections`: {section: the dataclass of an extension's own keys}, e.g. {"actor.clip_cov": ...})."""
    hints, keys = typing.get_type_hints(Config), []
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += describe(hints[f.name], f.name + ".")
            keys += [key for section, cls in extension_sections.items() if section.startswith(f.name + ".")
                     for key in describe(cls, section + ".")]
    return keys


def render(keys: list[KeyDescription]) -> str:
    """One entry per key: `key: type = default` (a section: `key: section`), its description indented below."""
    lines = []
    for key in keys:
        lines.append(f"  {key.key}: {key.type}" + (f" = {key.default}" if key.default else ""))
        lines += textwrap.wrap(key.text, WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)
