"""The cluster goodput simulator: hand-computable cases, Young/Daly, seeds, bad input, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.goodput_check import predict_ratio
from unbroken.cluster.costs import Figure, load_costs
from unbroken.cluster.degraded import dead_runs, step_load
from unbroken.cluster.failures import Event, FailureSpec, generate_events
from unbroken.cluster.montecarlo import SimOptions, run_monte_carlo
from unbroken.cluster.scaling import SimCosts
from unbroken.cluster.strategies import Strategy, daly_interval_s, simulate_strategy, young_interval_s

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _costs(**kw: float) -> SimCosts:
    base = dict(step_s=1.0, protocol_s=0.0, snapshot_s=0.0, ckpt_save_s=0.0, detect_crash_s=0.5, detect_hang_s=2.0,
                rejoin_warm_s=2.0, rejoin_cold_s=5.0, rejoin_stall_s=0.0, restart_memory_s=4.0, restart_disk_s=10.0,
                approx_ratio=0.75, svd_share=0.0)
    base.update(kw)
    return SimCosts(rows=1, **{k: Figure(v, "s", "test") for k, v in base.items()})


def _spec(**kw) -> FailureSpec:
    return FailureSpec(**{"workers": 4, "workers_per_node": 2, "worker_mtbf_h": 1e6, "duration_h": 100 / 3600, **kw})


CR = Strategy("cr", "checkpoint", ckpt_every=10)
DISCARD = Strategy("discard", "discard")
SPREAD = Strategy("spread", "takeover", policy="spread", memory=True)


@pytest.mark.parametrize("st", [CR, DISCARD, SPREAD, Strategy("neighbor", "takeover", policy="neighbor", memory=True)])
def test_no_failure_is_full_goodput(st: Strategy) -> None:
    assert simulate_strategy(st, _spec(), _costs(), []).goodput == pytest.approx(1.0, abs=1e-12)


def test_overheads_cost_exactly_their_share() -> None:
    c = _costs(protocol_s=0.01, snapshot_s=0.04, ckpt_save_s=0.5)
    assert simulate_strategy(SPREAD, _spec(), c, []).goodput == pytest.approx(1 / 1.05)
    assert simulate_strategy(CR, _spec(), c, []).goodput == pytest.approx(1 / 1.05)  # 0.5 s per 10 steps


def test_checkpoint_restart_one_failure_redoes_work_since_checkpoint() -> None:
    o = simulate_strategy(CR, _spec(), _costs(), [Event(15.5, "crash", 1)])
    # 15.5 steps done, checkpoint at 10: 5.5 steps redone; blocked 0.5 s detection + 10 s restart.
    assert o.redone_samples == pytest.approx(5.5 * 4)
    assert o.blocked_s == pytest.approx(10.5)
    assert o.goodput == pytest.approx((100 - 10.5 - 5.5) / 100)
    assert o.lost_samples == 0


def test_step_discard_one_failure_loses_the_step_and_the_dead_rows() -> None:
    o = simulate_strategy(DISCARD, _spec(), _costs(), [Event(10.25, "crash", 3)])
    # The step in flight (4 rows) is dropped, then 2 s of steps (rejoin) without worker 3's row.
    assert o.lost_samples == pytest.approx(4 + 2)
    assert o.samples == pytest.approx(40 + 2 * 3 + 87.25 * 4)
    assert o.goodput == pytest.approx(395 / 400)


def test_spread_one_failure_costs_stall_and_degraded_steps() -> None:
    o = simulate_strategy(SPREAD, _spec(), _costs(), [Event(10.0, "crash", 3)])
    # 0.5 s stall, then 2 s at 2 rows / step for worker 0 (3 live, 1 row each: worker 0 computes the dead row).
    assert o.lost_samples == 0
    assert o.degraded_s == pytest.approx(2.0)
    assert o.samples == pytest.approx(4 * (10 + 1.0 + 87.5))


def test_an_admission_stalls_the_job_once_per_view_change() -> None:
    spec = _spec(mix={"node": 1.0})
    o = simulate_strategy(SPREAD, spec, _costs(rejoin_stall_s=0.25), [Event(10.0, "node", 1)])
    # Node 1 (workers 2, 3) lost; no spare, so it is back after the repair (2 h), past the end: no admission.
    assert o.blocked_s == pytest.approx(2.0)
    o = simulate_strategy(SPREAD, _spec(), _costs(rejoin_stall_s=0.25), [Event(10.0, "crash", 3)])
    assert o.blocked_s == pytest.approx(0.5 + 0.25)
    assert o.samples == pytest.approx(4 * (10 + 1.0 + 87.25))


def test_whole_job_failure_memory_vs_disk() -> None:
    spec = _spec(mix={"job": 1.0})
    mem = simulate_strategy(SPREAD, spec, _costs(), [Event(15.5, "job", -1)])
    disk = simulate_strategy(Strategy("spread-disk", "takeover", policy="spread", ckpt_every=10), spec, _costs(),
                             [Event(15.5, "job", -1)])
    assert mem.redone_samples == pytest.approx(0.5 * 4)  # the step in flight
    assert mem.goodput == pytest.approx((100 - 2.0 - 4.0 - 0.5) / 100)
    assert disk.redone_samples == pytest.approx(5.5 * 4)
    assert disk.goodput == pytest.approx((100 - 2.0 - 10.0 - 5.5) / 100)


def test_young_and_daly() -> None:
    assert young_interval_s(2.0, 100.0) == pytest.approx(20.0)
    x = 2.0 / 200.0
    assert daly_interval_s(2.0, 100.0) == pytest.approx(20.0 * (1 + math.sqrt(x) / 3 + x / 9) - 2.0)
    assert daly_interval_s(300.0, 100.0) == 100.0
    with pytest.raises(ValueError, match="MTBF"):
        young_interval_s(1.0, 0.0)


def test_step_load_follows_the_runtime_assignment() -> None:
    assert dead_runs([0, 7, 3, 4], 8) == [2, 2]  # 7,0 wrap around the ring
    assert step_load("neighbor", workers=16, rows=4, down=[3, 4, 5], approx=0.75, svd=0.0).factor == 3.0
    spread = step_load("spread", workers=1000, rows=4, down=list(range(8)), approx=0.75, svd=0.0)
    assert spread.factor == 1.25  # a lost node's 8 slots x 4 rows land on 32 different survivors
    assert step_load("spread-approx", workers=4, rows=16, down=[2, 3], approx=0.75, svd=0.0).approx_rows == 32
    # 4 workers on 2 cores: two survivors doing two micro-batches each take as long as four doing one.
    assert step_load("spread", workers=4, rows=16, down=[2, 3], approx=0.75, svd=0.0, cores=2).factor == 1.0


def test_seeds_reproduce() -> None:
    spec = FailureSpec(workers=256, worker_mtbf_h=256 * 0.5, duration_h=24.0)
    assert generate_events(spec, 3) == generate_events(spec, 3)
    assert generate_events(spec, 3) != generate_events(spec, 4)
    c = _costs(ckpt_save_s=1.0)
    opts = SimOptions(seeds=3)
    a, b = run_monte_carlo(spec, c, opts), run_monte_carlo(spec, c, opts)
    assert [e.mean for e in a] == [e.mean for e in b]
    assert all(e.mean["failures"] > 0 for e in a)


def test_bad_input() -> None:
    for mtbf in (0.0, -3.0):
        with pytest.raises(ValueError, match="MTBF"):
            FailureSpec(workers=4, worker_mtbf_h=mtbf)
    with pytest.raises(ValueError, match="more failures than workers"):
        FailureSpec(workers=16, workers_per_node=8, worker_mtbf_h=1.0, mix={"node": 1.0}, repair_h=2.0)
    with pytest.raises(ValueError, match="at least 2 workers"):
        simulate_strategy(SPREAD, FailureSpec(workers=1, worker_mtbf_h=10.0), _costs(), [])
    with pytest.raises(ValueError, match="at least 2 workers"):
        run_monte_carlo(FailureSpec(workers=1, worker_mtbf_h=10.0), _costs(ckpt_save_s=1.0), SimOptions(seeds=1))


def test_costs_from_another_model_need_a_scaling_rule(tmp_path: Path) -> None:
    d = json.loads((RESULTS / "snapshot_tiny.json").read_text())
    d["preset"] = "my-own-model"
    f = tmp_path / "snapshot_mine.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="my-own-model.*cannot be scaled to 'llama-7b'"):
        load_costs([f], "llama-7b")


def test_goodput_check_prediction_without_failures_is_one() -> None:
    kw = dict(workers=4, rows=16, cores=2, fixed=0.0, approx=0.85, svd=0.0, step_s=1.0)
    assert predict_ratio(policy="spread", outages=[], stalls={}, first=1, last=40, **kw) == pytest.approx(1.0)
    # Two of four down from step 11 on 2 cores: as fast as failure-free; a 0.5 s stall at step 11.
    got = predict_ratio(policy="spread", outages=[(2, 11, 41), (3, 11, 41)], stalls={11: 0.5}, first=1, last=40, **kw)
    assert got == pytest.approx(39 / 39.5)
    # checkpoint-restart: a failure at step 13 went back to step 10: 2 steps redone + 5 s restart; one back
    # to step 0 falls before the measured window.
    cr = predict_ratio(policy=None, outages=[], stalls={}, first=1, last=40, restarts=[(6, 0), (13, 10)],
                       restart_s=5.0, **kw)
    assert cr == pytest.approx(39 / (39 + 5 + 2))


def test_cli_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from unbroken.cli import main

    out, png = tmp_path / "c.json", tmp_path / "g.png"
    rc = main(["simulate-cluster", "--workers", "64", "--seeds", "2", "--hours", "6", "--costs",
               *map(str, sorted(RESULTS.glob("*.json"))), "--out", str(out), "--plot", str(png), "--sweep", "64,128"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["projection"] and {x["strategy"].split(" (")[0] for x in r["results"]} >= {"spread", "step-discard"}
    assert png.stat().st_size > 0
    text = capsys.readouterr().out
    assert "failover.json" in text and "snapshot_tiny.json" in text  # every figure names its file
    assert main(["simulate-cluster", "--job-mtbf-h", "-1"]) == 2
    assert "--job-mtbf-h=-1.0 must be > 0" in capsys.readouterr().err


def test_worker_loads_are_the_step_loads_peak_and_sum() -> None:
    from unbroken.cluster.degraded import worker_loads

    assert worker_loads("neighbor", workers=4, rows=16, down=[2, 3], approx=0.75, svd=0.0) == [1.0, 2.25]
    assert worker_loads("spread", workers=4, rows=16, down=[3], approx=0.75, svd=0.0) == pytest.approx(
        [1 + 6 / 16, 1 + 5 / 16, 1 + 5 / 16])
    assert worker_loads("spread-approx", workers=4, rows=2, down=[3], approx=0.5, svd=0.25) == [1.5, 1.5, 1.0]
    assert worker_loads("spread", workers=3, rows=4, down=[], approx=0.5, svd=0.0) == [1.0, 1.0, 1.0]
    for policy in ("neighbor", "spread", "spread-approx"):
        for down in ([1], [0, 1], [0, 2, 5], [3, 4, 5, 6, 7]):
            loads = worker_loads(policy, workers=8, rows=3, down=down, approx=0.8, svd=0.05)
            assert len(loads) == 8 - len(down)
            assert step_load(policy, workers=8, rows=3, down=down, approx=0.8, svd=0.05).factor == pytest.approx(
                max(loads))
            assert step_load(policy, workers=8, rows=3, down=down, approx=0.8, svd=0.05, cores=4).factor == (
                pytest.approx(max(max(loads), sum(loads) / 4) / 2))
    with pytest.raises(ValueError, match="no live worker"):
        worker_loads("spread", workers=2, rows=4, down=[0, 1], approx=0.5, svd=0.0)


def test_shared_makespan_is_fair_sharing_of_the_cores() -> None:
    from benchmarks.goodput_check import shared_makespan

    assert shared_makespan([2.0, 2.0], 2) == 2.0  # a core each
    assert shared_makespan([1.0, 1.0, 1.0, 1.0], 2) == 2.0  # two to a core
    # 1, 1 and 2.5 on 2 cores: all three at 2/3 until the small ones finish (1.5), then 1.5 alone at full speed.
    assert shared_makespan([2.5, 1.0, 1.0], 2) == pytest.approx(3.0)
    assert shared_makespan([3.0], 4) == 3.0


def test_host_model_fits_each_worker_count_and_maps_uneven_loads() -> None:
    from benchmarks.goodput_check import HostModel

    h = HostModel(cores=2, steps={2: (0.4, 0.66), 4: (0.8, 1.5)})
    assert h.line(2) == pytest.approx((0.14, 0.26)) and h.line(4) == pytest.approx((0.1, 0.7))
    assert h.step_s([1.0] * 4) == pytest.approx(0.8)
    assert h.step_s([2.0, 2.0]) == pytest.approx(0.66)  # two workers at two micro-batches: measured
    assert h.step_s([1.0, 3.0]) == pytest.approx(0.14 + 0.26 * 3)  # a core each: the slowest sets it
    # three on two cores at 1, 1 and 2.5: busy as long as all three at 2 (shared_makespan 3.0 over 1.5)
    assert HostModel(cores=2, steps={3: (0.5, 0.9)}).step_s([2.5, 1.0, 1.0]) == pytest.approx(0.1 + 0.4 * 2)
    assert HostModel(cores=2, steps={1: (1.0, 2.5)}).line(1) == pytest.approx((0.0, 1.2))  # F < 0: through 0
    with pytest.raises(ValueError, match="no host measurement for 3 live worker"):
        h.step_s([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="positive, finite"):
        HostModel(cores=2, steps={2: (0.0, 1.0)})
    # The check's prediction with the host model: two of four down from step 11, spread, 0.5 s stall at 11;
    # failure-free steps take the reference's 0.9 s, degraded ones the host's measured 0.66 s.
    got = predict_ratio(policy="spread", outages=[(2, 11, 41), (3, 11, 41)], stalls={11: 0.5}, first=1, last=40,
                        workers=4, rows=16, approx=0.85, svd=0.0, step_s=0.9, host=h)
    assert got == pytest.approx(39 * 0.9 / (9 * 0.9 + 30 * 0.66 + 0.5))


def test_goodput_check_refuses_bad_arguments(tmp_path: Path) -> None:
    from benchmarks.goodput_check import main as check

    with pytest.raises(ValueError, match="--reuse needs --runs-dir"):
        check(["--reuse"])
    with pytest.raises(ValueError, match="--repeats=0: need at least 1"):
        check(["--repeats", "0"])
    with pytest.raises(ValueError, match="one folder when running"):
        check(["--runs-dir", str(tmp_path / "a"), str(tmp_path / "b")])
    with pytest.raises(ValueError, match="1 x 1 workers: a takeover needs at least 2"):
        check(["--nodes", "1", "--workers-per-node", "1"])
    assert not (tmp_path / "a").exists()  # refused before running anything
