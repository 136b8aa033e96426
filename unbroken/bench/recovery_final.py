"""The end of a job: ``unbroken bench recovery --parts final`` (see :mod:`unbroken.bench.recovery`).

In a job (:func:`end_phases`): seconds from the last step's commit to the final checkpoint's commit, to the
last worker's exit and to the launcher's return. The state written as the final checkpoint is against torch
DCP's Hugging Face writer, in one process, is a study in the repository: ``python -m
benchmarks.final_checkpoint_write``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["end_phases"]


def end_phases(events: list[dict[str, Any]], steps: int, returned_at: float) -> dict[str, Any] | None:
    """Seconds from the first commit of the last step to the final checkpoint's commit, to the last worker's
    exit and to ``returned_at`` (the launcher's return); None when the run has no commit of its last step."""
    last = [e["time"] for e in events if e.get("kind") == "commit" and e.get("step") == steps - 1]
    if not last:
        return None
    t0 = min(last)
    final = [e for e in events if e.get("event") == "final_checkpoint"]
    exits = [e["t"] for e in events if e.get("event") == "worker_exit" and e.get("clean")]

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 4)

    return {"checkpoint_committed": since(final[-1]["t"] if final else None),
            "checkpoint_gb": round(final[-1]["bytes"] / 1e9, 3) if final else None,
            "checkpoint_write_gb_s": final[-1]["gb_s"] if final else None,
            "writers": final[-1]["writers"] if final else None,
            "workers_exited": since(max(exits) if exits else None), "job_returned": since(returned_at)}
