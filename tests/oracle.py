"""jsonschema as the oracle of ampkit's own validator (`ampkit.tools.records.validate`): ampkit needs no
jsonschema, the tests use it to check that every generated schema is valid draft 2020-12 and that both
validators judge a real result, and each corruption of one of its fields, alike."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest

WRONG = (None, -1, 0, 2.5, "x", "", True, [], {})


def leaves(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every path in `value` (a list: through its first item only), deepest first."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, list) and value:
        yield from leaves(value[0], (*path, 0))
    yield path


def corrupted(value: Any, path: tuple, wrong: Any) -> Any:
    """A copy of `value` with `path` set to `wrong` (deleted where `wrong` is `delete`)."""
    value = copy.deepcopy(value)
    target = value
    for key in path[:-1]:
        target = target[key]
    if wrong is delete:
        del target[path[-1]]
    else:
        target[path[-1]] = wrong
    return value


def delete() -> None:
    """The corruption that deletes the field."""


def assert_agrees_with_jsonschema(
    schema: dict[str, Any],
    value: Any,
    validate: Callable[[Any], object],
    keep: Callable[[tuple], bool] = lambda path: True,
) -> int:
    """Both validators accept `value`, and judge alike each corruption of a path `keep` admits; returns how
    many corruptions were judged."""
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema)
    oracle = jsonschema.Draft202012Validator(schema)
    validate(value)
    assert oracle.is_valid(value)
    judged = 0
    for path in [p for p in leaves(value) if p and keep(p)]:
        for wrong in (*WRONG, delete):
            bad = corrupted(value, path, wrong)
            try:
                validate(bad)
            except ValueError:
                ours = False
            else:
                ours = True
            assert ours == oracle.is_valid(bad), (path, wrong)
            judged += 1
    return judged
