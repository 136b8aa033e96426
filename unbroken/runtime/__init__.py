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

from unbroken.runtime.job_store import JobStore, StoreBackend, TCPStoreBackend
from unbroken.runtime.membership import Fenced, Membership, ViewChanged
from unbroken.runtime.process_group import CollectiveFailed, ViewGroup
from unbroken.runtime.protocol import PHASES, MemberDied, StepProtocol
from unbroken.runtime.recovery import RECOVERIES, Recovery, recovery
from unbroken.runtime.view import View

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
    "TCPStoreBackend",
    "View",
    "ViewChanged",
    "ViewGroup",
    "recovery",
]
