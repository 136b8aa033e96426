"""Every worker builds the same job: the parameter layout and the data rows agree across workers.

A user's factories run in every worker; nothing forces them to build the same
thing. Before a worker enters the job it publishes two fingerprints through the
job store (compare-and-set: the first worker to start sets them, everyone else
compares against them):

- ``layout``: every trainable parameter's name, shape and dtype, in order
  (what the flat gradient buffer and the state transfer rely on);
- ``data``: a checksum of rows ``[0, min(2, micro_batch))`` of slot 0 of step
  0, computed twice in this worker (a source that answers differently within
  one process is caught even in a one-worker job).

A joiner whose layout differs is refused (it would corrupt the all-reduce); a
first member whose layout differs, or any worker whose data differs, makes the
job fail with a message naming the first differing parameter or the source.

Invariant: fingerprints are keyed by the config hash, so a worker started with
another config is refused by the config check instead (its own message).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from unbroken.store.job_store import JobStore

__all__ = ["InconsistentJob", "LayoutMismatch", "check_consistency", "data_fingerprint", "first_difference",
           "layout_fingerprint"]

logger = logging.getLogger(__name__)


class InconsistentJob(RuntimeError):
    """This worker built a different job than the others (the message says what differs and the fix)."""


class LayoutMismatch(InconsistentJob):
    """This worker's model has another parameter layout than the job's."""


def layout_fingerprint(named_params: list[tuple[str, Any]]) -> list[list[Any]]:
    """``[name, shape, dtype]`` of each trainable parameter, in order."""
    return [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in named_params if p.requires_grad]


def first_difference(mine: list[list[Any]], job: list[list[Any]]) -> str:
    """The first parameter where two layouts differ, in words."""
    for i, (a, b) in enumerate(zip(mine, job)):
        if a != b:
            return (f"parameter {i} is {a[0]} {tuple(a[1])} {a[2]} here but {b[0]} {tuple(b[1])} {b[2]} "
                    "in the job")
    if len(mine) != len(job):
        longer, who = (mine, "here") if len(mine) > len(job) else (job, "in the job")
        return (f"{len(mine)} parameters here, {len(job)} in the job; the first extra one {who} is "
                f"{longer[min(len(mine), len(job))][0]}")
    return "no difference"


def data_fingerprint(batch: Any, micro_batch: int) -> str:
    """Checksum of rows ``[0, min(2, micro_batch))`` of slot 0 of step 0, computed twice.

    Raises:
        InconsistentJob: the two answers differ (the source is not deterministic in this very process).
    """
    sums = []
    for _ in range(2):
        x, y = batch(0, 0, (0, min(2, micro_batch)))
        h = hashlib.sha256()
        for t in (x, y):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.detach().cpu().contiguous().long().numpy().tobytes())
        sums.append(h.hexdigest()[:16])
    if sums[0] != sums[1]:
        raise InconsistentJob(_nondeterministic(batch, "two calls in one worker gave different rows"))
    return sums[0]


def _nondeterministic(batch: Any, how: str) -> str:
    owner = getattr(batch, "__self__", None)
    name = type(getattr(owner, "source", owner)).__name__
    return (f"data source {name}.batch(step, slot, rows) is not deterministic: {how} for rows [0, 2) of "
            "slot 0, step 0; every worker must get the same rows for the same (step, slot, rows): draw them "
            "from a generator seeded with (seed, step, slot), never from global random state")


def check_consistency(store: JobStore, config_hash: str, named_params: list[tuple[str, Any]], batch: Any,
                      micro_batch: int, *, joining: bool) -> None:
    """Publish or compare this worker's layout and data fingerprints (see the module docstring).

    Raises:
        LayoutMismatch: another parameter layout than the job's.
        InconsistentJob: the data rows differ from the job's (or within this worker).
    """
    mine = layout_fingerprint(named_params)
    job = json.loads(store.agree_fingerprint(config_hash, "layout", json.dumps(mine)))
    if job != mine:
        raise LayoutMismatch(f"{'this joiner' if joining else 'this worker'}'s model differs from the job's: "
                             f"{first_difference(mine, job)}; the model factory must build the same model "
                             "in every worker (no dependence on the worker id, host or global random state)")
    data = data_fingerprint(batch, micro_batch)
    if store.agree_fingerprint(config_hash, "data", data) != data:
        raise InconsistentJob(_nondeterministic(batch, "another worker got different rows"))
