"""The store's request latency as a running histogram: a constant cost per request, fixed memory, quantiles
on demand.

:class:`LatencyHistogram` counts each request's seconds into log-spaced buckets (:data:`PER_DECADE` a decade
from :data:`FLOOR_S` to :data:`CEIL_S`, one below and one above), so a quantile is known to within one bucket
(about 12 % of its value) however many requests it saw. :class:`LatencyReport` hands a worker, at most every
:data:`REPORT_S` seconds, the summary of the requests since its last one (``calls``, ``p50_s``, ``p99_s``,
``max_s``), which the worker writes as one ``store_latency`` event: one line per worker per interval, never one
per request.

Invariants: :meth:`LatencyHistogram.add` is O(1) and allocates nothing; :meth:`~LatencyHistogram.add` and
:meth:`~LatencyHistogram.take` hold the histogram's lock, so a request counted while a report is taken lands in
exactly one of the two; a quantile is the geometric middle of its bucket, clamped to the
largest request seen.
"""

from __future__ import annotations

import math
import threading
from typing import Any

__all__ = ["CEIL_S", "FLOOR_S", "LatencyHistogram", "LatencyReport", "PER_DECADE", "REPORT_S"]

FLOOR_S = 1e-5
"""Requests faster than this share the lowest bucket."""
CEIL_S = 100.0
"""Requests slower than this share the highest bucket."""
PER_DECADE = 10
"""Buckets per factor of ten: a bucket spans a factor of ``10 ** (1 / PER_DECADE)`` (about 1.26)."""
REPORT_S = 10.0
"""Seconds between two reports of a worker's store latency (and one at its last step)."""

_BUCKETS = round(math.log10(CEIL_S / FLOOR_S) * PER_DECADE) + 2


class LatencyHistogram:
    """Counts of request seconds per log-spaced bucket (module docstring)."""

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.calls = 0
        self.max_s = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        if seconds <= FLOOR_S:
            i = 0
        else:
            i = min(_BUCKETS - 1, 1 + int(math.log10(seconds / FLOOR_S) * PER_DECADE))
        with self._lock:
            self.counts[i] += 1
            self.calls += 1
            if seconds > self.max_s:
                self.max_s = seconds

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0 < q <= 1) in seconds; None before the first request."""
        if self.calls == 0:
            return None
        rank, seen = q * self.calls, 0
        for i, n in enumerate(self.counts):
            seen += n
            if n and seen >= rank:
                return min(self.max_s, _middle(i))
        return self.max_s

    def take(self) -> LatencyHistogram:
        """The requests counted so far, as a histogram of their own; this one starts again from none."""
        taken, fresh = LatencyHistogram(), [0] * _BUCKETS
        with self._lock:
            taken.counts, taken.calls, taken.max_s = self.counts, self.calls, self.max_s
            self.counts, self.calls, self.max_s = fresh, 0, 0.0
        return taken

    def summary(self) -> dict[str, Any]:
        """``calls``, ``p50_s``, ``p99_s`` and ``max_s`` (seconds, rounded to the microsecond)."""
        p50, p99 = self.quantile(0.5), self.quantile(0.99)
        return {"calls": self.calls, "p50_s": None if p50 is None else round(p50, 6),
                "p99_s": None if p99 is None else round(p99, 6), "max_s": round(self.max_s, 6)}


def _middle(i: int) -> float:
    """The geometric middle of bucket ``i`` (the lowest and highest: their inner edge)."""
    if i == 0:
        return FLOOR_S
    if i == _BUCKETS - 1:
        return CEIL_S
    return FLOOR_S * 10 ** ((i - 0.5) / PER_DECADE)


class LatencyReport:
    """When a worker reports its store latency, and what (module docstring).

    Args:
        histogram: the store connection's (:meth:`~unbroken.store.job_store.JobStore.request_latency`).
        every_s: seconds between two reports.
    """

    def __init__(self, histogram: LatencyHistogram, *, every_s: float = REPORT_S) -> None:
        self.histogram, self.every_s = histogram, every_s
        self._last: float | None = None

    def due(self, now: float, *, last: bool = False) -> dict[str, Any] | None:
        """The summary of the requests since the previous report, if one is due at ``now`` (monotonic seconds;
        ``last``: the worker's last step, always due); None otherwise, or when no request came since."""
        if self._last is None:
            self._last = now  # the first interval starts at the first step, after the start-up's requests
            self.histogram.take()
            return None
        if not last and now - self._last < self.every_s:
            return None
        self._last = now
        taken = self.histogram.take()
        return taken.summary() if taken.calls else None
