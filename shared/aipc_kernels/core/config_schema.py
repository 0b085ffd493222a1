"""Typed option schemas: each plugin declares its options once, one checker serves them all.

A schema is a frozen dataclass whose fields carry exact type hints and :func:`option` metadata
(choices, range, an example). :func:`parse` checks a mapping against it (a config.json entry,
``--hf-overrides``, command-line options, keyword arguments) and returns the instance:

* unknown keys are refused (with the closest known key as a hint);
* types are exact, nothing is coerced: ``"false"`` is not a bool, ``64.5`` and ``True`` are not
  ints, ``"lm_head"`` is not a list of strings (``list("lm_head")`` would be its letters);
* choices and ranges are checked, then the schema's own ``check(naming)`` for rules that tie
  several fields together.

Every error is an :class:`OptionError` (a ValueError) that names the key the way its user wrote it
(:class:`Naming`: ``lowbit2 quantization_config.group_size``, ``--group-size`` or a keyword) and says
what to pass instead. (pydantic's strict mode would check the types, but it is not installed in
every plugin's environment and its messages do not name the fix.)
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import numbers
import os
import types
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")

_STYLES = ("json", "python", "cli")


class OptionError(ValueError):
    """An option that is unknown, of the wrong type or out of range; ``key`` is its name."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclasses.dataclass(frozen=True)
class Naming:
    """How errors spell keys and values for one kind of input.

    ``owner`` names the whole set (``lowbit2 quantization_config``, ``export_npu``). ``style``:
    ``"json"`` (config files, ``--hf-overrides``: keys ``owner.key``, literals ``true``/``["a"]``),
    ``"python"`` (keyword arguments: ``owner: key``, ``True``/``['a']``) or ``"cli"`` (``--key-name``).
    """

    owner: str
    style: str = "python"

    def __post_init__(self) -> None:
        if self.style not in _STYLES:
            raise ValueError(f"Naming.style={self.style!r} must be one of {_STYLES}")

    def key(self, name: str) -> str:
        """The key as its user writes it."""
        if self.style == "cli":
            return "--" + name.replace("_", "-")
        return f"{self.owner}.{name}" if self.style == "json" else name

    def ref(self, name: str) -> str:
        """A key in a message that already names the owner (``group_size``, ``--group-size``)."""
        return self.key(name) if self.style == "cli" else name

    def literal(self, value: Any) -> str:
        """``value`` as its user would write it."""
        if self.style == "json":
            return json.dumps(value)
        if self.style == "cli":
            return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        return repr(value)

    def setting(self, name: str, value: Any) -> str:
        """``key=value`` (a value as it was given: Python's repr, except on the command line)."""
        shown = self.literal(value) if self.style == "cli" else repr(value)
        return f"{self.key(name)}={shown}"

    def error(self, name: str, value: Any, problem: str) -> OptionError:
        """``OptionError("<key>=<value> <problem>")``, prefixed by the owner for keyword arguments."""
        lead = f"{self.owner}: " if self.style == "python" else ""
        return OptionError(f"{lead}{self.setting(name, value)} {problem}", name)


def option(
    default: Any = dataclasses.MISSING,
    *,
    choices: Sequence[Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    example: Any = None,
    note: str = "",
) -> Any:
    """A schema field: ``choices`` (the accepted values), a range (``ge``/``gt``/``le``; of each
    item for a list), ``example`` (a valid value shown in type errors) and ``note`` (appended to
    choice errors). A list or dict default is copied for each instance."""
    meta = dict(choices=None if choices is None else tuple(choices), ge=ge, gt=gt, le=le, example=example, note=note)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def field_names(schema: type) -> tuple[str, ...]:
    """The keys a schema accepts, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(schema))


def choices_of(schema: type, name: str) -> tuple[Any, ...] | None:
    """The declared choices of one field (for argparse ``choices=``)."""
    return {f.name: f for f in dataclasses.fields(schema)}[name].metadata.get("choices")


def parse(schema: type[T], values: Mapping[str, Any], naming: Naming) -> T:
    """Checks ``values`` against ``schema`` (keys, exact types, choices, ranges, then the schema's
    ``check(naming)``) and returns the schema instance, defaults filled in."""
    if not isinstance(values, Mapping):
        kind = "a JSON object" if naming.style == "json" else "a dict"
        raise OptionError(f"{naming.owner} must be {kind} of keys, got {type(values).__name__} {values!r}")
    fields = {f.name: f for f in dataclasses.fields(schema)}
    unknown = sorted(k for k in values if k not in fields)
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), list(fields), n=1)
        hint = f" (did you mean {naming.ref(close[0])!r}?)" if close else ""
        raise OptionError(f"{naming.owner} has unknown keys {[naming.ref(k) for k in unknown]}{hint}; "
                          f"known keys: {sorted(naming.ref(k) for k in fields)}", unknown[0])
    hints = get_type_hints(schema)
    checked = {name: _checked(name, value, hints[name], fields[name].metadata, naming) for name, value in values.items()}
    instance = schema(**checked)
    check = getattr(instance, "check", None)
    if check is not None:
        check(naming)
    return instance


def to_dict(instance: Any) -> dict[str, Any]:
    """The schema instance as a plain dict (lists copied)."""
    return {f.name: _copy(getattr(instance, f.name)) for f in dataclasses.fields(instance)}


# ---------------------------------------------------------------------- checking one value


def _copy(v: Any) -> Any:
    return list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v


def _checked(name: str, value: Any, hint: Any, meta: Mapping[str, Any], naming: Naming) -> Any:
    ok, v = _conform(hint, value)
    choices = meta.get("choices")
    if choices is not None and (not ok or not any(type(v) is type(c) and v == c for c in choices)):
        note = f" ({meta['note']})" if meta.get("note") else ""
        raise naming.error(name, value, f"is not supported; use one of {', '.join(naming.literal(c) for c in choices)}{note}")
    bounds = _range_text(meta)
    if not ok:
        example = meta.get("example")
        fix = f", e.g. {naming.literal(example)}" if example is not None else ""
        raise naming.error(name, value, f"must be {_describe(hint, naming, bounds)}{fix}")
    numbers_in = v if isinstance(v, list) else [v]  # a range applies to a list's items
    if bounds and not all(_in_range(x, meta) for x in numbers_in if isinstance(x, numbers.Real)):
        raise naming.error(name, value, f"must be {_describe(hint, naming, bounds)}")
    return v


def _conform(hint: Any, value: Any) -> tuple[bool, Any]:
    """(whether ``value`` has exactly the type ``hint``, the value normalised: ints to int, lists to list)."""
    origin = get_origin(hint)
    if hint is Any:
        return True, value
    if origin is Union or origin is types.UnionType:
        if value is None:
            return type(None) in get_args(hint), None
        for arm in get_args(hint):
            if arm is not type(None):
                ok, v = _conform(arm, value)
                if ok:
                    return True, v
        return False, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return ok, int(value) if ok else value
    if hint is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        (item,) = get_args(hint)[:1] or (Any,)
        items = [_conform(item, v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict or hint is dict:
        return isinstance(value, Mapping), dict(value) if isinstance(value, Mapping) else value
    return isinstance(value, origin or hint), value


def _describe(hint: Any, naming: Naming, bounds: str = "") -> str:
    """``hint`` in words, ``bounds`` after its number types (``an integer >= 1 or None``)."""
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        arms = [a for a in get_args(hint) if a is not type(None)]
        text = " or ".join(_describe(a, naming, bounds) for a in arms)
        optional = len(arms) < len(get_args(hint)) and naming.style != "cli"  # a flag is left out instead
        return text + (f" or {naming.literal(None)}" if optional else "")
    if hint in (int, float):
        return ("an integer" if hint is int else "a number") + bounds
    if hint is bool:
        return "true or false (a JSON boolean, without quotes)" if naming.style == "json" else "True or False"
    if hint is str:
        return "a string"
    if origin in (list, tuple) or hint in (list, tuple):
        args = get_args(hint)
        return "a list" + (f" of {_plural(args[0])}{bounds}" if args and args[0] is not Any else "")
    if origin is dict or hint is dict:
        return "a JSON object" if naming.style == "json" else "a dict"
    if hint is os.PathLike:
        return "a path (os.PathLike)"
    return f"a {getattr(hint, '__name__', hint)}"


def _plural(hint: Any) -> str:
    return {str: "strings", int: "integers", float: "numbers", bool: "booleans"}.get(hint, f"{_describe(hint, Naming('', 'python'))} values")


def _range_text(meta: Mapping[str, Any]) -> str:
    ge, gt, le = meta.get("ge"), meta.get("gt"), meta.get("le")
    low = f"[{ge}" if ge is not None else f"({gt}" if gt is not None else None
    if low and le is not None:
        return f" in {low}, {le}]"
    if low:
        return f" >= {ge}" if ge is not None else f" > {gt}"
    return f" <= {le}" if le is not None else ""


def _in_range(v: float, meta: Mapping[str, Any]) -> bool:
    ge, gt, le = meta.get("ge"), meta.get("gt"), meta.get("le")
    return (ge is None or v >= ge) and (gt is None or v > gt) and (le is None or v <= le)


__all__ = ["Naming", "OptionError", "choices_of", "field_names", "option", "parse", "to_dict"]
