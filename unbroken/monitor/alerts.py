"""When the job needs a person: the alert texts, each said once per episode.

:class:`Alerts` is asked at every poll with the :class:`~unbroken.monitor.job_state.JobState`: a restore that
failed (each new one), capacity below ``monitor.alert_capacity`` of the workers for longer than
``monitor.alert_capacity_s`` (again only after it recovered), no step for ``monitor.alert_no_step_s``
(again only after a step); :func:`stopped` words the end of a job that did not finish.
"""

from __future__ import annotations

from unbroken.config import MonitorConfig
from unbroken.monitor.job_state import JobState


def stopped(job: str, message: str) -> str:
    """The alert of a job that stopped before its last step; ``message`` says why and how to continue."""
    return f"unbroken {job}: the job stopped: {message}"


class Alerts:
    def __init__(self, job: str, cfg: MonitorConfig, *, started: float, hint: str) -> None:
        self.job, self.cfg, self.started, self.hint = job, cfg, started, hint  # where to look when no step comes
        self._failed_restores = 0
        self._low_since: float | None = None
        self._low_said = False
        self._quiet_said = False

    def check(self, s: JobState, now: float) -> list[str]:
        out = []
        if s.failed_restores > self._failed_restores:
            self._failed_restores = s.failed_restores
            out.append(f"unbroken {self.job}: a restore failed ({s.failed_restores} so far): "
                       f"{s.last_failed_restore}")
        low = s.live is not None and self.cfg.alert_capacity > 0 and s.live < self.cfg.alert_capacity * s.workers
        if not low:
            self._low_since, self._low_said = None, False
        else:
            self._low_since = self._low_since if self._low_since is not None else now
            if not self._low_said and now - self._low_since >= self.cfg.alert_capacity_s:
                self._low_said = True
                out.append(f"unbroken {self.job}: {s.live} of {s.workers} workers live for "
                           f"{now - self._low_since:.0f} s (below {self.cfg.alert_capacity:.0%}) at step {s.step}")
        # Counted from this monitor's start at the earliest: a resumed job's last step may be days old.
        since = now - max(s.last_step_time or self.started, self.started)
        if self.cfg.alert_no_step_s <= 0 or since < self.cfg.alert_no_step_s:
            self._quiet_said = False
        elif not self._quiet_said:
            self._quiet_said = True
            out.append(f"unbroken {self.job}: no step for {since:.0f} s (last: step {s.step}); {self.hint}")
        return out
