"""The replica engine: hand-computed passes, the runtime's refusals, inputs' provenance, --validate's exit code."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from unbroken.cluster.engine import EngineCosts, run_engine
from unbroken.cluster.phases import DEFAULT_INPUTS, load_inputs
from unbroken.cluster.projection import engine_costs, phase_budget, project
from unbroken.cluster.replicas import ReplicaEvent, ReplicaSpec, replica_events
from unbroken.cluster.strategies import daly_interval_s
from unbroken.cluster.validate import replay_soak

ROOT = Path(__file__).resolve().parents[2]
INPUTS = ROOT / DEFAULT_INPUTS


def _spec(**kw: object) -> ReplicaSpec:
    base: dict[str, object] = dict(gpus=4, replica_size=1, gpus_per_node=2, state_bytes=1e9, params=1e6,
                                   micro_batches=1, job_mtbf_h=1e6, mix={"software": 1.0}, spare_nodes=0,
                                   hours=100 / 3600)
    base.update(kw)
    return ReplicaSpec(**base)  # type: ignore[arg-type]


def _costs(**kw: float) -> EngineCosts:
    base = dict(step_s=1.0, detect_crash_s=0.5, detect_hang_s=2.0, reconfigure_s=0.25, start_warm_s=1.0,
                start_cold_s=2.0, cuda_warm_s=0.5, cuda_cold_s=1.0, load_s=0.5, admission_s=0.25,
                restart_memory_s=4.0, restart_disk_s=10.0, save_memory_s=0.5, save_disk_s=0.5)
    base.update(kw)
    return EngineCosts(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["spread", "hybrid", "drop-step"])
def test_no_failure_costs_the_failure_free_ratio_and_the_spares(strategy: str) -> None:
    c = _costs(ratio_unbroken=0.96, ratio_drop_step=0.98)
    ratio = 0.98 if strategy == "drop-step" else 0.96
    assert run_engine(strategy, _spec(), c, []).goodput == pytest.approx(ratio)
    spec = _spec(spare_nodes=1, mix={"hardware": 1.0})  # 2 spare GPUs paid beside 4
    assert run_engine(strategy, spec, c, []).goodput == pytest.approx(ratio * 4 / 6)


def test_spread_one_crash_by_hand() -> None:
    o = run_engine("spread", _spec(), _costs(), [ReplicaEvent(10.0, "software", (), 3)])
    # Stall 0.5 detect + 0.25 view + 1 step (the lost micro-batch of the step in flight on a survivor) to 11.75;
    # back at 10 + 0.5 + 1 + 0.5 + 0.5 = 12.5: 0.75 s of steps at twice the time (a survivor does 2 micro-batches);
    # the admission stalls 0.25 s; then 87.25 full steps.
    assert o.back_s == [2.5]
    assert o.rows == pytest.approx(4 * (10 + 0.375 + 87.25))
    assert o.lost_rows == 0 and o.deferred_rows == 0
    assert o.stalled_s == pytest.approx(1.75 + 0.25)
    assert o.goodput == pytest.approx(390.5 / 400)


def test_hybrid_defers_the_missing_replicas_rows() -> None:
    o = run_engine("hybrid", _spec(), _costs(defer_after_s=1.0), [ReplicaEvent(10.0, "software", (), 3)])
    # Deferred from 11.0 (inside the stall): 11.75 -> 12.5 at full speed on 3 replicas' rows.
    assert o.rows == pytest.approx(4 * 10 + 3 * 0.75 + 4 * 87.25)
    assert o.deferred_rows == pytest.approx(0.75) and o.lost_rows == 0


def test_drop_step_loses_the_step_in_flight_and_the_missing_rows() -> None:
    o = run_engine("drop-step", _spec(), _costs(), [ReplicaEvent(10.25, "software", (), 3)])
    # A quarter step of 4 rows dropped; stall 0.75 s; the replica restarts cold: back at
    # 10.25 + 0.5 + 2 + 1 + 0.5 = 14.25, 3.25 steps without its row; admission 0.25 s; 85.5 full steps.
    assert o.lost_rows == pytest.approx(1.0 + 3.25)
    assert o.rows == pytest.approx(4 * 10 + 3 * 3.25 + 4 * 85.5)


def test_checkpoint_restart_redoes_since_its_daly_checkpoint() -> None:
    spec = _spec(job_mtbf_h=50 / 3600)
    every = round(daly_interval_s(0.5, 50.0))
    wall = 1.0 + 0.5 / every
    o = run_engine("ckpt-disk", spec, _costs(), [ReplicaEvent(20.0, "software", (), 1)])
    done = 20.0 / wall
    keep = math.floor(done / every) * every
    assert o.ckpt_every == every == 7
    assert o.redone_rows == pytest.approx((done - keep) * 4)
    assert o.rows == pytest.approx(4 * (keep + (100 - 30.5) / wall))  # 0.5 detect + 10 restart
    mem = run_engine("ckpt-memory", spec, _costs(), [ReplicaEvent(20.0, "software", (), 1)])
    assert mem.rows == pytest.approx(4 * (keep + (100 - 24.5) / wall))


def test_a_lost_node_waits_for_a_spare_and_the_pool_is_replenished() -> None:
    spec = _spec(mix={"hardware": 1.0}, spare_nodes=1, replenish_h=50 / 3600, hours=200 / 3600)
    events = [ReplicaEvent(10.0, "hardware", (1,)), ReplicaEvent(20.0, "hardware", (0,))]
    o = run_engine("spread", spec, _costs(), events)
    # node 1 (replicas 2, 3): the spare at once, back after 2 + 1 + 0.5 + 0.5 = 4 s; node 0: the spare
    # is replaced at 60, then 2 s of start (its detection long past).
    assert o.back_s == pytest.approx([4.0, 4.0, 42.0, 42.0])


def test_replicas_per_node_and_per_gpu_state() -> None:
    from unbroken.cluster.costs import model_size

    params, state = model_size("llama-7b")
    spec = ReplicaSpec(gpus=100000, replica_size=8, state_bytes=state, params=params, job_mtbf_h=0.3)
    assert spec.replicas == 12500 and spec.nodes == 12500
    assert spec.shard_bytes == pytest.approx(10.1e9, rel=0.01)  # what moves in a rejoin or a restore
    c, how = engine_costs(load_inputs(INPUTS), spec)
    assert c.load_s == pytest.approx(spec.shard_bytes / 2.47e9)
    assert "10.11 GB" in how["load_s"]


def test_events_are_seeded_and_bursts_take_a_switch() -> None:
    spec = ReplicaSpec(gpus=1024, state_bytes=1e9, params=1e6, job_mtbf_h=0.05, hours=24.0,
                       mix={"network": 1.0}, burst_share=1.0, switch_nodes=4)
    a = replica_events(spec, 3)
    assert a == replica_events(spec, 3) and a != replica_events(spec, 4)
    assert all(len(e.nodes) == 4 and e.nodes[0] % 4 == 0 for e in a)
    lemons = ReplicaSpec(gpus=1024, state_bytes=1e9, params=1e6, job_mtbf_h=0.01, hours=24.0,
                         mix={"hardware": 1.0}, lemon_share=0.125, lemon_factor=100.0)
    hits = [e.nodes[0] for e in replica_events(lemons, 0)]
    assert sum(n < 16 for n in hits) / len(hits) > 0.9  # 16 lemons of 128 nodes: 1600 / 1712 of the weight


def test_configurations_the_runtime_refuses() -> None:
    def refused(match: str, **kw: object) -> None:
        with pytest.raises(ValueError, match=match):
            _spec(**kw).check_runtime()

    refused("--replica-size 3 does not divide --gpus 4", replica_size=3)
    refused("--spare-nodes 0 with node failures", mix={"hardware": 0.5, "software": 0.5})
    refused("--group-nodes 300: the erasure coder builds at most 256", group_nodes=300)
    refused("--group-nodes 5 is too small for --parity 2", group_nodes=5, parity=2)
    refused("1 replica", gpus=4, replica_size=4, gpus_per_node=4)
    _spec().check_runtime()


def test_an_input_without_provenance_is_refused(tmp_path: Path) -> None:
    d = json.loads(INPUTS.read_text())
    d["inputs"]["load_gbs"]["source"] = " "
    bad = tmp_path / "cluster_inputs.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="input 'load_gbs' has no provenance"):
        load_inputs(bad)
    del d["inputs"]["load_gbs"]
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="missing load_gbs"):
        load_inputs(bad)
    inputs = load_inputs(INPUTS)
    assert inputs["reconfigure_s"].at(3) == pytest.approx(0.152)
    assert inputs["reconfigure_s"].at(12) == pytest.approx(0.152 * 3)  # two doublings from 3 ranks
    assert all(i.source and i.basis for i in inputs.values())


def test_projection_and_budget_are_reproducible() -> None:
    spec = ReplicaSpec(gpus=1024, state_bytes=8e10, params=7e9, job_mtbf_h=0.3, hours=6.0, spare_nodes=4)
    c, _ = engine_costs(load_inputs(INPUTS), spec)
    a, b = project(spec, c, seeds=2), project(spec, c, seeds=2)
    assert a.mean == b.mean
    assert a.mean["hybrid"]["lost_rows"] == 0 and a.mean["drop-step"]["lost_rows"] > 0
    rows = phase_budget("hybrid", spec, c, seeds=2)
    ratio = next(r for r in rows if r["phase"] == "ratio_unbroken")
    assert float(ratio["points"]) > 3.0  # the failure-free ratio 0.9594 alone costs about 4 points


def _soak(tmp_path: Path, committed: float) -> Path:
    d = {"benchmark": "soak", "preset": "debug", "nodes": 2, "workers": 4, "committed": committed + 100,
         "machine": {"cpu_count": 2}, "launches": [{"t": 0.0, "t_end": 200.0}],
         "faults": [{"t": 0.0, "target": "worker:w1", "signal": "SIGKILL", "committed": 0},
                    {"t": 50.0, "target": "worker:w2", "signal": "SIGSTOP", "committed": committed / 2},
                    {"t": 100.0, "target": "standby:standby0", "signal": "SIGKILL", "committed": committed}]}
    path = tmp_path / "soak_mine.json"
    path.write_text(json.dumps(d))
    return path


def test_validate_exit_code_both_ways(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from unbroken.cli import main

    inputs = load_inputs(INPUTS)
    # A run whose measured goodput is what the engine gives for its faults passes; one 5 points lower fails.
    model = replay_soak(_soak(tmp_path, 90.0), inputs)[0].model
    soak = _soak(tmp_path, 100 * model)
    assert main(["simulate-cluster", "--validate", "--checks", "replay", "--runs", str(soak)]) == 0
    assert "[ok ] replay soak_mine.json (2 faults, spread)" in capsys.readouterr().out
    soak = _soak(tmp_path, 100 * model - 5)
    assert main(["simulate-cluster", "--validate", "--checks", "replay", "--runs", str(soak)]) == 1
    out = capsys.readouterr().out
    assert "[OUT] replay soak_mine.json" in out and "a check is outside its bound" in out
    assert main(["simulate-cluster", "--validate", "--checks", "replays"]) == 2
    assert "--checks 'replays': valid are replay, phases, published" in capsys.readouterr().err


def test_published_results_with_their_stated_costs() -> None:
    from unbroken.cluster.validate import check_published

    checks = {c.name: c for c in check_published(load_inputs(INPUTS))}
    assert all(c.ok for c in checks.values()), [c.line() for c in checks.values()]
    sync = checks["FT-HSDP paper: synchronous at ~100K GPUs"]
    assert sync.reference == 0.44 and abs(sync.model - 0.44) <= 0.03


def test_cli_projection_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from unbroken.cli import main

    out = tmp_path / "p.json"
    assert main(["simulate-cluster", "--gpus", "1024", "--replica-size", "8", "--seeds", "2", "--hours", "4",
                 "--spare-nodes", "4", "--inputs", str(INPUTS), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "PROJECTION" in text and "gpu_checks_h100.json" in text and "arXiv 2602.00277" in text
    r = json.loads(out.read_text())
    assert set(r["tables"]) == {"18", "30"}
    assert set(r["tables"]["18"]["mean"]) == {"spread", "hybrid", "drop-step", "ckpt-memory", "ckpt-disk"}
    assert main(["simulate-cluster", "--gpus", "1000", "--replica-size", "3"]) == 2
    assert "--replica-size 3 does not divide --gpus 1000" in capsys.readouterr().err
    assert main(["simulate-cluster", "--gpus", "1024", "--spare-nodes", "0"]) == 2
    assert "--spare-nodes 0 with node failures" in capsys.readouterr().err
    d = json.loads(INPUTS.read_text())
    d["inputs"]["cuda_warm_s"].pop("source")
    (tmp_path / "in.json").write_text(json.dumps(d))
    assert main(["simulate-cluster", "--gpus", "1024", "--inputs", str(tmp_path / "in.json")]) == 2
    assert "input 'cuda_warm_s' has no provenance" in capsys.readouterr().err


def test_costs_are_a_frozen_dataclass() -> None:
    c = _costs()
    assert dataclasses.replace(c, load_s=0.0).rejoin_s(warm=True, kind="software") == 0.5 + 1.0 + 0.5


def test_the_recorded_soaks_replay_to_their_documented_figures() -> None:
    """The figures docs/benchmarks.md gives for the replays (the bound is missed: the doc says why)."""
    inputs = load_inputs(INPUTS)
    results = ROOT / "benchmarks" / "results"
    check, back, _ = replay_soak(results / "soak.json", inputs)
    assert (round(check.model, 3), round(check.reference, 3), check.ok) == (0.565, 0.740, False)
    check, back, _ = replay_soak(results / "soak_2000.json", inputs)
    assert (round(check.model, 3), round(check.reference, 3), check.ok) == (0.582, 0.560, False)
    assert len(back) > 1000 and sorted(set(round(b, 3) for b in back)) == [0.733, 2.528]  # crash, hang


def test_bad_projection_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from unbroken.cli import main

    assert main(["simulate-cluster", "--gpus", "1024", "--job-mtbf-min", "0"]) == 2
    assert "--job-mtbf-min '0': give minutes > 0" in capsys.readouterr().err
    assert main(["simulate-cluster", "--gpus", "1024", "--mix", "hardware"]) == 2
    assert "'hardware' is not KIND=SHARE" in capsys.readouterr().err
    assert main(["simulate-cluster", "--gpus", "1024", "--mix", "hardware=0.5,cosmic=0.5"]) == 2
    assert "must give shares >= 0 of hardware, software, network summing to 1" in capsys.readouterr().err
    assert main(["simulate-cluster", "--gpus", "1024", "--group-nodes", "257"]) == 2
    assert "at most 256 fragments" in capsys.readouterr().err
