"""A run's output directory: created, or a previous run in it replaced; never anything else.

Shared by the launcher's preflight (:func:`unbroken.agent.preflight.prepare_run_dir`)
and the simulator (:func:`unbroken.job.simulator.simulate`), so ``--overwrite``
means the same thing for both.

A directory *holds a run* when its ``config.json`` parses as an unbroken
config: a JSON object whose keys are config sections, each a table (what
``Config.to_dict()`` writes). The values are not validated, so a run written by
an older version (a removed field, a value now rejected) can still be replaced.

Invariants: nothing is deleted unless the directory holds a run and
``overwrite`` is set; then only its contents go (the directory itself stays, so
``--out .`` inside a run directory works); the home directory, its ancestors
and the filesystem root are never cleared.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from unbroken.config import config_from_dict
from unbroken.config import SECTIONS, Config, config_hash

RUN_CONFIG = "config.json"
"""The file that marks a run directory (the run's config, ``Config.to_dict()`` form)."""


def saved_config(directory: Path) -> dict[str, Any] | None:
    """The config a run directory holds, or None when ``directory`` holds no unbroken run."""
    try:
        data = json.loads((directory / RUN_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or not data:
        return None
    if not all(k in SECTIONS and isinstance(v, dict) for k, v in data.items()):
        return None
    return data


RUN_DIR_MODE = 0o700
"""A run directory is readable by its owner only: it holds the job's secret, config and state."""


def prepare_out_dir(out: Path, cfg: Config, *, overwrite: bool, continue_hint: str = "") -> None:
    """Make ``out`` an empty directory for a new run of ``cfg``.

    A missing directory is created; an empty one is used as it is; one holding
    a run is emptied when ``overwrite`` is set.

    Args:
        continue_hint: appended to the "pass --overwrite" advice (e.g. ``", --resume to continue it"``).
    Raises:
        ValueError: ``out`` is not a directory; holds a run and ``overwrite`` is not set; or is not
            empty and holds no run (then even ``overwrite`` deletes nothing). Nothing is changed.
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {out} exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()):
        saved = saved_config(out)
        if saved is None:
            raise ValueError(
                f"output directory {out} is not empty and holds no unbroken run (no {RUN_CONFIG} with a run's "
                f"config); --overwrite only replaces a run directory, so nothing was deleted: choose a new or "
                f"empty --out"
            )
        if not overwrite:
            what = "a run" if _hash_of(saved) in (config_hash(cfg), None) else "a different run"
            raise ValueError(f"output directory {out} already holds {what}; pass --overwrite to replace it"
                             f"{continue_hint}, or choose another --out")
        _refuse_protected(out)
        _clear(out)
    out.mkdir(mode=RUN_DIR_MODE, parents=True, exist_ok=True)
    # The config, job id, secret, logs and checkpoints inside are the owner's alone (mkdir's mode is cut by
    # the umask and does not apply to a directory that already existed).
    os.chmod(out, RUN_DIR_MODE)


def _hash_of(saved: dict[str, Any]) -> str | None:
    """The saved run's config hash; None when it no longer validates (then it cannot be compared)."""
    try:
        return config_hash(config_from_dict(saved))
    except ValueError:
        return None


def _refuse_protected(out: Path) -> None:
    target = out.resolve()
    home = Path.home().resolve()
    if target == home or target in home.parents or target.parent == target:
        raise ValueError(f"refusing to clear {out} ({target}): it is the home directory, one of its parents or "
                         f"the filesystem root; choose a dedicated --out")


def _clear(out: Path) -> None:
    """Delete what ``out`` contains (links themselves, never what they point to)."""
    for entry in out.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
