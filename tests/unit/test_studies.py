"""The in-process studies of ``benchmarks/`` that had no test of their own: each runs with its smallest
arguments and writes the JSON it returns."""

from __future__ import annotations

import json

import pytest

from benchmarks import data_sampler, snapshot_contention, snapshot_first_writes, snapshot_pinned

pytestmark = pytest.mark.timeout(120)


def test_the_pinned_and_device_staging_counts_shrink_to_what_a_worker_writes(tmp_path):
    out = tmp_path / "pinned.json"
    result = snapshot_pinned.main(["--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for case in result["pinned"].values():
        assert case["pinned_gb_per_worker_after_max"] < case["pinned_gb_per_worker_before"]
        assert case["restore_host_gb_per_worker_after"] < case["restore_host_gb_per_worker_before"]
    for case in result["device_staging"].values():
        assert case["device_staging_gb"] <= min(case["cap_gb"], case["device_staging_gb_before"])


def test_the_data_sampler_study_reports_memory_and_rate(tmp_path):
    out = tmp_path / "sampler.json"
    result = data_sampler.main(["--tokens", "10000000", "--calls", "200", "--slots", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["tokens"] == 10_000_000 and result["slots"] == 4 and "machine" in result


def test_the_snapshot_write_studies_run_from_their_command_lines(tmp_path):
    contention = snapshot_contention.main(["--mb", "8", "--threads", "1", "--iters", "2000", "--rounds", "2",
                                           "--out", str(tmp_path / "contention.json")])
    assert set(contention["slowdown"]) == {"snapshot", "torch_copy"}
    assert json.loads((tmp_path / "contention.json").read_text())["slowdown"] == contention["slowdown"]
    first = snapshot_first_writes.main(["--first-writes-mb", "4", "--threads", "2", "--writes", "3", "--rounds", "2",
                                        "--out", str(tmp_path / "first.json")])
    assert (first["state_mb"], first["writes"]) == (4, 3)
    assert json.loads((tmp_path / "first.json").read_text())["first_two_ratio"] == first["first_two_ratio"]
