"""Tests of unbroken.faults.injector: which signal fires at which step, for which node and worker."""

from __future__ import annotations

import json
import signal

import pytest

from unbroken.faults.fail_at import fail_at, parse_fail_at, trace_to_faults
from unbroken.faults.injector import NodeFaults, check_faults, node_of, workers_of
from unbroken.faults.traces import FailureTrace, Outage

pytestmark = pytest.mark.timeout(60)

# 2 nodes x 2 workers: node 0 owns workers 0, 1; node 1 owns 2, 3.
SPECS = parse_fail_at(
    "step=5:worker=1:kill:back=8,"
    "step=3:worker=2:stop:for=1.5,"
    "step=7:node=1:kill,"
    "step=4:worker=0:term,"
    "step=6:worker=3:kill:phase=allreduce:back=9,"
    "step=4:node=0:stop"
)


def plan(node: int, start: int = 0) -> NodeFaults:
    return NodeFaults(SPECS, node=node, workers_per_node=2, start_step=start)


def test_layout() -> None:
    assert [node_of(w, 2) for w in range(4)] == [0, 0, 1, 1]
    assert list(workers_of(1, 2)) == [2, 3]


def test_node_fires_only_its_own_signal_specs_in_step_order() -> None:
    p0 = plan(0)
    assert p0.next_step == 4
    assert p0.due(3) == []
    fired = p0.due(4)
    assert [(i.spec.step, i.workers, i.signal) for i in fired] == [
        (4, (0,), signal.SIGTERM), (4, (0, 1), signal.SIGSTOP)]
    assert p0.due(4) == [], "each spec fires once"
    assert [(i.workers, i.signal, i.kill_agent) for i in p0.due(100)] == [((1,), signal.SIGKILL, False)]
    assert p0.next_step is None


def test_node_kill_kills_its_workers_then_the_agent_and_stop_resumes() -> None:
    p1 = plan(1)
    first = p1.due(3)
    assert [(i.workers, i.signal, i.resume_after_s) for i in first] == [((2,), signal.SIGSTOP, 1.5)]
    assert p1.due(6) == [], "a phase spec is the worker's own business"
    (lost,) = p1.due(7)
    assert lost.workers == (2, 3) and lost.signal == signal.SIGKILL and lost.kill_agent


def test_progress_jump_fires_everything_due_at_once() -> None:
    assert [i.spec.step for i in plan(0).due(10)] == [4, 4, 5]


def test_specs_before_the_start_never_fire() -> None:
    p0 = plan(0, start=5)
    assert [i.spec.step for i in p0.due(10)] == [5]


def test_phase_specs_go_on_the_workers_command_line() -> None:
    p1 = plan(1)
    assert [p1.plan[i] for i in p1.worker_faults(3, from_step=0)] == [
        fail_at(step=6, worker=3, phase="allreduce", back=9)]
    assert p1.worker_faults(2, from_step=0) == ()
    assert plan(1).worker_faults(3, from_step=7) == (), "a worker joining after the step cannot fire it"


def test_death_attribution_and_back() -> None:
    p0 = plan(0)
    p0.due(5)
    cause = p0.on_death(1, progress=5)
    assert cause.injected and cause.back_step == 8 and cause.spec == fail_at(step=5, worker=1, back=8)
    assert not p0.on_death(1, progress=6).injected, "one death per fired spec"
    p1 = plan(1)
    assert not p1.on_death(3, progress=5).injected, "its phase spec has not begun"
    cause = p1.on_death(3, progress=6)
    assert cause.injected and cause.back_step == 9
    assert p1.worker_faults(3, from_step=6) == (), "a fired phase spec is not handed to the next incarnation"


def test_resumed_stop_is_not_blamed_for_a_later_death() -> None:
    p1 = plan(1)
    p1.due(3)
    p1.resumed(2)
    assert not p1.on_death(2, progress=4).injected


def test_stale_phase_spec_is_dropped_when_the_worker_misses_its_step() -> None:
    p1 = plan(1)
    p1.worker_faults(3, from_step=8)  # worker 3 was down during step 6
    assert not p1.on_death(3, progress=8).injected


def test_trace_outages_become_kill_and_back() -> None:
    trace = FailureTrace(n_workers=4, n_steps=20, outages=(Outage(worker=3, start_step=2, end_step=6),
                                                          Outage(worker=0, start_step=4, end_step=20)))
    specs = trace_to_faults(trace)
    p1 = NodeFaults(specs, node=1, workers_per_node=2, start_step=0)
    (kill,) = p1.due(2)
    assert kill.workers == (3,) and kill.signal == signal.SIGKILL
    assert p1.on_death(3, progress=2).back_step == 6
    p0 = NodeFaults(specs, node=0, workers_per_node=2, start_step=0)
    p0.due(4)
    assert p0.on_death(0, progress=4).back_step == 20, "cut at the end of the run: never back"


def test_check_faults_reports_everything() -> None:
    check_faults(SPECS, n_nodes=2, workers_per_node=2)
    with pytest.raises(ValueError) as e:
        check_faults(parse_fail_at("step=1:worker=4:kill,step=1:node=2:kill,step=2:node=0:term:phase=forward"),
                     n_nodes=2, workers_per_node=2)
    msg = str(e.value)
    assert "worker=4 out of range; expected 0..3 (2 node(s) x 2 worker(s))" in msg
    assert "node=2 out of range; expected 0..1" in msg
    assert "phase=forward needs a worker target" in msg


def test_specs_fired_in_an_earlier_attempt_do_not_fire_again() -> None:
    p0 = NodeFaults(SPECS, node=0, workers_per_node=2, start_step=0,
                    fired={"step=5:worker=1:kill:back=8", "step=4:node=0:stop"})
    assert [i.spec for i in p0.due(10)] == [fail_at(step=4, worker=0, how="term")]


def test_a_self_injected_fault_is_read_back_from_the_end_of_the_workers_event_file(tmp_path) -> None:
    from unbroken.agent._run_files import last_self_fault

    assert last_self_fault(tmp_path, 2) is None  # no file
    events = tmp_path / "events" / "w2.jsonl"
    events.parent.mkdir()
    lines = [{"kind": "commit", "step": s, "pad": "x" * 300} for s in range(40)]  # longer than the tail read
    events.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert last_self_fault(tmp_path, 2) is None  # last record is not a fault
    with events.open("a") as fh:
        fh.write(json.dumps({"kind": "event", "event": "fault_self", "worker": 2, "step": 6,
                             "phase": "restore"}) + "\n")
    assert last_self_fault(tmp_path, 2) == (6, "restore")  # the worker was in step 6, whatever the progress says
    with events.open("a") as fh:
        fh.write('{"kind": "event", "event": "view_ad')  # a torn line is skipped
    assert last_self_fault(tmp_path, 2) == (6, "restore")


def test_the_phase_spec_a_worker_named_as_it_killed_itself_is_the_one_spent() -> None:
    """A restored job trains its steps again: a worker killed at step 11 had also begun step 10, whose restore
    spec has not fired yet; the spec it named in its last record is spent, the other stays pending."""
    specs = [fail_at(step=11, worker=0, how="kill", phase="allreduce"),
             fail_at(step=10, worker=0, how="kill", phase="restore")]
    plan = NodeFaults(specs, node=0, workers_per_node=2, start_step=0)
    assert plan.on_death(0, progress=11, fired=(11, "allreduce")).spec == specs[0]
    assert plan.worker_faults(0, 10) == (1,), "the restore spec still fires in the next restore of step 10"
    assert plan.on_death(0, progress=11, fired=(10, "restore")).spec == specs[1]
