"""Checking a parsed TOML table against a frozen dataclass: the config's schema rules.

Owns the generic part of validation: a key's type, range, choices and emptiness
(declared on each dataclass field through `spec`), unknown keys, required keys, and the
`[policy.rules.NAME]` tables merged over the defaults. Every problem is appended to a
list as one operator-facing line naming its key path; nothing here raises for bad input.
`supervisor/settings/sections.py` owns the sections themselves, `supervisor/settings/config.py` and
`supervisor/settings/checks.py` the rules across them.

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from supervisor.watchdog.conditions import parse_condition
from supervisor.watchdog.rules import ACTIONS, DEFAULT_RULES, RuleConfig
from supervisor.watchdog.signal_list import SIGNAL_NAMES


class ConfigError(Exception):
    """One or more problems in a config file; str() is the operator-facing message."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


def spec(default: Any = dataclasses.MISSING, *, lo: float | None = None,
           hi: float | None = None, choices: tuple[str, ...] | None = None,
           nonempty: bool = False) -> Any:
    meta = {"lo": lo, "hi": hi, "choices": choices, "nonempty": nonempty}
    if isinstance(default, list | dict):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _type_name(tp: Any) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"a list of {_type_name(inner).split(' ', 1)[1]}s"
    if origin is dict:
        return "a table of strings"
    return str(tp)


def _check_scalar(tp: Any, value: Any) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return False


def check_value(key: str, tp: Any, meta: Mapping[str, Any], value: Any,
                 problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    expected = _type_name(tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list) or not all(_check_scalar(inner, v) for v in value):
            problems.append(f"{key}: expected {expected}, got {value!r}")
            return None
        if meta["nonempty"] and not value:
            problems.append(f"{key}: expected a non-empty list")
            return None
        if meta["choices"] is not None and (bad := [v for v in value
                                                    if v not in meta["choices"]]):
            problems.append(f"{key}: expected a list of {', '.join(meta['choices'])}, "
                            f"got {bad[0]!r}")
            return None
        return [float(v) if inner is float else v for v in value]
    if origin is dict:
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            problems.append(f"{key}: expected {expected} (name = \"value\"), got {value!r}")
            return None
        return dict(value)
    if not _check_scalar(tp, value):
        problems.append(f"{key}: expected {expected}, got {value!r}")
        return None
    if tp is float:
        value = float(value)
    lo, hi, choices = meta["lo"], meta["hi"], meta["choices"]
    if lo is not None and hi is not None and not lo <= value <= hi:
        problems.append(f"{key}: expected a value from {lo:g} to {hi:g}, got {value!r}")
        return None
    if choices is not None and value not in choices:
        problems.append(f"{key}: expected one of {', '.join(choices)}, got {value!r}")
        return None
    if meta["nonempty"] and value == "":
        problems.append(f"{key}: expected a non-empty string")
        return None
    return value


def build_section(name: str, cls: type[Any], table: Any, problems: list[str]) -> Any:
    if not isinstance(table, dict):
        problems.append(f"{name}: expected a table [{name}], got {table!r}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    nested = [fname for fname, f in fields.items() if f.metadata.get("table")]
    for fname in nested:  # nested tables, built by their own rules
        builder = fields.pop(fname).metadata["table"]
        if fname in table:
            kwargs[fname] = (build_rules if builder is True else builder)(
                f"{name}.{fname}", table[fname], problems)
    for key in table:
        if key not in fields and key not in nested:
            known = ", ".join(sorted(fields))
            problems.append(f"{name}.{key}: unknown key (known keys: {known})")
    before = len(problems)
    for fname, f in fields.items():
        if fname in table:
            value = check_value(f"{name}.{fname}", hints[fname], f.metadata, table[fname],
                                 problems)
            kwargs[fname] = value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(f"{name}.{fname}: required key is missing")
    if len(problems) > before:
        return None
    return cls(**kwargs)


_RULE_NUMBERS = ("for_s", "clear_for_s", "cooldown_s", "escalate_after_s")


def named_tables(prefix: str, table: Any,
                 problems: list[str]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Each `[PREFIX.NAME]` table as (NAME, its key path, its table); what is not a table
    is a problem named by its key, and skipped."""
    if not isinstance(table, dict):
        problems.append(f"{prefix}: expected tables [{prefix}.NAME], got {table!r}")
        return
    for name, raw in table.items():
        key = f"{prefix}.{name}"
        if isinstance(raw, dict):
            yield name, key, raw
        else:
            problems.append(f"{key}: expected a table, got {raw!r}")


def build_rules(prefix: str, table: Any, problems: list[str]) -> dict[str, RuleConfig]:
    """[policy.rules.NAME] tables over the defaults: a default rule takes the keys given
    and keeps the others; a new rule needs `when` and `action`."""
    rules = dict(DEFAULT_RULES)
    known = [f.name for f in dataclasses.fields(RuleConfig)]
    for name, key, raw in named_tables(prefix, table, problems):
        values: dict[str, Any] = {}
        base = DEFAULT_RULES.get(name)
        for k, v in raw.items():
            where = f"{key}.{k}"
            if k not in known:
                problems.append(f"{where}: unknown key (known keys: {', '.join(sorted(known))})")
            elif k == "enabled":
                if isinstance(v, bool):
                    values[k] = v
                else:
                    problems.append(f"{where}: expected true or false, got {v!r}")
            elif k in _RULE_NUMBERS:
                if isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 604800:
                    values[k] = float(v)
                else:
                    problems.append(f"{where}: expected a number of seconds from 0 to 604800, "
                                    f"got {v!r}")
            elif k == "for_fraction":
                if isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= 1:
                    values[k] = float(v)
                else:
                    problems.append(f"{where}: expected a share above 0 and at most 1, "
                                    f"got {v!r}")
            elif k in ("when", "clear_when", "escalate_when"):
                if not isinstance(v, str) or (k == "when" and not v.strip()):
                    problems.append(f"{where}: expected a condition string, got {v!r}")
                elif v.strip():
                    try:
                        parse_condition(v, SIGNAL_NAMES)
                        values[k] = v
                    except ValueError as exc:
                        problems.append(f"{where}: {exc}")
                else:
                    values[k] = ""
            elif k in ("action", "escalate_action"):
                allowed = ACTIONS if k == "action" else ("", *ACTIONS)
                if v in allowed:
                    values[k] = v
                else:
                    problems.append(f"{where}: expected one of {', '.join(ACTIONS)}, got {v!r}")
        if base is None:
            for req in ("when", "action"):
                if req not in raw:
                    problems.append(f"{key}.{req}: required for a new rule (the default rules "
                                    f"are {', '.join(DEFAULT_RULES)})")
            if "when" not in values or "action" not in values:
                continue
            rule = RuleConfig(**values)
        else:
            rule = dataclasses.replace(base, **values)
        if rule.escalate_after_s and not rule.escalate_action:
            problems.append(f"{key}.escalate_action: required when escalate_after_s is set")
        rules[name] = rule
    return rules


