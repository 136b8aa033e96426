"""``torch.distributed.checkpoint`` (DCP), imported on first use.

It is a third of a worker's import time, and most processes (agents, standbys, a worker until its first
save) never need it. Both kinds of checkpoint files use it: the whole state's
(:mod:`unbroken.checkpoint.checkpointer`) and a sharded optimizer's ranges (:mod:`unbroken.checkpoint.sharded`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["dcp"]


def dcp() -> Any:
    """The ``torch.distributed.checkpoint`` module."""
    import torch.distributed.checkpoint as module

    return module
