"""Structured JSONL output: metrics lines and events, appended and flushed per line.

Every line is one JSON object with a ``kind`` field (``train``, ``val``,
``event``...). Readers tolerate a trailing partial line (a writer may be killed
mid-line), so the files are safe to tail while a run is in progress.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator


class JsonlWriter:
    """Append-only JSONL file, flushed after every record."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        record.setdefault("time", time.time())
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a JSONL file (a torn last line is ignored)."""
    return list(iter_jsonl(path))


def iter_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return
    with p.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.endswith("\n"):
                break
            yield json.loads(line)


class JsonlTail:
    """Incrementally read complete new lines of a JSONL file being written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._pos = 0

    @property
    def position(self) -> int:
        """Bytes of the file read so far (whole lines)."""
        return self._pos

    def read_new(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        out = []
        with self.path.open(encoding="utf-8") as fh:
            fh.seek(self._pos)
            while True:
                line = fh.readline()
                if not line.endswith("\n"):
                    break
                self._pos = fh.tell()
                out.append(json.loads(line))
        return out
