"""Typed configuration: one dataclass per section, named presets, overrides.

A run is fully described by a :class:`Config`. Presets are functions returning a
``Config``; a variant calls its base and changes a few fields. TOML files and
``--section.field=value`` overrides map onto the same dataclasses, and every
problem in them is reported at once in a single ``ValueError``.

Invariant: ``config_from_dict(cfg.to_dict()) == cfg`` and
``config_hash(cfg)`` depends only on fields that change what is trained.
"""

from unbroken.config.choices import REMOVED_FIELDS
from unbroken.config.loading import config_from_dict, load_config
from unbroken.config.presets import PRESETS, preset
from unbroken.config.sections import (
    SECTIONS,
    Config,
    DataConfig,
    FaultConfig,
    MecefoConfig,
    MonitorConfig,
    ModelConfig,
    OptimConfig,
    SnapshotConfig,
    TrainConfig,
)
from unbroken.config.validation import config_diff, config_hash, validate

__all__ = [
    "Config", "DataConfig", "FaultConfig", "MecefoConfig", "ModelConfig", "MonitorConfig", "OptimConfig", "SnapshotConfig",
    "TrainConfig",
    "SECTIONS", "PRESETS", "REMOVED_FIELDS", "preset", "load_config", "config_from_dict", "validate", "config_hash", "config_diff",
]
