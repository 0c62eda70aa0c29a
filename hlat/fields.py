"""Typed config fields: dataclasses filled from TOML and `--section.key value` overrides, below every config section
(`hlat/<package>/config.py`) and the job's config built of them (`hlat.config.job`).

Every value is checked against its field's type as it is set, so an unknown key, a wrong type or a bad
choice is reported with the field's full dotted name before any work starts. Torch-free on purpose: the
planner and `hlat describe` import this without paying for torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from hlat import HlatError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


# How overrides are written, for the commands' --help
OVERRIDES_HELP = (
    "Any config field can be overridden: --section.key value (or --section.key=value). A list is "
    "comma-separated (--data.paths a.jsonl,b.jsonl) or, when it starts with [, a TOML array "
    "(--data.paths '[\"a b.jsonl\", \"c.jsonl\"]'; '[]' is the empty list)."
)


class ConfigError(HlatError):
    pass


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def merge_tables(base: dict, extra: dict) -> dict:
    """`extra` laid over `base`, table by table: a later config file sets only the keys it names."""
    out = dict(base)
    for key, value in extra.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge_tables(out[key], value) if nested else value
    return out


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _toml_array(text: str, name: str) -> list:
    """A command-line list written as a TOML array: `[]`, `["a b.jsonl", "c.jsonl"]`."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(
            f"{name}: {text!r} is not a TOML array (a value starting with [ is read as one): quote "
            'each string, e.g. \'["a.jsonl", "b c.jsonl"]\''
        ) from None


def _coerce(tp: Any, value: Any, name: str, from_text: bool) -> Any:
    """Return `value` as type `tp`, or raise ConfigError naming the field. `from_text`: value came from the CLI."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in get_args(tp) if a is not type(None)]
        if value is None or (from_text and value in ("none", "None", "")):
            return None
        return _coerce(members[0], value, name, from_text)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{name}: {value!r} is not one of {', '.join(repr(c) for c in choices)}")
        return value
    if origin is list:
        (item,) = get_args(tp)
        if from_text and isinstance(value, str) and value.lstrip().startswith("["):
            value, from_text = _toml_array(value, name), False  # its items are typed TOML values
        elif from_text and isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return [_coerce(item, v, f"{name}[{i}]", from_text) for i, v in enumerate(value)]
    if tp is bool:
        if from_text and isinstance(value, str):
            lowered = value.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if tp in (int, float):
        if from_text and isinstance(value, str):
            try:
                value = float(value) if tp is float else int(value)
            except ValueError:
                raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}")
        if tp is int and isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{name}: expected int, got {value!r}")
            value = int(value)
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {_type_name(tp)} for {name}")  # a bug in a config class


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def unknown(what: str, name: str, known: list[str], prefix: str = "") -> ConfigError:
    """The error for a key (or section) `name` that is not one of `known`: the closest of them first, where one is
    close ('did you mean'), then every one."""
    close = difflib.get_close_matches(name.rpartition(".")[2], known, n=1)
    guess = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    listed = "known in this section" if what == "key" else "sections"
    return ConfigError(f"unknown config {what} {name!r}{guess} ({listed}: {', '.join(sorted(known))})")


def update(obj: Any, data: dict, prefix: str = "") -> Any:
    """Set the fields of dataclass `obj` from a (nested) dict, checking every key and value."""
    fields = _fields(type(obj))
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            raise unknown("key", name, list(fields), prefix)
        tp = fields[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: expected a table [{name}], got {value!r}")
            update(getattr(obj, key), value, f"{name}.")
        else:
            setattr(obj, key, _coerce(tp, value, name, from_text=False))
    return obj


def set_path(obj: Any, dotted: str, text: str) -> None:
    """Apply one command-line override, e.g. set_path(cfg, "optim.lr", "1e-3")."""
    *parents, leaf = dotted.split(".")
    target, walked = obj, []
    for part in parents:
        walked.append(part)
        fields = _fields(type(target))
        sub = fields.get(part)
        if sub is None or not dataclasses.is_dataclass(sub):
            sections = [name for name, tp in fields.items() if dataclasses.is_dataclass(tp)]
            raise unknown("section", ".".join(walked), sections, ".".join(walked[:-1] + [""]))
        target = getattr(target, part)
    fields = _fields(type(target))
    if leaf not in fields or dataclasses.is_dataclass(fields[leaf]):
        keys = [name for name, tp in fields.items() if not dataclasses.is_dataclass(tp)]
        raise unknown("key", dotted, keys, dotted[: len(dotted) - len(leaf)])
    setattr(target, leaf, _coerce(fields[leaf], text, dotted, from_text=True))


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ['--optim.lr', '1e-3', '--train.steps=5'] into [('optim.lr', '1e-3'), ('train.steps', '5')]."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {arg!r} (overrides look like --section.key value)")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{arg}: missing value")
            key, value = arg[2:], args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def field_comments(cls: type) -> dict[str, str]:
    """The comment of each field in the class source: on its line (`name: type = default  # why`), else the
    comment lines just above it."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):  # no source at hand (a frozen build): the fields still list without comments
        return {}
    comments, above = {}, []
    for line in lines:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# "))
            continue
        field = re.match(r"(\w+): [^#]*(?:#(.*))?$", text)
        if field:
            comments[field.group(1)] = (field.group(2) or " ".join(above)).strip()
        above = []
    return comments


def describe_fields(obj: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, comment) of every field of dataclass instance `obj`, sections recursed."""
    rows, comments = [], field_comments(type(obj))
    for name, tp in _fields(type(obj)).items():
        value = getattr(obj, name)
        if dataclasses.is_dataclass(tp):
            rows += describe_fields(value, f"{prefix}{name}.")
        else:
            rows.append(
                (
                    f"{prefix}{name}",
                    _type_name(tp),
                    to_toml({"v": value}).strip().removeprefix("v = "),
                    comments.get(name, ""),
                )
            )
    return rows


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def to_toml(data: dict) -> str:
    """A minimal TOML writer for config dicts (scalars, lists and one level of tables per section)."""

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        escaped = str(v).replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'

    lines: list[str] = []

    def emit(table: dict, prefix: str) -> None:
        plain = {k: v for k, v in table.items() if not isinstance(v, dict) and v is not None}
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        if prefix and plain:
            lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {scalar(v)}" for k, v in plain.items())
        if plain:
            lines.append("")
        for k, v in nested.items():
            emit(v, f"{prefix}.{k}" if prefix else k)

    emit(data, "")
    return "\n".join(lines)
