"""Loading a config: preset, then a TOML file, then ``section.field=value`` overrides.

Every problem is reported at once in a single ``ValueError``; values are coerced to
the field's declared type, and fields whose choices a registry defines are checked
against it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from unbroken.config.fields import raise_all, set_field
from unbroken.config.presets import preset
from unbroken.config.sections import SECTIONS, Config
from unbroken.config.validation import validate


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build from nested dicts (a ``to_dict()`` form, a saved ``config.json``), validating every field; all
    errors at once.

    Raises:
        ValueError: listing every unknown section/field and every bad value.
    """
    cfg = Config()
    errors: list[str] = []
    for section, values in data.items():
        if section not in SECTIONS:
            errors.append(f"unknown section {section!r}; valid: {', '.join(SECTIONS)}")
            continue
        if not isinstance(values, dict):
            errors.append(f"section {section!r} must be a table, got {values!r}")
            continue
        for name, value in values.items():
            err = set_field(getattr(cfg, section), section, name, value, from_text=False)
            if err:
                errors.append(err)
    errors += validate(cfg)
    raise_all(errors)
    return cfg


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
    return _load(config_from_dict(cfg.to_dict()), None, overrides)


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
                err = set_field(getattr(cfg, section), section, name, value, from_text=False)
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
        err = set_field(getattr(cfg, section), section, name, text, from_text=True)
        if err:
            errors.append(err)
    if not errors:
        errors = validate(cfg)
    raise_all(errors)
    return cfg
