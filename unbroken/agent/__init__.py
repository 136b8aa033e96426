"""unbroken.agent: per-node agents and the launcher that plays a cluster on one machine.

An agent (:mod:`unbroken.agent.agent`) supervises one node's workers: it marks
their deaths in the store, fences workers declared dead by their peers,
restarts dead workers as joiners, keeps a warm standby and injects faults
with real signals. :func:`launch` hosts the store and runs one agent per node.

Names are resolved lazily so that ``python -m unbroken.agent.command`` does not
import its own module twice (and importing the package stays cheap).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Agent", "AgentError", "AgentFailed", "AgentOptions", "JobFailed", "launch", "run_agent"]

_WHERE = {
    "Agent": "unbroken.agent.agent",
    "AgentError": "unbroken.agent.agent",
    "run_agent": "unbroken.agent.command",
    "AgentOptions": "unbroken.agent.options",
    "AgentFailed": "unbroken.agent.launcher",
    "JobFailed": "unbroken.agent.launcher",
    "launch": "unbroken.agent.launcher",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'unbroken.agent' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
