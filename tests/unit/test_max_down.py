"""``fault.max_down``: failures past the cap wait for a worker to return.

The trace generator against an independent step-by-step FIFO reference, the
M/M/K analytics of the cap (exact), the agent's schedule holding signal
faults at the cap, and the validation of the cap and of the slot count.
"""

from __future__ import annotations

import json
import math
from collections import deque

import numpy as np
import pytest

from benchmarks.mecefo_convergence import main as convergence_main
from benchmarks.mecefo_convergence import micro_batch_for
from unbroken.config import load_config
from unbroken.faults.analytics import down_distribution, expected_degraded_fraction, expected_down_fraction
from unbroken.faults.fail_at import parse_fail_at
from unbroken.faults.injector import NodeFaults
from unbroken.faults.trace_presets import TracePreset, trace_preset
from unbroken.faults.traces import FailureTrace, Outage, generate_trace, step_time_for

pytestmark = pytest.mark.timeout(60)


def _reference(preset: str, *, n: int, n_steps: int, seed: int, max_down: int) -> tuple[list[Outage], int, int]:
    """Step by step: returns first, then the step's arrivals join a FIFO queue, then the queue's head strikes
    while fewer than ``max_down`` workers are down. Same draws as the generator (gap, choice, repair)."""
    p, st = trace_preset(preset), step_time_for(n_steps)
    rng = np.random.default_rng(seed)
    arrivals, t = [], 0.0
    while True:
        t += p.mtbf_hours * 3600 * rng.standard_exponential()
        if t >= n_steps * st:
            break
        u, r = rng.random(), p.mttr_hours * 3600 * rng.standard_exponential()
        arrivals.append((min(math.floor(t / st), n_steps - 1), t, u, r))
    down: dict[int, int] = {}  # worker -> first step up again
    queue: deque = deque()
    outages, deferred = [], 0
    for s in range(n_steps):
        down = {w: e for w, e in down.items() if e > s}
        queue.extend(a for a in arrivals if a[0] == s)
        while queue and len(down) < max_down:
            a, t, u, r = queue.popleft()
            if a == s:
                end = max(s + 1, math.ceil((t + r) / st))
            else:
                deferred += 1
                end = s + max(1, math.ceil(r / st))
            up = [w for w in range(n) if w not in down]
            w = up[int(u * len(up))]
            down[w] = end
            outages.append(Outage(worker=w, start_step=s, end_step=min(end, n_steps)))
    return outages, deferred + len(queue), len(queue)


@pytest.mark.parametrize("preset", ["low", "high"])
@pytest.mark.parametrize("max_down", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deferral_matches_a_step_by_step_fifo_queue(preset: str, max_down: int, seed: int) -> None:
    t = generate_trace(preset, n_workers=8, n_steps=300, step_time_s=step_time_for(300), seed=seed,
                       max_down=max_down)
    outages, deferred, pending = _reference(preset, n=8, n_steps=300, seed=seed, max_down=max_down)
    assert t.outages == tuple(sorted(outages, key=lambda o: (o.start_step, o.worker)))
    assert (t.deferred, t.pending_at_end, t.dropped) == (deferred, pending, 0)
    assert t.most_down() == max_down and t.deferred > 0 and t.max_down == max_down


def test_one_at_a_time_and_the_uncapped_trace_is_unchanged() -> None:
    kw = dict(n_workers=32, n_steps=720, step_time_s=step_time_for(720), seed=0)
    capped, free = generate_trace("high", max_down=1, **kw), generate_trace("high", **kw)
    assert free == generate_trace("high", max_down=None, **kw) and free.most_down() > 1
    assert capped.outages[0] == free.outages[0], "the first failure finds nobody down"
    assert capped.most_down() == 1
    # One at a time: every later failure starts exactly when the one before it ended (the queue never empties).
    for before, after in zip(capped.outages, capped.outages[1:]):
        assert after.start_step >= before.end_step
    assert len(capped.outages) + capped.pending_at_end == len(free.outages)
    assert capped.deferred == len(capped.outages) - 1 + capped.pending_at_end
    # max_down=0: nothing ever strikes; every arrival is still waiting at the end.
    none = generate_trace("high", max_down=0, **kw)
    assert none.outages == () and none.deferred == none.pending_at_end == len(free.outages)


def test_the_trace_records_the_cap_and_refuses_outages_past_it() -> None:
    t = generate_trace("mid", n_workers=4, n_steps=200, step_time_s=step_time_for(200), seed=4, max_down=1)
    d = json.loads(json.dumps(t.to_json(), allow_nan=False))
    assert (d["max_down"], d["deferred"], d["pending_at_end"]) == (1, t.deferred, t.pending_at_end)
    assert FailureTrace.from_json(d) == t
    old = {k: v for k, v in d.items() if k not in ("max_down", "deferred", "pending_at_end")}
    assert FailureTrace.from_json(old).max_down is None, "a trace written before the cap still loads"
    two = (Outage(worker=0, start_step=0, end_step=3), Outage(worker=1, start_step=2, end_step=4))
    with pytest.raises(ValueError, match="2 workers down at once, more than max_down=1"):
        FailureTrace(n_workers=3, n_steps=5, outages=two, max_down=1)
    with pytest.raises(ValueError, match=r"max_down=4 must be an integer in 0\.\.3"):
        generate_trace("high", n_workers=4, n_steps=10, step_time_s=1.0, seed=0, max_down=4)
    with pytest.raises(ValueError, match="max_down=-1"):
        generate_trace("high", n_workers=4, n_steps=10, step_time_s=1.0, seed=0, max_down=-1)


def test_erlang_queue_of_deferred_failures() -> None:
    # 32 of 256 workers, high: rho = 32/256 * 2 h / 0.5 h = 1/2. K = 1: pi = c (1, rho * 1/(1 - rho)) = (1/2, 1/2).
    assert down_distribution("high", n_workers=32, cluster_workers=256, max_down=1) == pytest.approx((0.5, 0.5))
    assert expected_degraded_fraction("high", n_workers=32, cluster_workers=256, max_down=1) == pytest.approx(0.5)
    assert expected_down_fraction("high", n_workers=32, cluster_workers=256, max_down=1) == pytest.approx(0.5 / 32)
    # rho = 1, K = 2: weights (1, 1, 1/2 * 2/(2 - 1)) = (1, 1, 1); the mean number down is rho = 1.
    even = TracePreset(name="even", mtbf_hours=1.0, mttr_hours=1.0)
    assert down_distribution(even, n_workers=4, max_down=2) == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    assert expected_down_fraction(even, n_workers=4, max_down=2) == pytest.approx(1 / 4)
    # rho >= K: the queue never empties, K are down for good. Every preset at max_down=1 with the job's own rate.
    for name, rho in (("low", 2), ("mid", 3), ("high", 4)):
        assert down_distribution(name, n_workers=32, max_down=1) == (0.0, 1.0), (name, rho)
    assert down_distribution(even, n_workers=4, max_down=1) == (0.0, 1.0)
    # A cap the min_live drop reaches first changes nothing: the Erlang loss formula.
    assert down_distribution("high", n_workers=4, min_live=2, max_down=3) == down_distribution(
        "high", n_workers=4, min_live=2)


def test_realized_deferral_matches_the_queue_over_a_long_trace() -> None:
    # 10000 h at 60 s per step, rho = 1/2, K = 1: one worker down half the time; by PASTA half the arrivals wait.
    t = generate_trace("high", n_workers=32, n_steps=600_000, step_time_s=60.0, seed=0, cluster_workers=256,
                       max_down=1)
    assert t.degraded_fraction() == pytest.approx(0.5, abs=0.03)
    assert t.down_fraction() == pytest.approx(0.5 / 32, abs=0.03 / 32)
    assert t.deferred / (len(t.outages) + t.pending_at_end) == pytest.approx(0.5, abs=0.04)


def test_agent_schedule_holds_signal_faults_at_the_cap() -> None:
    specs = parse_fail_at("step=3:worker=1:kill:back=5,step=4:worker=2:kill:back=8,step=4:worker=3:term")
    plan = NodeFaults(specs, node=0, workers_per_node=4, start_step=0, max_down=1)
    (first,) = plan.due(3, down=())
    assert first.workers == (1,)
    assert plan.due(4, down=()) == [], "worker 1 was signalled and has not died yet: it counts as down"
    assert plan.held == {"step=4:worker=2:kill:back=8"}
    assert plan.on_death(1, progress=4).back_step == 5
    assert plan.due(5, down={1}) == [] and plan.waiting(5)
    second, = plan.due(6, down=())  # worker 1 is back: the head of the queue fires, the spec behind it waits
    assert second.spec == specs[1] and second.workers == (2,)
    assert plan.on_death(2, progress=6).back_step == 10, "waited 2 steps: back 2 steps later"
    (third,) = plan.due(11, down=())
    assert third.workers == (3,) and third.spec.how == "term"
    # No cap: everything due fires, whoever is down.
    free = NodeFaults(specs, node=0, workers_per_node=4, start_step=0)
    assert [i.workers for i in free.due(4, down={0, 1, 2, 3})] == [(1,), (2,), (3,)]
    # A node fault counts all of its workers.
    node = NodeFaults(parse_fail_at("step=1:node=0:stop"), node=0, workers_per_node=2, start_step=0, max_down=2)
    assert node.due(1, down={2}) == [] and [i.workers for i in node.due(1, down=())] == [(0, 1)]


@pytest.mark.parametrize("value", ["-1", "4"])
def test_config_rejects_max_down_outside_the_slots(value: str) -> None:
    with pytest.raises(ValueError, match=rf"fault\.max_down={value}: must be in 0\.\.3 \(fewer than "
                                         r"train\.workers=4.*or none for no cap"):
        load_config(preset_name="debug", overrides=["train.workers=4", f"fault.max_down={value}"])
    assert load_config(preset_name="debug", overrides=["train.workers=4", "fault.max_down=3"]).fault.max_down == 3
    assert load_config(preset_name="debug").fault.max_down is None


def test_slot_count_must_divide_the_global_batch(tmp_path, capsys) -> None:
    assert micro_batch_for(32, 32, None) == 1 and micro_batch_for(4, 32, None) == 8
    assert micro_batch_for(4, None, None) == 8 and micro_batch_for(4, None, 3) == 3
    with pytest.raises(ValueError, match=r"--slots=5 does not divide --global-batch=32.*"
                                         r"slot counts that do: 1, 2, 4, 8, 16, 32$"):
        micro_batch_for(5, 32, None)
    with pytest.raises(ValueError, match=r"--micro-batch=2 x --slots=32 != --global-batch=32"):
        micro_batch_for(32, 32, 2)
    out = ["--out", str(tmp_path / "x.json"), "--plot", str(tmp_path / "x.png")]
    for argv, message in ((["--slots", "12", "--global-batch", "32"], "slot counts that do: 1, 2, 4, 8, 16, 32"),
                          (["--slots", "4", "--max-down", "4"], r"--max-down=4 must be in 0..3"),
                          (["--seeds-per-point", "low"], "NAME=K")):
        with pytest.raises(SystemExit):
            convergence_main(argv + out)
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_spec_seen_late_without_the_cap_keeps_its_back_step() -> None:
    plan = NodeFaults(parse_fail_at("step=3:worker=1:kill:back=5"), node=0, workers_per_node=2, start_step=0,
                      max_down=1)
    (late,) = plan.due(4, down=())  # the agent learned of step 3 only at step 4: nothing held it
    assert plan.held == set() and plan.on_death(1, progress=4).back_step == 5
