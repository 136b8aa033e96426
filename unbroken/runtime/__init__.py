"""unbroken.runtime: the fault-tolerant data-parallel runtime of one worker.

Membership views and the failure detector, a process group per view, the
step protocol (its view changes a part of it) and the recovery modes, where a
worker's state comes from when its view changes, the worker's parts built once
(:mod:`unbroken.runtime.assembly`) and its training loop, state transfer to
joiners and the ledger. The store's keys live in
:mod:`unbroken.store`, checkpoints in :mod:`unbroken.checkpoint`. It
imports nothing from ``unbroken.faults`` (faults install themselves on the
protocol's hook points from the worker's entry point).

Invariants: a step is applied by every live worker or by none, with the same
reduced gradient; every ``(step, slot, row)`` is trained exactly once (the
ledger proves it).
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use (PEP 562): a process that needs only part of it does not pay for the protocol's and
# state transfer's imports (torch.distributed.tensor, half a CPU-second).
_WHERE = {
    "Fenced": "membership", "Membership": "membership", "ViewChanged": "membership",
    "CollectiveFailed": "process_group", "ViewGroup": "process_group",
    "PHASES": "protocol", "MemberDied": "protocol", "StepProtocol": "protocol",
    "RECOVERIES": "recovery", "Recovery": "recovery",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"unbroken.runtime.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'unbroken.runtime' has no attribute {name!r}")


__all__ = [
    "PHASES",
    "RECOVERIES",
    "CollectiveFailed",
    "Fenced",
    "MemberDied",
    "Membership",
    "Recovery",
    "StepProtocol",
    "ViewChanged",
    "ViewGroup",
]
