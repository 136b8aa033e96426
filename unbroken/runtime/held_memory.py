"""What the runtime holds in tensors beside the model and its optimizer, measured inside a step.

With :data:`HELD_ENV` set, a worker measures once, right after the backward
pass of its second step (:meth:`HeldMemory.install`): the moment the step's
reduction buffer is complete and the activations are gone, so whatever else
still holds gradient-sized memory then (an earlier step's buffer kept by the
group, the protocol or the layout) adds to the step's peak. The measure walks
every tensor the garbage collector tracks (all a Python object holds: the
protocol's, the group's, the layout's), counts each floating-point storage
once, and leaves out the model's parameters and buffers and the optimizer's
state.

Invariant checked by the throughput benchmark: in a replicated job the
storages of exactly the reduction buffer's size are that step's buffer and,
on the CPU only, the protocol's retry copy (:meth:`StepProtocol._keep`): one
reduction buffer, whatever the number of workers.
"""

from __future__ import annotations

import gc
from typing import Any, Iterable

import torch

__all__ = ["HELD_ENV", "HeldMemory", "held_storages"]

HELD_ENV = "UNBROKEN_MEASURE_HELD"
"""Set (to anything) in a worker's environment: it measures :class:`HeldMemory` and reports it."""


def held_storages(device: torch.device, leave_out: Iterable[torch.Tensor]) -> list[int]:
    """The size in bytes of every storage on ``device`` a live floating-point tensor uses, each once, but
    those of ``leave_out`` (token ids, the data, are integers). A storage that cannot be read (a meta or fake
    tensor) does not count."""
    skip = {_storage_key(t) for t in leave_out}
    seen: dict[tuple[int, int], int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.device.type != device.type or not obj.is_floating_point():
            continue
        try:
            key = _storage_key(obj)
        except (RuntimeError, NotImplementedError):
            continue
        if key not in skip and key[0] != 0:
            seen[key] = key[1]
    return list(seen.values())


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class HeldMemory:
    """One measurement of what a trainer holds at the end of its second step's backward pass.

    Args:
        trainer: the worker's :class:`~unbroken.runtime.worker.Trainer`.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.first: int | None = None
        self.result: dict[str, int] | None = None

    def install(self) -> HeldMemory:
        """Register on the protocol's ``backward`` hook point; returns self."""
        self.trainer.protocol.on("backward", self._after_backward)
        return self

    def _after_backward(self, step: int) -> None:
        if self.first is None:
            self.first = step
        if self.result is None and step > self.first:
            self.result = self.measure()

    def measure(self) -> dict[str, int]:
        """``buffer_bytes`` (one reduction buffer), ``reduction_buffers`` (live storages of that size but the
        retry copy), ``retry_copy_bytes`` and ``held_bytes`` (every storage counted, the copy included)."""
        job = self.trainer.job
        buffer_bytes = 4 * job.layout.size
        spare = self.trainer.protocol.retry_copy
        sizes = held_storages(job.device, [*job.model.parameters(), *job.model.buffers(), *_optimizer_tensors(job.optimizer)])
        copy = spare.untyped_storage().nbytes() if spare is not None else 0
        return {"buffer_bytes": buffer_bytes, "held_bytes": sum(sizes), "retry_copy_bytes": copy,
                "reduction_buffers": sum(1 for n in sizes if n == buffer_bytes) - (1 if copy == buffer_bytes else 0)}


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state: per-parameter state and tensors it holds itself (ZeRO-1's moments)."""
    out = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out + [v for v in vars(optimizer).values() if isinstance(v, torch.Tensor)]
