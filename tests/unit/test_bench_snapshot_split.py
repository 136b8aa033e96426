"""``bench throughput --reference``: a job's steps told apart by what its snapshots did during them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unbroken.bench.throughput_reference import snapshot_split


def _events(run: Path, records: list[dict]) -> None:
    (run / "events").mkdir(parents=True)
    (run / "events" / "w0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_steps_are_split_into_snapshot_overlapped_and_other(tmp_path: Path):
    # steps 1..8 end at t = 1..8 (step s spans (s-1, s]); 0-based commit records
    commits = [{"kind": "commit", "step": s - 1, "worker": 0, "time": float(s)} for s in range(0, 9)]
    commits[6]["time"] = 6.5  # step 6 ends late: (5, 6.5], and step 7 spans (6.5, 7]
    sealed = [{"kind": "event", "event": "snapshot_sealed", "worker": 0, "step": 5, "bytes": 1, "stage_s": 0.1,
               "write_s": 0.5, "started_at": 4.9, "sealed_at": 6.2},
              {"kind": "event", "event": "snapshot_sealed", "worker": 1, "step": 7, "bytes": 1, "stage_s": 0.1,
               "write_s": 0.5, "started_at": 6.6, "sealed_at": 7.5}]  # another worker's: not counted
    _events(tmp_path, commits + sealed)
    split = snapshot_split(tmp_path, steps=8)  # the last half: steps 5..8
    assert split is not None
    assert split["snapshot"]["steps"] == 1 and split["snapshot"]["median_s"] == pytest.approx(1.0)  # step 5
    assert split["overlapped"]["steps"] == 1 and split["overlapped"]["median_s"] == pytest.approx(1.5)  # step 6
    assert split["other"]["steps"] == 2  # steps 7 (0.5 s) and 8 (1 s)
    assert split["other"]["median_s"] == pytest.approx(0.75)
    assert split["overlapped"]["above_other_s"] == pytest.approx(0.75)


def test_no_sealed_snapshot_gives_none(tmp_path: Path):
    _events(tmp_path, [{"kind": "commit", "step": s, "worker": 0, "time": float(s)} for s in range(4)])
    assert snapshot_split(tmp_path, steps=4) is None
