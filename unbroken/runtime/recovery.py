"""Recovery modes (``fault.recovery``): what a job does when a worker fails.

One object per mode, in one registry (:data:`RECOVERIES`), from which the
config's accepted values come. The launcher, the agents, the worker and the
failover benchmark ask the mode instead of comparing names:

- ``takeover`` (:class:`Takeover`): the step protocol; survivors finish the
  step and carry on, dead workers rejoin (unbroken);
- ``restart`` (:class:`CheckpointRestart`): plain data parallelism; any
  failure stops every worker and the launcher restarts the job from the last
  persistent checkpoint (the comparison baseline);
- ``alternate`` (:class:`Alternate`): a measurement, not a way to train: even
  steps plain data parallelism, odd steps the step protocol, in the same
  processes and group, so one job times both side by side.

Every protocol reduces through the view's group
(:meth:`~unbroken.runtime.process_group.ViewGroup.allreduce`) and writes its
ledger record before the reduction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the protocols load with a worker; the launcher and tools only ask a mode what it does
    from unbroken.runtime.protocol import StepProtocol

from unbroken.config.choices import RECOVERY_NAMES, check_registry
__all__ = ["RECOVERIES", "Alternate", "CheckpointRestart", "Recovery", "Takeover", "recovery"]


class Recovery(ABC):
    """One recovery mode."""

    name: str
    restarts_job: bool
    """A death stops every worker and the launcher restarts the job from the last checkpoint."""
    survives_failures: bool
    """Workers carry on through a failure, so the ledger of every step is the step protocol's."""

    @abstractmethod
    def protocol_class(self) -> type[StepProtocol]:
        """The step protocol a worker runs under this mode."""


class Takeover(Recovery):
    name, restarts_job, survives_failures = "takeover", False, True

    def protocol_class(self) -> type[StepProtocol]:
        from unbroken.runtime.protocol import StepProtocol

        return StepProtocol


class CheckpointRestart(Recovery):
    name, restarts_job, survives_failures = "restart", True, False

    def protocol_class(self) -> type[StepProtocol]:
        from unbroken.runtime.baseline_protocols import PlainProtocol

        return PlainProtocol


class Alternate(Recovery):
    # A failure on a plain step is not survived, but the job is not restarted either: it is a measurement.
    name, restarts_job, survives_failures = "alternate", False, False

    def protocol_class(self) -> type[StepProtocol]:
        from unbroken.runtime.baseline_protocols import AlternatingProtocol

        return AlternatingProtocol


RECOVERIES: dict[str, Recovery] = {r.name: r for r in (Takeover(), CheckpointRestart(), Alternate())}
"""The recovery modes by name (``fault.recovery``)."""
check_registry("fault.recovery", RECOVERIES, RECOVERY_NAMES)


def recovery(name: str) -> Recovery:
    """The mode called ``name``.

    Raises:
        ValueError: unknown name (lists the valid ones).
    """
    if name not in RECOVERIES:
        raise ValueError(f"unknown recovery mode {name!r}; valid: {', '.join(RECOVERIES)}")
    return RECOVERIES[name]
