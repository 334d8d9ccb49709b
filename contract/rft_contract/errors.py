"""One wording for a bad spec or config, whoever validates it: the operator (camelCase
keys, `spec.` prefix) and every pod (snake_case keys of the mounted config) turn a
pydantic `ValidationError` into `<dotted.key>: <what is wrong>`, naming the key to fix.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

_TYPES = {"float_type": "float", "float_parsing": "float", "int_type": "int", "int_parsing": "int",
          "int_from_float": "int", "bool_type": "bool", "bool_parsing": "bool", "string_type": "str"}
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
           "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}


def describe(error: ValidationError, model: type[BaseModel], prefix: str = "",
             style: Literal["camel", "snake"] = "camel") -> str:
    """The first error as `prefix.key.path: message`; keys spelled in `style`."""
    first = error.errors()[0]
    loc, kind, value = list(first["loc"]), first["type"], first.get("input")
    ctx = first.get("ctx") or {}
    annotation, names = _walk(model, loc, style)
    if kind == "missing" and names and isinstance(names[-1], int):
        names.pop()  # a tuple too short: name the tuple, not its missing item
        annotation = _walk(model, loc[:-1], style)[0]
        kind = "tuple_length"
    where = _join(prefix, names)
    return f"{where}: {_message(kind, value, ctx, annotation, model, loc, style, first['msg'])}"


def _message(kind: str, value: Any, ctx: dict, annotation: Any, model: type[BaseModel],
             loc: list, style: str, msg: str) -> str:
    if kind == "extra_forbidden":
        parent = _walk(model, loc[:-1], style)[0]
        return "unknown key" + _suggest(parent, str(loc[-1]), style)
    if kind == "missing":
        return "required section is missing" if _is_model(annotation) else "required key is missing"
    if kind in ("tuple_length", "too_long", "too_short", "tuple_type") and typing.get_origin(annotation) is tuple:
        n = len(typing.get_args(annotation))
        return f"expected a list of {n} numbers, got {value!r}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        if value is None and _is_model(annotation):
            return "required section is missing"
        return f"expected a mapping, got {type(value).__name__}"
    if kind in _TYPES:
        options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
        want = " or ".join(a.__name__ for a in options) if options else _TYPES[kind]
        return f"expected {want}, got {type(value).__name__} {value!r}"
    if kind == "literal_error":
        allowed = ctx.get("expected", "").replace(" or ", ", ")
        return f"must be one of {allowed}, got {value!r}"
    if kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        bound = ctx.get(key)
        shown = float(value) if isinstance(bound, float) and isinstance(value, int) else value
        return f"must be {op} {_num(bound)}, got {shown!r}"
    if kind == "string_too_short" and ctx.get("min_length") == 1:
        return "must not be empty"
    if kind == "value_error":
        return str(ctx.get("error", msg))
    return msg[:1].lower() + msg[1:]


def _suggest(parent: Any, key: str, style: str) -> str:
    """` (did you mean x?)`: a close name at this level, else the same name one level
    down (a top-level `fsdp` belongs under `trainer`)."""
    if not _is_model(parent):
        return ""
    close = difflib.get_close_matches(key, _field_names(parent, style), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]}?)"
    for name, info in parent.model_fields.items():
        child = _unwrap(info.annotation)
        if _is_model(child) and key in _field_names(child, style):
            return f" (did you mean {(info.alias or name) if style == 'camel' else name}.{key}?)"
    return ""


def _num(x: Any) -> Any:
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _join(prefix: str, names: list) -> str:
    out = prefix
    for n in names:
        out = f"{out}[{n}]" if isinstance(n, int) else (f"{out}.{n}" if out else str(n))
    return out


def _unwrap(annotation: Any) -> Any:
    """`X | None` -> X; `Annotated[X, ...]` -> X."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _field_names(model: type[BaseModel], style: str) -> list[str]:
    return [(info.alias or name) if style == "camel" else name for name, info in model.model_fields.items()]


def _walk(model: type[BaseModel], loc: list, style: str) -> tuple[Any, list]:
    """The annotation at `loc` and the loc's names respelled in `style` (unknown keys
    are kept as the input spelled them)."""
    annotation: Any = model
    names: list = []
    for part in loc:
        annotation = _unwrap(annotation)
        if isinstance(part, int):
            args = typing.get_args(annotation)
            annotation = args[min(part, len(args) - 1)] if args else Any
            names.append(part)
            continue
        field = None
        if _is_model(annotation):
            fields = annotation.model_fields
            field = next((n for n, i in fields.items() if part in (n, i.alias)), None)
        elif typing.get_origin(annotation) in (typing.Union, types.UnionType):
            continue  # pydantic names the union member it tried (`int`, `str`): not a key
        elif typing.get_origin(annotation) is dict:
            names.append(part)  # a user's key in a mapping (resources.requests.cpu)
            annotation = typing.get_args(annotation)[1]
            continue
        if field is None:
            names.append(part)
            annotation = Any
            continue
        info = annotation.model_fields[field]
        names.append((info.alias or field) if style == "camel" else field)
        annotation = info.annotation
    return _unwrap(annotation), names
