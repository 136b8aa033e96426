"""unbroken.runtime: the fault-tolerant data-parallel runtime of one worker.

The job store (every coordination key), membership views and the failure
detector, a process group per view, the step protocol and the recovery modes,
the worker's training loop, state transfer to joiners, checkpoints and the
ledger. The only package that runs collectives or touches the store; it
imports nothing from ``unbroken.faults`` (faults install themselves on the
protocol's hook points from the worker's entry point).

Invariants: a step is applied by every live worker or by none, with the same
reduced gradient; every ``(step, slot, row)`` is trained exactly once (the
ledger proves it).
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use (PEP 562): a process that needs only the store (an agent's stand-in, a tool) does not
# pay for the protocol's and state transfer's imports (torch.distributed.tensor, half a CPU-second).
_WHERE = {
    "JobStore": "job_store", "StoreBackend": "job_store", "EmbeddedBackend": "store_backend",
    "Fenced": "membership", "Membership": "membership", "ViewChanged": "membership",
    "CollectiveFailed": "process_group", "ViewGroup": "process_group",
    "PHASES": "protocol", "MemberDied": "protocol", "StepProtocol": "protocol",
    "RECOVERIES": "recovery", "Recovery": "recovery",
    "View": "view",
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
    "JobStore",
    "MemberDied",
    "Membership",
    "Recovery",
    "StepProtocol",
    "StoreBackend",
    "EmbeddedBackend",
    "View",
    "ViewChanged",
    "ViewGroup",
]
