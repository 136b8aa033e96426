"""The step protocols of the comparison modes (:mod:`unbroken.runtime.recovery`): plain data parallelism
(``restart``) and the alternating measurement (``alternate``).
"""

from __future__ import annotations

import torch

from unbroken.mecefo.gradients import SlotWork
from unbroken.runtime.process_group import CollectiveFailed
from unbroken.runtime.protocol import StepProtocol

__all__ = ["AlternatingProtocol", "PlainProtocol"]


class PlainProtocol(StepProtocol):
    """Plain data parallelism: own slot, one all-reduce, no failure handling.

    It watches nothing while it waits: a death fails the all-reduce (or it
    times out), and the error ends the worker.
    """

    def run_step(self, step: int) -> tuple[torch.Tensor, list[SlotWork]]:
        self.step = step
        items = [SlotWork(self.me, (0, self.job.micro_batch))]
        local = self._compute(step, items)
        reduced = self._reduce(step, local, items, check=_watch_nothing)
        if self.view.leader == self.me:  # no vote here: the leader says how far the job got (agents, launcher)
            self.store.set_progress(step + 1)
        return reduced, items

    def admit_joiners(self, next_step: int) -> bool:
        return False

    def reconfigure_at_start(self, step: int, reason: str) -> None:
        raise CollectiveFailed(f"the first view could not be formed ({reason}); plain data parallelism "
                               f"restarts the job")


def _watch_nothing() -> None:
    pass


class AlternatingProtocol(StepProtocol):
    """Even steps plain data parallelism, odd steps the step protocol (module docstring)."""

    def run_step(self, step: int) -> tuple[torch.Tensor, list[SlotWork]]:
        if step % 2 == 0:
            return PlainProtocol.run_step(self, step)  # type: ignore[arg-type]
        return super().run_step(step)
