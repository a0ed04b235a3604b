"""Typed records for the JSON files ampkit writes: the schema is generated from them, and always checked.

A record is a dataclass whose annotations say what each field holds in JSON (scalars, `Literal`,
`X | None`, `list[X]`, `dict[str, X]`, records) and whose `field(...)` carries its description and
bounds. `schema_of(cls)` writes the JSON Schema (draft 2020-12); `validate(value, schema)` checks a
value with the standard library alone, naming the first bad field ("runs[2].speedup_vs_baseline:
..."); `build(cls, value)` turns checked JSON back into records.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from typing import Any, Literal, Union

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def field(description: str = "", default: Any = dataclasses.MISSING, *, optional: bool = False, **bounds: Any) -> Any:
    """A record field: its JSON description and bounds (minimum, maximum, exclusiveMinimum, minLength,
    pattern, minItems, maxItems; `items={...}` for a list's items; `schema={...}` to replace the generated schema).
    `optional=True`: files may leave it out (one written before the field existed)."""
    metadata = {"description": description, "optional": optional, **bounds}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=type(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_record(tp: Any) -> typing.TypeGuard[type]:
    """Whether the hint `tp` is a record: a dataclass (hints name classes, never instances)."""
    return dataclasses.is_dataclass(tp)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0], len(inner) < len(typing.get_args(tp))
    return tp, False


def _type_schema(tp: Any) -> dict[str, Any]:
    tp, nullable = _unwrap_optional(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        schema: dict[str, Any] = {"const": args[0]} if len(args) == 1 else {"enum": list(args)}
    elif origin is list:
        schema = {"type": "array", "items": _type_schema(args[0])}
    elif origin is dict:
        schema = {"type": "object", "additionalProperties": _type_schema(args[1])}
    elif tp in _SCALARS:
        schema = {"type": _SCALARS[tp]}
    elif tp is Any:
        schema = {}
    else:
        schema = schema_of(tp)
    if nullable:
        if isinstance(schema.get("type"), str):
            schema["type"] = [schema["type"], "null"]
        elif "enum" in schema:
            schema["enum"] = [*schema["enum"], None]
        else:
            schema = {"anyOf": [schema, {"type": "null"}]}
    return schema


def schema_of(cls: type) -> dict[str, Any]:
    """The JSON Schema of record `cls`. Unknown keys are refused unless the class sets `OPEN = True`."""
    properties, required = {}, []
    for f in dataclasses.fields(cls):
        meta = {k: v for k, v in f.metadata.items() if v not in ("", None) and k != "optional"}
        schema = meta.pop("schema", None) or _type_schema(_hints(cls)[f.name])
        if "items" in meta:
            schema["items"].update(meta.pop("items"))
        properties[f.name] = {**schema, **meta}
        if not f.metadata.get("optional"):
            required.append(f.name)
    doc = " ".join((cls.__doc__ or "").split())
    schema = {"type": "object", "description": doc, "required": required, "properties": properties}
    if not getattr(cls, "OPEN", False):
        schema["additionalProperties"] = False
    return schema


def contract(record: type, name: str, title: str) -> dict[str, Any]:
    """The JSON Schema of `record` under its `$id` (`name`) and title."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://ampkit.invalid/schemas/{name}.json",
        "title": title,
        **schema_of(record),
    }


def build(cls: Any, value: Any) -> Any:
    """`value` (JSON already checked against `schema_of(cls)`) as records of type `cls`."""
    tp, _ = _unwrap_optional(cls)
    if value is None or (_is_record(tp) and isinstance(value, tp)):
        return value
    if _is_record(tp):
        hints = _hints(tp)
        return tp(**{f.name: build(hints[f.name], value[f.name]) for f in dataclasses.fields(tp) if f.name in value})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return [build(args[0], v) for v in value]
    if origin is dict:
        return {k: build(args[1], v) for k, v in value.items()}
    return value


class Invalid(ValueError):
    """A value breaks its schema: `path` is where (["runs", 2, "reason"]), `str()` says what
    ("runs[2].reason is missing")."""

    def __init__(self, path: list[Any], problem: str) -> None:
        self.path, self.problem = path, problem
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        super().__init__(f"{where or '<root>'}{problem}")


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    expected = {"null": type(None), "boolean": bool, "string": str, "array": list, "object": dict}[kind]
    return isinstance(value, expected)


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: `true` is not `1`."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _fits(value: Any, schema: dict[str, Any]) -> bool:
    kinds = schema.get("type")
    return kinds is None or any(_is(value, k) for k in ([kinds] if isinstance(kinds, str) else kinds))


def validate(value: Any, schema: dict[str, Any], path: list[Any] | None = None, noun: str = "known") -> None:
    """Raise `Invalid` at the first place `value` breaks `schema`; numbers must also be finite (JSON has
    no NaN). Keywords: type, const, enum, properties, required, additionalProperties, items, minItems,
    maxItems, anyOf, minimum, maximum, exclusiveMinimum, minLength, pattern."""
    path = path or []
    if "anyOf" in schema:  # the branch of the value's type says what is wrong, if there is one
        branches = [b for b in schema["anyOf"] if _fits(value, b)] or schema["anyOf"]
        return validate(value, branches[0], path, noun)
    problem = None
    if isinstance(value, float) and not math.isfinite(value):
        problem = f"{value} is not allowed (use null)"
    elif not _fits(value, schema):
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        problem = f"{value!r} is not of type {', '.join(map(repr, kinds))}"
    elif "const" in schema and not _equal(value, schema["const"]):
        problem = f"{schema['const']!r} was expected"
    elif "enum" in schema and not any(_equal(value, option) for option in schema["enum"]):
        problem = f"{value!r} is not one of {schema['enum']!r}"
    elif _is(value, "number") and value < schema.get("minimum", -math.inf):
        problem = f"{value!r} is less than the minimum of {schema['minimum']!r}"
    elif _is(value, "number") and value > schema.get("maximum", math.inf):
        problem = f"{value!r} is greater than the maximum of {schema['maximum']!r}"
    elif _is(value, "number") and value <= schema.get("exclusiveMinimum", -math.inf):
        problem = f"{value!r} is less than or equal to the minimum of {schema['exclusiveMinimum']!r}"
    elif isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            problem = f"{value!r} is too short"
        elif "pattern" in schema and not re.search(schema["pattern"], value):
            problem = f"{value!r} does not match {schema['pattern']!r}"
    elif isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            problem = f"{len(value)} items are fewer than the minimum of {schema['minItems']}"
        elif len(value) > schema.get("maxItems", math.inf):
            problem = f"{len(value)} items are more than the maximum of {schema['maxItems']}"
    if problem:
        raise Invalid(path, f": {problem}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            validate(item, schema["items"], [*path, i], noun)
    if isinstance(value, dict):
        missing = [k for k in schema.get("required", ()) if k not in value]
        properties, other = schema.get("properties", {}), schema.get("additionalProperties", True)
        if missing:
            raise Invalid([*path, missing[0]], " is missing")
        unknown = sorted(k for k in value if k not in properties)
        if other is False and unknown:
            raise Invalid([*path, unknown[0]], f" is not a {noun} field")
        for key, item in value.items():
            if isinstance(sub := properties.get(key, other), dict):
                validate(item, sub, [*path, key], noun)
    return None
