"""unbroken: data-parallel LLM pre-training that keeps running through failures.

The public Python API (see :mod:`unbroken.api` and the README):

- :func:`train`: train your model factory on your data on this machine;
- :func:`run_node`: one node's agent of a cluster job;
- :func:`job_config`: a config naming your factories;
- :class:`Config`: the configuration (sections ``model``, ``data``, ``optim``,
  ``train``, ``mecefo``, ``fault``, ``snapshot``);
- :class:`BuildContext`: what your factories are called with;
- :class:`DataSource`, :class:`MapDatasetSource`: the data you bring.

Names are imported on first use, so ``import unbroken`` loads nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "train": "unbroken.api",
    "run_node": "unbroken.api",
    "job_config": "unbroken.api",
    "Config": "unbroken.config",
    "BuildContext": "unbroken.job.user_parts",
    "DataSource": "unbroken.data.source",
    "MapDatasetSource": "unbroken.data.source",
}

__all__ = ["BuildContext", "Config", "DataSource", "MapDatasetSource", "__version__", "job_config", "run_node",
           "train"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
