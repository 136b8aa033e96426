"""What an agent reads back from a worker's event file (:mod:`unbroken.agent._run_files`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unbroken.agent._run_files import newest_adopted_gen


def _write(run_dir: Path, records: list[dict], torn: str = "") -> None:
    path = run_dir / "events" / "w3.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)


@pytest.mark.parametrize("chunk", [7, 64, 1 << 16])  # lines split across chunks, and one chunk for all
def test_the_newest_view_an_incarnation_adopted_is_read_back_from_the_end(tmp_path: Path, chunk: int) -> None:
    steps = [{"kind": "work", "step": s, "time": 200.0 + s} for s in range(40)]
    _write(tmp_path, [
        {"event": "view_adopted", "gen": 0, "pid": 10, "time": 100.0},  # an earlier incarnation
        {"event": "view_adopted", "gen": 2, "pid": 11, "time": 150.0},
        *steps[:20],
        {"event": "view_adopted", "gen": 4, "pid": 11, "time": 221.0},
        *steps[20:],
    ], torn='{"event": "view_adopted", "gen": 9, "pid": 11, "ti')  # a torn last line is no record
    assert newest_adopted_gen(tmp_path, 3, 11, since=140.0, chunk=chunk) == 4
    assert newest_adopted_gen(tmp_path, 3, 10, since=90.0, chunk=chunk) == 0
    # Only the records since the incarnation's start are read: an older one of its pid is not its own
    assert newest_adopted_gen(tmp_path, 3, 10, since=230.0, chunk=chunk) is None
    assert newest_adopted_gen(tmp_path, 3, 12, since=0.0, chunk=chunk) is None  # adopted nothing
    assert newest_adopted_gen(tmp_path, 4, 11, since=0.0, chunk=chunk) is None  # no event file
