"""``python -m benchmarks.throughput_reference``: a job's steps told apart by what its snapshots did during them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.throughput_reference import snapshot_split, split_line


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


def test_split_line_when_every_step_overlapped_a_write():
    # a run whose writes never stopped (fresh buffers on a slow host): no "other" steps to measure against
    split = {"snapshot": {"steps": 1, "median_s": 0.195, "mean_s": 0.195, "above_other_s": None},
             "overlapped": {"steps": 55, "median_s": 0.1646, "mean_s": 0.1686, "above_other_s": None},
             "other": {"steps": 0, "median_s": None, "mean_s": None, "above_other_s": None}}
    assert split_line(split) == "snapshot steps 1, median 0.1950 s; overlapped steps 55, median 0.1646 s"
    split["other"] = {"steps": 3, "median_s": 0.16, "mean_s": 0.16, "above_other_s": 0.0}
    split["snapshot"]["above_other_s"] = 0.035
    assert split_line(split).startswith("snapshot steps 1, median 0.1950 s, +0.04 s above the others' median; ")
    assert split_line(split).endswith("; other steps 3, median 0.1600 s")
