"""Strict decoding of msgpack maps into typed dataclasses.

Every message body and every admin argument set is a dataclass. `decode_into`
turns an untrusted mapping into an instance or raises `SchemaError` with a stable
reason code (`missing_field`, `extra_field`, `wrong_type`, `field_too_large`) —
never anything else, whatever the input. Supported annotations: int, float, str,
bool, bytes, `object` (any msgpack value, already size-capped by the unpacker),
`X | None`, `list[T]`, `dict[str, T]`, str enums (a closed set: a value outside it is
`wrong_type`) and nested dataclasses.

Each class is compiled once into a tuple of per-field checkers (no `typing`
introspection per message): decoding sits on every bus message's hot path.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
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


Checker = Callable[[Any], Any]
_HINTS: dict[type, dict[str, Any]] = {}
_FIELDS: dict[type, tuple[dataclasses.Field, ...]] = {}
# cls → (field names, ((name, required, checker), ...)); details are relative to cls
_PLANS: dict[type, tuple[frozenset[str], tuple[tuple[str, bool, Checker], ...]]] = {}
_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})


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


def _identity(value: Any) -> Any:
    return value


def _compile(tp: Any, name: str, max_len: int | None) -> Checker:
    """One checker per annotation; raises SchemaError with `name` in the detail."""
    optional, inner = _is_optional(tp)
    if optional:
        check_inner = _compile(inner, name, max_len)

        def check_optional(v: Any) -> Any:
            return None if v is None else check_inner(v)

        return check_optional
    if tp is object or tp is Any:
        return _identity
    if tp is bool or tp is int or tp is str or tp is bytes:
        want = tp
        label = tp.__name__
        if tp is str or tp is bytes:
            cap = max_len or (DEFAULT_MAX_STR if tp is str else DEFAULT_MAX_BYTES)
            noun = "string" if tp is str else "bytes"

            def check_sized(v: Any) -> Any:
                if type(v) is not want:
                    raise SchemaError("wrong_type", f"{name}: expected {label}")
                if len(v) > cap:
                    raise SchemaError("field_too_large", f"{name}: {noun} too long")
                return v

            return check_sized

        def check_exact(v: Any) -> Any:
            if type(v) is not want:
                raise SchemaError("wrong_type", f"{name}: expected {label}")
            return v

        return check_exact
    if isinstance(tp, type) and issubclass(tp, enum.Enum) and issubclass(tp, str):
        members = {e.value: e for e in tp}
        label = tp.__name__

        def check_enum(v: Any) -> Any:
            if type(v) is not str or v not in members:
                raise SchemaError("wrong_type", f"{name}: expected a {label}")
            return members[v]

        return check_enum
    if tp is float:

        def check_float(v: Any) -> Any:
            if type(v) is float:
                return v
            if type(v) is int:
                return float(v)
            raise SchemaError("wrong_type", f"{name}: expected float")

        return check_float
    origin = get_origin(tp)
    if origin is list:
        cap = max_len or DEFAULT_MAX_LIST
        (item_tp,) = get_args(tp)
        if item_tp is int:  # hot path: token id lists

            def check_int_list(v: Any) -> Any:
                if type(v) is not list:
                    raise SchemaError("wrong_type", f"{name}: expected list")
                if len(v) > cap:
                    raise SchemaError("field_too_large", f"{name}: list too long")
                for x in v:
                    if type(x) is not int:
                        raise SchemaError("wrong_type", f"{name}[]: expected int")
                return v

            return check_int_list
        check_item = _compile(item_tp, f"{name}[]", None)

        def check_list(v: Any) -> Any:
            if type(v) is not list:
                raise SchemaError("wrong_type", f"{name}: expected list")
            if len(v) > cap:
                raise SchemaError("field_too_large", f"{name}: list too long")
            return [check_item(x) for x in v]

        return check_list
    if origin is dict:
        cap = max_len or DEFAULT_MAX_DICT
        key_tp, val_tp = get_args(tp)
        check_key = _compile(key_tp, f"{name}.key", None)
        check_val = _compile(val_tp, f"{name}.*", None)

        def check_dict(v: Any) -> Any:
            if type(v) is not dict:
                raise SchemaError("wrong_type", f"{name}: expected map")
            if len(v) > cap:
                raise SchemaError("field_too_large", f"{name}: map too large")
            return {check_key(k): check_val(x) for k, x in v.items()}

        return check_dict
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        cls = tp

        def check_nested(v: Any) -> Any:
            return decode_into(cls, v, prefix=f"{name}.")

        return check_nested

    def check_unsupported(v: Any) -> Any:
        raise SchemaError("wrong_type", f"{name}: unsupported annotation {tp!r}")

    return check_unsupported


def _plan(cls: type) -> tuple[frozenset[str], tuple[tuple[str, bool, Checker], ...]]:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = _hints(cls)
        items = []
        for f in _FIELDS[cls]:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            items.append((f.name, required, _compile(hints[f.name], f.name, f.metadata.get("max_len"))))
        plan = (frozenset(name for name, _, _ in items), tuple(items))
        _PLANS[cls] = plan
    return plan


def decode_into(cls: type[T], data: Any, *, prefix: str = "") -> T:
    """Build `cls` from an untrusted mapping; raise SchemaError on any mismatch."""
    if type(data) is not dict:
        raise SchemaError("wrong_type", f"{prefix or 'body'}: expected map")
    names, items = _plan(cls)
    try:
        if not names.issuperset(data):
            for key in data:
                if key not in names:
                    raise SchemaError("extra_field", f"{key!s:.64}")
        kwargs = {}
        for name, required, check in items:
            if name in data:
                kwargs[name] = check(data[name])
            elif required:
                raise SchemaError("missing_field", name)
    except SchemaError as exc:
        if prefix:
            raise SchemaError(exc.reason, prefix + exc.detail) from None
        raise
    return cls(**kwargs)


def to_wire(obj: Any) -> Any:
    """Dataclass (possibly nested) → plain msgpack-able structure."""
    t = type(obj)
    if t in _SCALARS:
        return obj
    if t is list or t is tuple:
        return [v if type(v) in _SCALARS else to_wire(v) for v in obj]
    fields = _FIELDS.get(t)
    if fields is None and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = _fields(obj)
    if fields is not None:
        return {f.name: to_wire(getattr(obj, f.name)) for f in fields}
    if isinstance(obj, list | tuple):
        return [to_wire(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    if hasattr(obj, "value") and isinstance(obj, str):  # str Enum
        return obj.value
    return obj


def wire_default(obj: Any) -> Any:
    """msgpack `default=` hook: `packb(body, default=wire_default)` equals
    `packb(to_wire(body))`, but lists, str enums and scalars are packed natively."""
    fields = _FIELDS.get(type(obj))
    if fields is None:
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            raise TypeError(f"cannot serialize {type(obj).__name__}")
        fields = _fields(obj)
    # Hot path (every message): a frozen dataclass's __dict__ holds exactly its init
    # fields in declaration order, so it is packed as is; anything else is rebuilt.
    d = getattr(obj, "__dict__", None)
    if d is not None and len(d) == len(fields):
        return d
    return {f.name: getattr(obj, f.name) for f in fields}


def _fields(obj: Any) -> tuple[dataclasses.Field, ...]:
    _hints(type(obj))
    return _FIELDS[type(obj)]
