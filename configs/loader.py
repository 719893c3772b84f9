"""Reading ``ServeConfig`` from YAML plus overrides, with one readable error per problem.

``load_config`` is the only entry point users need. Every failure is a
``ConfigError`` whose message names the source (file or overrides), the dotted
field path and the offending value, so the CLI can print it as one line.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from lockserve.configs.schema import ServeConfig
from pydantic import BaseModel, ValidationError

OVERRIDES_SOURCE = "overrides"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names source, field path and value."""


def default_config_path() -> Path:
    """Path of the packaged ``serve.yaml`` (the embedded-model defaults)."""
    return Path(str(resources.files("lockserve.configs") / "serve.yaml"))


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> ServeConfig:
    """Read ``path`` (None = the packaged serve.yaml), apply ``overrides``, validate.

    ``overrides`` maps dotted keys (``{"server.port": 9000}``) or nested
    sections (``{"server": {"port": 9000}}``) to values; they win over the file.
    Raises ConfigError naming the key for unknown keys and the field path and
    value for invalid values.
    """
    source = str(path) if path is not None else str(default_config_path())
    data = read_yaml_mapping(source)
    check_keys(data, ServeConfig, source)
    nested = nest_overrides(overrides or {})
    check_keys(nested, ServeConfig, OVERRIDES_SOURCE)
    merged = deep_merge(data, nested)
    try:
        return ServeConfig.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source, nested)) from None


def read_yaml_mapping(source: str) -> dict[str, Any]:
    """The top-level mapping of a YAML file; an empty file is an empty mapping."""
    file = Path(source)
    if not file.is_file():
        raise ConfigError(f"config file {source} does not exist")
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: invalid YAML: {_yaml_problem(err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """``"cache.budget_tokens=1024"`` -> ``("cache.budget_tokens", 1024)``; the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: invalid value: {_yaml_problem(err)}") from None
    return key.strip(), value


def nest_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Expand dotted keys into nested dicts: ``{"a.b": 1}`` -> ``{"a": {"b": 1}}``."""
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        parts = str(key).split(".")
        node = nested
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key!r} conflicts with the override of {part!r}")
            node = child
        leaf = parts[-1]
        if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
            node[leaf] = deep_merge(node[leaf], dict(value))
        else:
            node[leaf] = dict(value) if isinstance(value, Mapping) else value
    return nested


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``top`` merged in; nested mappings merge, other values replace."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def check_keys(data: Mapping[Any, Any], model: type[BaseModel], source: str, prefix: str = "") -> None:
    """Raise ConfigError for the first key of ``data`` that ``model`` (recursively) does not define."""
    fields = model.model_fields
    for key, value in data.items():
        name = str(key)
        path = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"unknown key {path!r} in {source}{_suggest(name, list(fields))}")
        section = fields[name].annotation
        if isinstance(value, Mapping) and isinstance(section, type) and issubclass(section, BaseModel):
            check_keys(value, section, source, prefix=f"{path}.")


def format_validation_error(err: ValidationError, source: str, overrides: Mapping[str, Any]) -> str:
    """One line per problem: ``<source>: <field.path> = <value>: <reason>``."""
    lines = []
    for item in err.errors(include_url=False):
        loc = [str(part) for part in item["loc"]]
        path = ".".join(loc)
        origin = OVERRIDES_SOURCE if _in_mapping(overrides, loc) else source
        reason = readable_reason(item)
        if item["type"] == "extra_forbidden":
            lines.append(f"unknown key {path!r} in {origin}")
        elif item["type"] == "value_error" and isinstance(item.get("input"), Mapping):
            # A cross-field check: its fields may come from the file and the overrides.
            both = f"{source} + {OVERRIDES_SOURCE}" if overrides else source
            lines.append(f"{both}: {path + ': ' if path else ''}{reason}")
        else:
            value = "'***'" if "api_key" in loc else repr(item.get("input"))
            lines.append(f"{origin}: {path} = {value}: {reason}")
    return "invalid configuration: " + "; ".join(lines)


_BOUND_WORDS = {
    "greater_than_equal": ("ge", ">="),
    "greater_than": ("gt", ">"),
    "less_than_equal": ("le", "<="),
    "less_than": ("lt", "<"),
}


def readable_reason(item: Mapping[str, Any]) -> str:
    """The reason of one pydantic error item, with bounds as ``must be >= 2``."""
    bound = _BOUND_WORDS.get(item["type"])
    ctx = item.get("ctx") or {}
    if bound is not None and bound[0] in ctx:
        return f"must be {bound[1]} {ctx[bound[0]]}"
    return str(item["msg"]).removeprefix("Value error, ")


def _in_mapping(mapping: Mapping[str, Any], loc: list[str]) -> bool:
    node: Any = mapping
    for part in loc:
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return bool(loc)


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (known: {', '.join(sorted(known))})"


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    if mark is None:
        return problem
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
