"""Smoke tests of the studies in ``benchmarks/`` that run jobs or processes: each runs end to end with its smallest
arguments and writes its JSON."""

from __future__ import annotations

import json

import pytest

from benchmarks import (failover_stall, final_checkpoint_write, recovery_load, throughput_reference,
                        throughput_under_failures)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_failover_stall_study(tmp_path, corpus_overrides):
    """One crash run and one hang run: each fault's stall, the normal step and the target side
    by side, in the JSON too; no attempt aborted by a rejoin, nothing lost."""
    out = tmp_path / "stall.json"
    result = failover_stall.main(["--steps", "40", "--crash-runs", "1", "--hang-runs", "1",
                                  "--nodes", "3", "--workers-per-node", "1", "--out", str(out),
                                  *[f"--{o}" for o in corpus_overrides]])
    stall = result["stall"]
    assert json.loads(out.read_text())["stall"]["crash"]["median_stall_s"] == stall["crash"]["median_stall_s"]
    assert stall["fault_step"] == 25 and stall["heartbeat_timeout_s"] == 0.5
    for kind in ("crash", "hang"):
        k = stall[kind]
        assert len(k["runs"]) == 1 and len(k["runs"][0]["stall_s"]) == 1, f"the {kind} was one failure"
        assert k["median_stall_s"] == k["runs"][0]["stall_s"][0] and k["normal_step_s"] > 0
        assert k["admission_aborts"] == 0 and k["lost_steps"] == 0 and k["ledger_ok"]
        run = k["runs"][0]
        assert run["detect_s"] >= 0 and run["recover_s"] > 0, "where the stall went, from the run's records"
    assert stall["crash"]["target_s"] == pytest.approx(stall["crash"]["normal_step_s"] / 2 + 0.05)
    assert stall["hang"]["target_s"] == pytest.approx(0.8)


def test_throughput_reference_study(tmp_path, corpus_overrides):
    """On the CPU: the plain eager loop, then unbroken with ``every=0`` and every 2 steps, side by
    side: each unbroken row's ratio to the plain loop, the snapshot overhead on the snapshotting row only, the
    jobs' records kept and their checkpoints dropped."""
    out, logs = tmp_path / "ref.json", tmp_path / "logs"
    result = throughput_reference.main(["--workers", "1", "--steps", "6", "--plain", "eager", "--snapshots", "0,2",
                                        "--keep-logs", str(logs), "--out", str(out),
                                        *[f"--{o}" for o in corpus_overrides]])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    plain, off, on = result["rows"]
    assert (plain["loop"], plain["compile"]) == ("plain", False)
    assert [(r["loop"], r["workers"], r["snapshot_every"]) for r in (off, on)] == [("unbroken", 1, 0),
                                                                                   ("unbroken", 1, 2)]
    for row in (off, on):
        assert row["ratio_vs_plain"] == pytest.approx(row["tokens_per_s"] / plain["tokens_per_s"])
        assert row["ratio_vs_plain_rounds"] == [pytest.approx(row["ratio_vs_plain"])]
        assert row["mfu"] is None  # no peak FLOP/s is known for a CPU
        assert row["store_per_step"]["main_per_step"] > 0, "the step's store requests, from the worker's report"
    assert "snapshot_overhead" not in off
    assert on["snapshot_overhead"] == pytest.approx(1 - on["window_tokens_per_s"] / off["window_tokens_per_s"])
    assert off["snapshots"] == {"every": 0, "taken": 0}
    assert on["snapshots"]["every"] == 2 and on["snapshots"]["taken"] >= 1
    assert sorted(p.name for p in logs.iterdir()) == ["w1-s0-r0", "w1-s2-r0"]
    assert all((logs / name / "summary.json").is_file() and not (logs / name / "checkpoints").exists()
               for name in ("w1-s0-r0", "w1-s2-r0"))


def test_recovery_load_study(tmp_path, corpus_overrides):
    """The state's load in its own process: the inventory and the loads, three of each, into the live state and
    into a forked worker."""
    out = tmp_path / "load.json"
    result = recovery_load.main(["--presets", "debug", "--out", str(out), *[f"--{o}" for o in corpus_overrides]])
    assert json.loads(out.read_text())["load"] == result["load"]
    load = result["load"]["debug"]
    assert load["forked"] == "measured" and load["checked_bytes"] > 2 * load["state_bytes"] > 0
    assert all(len(load[k]) == 3 and all(x and x > 0 for x in load[k])
               for k in ("inventory_verify_gb_s", "inventory_seals_s", "load_live_gb_s", "load_forked_gb_s"))


def test_final_checkpoint_write_study(tmp_path, corpus_overrides):
    """In this process: the same state written both ways, three times each, into the directory given."""
    out = tmp_path / "final.json"
    result = final_checkpoint_write.main(["--presets", "debug", "--checkpoint-dir", str(tmp_path), "--out", str(out),
                                          *[f"--{o}" for o in corpus_overrides]])
    assert json.loads(out.read_text())["final"] == result["final"]
    final = result["final"]["debug"]
    assert all(len(final["seconds"][k]) == 3 and all(x > 0 for x in final["seconds"][k]) for k in ("unbroken",
                                                                                                  "dcp_hf"))
    assert final["state_bytes"] > 0 and final["directory"] == str(tmp_path) and not list(tmp_path.glob("unbroken-final-*"))


def test_throughput_under_failures_study(tmp_path, corpus_overrides):
    """Two workers, one trace, one policy: the run's ratio to the failure-free run, every row trained once, and the
    two comparisons modelled from the phases the runs measured (said so in the JSON)."""
    out = tmp_path / "tuf.json"
    result = throughput_under_failures.main(["--preset", "debug", "--nodes", "1", "--workers-per-node", "2",
                                             "--steps", "12", "--traces", "high", "--policies", "neighbor",
                                             "--cover-repeats", "1", "--out", str(out),
                                             *[f"--{o}" for o in corpus_overrides]])
    assert json.loads(out.read_text())["traces"] == json.loads(json.dumps(result["traces"]))
    assert result["benchmark"] == "throughput_under_failures" and result["slots"] == result["workers"] == 2
    assert "modelled" in result["modelled"] and result["paper"]["throughput_loss"] == 0.0418
    rows = result["traces"]["high"]["rows"]
    run = rows["neighbor"]
    assert run["failures"] >= 1 and run["ledger_ok"] and run["lost_steps"] == 0
    assert run["throughput_ratio"] == pytest.approx(run["tokens_per_s"] / result["failure_free"]["tokens_per_s"])
    for name in ("drop-the-step", "checkpoint-restart-from-memory"):
        assert rows[name]["modelled"] and 0 < rows[name]["throughput_ratio"] < 1, rows[name]
    assert rows["drop-the-step"]["phases"]["detect_s"] == max(0.0, run["stall_median_s"])
    cover = result["cover"]["time_ratio"]["neighbor"]  # the covering step, measured in the same invocation
    assert cover > 1 and run["model"]["phases"]["cover_ratio"] == cover
    assert run["model"]["modelled"] and 0 < run["model"]["throughput_ratio"] < 1
