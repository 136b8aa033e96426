"""Setting one config field from a value: coerced to the field's declared type, checked against a registry's
choices where one defines them, a removed field ignored with a warning; every error a message, all raised at
once (:func:`raise_all`).

Used by :mod:`unbroken.config.loading` (presets, files, overrides) and :func:`~unbroken.config.loading.config_from_dict`; imports no other
config module but :mod:`unbroken.config.validation` (the registries and the removed fields).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
import typing
from typing import Any, Literal, get_args, get_origin

from unbroken.config.choices import REGISTRY_CHOICES, REMOVED_FIELDS

__all__ = ["raise_all", "set_field"]

logger = logging.getLogger(__name__)


def raise_all(errors: list[str]) -> None:
    if errors:
        lines = "\n  - ".join(errors)
        raise ValueError(f"{len(errors)} configuration error(s):\n  - {lines}")


def set_field(obj: Any, section: str, name: str, value: Any, *, from_text: bool) -> str | None:
    if f"{section}.{name}" in REMOVED_FIELDS:
        logger.warning("config field %s.%s=%r is no longer read (ignored): %s", section, name, value,
                       REMOVED_FIELDS[f"{section}.{name}"])
        return None
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if name not in fields:
        return f"unknown field {section}.{name}; valid fields: {', '.join(fields)}"
    hint = typing.get_type_hints(type(obj))[name]
    try:
        coerced = _coerce(value, hint, from_text)
        if f"{section}.{name}" in REGISTRY_CHOICES:
            _expect_one_of(coerced, REGISTRY_CHOICES[f"{section}.{name}"])
        setattr(obj, name, coerced)
    except ValueError as exc:
        return f"{section}.{name}={value!r}: {exc}"
    return None


def _expect_one_of(value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"expected one of {', '.join(map(str, choices))}")


def _coerce(value: Any, hint: Any, from_text: bool) -> Any:
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = get_args(hint)
        if type(None) in options and (value is None or (from_text and str(value).lower() in ("none", "null", ""))):
            return None
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(value, opt, from_text)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError("; ".join(errors))
    if origin is Literal:
        _expect_one_of(value, get_args(hint))
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return str(value).lower() in ("1", "true", "yes", "on")
        raise ValueError("expected a boolean (true/false)")
    if hint is int:
        if isinstance(value, bool):
            raise ValueError("expected an integer")
        if isinstance(value, int):
            return value
        if from_text:
            try:
                return int(str(value).replace("_", ""))
            except ValueError:
                pass
        raise ValueError("expected an integer")
    if hint is float:
        if isinstance(value, bool) or not (isinstance(value, (int, float)) or from_text):
            raise ValueError("expected a number")
        try:
            number = float(value)
        except ValueError:
            raise ValueError("expected a number") from None
        if not math.isfinite(number):  # no float field means anything as inf or nan (timeouts would overflow)
            raise ValueError("expected a finite number (not inf or nan)")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        raise ValueError("expected a string")
    raise ValueError(f"unsupported field type {hint!r}")  # pragma: no cover
