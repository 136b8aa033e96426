"""When a collective the job waited for has completed, did it fail? One rule for every group.

The view's group (:mod:`unbroken.runtime.process_group`) and a replica's own group
(:mod:`unbroken.sharding.hsdp`) both ask it.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["completion_error"]

_WORK_SUCCESS = 0
_WORK_RESULTS = {0: "SUCCESS", 1: "TIMEOUT", 2: "COMM_ERROR", 100: "UNKNOWN"}
"""``c10d::WorkResult`` (``Work.hpp``), the value of ``work.get_future_result()``."""


def completion_error(work: dist.Work, nccl: bool) -> str | None:
    """The error a completed ``work`` recorded, or None: the one completion rule of every collective the job
    waits for (a view's group, a replica's own).

    gloo: its ``wait()`` raises the collective's failure. NCCL: its untimed
    ``wait()`` raises nothing (it only makes the current stream wait), and
    ``work.exception()`` cannot cross into Python (torch 2.11: "Unable to
    convert function return value"): the work's result future tells instead.
    Its completion check completes it with ``COMM_ERROR`` at once; ``SUCCESS``
    comes later, from the watchdog, so a result not yet set after completion
    means no error.
    """
    if nccl:
        result = work.get_future_result()  # type: ignore[attr-defined]  # NCCL's Work has it (torch >= 2.5)
        if result.done() and (value := int(result.value())) != _WORK_SUCCESS:
            return f"NCCL reported {_WORK_RESULTS.get(value, value)}"
    try:
        work.wait()  # gloo: raises the collective's failure; NCCL: the current stream waits on it
    except RuntimeError as exc:
        return str(exc) or type(exc).__name__
    return None
