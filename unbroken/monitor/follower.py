"""Follows a run directory: new ``metrics.jsonl`` lines and new events, in the order they were written.

Events are read from the files each process writes (``RUN/events/w*.jsonl``, ``agent*``, ``standby*``,
``chaos.jsonl``), so the same follower serves ``unbroken train`` (whose launcher also merges them into
``events.jsonl``) and agents a scheduler started (where nobody merges them). An event every member of a
view records (``view_adopted``, ``reconfigured``, ``attempt_aborted``) is kept once per generation; a line
that is not JSON stops the reading of its file, said once. A ``metrics.jsonl`` cut back (a restart from a
checkpoint rewrites it shorter) is read again from its start.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from pathlib import Path
from typing import Any

from unbroken.jsonl import JsonlTail

logger = logging.getLogger(__name__)

SOURCES = ("w*.jsonl", "agent*.jsonl", "standby*.jsonl", "chaos.jsonl")
PER_VIEW = frozenset({"view_adopted", "reconfigured", "attempt_aborted"})

Record = dict[str, Any]


def written_at(rec: Record) -> float:
    return float(rec.get("time") or rec.get("t") or 0.0)


class RunFollower:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._metrics = JsonlTail(run_dir / "metrics.jsonl")
        self._tails: dict[str, JsonlTail] = {}
        self._broken: set[str] = set()
        self._seen: set[tuple[Any, Any]] = set()

    def read(self) -> list[tuple[str, Record]]:
        """``("record", line)`` and ``("event", event)`` pairs written since the last call, ordered by time."""
        path = self._metrics.path
        try:
            if path.stat().st_size < self._metrics.position:  # cut back: read it again from the start
                self._metrics = JsonlTail(path)
        except FileNotFoundError:
            pass
        out = [("record", r) for r in self._safe(self._metrics, "metrics.jsonl")]
        out += [("event", e) for e in self._events()]
        out.sort(key=lambda item: written_at(item[1]))  # stable: each file keeps its order
        return out

    def _events(self) -> list[Record]:
        try:
            names = sorted(e.name for e in os.scandir(self.run_dir / "events"))
        except FileNotFoundError:
            return []
        out: list[Record] = []
        for name in names:
            if name in self._broken or not any(fnmatch.fnmatch(name, p) for p in SOURCES):
                continue
            tail = self._tails.setdefault(name, JsonlTail(self.run_dir / "events" / name))
            for rec in self._safe(tail, f"events/{name}"):
                if rec.get("kind") != "event":
                    continue
                if rec.get("event") in PER_VIEW:
                    key = (rec["event"], rec.get("gen"))
                    if key in self._seen:
                        continue
                    self._seen.add(key)
                out.append(rec)
        return out

    def _safe(self, tail: JsonlTail, name: str) -> list[Record]:
        try:
            return tail.read_new()
        except (ValueError, json.JSONDecodeError) as exc:
            logger.warning("monitor: %s has an unreadable line (%s); no longer following it", name, exc)
            self._broken.add(name.removeprefix("events/"))
            return []
