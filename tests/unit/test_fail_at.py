"""Tests of unbroken.faults.fail_at: parsing, formatting and validating fault specs."""

from __future__ import annotations

import pytest

from unbroken.faults.fail_at import FaultSpec, fail_at, format_fail_at, parse_fail_at, trace_to_faults
from unbroken.faults.traces import FailureTrace, Outage, generate_trace, step_time_for

pytestmark = pytest.mark.timeout(60)

EXAMPLE = "step=40:worker=2:kill,step=90:node=1:kill,step=120:worker=0:stop"


def test_parse_example() -> None:
    assert parse_fail_at(EXAMPLE) == (
        FaultSpec(step=40, target="worker", index=2, how="kill"),
        FaultSpec(step=90, target="node", index=1, how="kill"),
        FaultSpec(step=120, target="worker", index=0, how="stop"),
    )


def test_optional_keys_any_order_and_whitespace() -> None:
    specs = parse_fail_at(" worker=1 : for=3.5 : stop : step=7 : phase=allreduce , how=term:node=0:step=3 ")
    assert specs == (
        fail_at(step=7, worker=1, how="stop", phase="allreduce", duration_s=3.5),
        fail_at(step=3, node=0, how="term"),
    )


def test_how_defaults_to_kill_and_empty_text_is_no_faults() -> None:
    assert parse_fail_at("step=1:worker=0") == (fail_at(step=1, worker=0),)
    assert parse_fail_at("") == () and parse_fail_at("  ") == ()


@pytest.mark.parametrize(
    "text",
    [
        EXAMPLE,
        "step=0:worker=3:stop:phase=backward:for=0.1",
        "step=5:node=2:term:phase=forward,step=5:worker=0:stop:for=1e-05",
        "step=3:worker=1:kill:back=9,step=4:node=0:stop:for=2.0:back=5",
        "",
    ],
)
def test_round_trip(text: str) -> None:
    specs = parse_fail_at(text)
    assert format_fail_at(specs) == text
    assert parse_fail_at(format_fail_at(specs)) == specs


def test_all_errors_at_once() -> None:
    text = (
        "step=1:worker=0:kill:color=red,"  # unknown key
        "worker=1:kill,"  # missing step
        "step=2:worker=1:node=0:kill,"  # both
        "step=3:kill,"  # neither
        "step=-4:worker=-1:kill,"  # negatives
        "step=5:worker=9:explode,"  # unknown how word
        "step=6:worker=0:how=melt:phase=lunch,"  # unknown how / phase
        "step=7:worker=0:kill:for=2,"  # duration on kill
        "step=x:worker=0:stop:for=-1,"  # not an int, bad duration
        ","  # empty item
    )
    with pytest.raises(ValueError) as e:
        parse_fail_at(text)
    msg = str(e.value)
    for expected in [
        "'step=1:worker=0:kill:color=red': unknown key 'color' (='red'); expected one of step, worker, node, store, how, phase, for, back",
        "'worker=1:kill': missing step=N",
        "'step=2:worker=1:node=0:kill': more than one of worker=, node=, store=; give exactly one",
        "'step=3:kill': none of worker=, node=, store=; give exactly one",
        "step='-4' is negative; expected an integer >= 0",
        "worker='-1' is negative; expected an integer >= 0",
        "'explode' is neither key=value nor one of kill, stop, term",
        "how='melt'; expected one of kill, stop, term",
        "phase='lunch'; expected one of forward, backward, allreduce, update, allgather, confirm, restore, finish, any",
        "for='2' only applies to stop",
        "step='x' is not an integer",
        "for='-1'; expected a finite number of seconds > 0",
        "item 11 is empty",
    ]:
        assert expected in msg, expected
    assert len(msg.splitlines()) == 1 + 14  # header + one line per problem (the negatives item has two)


def test_bounds_checked_when_sizes_given() -> None:
    assert parse_fail_at(EXAMPLE, n_workers=3, n_nodes=2) == parse_fail_at(EXAMPLE)
    with pytest.raises(ValueError) as e:
        parse_fail_at(EXAMPLE, n_workers=2, n_nodes=1)
    msg = str(e.value)
    assert "worker=2 out of range; expected 0..1 (n_workers=2)" in msg
    assert "node=1 out of range; expected 0..0 (n_nodes=1)" in msg
    assert len(msg.splitlines()) == 3  # header + the two bad items; worker=0 is fine


def test_duplicate_key() -> None:
    with pytest.raises(ValueError, match=r"step given twice \('1' and '2'\)"):
        parse_fail_at("step=1:step=2:worker=0:kill")


def test_fail_at_helper_validates() -> None:
    assert fail_at(step=5, worker=1) == FaultSpec(step=5, target="worker", index=1, how="kill")
    with pytest.raises(ValueError, match="exactly one of worker= or node="):
        fail_at(step=5)
    with pytest.raises(ValueError, match="exactly one of worker= or node="):
        fail_at(step=5, worker=1, node=0)
    with pytest.raises(ValueError, match=r"step=-1.*how='boom'"):
        fail_at(step=-1, worker=0, how="boom")
    with pytest.raises(ValueError, match="only how=stop takes a duration"):
        fail_at(step=1, worker=0, duration_s=2.0)
    with pytest.raises(ValueError, match="step=True"):
        fail_at(step=True, worker=0)  # type: ignore[arg-type]


def test_trace_to_faults() -> None:
    trace = FailureTrace(
        n_workers=3,
        n_steps=50,
        outages=(Outage(worker=2, start_step=10, end_step=20), Outage(worker=0, start_step=4, end_step=50)),
    )
    assert trace_to_faults(trace) == (fail_at(step=4, worker=0, back=50), fail_at(step=10, worker=2, back=20))
    generated = generate_trace("high", n_workers=4, n_steps=500, step_time_s=step_time_for(500), seed=0)
    faults = trace_to_faults(generated)
    assert len(faults) == len(generated.outages) > 0
    assert all(f.how == "kill" and f.target == "worker" for f in faults)
    assert parse_fail_at(format_fail_at(faults), n_workers=4) == faults


def test_back_step() -> None:
    assert parse_fail_at("back=12:step=4:worker=1") == (fail_at(step=4, worker=1, back=12),)
    assert parse_fail_at("step=4:node=1:term:back=5") == (FaultSpec(step=4, target="node", index=1, how="term", back_step=5),)
    with pytest.raises(ValueError) as e:
        parse_fail_at("step=4:worker=1:back=4,step=2:node=0:kill:back=9,step=1:worker=0:back=x")
    msg = str(e.value)
    assert "back=4 is not after step=4; expected back > step" in msg
    assert "back= with node=...:kill" in msg
    assert "back='x' is not an integer" in msg
    with pytest.raises(ValueError, match="back=3: expected an integer step > step=3"):
        fail_at(step=3, worker=0, back=3)
    with pytest.raises(ValueError, match="cannot restart its workers"):
        fail_at(step=3, node=0, back=5)


def test_sharded_phases_need_a_sharded_run() -> None:
    from unbroken.faults.injector import check_faults

    specs = parse_fail_at("step=3:worker=1:kill:phase=allgather")
    check_faults(specs, n_nodes=2, workers_per_node=2, sharded=True)
    check_faults(specs, n_nodes=2, workers_per_node=2)  # not known (an agent's own check): accepted
    with pytest.raises(ValueError, match="phase=allgather is a point of a sharded step only; set "
                                         "train.shard_optimizer=true"):
        check_faults(specs, n_nodes=2, workers_per_node=2, sharded=False)
