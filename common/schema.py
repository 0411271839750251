"""Strict decoding of msgpack maps into typed dataclasses.

Every message body and every admin argument set is a dataclass. `decode_into`
turns an untrusted mapping into an instance or raises `SchemaError` with a stable
reason code (`missing_field`, `extra_field`, `wrong_type`, `field_too_large`) —
never anything else, whatever the input. Supported annotations: int, float, str,
bool, bytes, `object` (any msgpack value, already size-capped by the unpacker),
`X | None`, `list[T]`, `dict[str, T]` and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, get_args, get_origin

T = TypeVar("T")

# Per-field caps unless a field says otherwise with metadata={"max_len": N}.
DEFAULT_MAX_STR = 4096
DEFAULT_MAX_BYTES = 65536
DEFAULT_MAX_LIST = 65536
DEFAULT_MAX_DICT = 1024


class SchemaError(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_HINTS: dict[type, dict[str, Any]] = {}
_FIELDS: dict[type, tuple[dataclasses.Field, ...]] = {}


def _hints(cls: type) -> dict[str, Any]:
    h = _HINTS.get(cls)
    if h is None:
        h = typing.get_type_hints(cls)
        _HINTS[cls] = h
        _FIELDS[cls] = tuple(f for f in dataclasses.fields(cls) if f.init)
    return h


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _check(value: Any, tp: Any, name: str, max_len: int | None) -> Any:
    optional, inner = _is_optional(tp)
    if optional:
        if value is None:
            return None
        return _check(value, inner, name, max_len)
    if tp is object or tp is Any:
        return value
    if tp is bool:
        if type(value) is not bool:
            raise SchemaError("wrong_type", f"{name}: expected bool")
        return value
    if tp is int:
        if type(value) is not int:
            raise SchemaError("wrong_type", f"{name}: expected int")
        return value
    if tp is float:
        if type(value) is float:
            return value
        if type(value) is int:
            return float(value)
        raise SchemaError("wrong_type", f"{name}: expected float")
    if tp is str:
        if type(value) is not str:
            raise SchemaError("wrong_type", f"{name}: expected str")
        if len(value) > (max_len or DEFAULT_MAX_STR):
            raise SchemaError("field_too_large", f"{name}: string too long")
        return value
    if tp is bytes:
        if type(value) is not bytes:
            raise SchemaError("wrong_type", f"{name}: expected bytes")
        if len(value) > (max_len or DEFAULT_MAX_BYTES):
            raise SchemaError("field_too_large", f"{name}: bytes too long")
        return value
    origin = get_origin(tp)
    if origin is list:
        if type(value) is not list:
            raise SchemaError("wrong_type", f"{name}: expected list")
        if len(value) > (max_len or DEFAULT_MAX_LIST):
            raise SchemaError("field_too_large", f"{name}: list too long")
        (item_tp,) = get_args(tp)
        if item_tp is int:  # hot path: token id lists
            for v in value:
                if type(v) is not int:
                    raise SchemaError("wrong_type", f"{name}[]: expected int")
            return value
        return [_check(v, item_tp, f"{name}[]", None) for v in value]
    if origin is dict:
        if type(value) is not dict:
            raise SchemaError("wrong_type", f"{name}: expected map")
        if len(value) > (max_len or DEFAULT_MAX_DICT):
            raise SchemaError("field_too_large", f"{name}: map too large")
        key_tp, val_tp = get_args(tp)
        out = {}
        for k, v in value.items():
            out[_check(k, key_tp, f"{name}.key", None)] = _check(v, val_tp, f"{name}.{k}", None)
        return out
    if dataclasses.is_dataclass(tp):
        return decode_into(tp, value, prefix=f"{name}.")
    raise SchemaError("wrong_type", f"{name}: unsupported annotation {tp!r}")


def decode_into(cls: type[T], data: Any, *, prefix: str = "") -> T:
    """Build `cls` from an untrusted mapping; raise SchemaError on any mismatch."""
    if type(data) is not dict:
        raise SchemaError("wrong_type", f"{prefix or 'body'}: expected map")
    hints = _hints(cls)
    fields = _FIELDS[cls]
    names = {f.name for f in fields}
    for key in data:
        if key not in names:
            raise SchemaError("extra_field", f"{prefix}{key!s:.64}")
    kwargs = {}
    for f in fields:
        if f.name not in data:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            raise SchemaError("missing_field", f"{prefix}{f.name}")
        kwargs[f.name] = _check(data[f.name], hints[f.name], prefix + f.name, f.metadata.get("max_len"))
    return cls(**kwargs)


def to_wire(obj: Any) -> Any:
    """Dataclass (possibly nested) → plain msgpack-able structure."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_wire(getattr(obj, f.name)) for f in _FIELDS.get(type(obj)) or _fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_wire(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    if hasattr(obj, "value") and isinstance(obj, str):  # str Enum
        return obj.value
    return obj


def _fields(obj: Any) -> tuple[dataclasses.Field, ...]:
    _hints(type(obj))
    return _FIELDS[type(obj)]
