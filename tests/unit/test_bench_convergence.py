"""Smoke test of the MeCeFO convergence study (``python -m benchmarks.mecefo_convergence``): runs, writes JSON and
a plot."""

from __future__ import annotations

import json

import pytest

from benchmarks.mecefo_convergence import main

pytestmark = pytest.mark.timeout(120)


def test_convergence_smoke(tmp_path, corpus_overrides):
    out, plot = tmp_path / "conv.json", tmp_path / "conv.png"
    result = main(["--presets", "debug", "--steps", "20", "--policies", "neighbor", "--traces", "none,high",
                   "--cluster-workers", "job,64", "--micro-batch", "2", "--seq-len", "32", "--val-batches", "2",
                   "--out", str(out), "--plot", str(plot), *(f"--{o}" for o in corpus_overrides)])
    saved = json.loads(out.read_text())
    assert saved.keys() >= {"benchmark", "settings", "rel_val_ppl", "targets", "runs", "wall_s", "machine"}
    assert [(r["trace"], r["cluster_workers"], r["policy"]) for r in saved["runs"]] == [
        ("none", None, None), ("high", None, "neighbor"), ("high@64", 64, "neighbor")]
    assert saved["runs"][0]["rel_ppl"] == 0.0
    assert set(saved["rel_val_ppl"]["debug"]) == {"high", "high@64"}
    assert set(saved["rel_val_ppl"]["debug"]["high"]) == {"neighbor"}
    assert set(saved["targets"]) == {"debug/high/neighbor_within_2pct", "debug/high@64/neighbor_within_2pct"}
    # A 4-slot slice of a 64-worker cluster fails 16 times less often than the job on its own.
    assert saved["runs"][2]["down_fraction"] < saved["runs"][1]["down_fraction"]
    assert saved["runs"][1]["degraded_fraction"] > 0 and len(saved["runs"][1]["train_curve"]) == 20
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["rel_val_ppl"] == saved["rel_val_ppl"]


@pytest.mark.parametrize("bad", ["3", "many", "job,-8"])
def test_convergence_rejects_bad_cluster_workers(tmp_path, capsys, bad):
    with pytest.raises(SystemExit):
        main(["--cluster-workers", bad, "--out", str(tmp_path / "x.json"), "--plot", str(tmp_path / "x.png")])
    assert "--cluster-workers" in capsys.readouterr().err


def test_convergence_rejects_unknown_policy(tmp_path):
    with pytest.raises(ValueError, match="--policies"):
        main(["--policies", "ring", "--out", str(tmp_path / "x.json"), "--plot", str(tmp_path / "x.png")])


def test_convergence_seeds_and_reuse_of_finished_runs(tmp_path, corpus_overrides):
    args = ["--presets", "debug", "--steps", "6", "--policies", "neighbor,spread", "--traces", "high",
            "--slots", "4", "--global-batch", "8", "--max-down", "1", "--seeds", "0,1", "--seeds-per-point",
            "spread=1", "--seq-len", "32", "--val-batches", "2", "--runs-dir", str(tmp_path / "runs"), "--reuse",
            "--out", str(tmp_path / "a.json"), "--plot", str(tmp_path / "a.png"),
            *(f"--{o}" for o in corpus_overrides)]
    first = main(args)
    assert [(r["trace"], r["policy"], r["seed"]) for r in first["runs"]] == [
        ("none", None, 0), ("none", None, 1), ("high", "neighbor", 0), ("high", "neighbor", 1),
        ("high", "spread", 0)]
    assert first["settings"]["micro_batch"] == 2 and first["settings"]["max_down"] == 1
    assert all(r["most_down"] <= 1 for r in first["runs"])
    stats = first["rel_val_ppl_stats"]["debug"]["high"]
    assert stats["neighbor"]["n"] == 2 and stats["spread"]["n"] == 1
    assert stats["neighbor"]["mean"] == pytest.approx(sum(r["rel_ppl"] for r in first["runs"][2:4]) / 2)
    assert abs(stats["spread"]["mean"]) < 1e-4 and first["targets"]["debug/high/spread_equals_failure_free"]
    marker = tmp_path / "runs" / "debug-high-neighbor-s1" / "metrics.jsonl"
    mtime = marker.stat().st_mtime_ns
    second = main(args)
    assert marker.stat().st_mtime_ns == mtime, "a finished run of the same config is read back, not trained again"
    assert [r["val_ppl"] for r in second["runs"]] == [r["val_ppl"] for r in first["runs"]]
    # A run written before a field existed (its config.json lacks it) matches that field at its default;
    # a run of another config does not.
    from benchmarks.mecefo_convergence import _finished_run

    run = tmp_path / "runs" / "debug-high-neighbor-s1"
    current = json.loads((run / "config.json").read_text())
    stored = json.loads((run / "config.json").read_text())
    del stored["model"]["factory"], stored["train"]["shard_optimizer"]
    (run / "config.json").write_text(json.dumps(stored))
    assert _finished_run(run, current)
    assert not _finished_run(run, {**current, "train": {**current["train"], "seed": 7}})
    # The final parameters on the whole validation split: the same windows for every seed, cached per run.
    third = main(args + ["--full-val"])
    full = [r["val_ppl_full"] for r in third["runs"]]
    assert all(1.0 < v < 1e4 for v in full) and full[0] != full[1]  # two seeds, two models
    assert full[4] == pytest.approx(full[0], rel=1e-4)  # spread, seed 0: the failure-free model
    assert (run / "final_val_full.json").is_file()
    stats = third["rel_val_ppl_full_stats"]["debug"]["high"]
    assert stats["neighbor"]["n"] == 2 and abs(stats["spread"]["mean"]) < 1e-4
    assert third["targets_full_split"]["debug/high/spread_equals_failure_free"]
    assert third["runs"][2]["full_rel_ppl"] == pytest.approx(full[2] / full[0] - 1)
