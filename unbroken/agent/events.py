"""The run's events in one file, ``RUN/events.jsonl``, merged by the launcher as they happen.

Each worker appends its own ``events/w<id>.jsonl`` (view changes, aborted
attempts, takeovers, rejoins, late results, refused joins; next to its ledger
records) and each agent its ``events/agent<R>.jsonl`` (worker starts and
exits, injected faults, fences, standby handovers), a warm standby once warm
its ``events/standby<R>.jsonl``; ``unbroken chaos`` writes
``events/chaos.jsonl``. :class:`EventMerger` follows all of them (files are
found as they appear) and appends every ``kind: event`` record to
``events.jsonl`` with ``source``, the file it came from (relative to the run
directory), and its original fields.

Invariants: a record is merged at most once; a view change, which every
member records, is kept once per ``(event, gen)``; records written before the
merger started (an earlier launch of a resumed run, an earlier attempt under
checkpoint-restart) are left out; records keep their order of arrival (those
found in one poll are ordered by the time they were written). A poll costs one
directory listing and a ``stat`` per file when nothing was written.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from pathlib import Path
from typing import Any

from unbroken.jsonl import JsonlTail, JsonlWriter

logger = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
"""The merged events, in the run directory."""
SOURCES = ("w*.jsonl", "agent*.jsonl", "standby*.jsonl", "chaos.jsonl")
"""The per-process event files under ``RUN/events/`` that are merged."""
PER_VIEW = frozenset({"view_adopted", "reconfigured", "attempt_aborted"})
"""Events every member of a view records: kept once per ``(event, gen)``."""


class EventMerger:
    """Merges the event files of ``run_dir`` into ``run_dir/events.jsonl`` (module docstring).

    Args:
        run_dir: the run directory.
        since: records written before this time (``time.time()``) are left out.
    """

    def __init__(self, run_dir: str | Path, *, since: float) -> None:
        self.run_dir = Path(run_dir)
        self.since = since
        self._tails: dict[str, JsonlTail] = {}
        self._sizes: dict[str, int] = {}
        self._broken: set[str] = set()
        self._seen: set[tuple[str, Any]] = set()
        self._out = JsonlWriter(self.run_dir / EVENTS_FILE)

    def poll(self) -> list[dict[str, Any]]:
        """Merge what was written since the last poll; returns the new merged records, in order."""
        batch: list[dict[str, Any]] = []
        for name in self._grown():
            tail = self._tails.setdefault(name, JsonlTail(self.run_dir / "events" / name))
            try:
                records = tail.read_new()
            except ValueError as exc:  # a line that is not JSON: the tail cannot get past it
                logger.warning("events/%s: unreadable line (%s); no longer merging that file", name, exc)
                self._broken.add(name)
                continue
            batch += [{"source": f"events/{name}", **r} for r in records if self._accept(r)]
        batch.sort(key=_written_at)
        for rec in batch:
            self._out.write(rec)
        return batch

    def close(self) -> None:
        self._out.close()

    def __enter__(self) -> EventMerger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _grown(self) -> list[str]:
        """The names of the source files that grew since the last poll."""
        try:
            entries = list(os.scandir(self.run_dir / "events"))
        except FileNotFoundError:
            return []
        grown = []
        for entry in entries:
            if entry.name in self._broken or not any(fnmatch.fnmatch(entry.name, p) for p in SOURCES):
                continue
            try:
                size = entry.stat().st_size
            except FileNotFoundError:
                continue
            if size != self._sizes.get(entry.name):
                self._sizes[entry.name] = size
                grown.append(entry.name)
        return sorted(grown)

    def _accept(self, rec: dict[str, Any]) -> bool:
        if rec.get("kind") != "event" or _written_at(rec) < self.since:
            return False
        if rec.get("event") in PER_VIEW:
            key = (rec["event"], rec.get("gen"))
            if key in self._seen:
                return False
            self._seen.add(key)
        return True


def _written_at(rec: dict[str, Any]) -> float:
    return float(rec.get("time", rec.get("t", 0.0)))
