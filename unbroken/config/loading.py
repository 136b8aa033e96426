"""Loading a config: preset, then a TOML file, then ``section.field=value`` overrides.

Every problem is reported at once in a single ``ValueError``; values are coerced to
the field's declared type, and fields whose choices a registry defines are checked
against it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence, get_args, get_origin

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from unbroken.config.presets import preset
from unbroken.config.sections import SECTIONS, Config
from unbroken.config.validation import _REGISTRY_CHOICES, REMOVED_FIELDS, validate

logger = logging.getLogger(__name__)

def load_config(
    *, preset_name: str = "debug", file: str | Path | None = None, overrides: Sequence[str] = ()
) -> Config:
    """Preset, then a TOML file, then ``section.field=value`` overrides.

    Raises:
        ValueError: listing every unknown section/field and every bad value.
    """
    return _load(preset(preset_name), file, overrides)


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """``cfg`` (a copy) with ``section.field=value`` overrides applied and validated (see :func:`load_config`)."""
    return _load(Config.from_dict(cfg.to_dict()), None, overrides)


def _load(cfg: Config, file: str | Path | None, overrides: Sequence[str]) -> Config:
    errors: list[str] = []
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        with path.open("rb") as fh:
            try:
                data = tomllib.load(fh)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
        for section, values in data.items():
            if section not in SECTIONS or not isinstance(values, dict):
                errors.append(f"{path}: unknown section {section!r}; valid: {', '.join(SECTIONS)}")
                continue
            for name, value in values.items():
                err = _set_field(getattr(cfg, section), section, name, value, from_text=False)
                if err:
                    errors.append(f"{path}: {err}")
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().lstrip("-").partition(".")
        if not sep or not dot:
            errors.append(f"override {item!r} is not of the form section.field=value")
            continue
        if section not in SECTIONS:
            errors.append(f"unknown section {section!r} in {item!r}; valid: {', '.join(SECTIONS)}")
            continue
        err = _set_field(getattr(cfg, section), section, name, text, from_text=True)
        if err:
            errors.append(err)
    if not errors:
        errors = validate(cfg)
    _raise_all(errors)
    return cfg


def _raise_all(errors: list[str]) -> None:
    if errors:
        lines = "\n  - ".join(errors)
        raise ValueError(f"{len(errors)} configuration error(s):\n  - {lines}")


def _set_field(obj: Any, section: str, name: str, value: Any, *, from_text: bool) -> str | None:
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
        if f"{section}.{name}" in _REGISTRY_CHOICES:
            _expect_one_of(coerced, _REGISTRY_CHOICES[f"{section}.{name}"]())
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
