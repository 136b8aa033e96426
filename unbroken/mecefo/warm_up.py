"""MeCeFO's approximate graphs compiled at a worker's start, not at its first takeover.

The first approximate step is a takeover's, and compiling then (tens of
seconds on a loaded host, beyond the progress timeout) would look like a
hang. A worker of a compiling job whose policy approximates
(:mod:`unbroken.mecefo.compiled`) warms the approximate path at its start
instead: one forward and backward in approximate mode for each row count it
would compute in a step that any one other worker misses
(:func:`takeover_rows`), through the step's own code
(:func:`~unbroken.mecefo.gradients.compute_gradient_sums`), on rows of step 0
that are not trained on. A block that cannot compile falls back to eager
there, at the start, rather than during the takeover.

Invariants: a warm-up changes no parameter, optimizer state, gradient or RNG
state, and leaves no low-rank basis a step would use; a takeover by a single
worker's loss then compiles no new graph. With one row count (``neighbor``:
the whole micro-batch) the takeover runs the very graph a run without warm-up
would compile, so the two train bit for bit alike; with several
(``spread-approx``) the second and later counts run the graph with a dynamic
batch dimension, as a run without warm-up does from its second count on, so
its first takeover may differ in rounding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.utils import counters

from unbroken.mecefo.adapter import LlamaAdapter
from unbroken.mecefo.gradients import BatchFn, GradLayout, LossFn, SlotWork, compute_gradient_sums

__all__ = ["takeover_rows", "warm_up"]

logger = logging.getLogger(__name__)


def takeover_rows(assign: Callable[[Sequence[int]], Sequence[Any]], me: int, world: int) -> list[int]:
    """The row counts of the approximate items worker ``me`` computes in a step that one other worker misses.

    Args:
        assign: ``assign(live)``: ``me``'s items (each with ``mode`` and ``n_rows``) of a step begun by ``live``
            (the step protocol's plan).
        me: this worker; world: the job's workers.

    Returns:
        The distinct counts, largest first (the first compiles a static graph, a second one a dynamic batch
        dimension, as the takeovers would), empty when no single failure makes ``me`` approximate.
    """
    counts: set[int] = set()
    for dead in range(world):
        if dead != me:
            counts.update(item.n_rows for item in assign([w for w in range(world) if w != dead])
                          if item.mode == "approx")
    return sorted(counts, reverse=True)


def warm_up(adapter: LlamaAdapter, layout: GradLayout, rows: Sequence[int], *, micro_batch: int, batch_fn: BatchFn,
            device: torch.device, precision: str, loss_fn: LossFn) -> dict[str, Any] | None:
    """Compile ``adapter``'s approximate path now (module docstring): for each count of ``rows``, the gradient
    sums of rows ``[0, count)`` of slot 0 of step 0 in approximate mode, computed as a step computes them
    (:func:`~unbroken.mecefo.gradients.compute_gradient_sums`) and thrown away.

    Nothing of the training state changes: the parameters' gradients are put back as they were (the sums went
    to a buffer of their own), the RNG states of the CPU and ``device`` are restored, the optimizer is not
    touched, and the low-rank bases are computed for a period no step has (``-1``), so the first approximate
    step computes its own from its own weights, as it would without the warm-up.

    Returns:
        What was warmed (``rows``), the graphs dynamo captured (``graphs``), the seconds, and whether the path
        runs compiled afterwards (``compiled``; False with ``fallback``, dynamo's reason, when it fell back to
        eager); None when there is nothing to warm (no rows, or the path is not compiled).

    Raises:
        RuntimeError: a basis of some step is cached already (a warm-up belongs before the first approximate step).
    """
    path = adapter.approx_path
    if not rows or not path.compiled:
        return None
    if adapter.basis.svd_count:
        raise RuntimeError("the approximate path is warmed up before the first approximate step (a step's "
                         f"low-rank bases are cached already: {adapter.basis.svd_count} SVDs)")
    before, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
    grads = [p.grad for p in layout.params]
    rng_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices):
            for n in rows:
                compute_gradient_sums(adapter.model, adapter, layout, [SlotWork(0, (0, n), "approx")],
                                      step=-adapter.basis.tau, micro_batch=micro_batch,
                                      batch_fn=lambda _step, slot, r: batch_fn(0, slot, r), device=device,
                                      precision=precision, loss_fn=loss_fn)
    finally:
        for p, g in zip(layout.params, grads):
            p.grad = g
    done = {"rows": list(rows), "graphs": counters["stats"]["unique_graphs"] - before,
            "seconds": round(time.perf_counter() - t0, 3), "compiled": path.compiled}
    if path.fallback_reason is not None:
        done["fallback"] = path.fallback_reason
    logger.info("approximate path warmed up for %s rows: %d graphs in %.2f s%s", ", ".join(map(str, rows)),
                done["graphs"], done["seconds"], "" if path.compiled else " (it runs eager)")
    return done
