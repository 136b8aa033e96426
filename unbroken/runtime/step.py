"""The step protocol's reduction: the one place gradients cross workers.

A step's flat buffer (gradient sums, per-group weights, loss, token count, see
:class:`unbroken.mecefo.gradients.GradLayout`) is summed over all live workers
with one all-reduce. The collective is waited on with an explicit timeout, never
the backend's long default.

Invariant: every worker that returns from :meth:`StepProtocol.reduce` holds the
same reduced buffer.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within its timeout."""


def resolve_device(choice: str, rank: int) -> torch.device:
    """``auto``: the rank's CUDA device when CUDA is available, else CPU."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but CUDA is not available; use 'cpu' or 'auto'")
    return torch.device("cuda", rank % torch.cuda.device_count())


class StepProtocol:
    """Sums per-worker buffers across the current process group."""

    def __init__(self, *, rank: int, world: int, timeout_s: float, device: torch.device) -> None:
        self.rank, self.world = rank, world
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device

    def reduce(self, buf: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) ``buf`` in place and return it."""
        if self.world == 1:
            return buf
        if dist.get_backend() == "nccl" and buf.device.type != "cuda":
            buf = buf.to(self.device)
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True)
        if not work.wait(self.timeout):
            raise CollectiveTimeout(f"all-reduce did not finish within {self.timeout.total_seconds()} s")
        return buf
