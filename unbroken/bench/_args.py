"""Config overrides on benchmark command lines: ``--section.field=value``, as everywhere else."""

from __future__ import annotations

import argparse

from unbroken.config import SECTIONS


def parse_with_overrides(ap: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Parse ``argv``; arguments of the form ``--section.field=value`` come back as overrides."""
    a, extra = ap.parse_known_args(argv)
    overrides, bad = [], []
    for arg in extra:
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if "=" in arg and "." in key and key.split(".", 1)[0] in SECTIONS:
            overrides.append(arg[2:])
        else:
            bad.append(arg)
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)} (config overrides are --section.field=value)")
    return a, overrides
