"""unbroken.mecefo: turns ``(slot, rows, mode)`` items into gradient sums, and says who covers which rows.

MeCeFO's approximations (skip-connected attention backward, recomputed FFN
activations, low-rank FFN weight gradients) on a model through a small
adapter; the gradient-sum buffer and its aggregation rule; the takeover
policies. Knows nothing of processes, run directories or failure traces: the
same code serves the single-process simulator and the distributed runtime.

Invariants: with no failure the aggregated gradient equals plain data-parallel
training's; under any policy every ``(slot, row)`` of a step is computed
exactly once.
"""

from unbroken.mecefo.adapter import LlamaAdapter, ModelAdapter
from unbroken.mecefo.gradients import GradLayout, SlotWork, apply_step, compute_gradient_sums, slot_rows
from unbroken.mecefo.takeover import POLICIES, NoLiveWorker, TakeoverPolicy, takeover_policy

__all__ = [
    "POLICIES",
    "GradLayout",
    "LlamaAdapter",
    "ModelAdapter",
    "NoLiveWorker",
    "SlotWork",
    "TakeoverPolicy",
    "apply_step",
    "compute_gradient_sums",
    "slot_rows",
    "takeover_policy",
]
