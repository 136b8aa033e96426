"""The names a setting may take where a registry further up the package defines what each name does.

The config is the package's lowest layer: it names the choices, and each registry (the model presets, the
takeover policies, the recovery modes) is keyed by exactly these names and checks it on import, so a name
added to one and not the other fails at once rather than at a user's ``--set``.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["MODEL_PRESET_NAMES", "POLICY_NAMES", "RECOVERY_NAMES", "REGISTRY_CHOICES", "REMOVED_FIELDS", "check_registry"]

MODEL_PRESET_NAMES: tuple[str, ...] = (
    "debug", "tiny", "tiny-2l", "tiny-8l", "llama-60m", "llama-350m", "llama-1b", "llama-7b",
)
"""``model.preset`` (:data:`unbroken.models.llama.MODEL_PRESETS`), in documentation order."""

POLICY_NAMES: tuple[str, ...] = ("neighbor", "spread", "spread-approx")
"""``mecefo.policy`` (:data:`unbroken.mecefo.takeover.POLICIES`), in documentation order."""

RECOVERY_NAMES: tuple[str, ...] = ("takeover", "restart", "alternate")
"""``fault.recovery`` (:data:`unbroken.runtime.recovery.RECOVERIES`), in documentation order."""


REGISTRY_CHOICES: dict[str, tuple[str, ...]] = {
    "mecefo.policy": POLICY_NAMES,
    "fault.recovery": RECOVERY_NAMES,
}
"""Fields whose accepted values a registry defines, checked like a ``Literal``."""


REMOVED_FIELDS: dict[str, str] = {}
"""Fields that no longer exist, and why. A saved ``config.json``, a TOML file or an
override that still names one loads: the value is ignored with a logged warning
(it never changed what was trained), and :func:`~unbroken.config.validation.config_diff` skips it."""


def check_registry(setting: str, registry: Iterable[str], names: tuple[str, ...]) -> None:
    """Raise unless ``registry``'s keys are ``names``, in order (a defect in the package, never in input)."""
    if tuple(registry) != names:
        raise AssertionError(f"{setting}: the registry holds {tuple(registry)}, the config names {names}")
