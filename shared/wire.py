"""Dataclasses as plain msgpack-ready values and back: `to_plain` flattens, `from_plain` rebuilds
with every field checked against its type hint (exact ints, strs and bools; bools are not ints
here), so a malformed body is a ProtocolError naming its field, never a half-built object.
The wire contract (shared/protocol.py) and anything nesting its types in other payloads use it.
"""

import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields, is_dataclass
from functools import cache
from typing import Any, TypeVar

from shared.errors import InvalidRequestError, ProtocolError

M = TypeVar("M")


def to_plain(value: Any) -> Any:
    """A dataclass (nested ones, tuples, dicts) as msgpack-ready lists and maps."""
    if is_dataclass(value):
        return {f.name: to_plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def from_plain(cls: type[M], value: Any, where: str = "") -> M:
    """The inverse of to_plain, every field checked against its type hint; ProtocolError
    naming the bad field (under `where`, default the class's name)."""
    try:
        return _converter(cls)(value)
    except _Bad as e:
        path = ".".join([where or cls.__name__, *reversed(e.where)])
        raise ProtocolError(path, e.problem) from None


class _Bad(Exception):
    """A value of the wrong shape. The field path is collected as it propagates, so the happy
    path builds no strings."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem
        self.where: list[str] = []


@cache
def _converter(tp: Any) -> Callable[[Any], Any]:
    """A function checking and converting a msgpack value to `tp`, built once per type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = _converter(next(a for a in args if a is not type(None)))
        return lambda v: None if v is None else inner(v)
    if origin is tuple and args[-1] is Ellipsis:
        return _sequence(_converter(args[0]))
    if origin is tuple:  # fixed length: tuple[int, float]
        return _fixed(tuple(_converter(a) for a in args))
    if origin is dict:
        return _mapping(_converter(args[1]))
    if is_dataclass(tp):
        return _record(tp)
    if tp is float:
        return _number
    return _exact(tp)


def _sequence(item: Callable) -> Callable:
    def convert(value):
        if type(value) is not list:
            raise _Bad(f"expected a list, got {type(value).__name__}")
        try:
            return tuple(map(item, value))
        except _Bad as e:
            e.where.append("[]")
            raise

    return convert


def _fixed(items: tuple[Callable, ...]) -> Callable:
    def convert(value):
        if type(value) is not list or len(value) != len(items):
            raise _Bad(f"expected a list of {len(items)}, got {type(value).__name__}")
        out = []
        for i, (item, v) in enumerate(zip(items, value)):
            try:
                out.append(item(v))
            except _Bad as e:
                e.where.append(f"[{i}]")
                raise
        return tuple(out)

    return convert


def _mapping(item: Callable) -> Callable:
    def convert(value):
        if type(value) is not dict or not all(type(k) is str for k in value):
            raise _Bad(f"expected a map with string keys, got {type(value).__name__}")
        out = {}
        for k, v in value.items():
            try:
                out[k] = item(v)
            except _Bad as e:
                e.where.append(k)
                raise
        return out

    return convert


def _record(cls: type) -> Callable:
    hints = typing.get_type_hints(cls)
    specs = [
        (f.name, _converter(hints[f.name]), f.default is MISSING and f.default_factory is MISSING)
        for f in fields(cls)
    ]

    def convert(body):
        if type(body) is not dict:
            raise _Bad(f"expected a map for {cls.__name__}, got {type(body).__name__}")
        kwargs = {}
        for name, field_converter, required in specs:
            if name in body:
                try:
                    kwargs[name] = field_converter(body[name])
                except _Bad as e:
                    e.where.append(name)
                    raise
            elif required:
                raise _Bad(f"missing field {name!r}")
        try:
            return cls(**kwargs)
        except InvalidRequestError as e:  # SamplingParams and SubmitMsg validate themselves
            raise _Bad(str(e)) from None

    return convert


def _number(value):
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise _Bad(f"expected a number, got {type(value).__name__}")


def _exact(tp: type) -> Callable:
    """int, str, bool: the exact type (a bool is not an int here)."""

    def convert(value):
        if type(value) is not tp:
            raise _Bad(f"expected {tp.__name__}, got {type(value).__name__}")
        return value

    return convert
