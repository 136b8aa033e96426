"""Smoke tests: the throughput, failover, store and recovery benchmarks run end to end and write their JSON."""

from __future__ import annotations

import json

import pytest

from unbroken.bench import failover, throughput
from unbroken.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_throughput_benchmark(tmp_path, corpus_overrides):
    out = tmp_path / "tp.json"
    result = throughput.main(["--workers", "2", "--precision", "fp32,bf16", "--steps", "4", "--out", str(out),
                              *[f"--{o}" for o in corpus_overrides]])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert [(r["workers"], r["precision"]) for r in result["rows"]] == [(2, "fp32"), (2, "bf16")]
    assert all(r["tokens_per_s"] > 0 and r["scaling_vs_first"] == 1.0 for r in result["rows"])
    fp32, bf16 = result["rows"]
    assert bf16["bf16_vs_fp32"] == pytest.approx(bf16["tokens_per_s"] / fp32["tokens_per_s"])
    for r in result["rows"]:  # a step's peak holds its own reduction buffer, not the last step's beside it
        assert r["held"]["reduction_buffers"] == 1, r["held"]
        assert r["held"]["held_bytes"] >= r["held"]["buffer_bytes"], "the step's buffer itself was seen"


def test_failover_benchmark_overhead_part(tmp_path, corpus_overrides):
    out = tmp_path / "fo.json"
    result = failover.main(["--steps", "8", "--repeats", "1", "--parts", "overhead", "--nodes", "1",
                            "--workers-per-node", "2", "--out", str(out), *[f"--{o}" for o in corpus_overrides]])
    assert json.loads(out.read_text())["overhead"]["ratio"] == pytest.approx(result["overhead"]["ratio"])
    assert len(result["overhead"]["plain_step_s"]) == len(result["overhead"]["takeover_step_s"]) == 1
    assert result["overhead"]["ratio"] > 0
    # 16 alternating steps; the first 4 are warm-up: 6 plain and 6 protocol steps are compared.
    assert result["overhead"]["alternating"]["steps_each"] == 6


def test_bench_rejects_unknown_arguments(capsys):
    with pytest.raises(SystemExit):
        throughput.main(["--bogus", "1"])
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_store_benchmark_latency_part(tmp_path, etcd_cluster):
    """On the session's etcd cluster (``--store``): the latency table of both stores, and its JSON."""
    from unbroken.bench import store

    out = tmp_path / "store.json"
    result = store.main(["--parts", "latency", "--ops", "5", "--store", etcd_cluster.url, "--out", str(out)])
    assert json.loads(out.read_text())["latency_us"] == result["latency_us"]
    assert set(result["latency_us"]) == {"tcp", "etcd"}
    assert all(v > 0 for lat in result["latency_us"].values() for v in lat.values())


def test_recovery_benchmark_reads_each_phase_of_both_parts(tmp_path, corpus_overrides):
    """``bench recovery`` on one node of two workers: one worker killed, then both, then a job's end alone; every
    phase is read from the runs' events, in the order a recovery (and an end) goes through them."""
    from unbroken.bench import recovery

    out = tmp_path / "recovery.json"
    # 36 steps after the kill: the killed worker's restart and admission (a second or two on a loaded machine)
    # come before the job's end, which would leave part one without a recovery to read
    result = recovery.main(["--cases", "debug:1x2", "--parts", "one,all,final", "--steps", "40", "--kill-step",
                            "4", "--snapshot-every", "1", "--out", str(out),
                            *[f"--{o}" for o in corpus_overrides]])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"], default=str))
    assert [(r["case"], r["part"], r["killed"]) for r in result["rows"]] == [
        ("debug:1x2", "one", [1]), ("debug:1x2", "all", [0, 1]), ("debug:1x2", "final", [])]
    for row in result["rows"]:  # every job ends with its final checkpoint, written by the view's leader
        end = row["end"]
        assert 0 < end["checkpoint_committed"] <= end["workers_exited"] <= end["job_returned"], end
        assert end["checkpoint_gb"] > 0 and end["writers"] == 1, end
    assert result["rows"][2]["recovery"] is None and result["rows"][2]["recoveries"] == 0
    for row in result["rows"][:2]:
        rec = row["recovery"]
        assert row["recoveries"] == 1 and rec["workers"] == row["killed"] and rec["kill_step"] == 4
        assert rec["whole_job"] is (row["part"] == "all")
        phases = [rec[p] for p in ("death_seen", "decided", "state_loaded", "first_step")]
        assert all(p is not None for p in phases), rec
        assert 0 <= rec["death_seen"] <= rec["first_step"] and rec["decided"] <= rec["state_loaded"] <= rec["first_step"]
        assert 0 < rec["process_ready"] <= rec["first_step"] and rec["median_step_s"] > 0
    whole = result["rows"][1]["recovery"]
    # The whole job restored from memory; a worker whose restart came after the restored view's admission joins
    # it from its node's memory as well ("memory"), never by a transfer or from a checkpoint.
    assert "restore" in whole["load"]["how"] and set(whole["load"]["how"]) <= {"restore", "memory"}
    assert whole["load"]["bytes"] > 0 and set(whole["inventory_s"]) == {"0"}
