"""Tests of the gray failures (slow, bitflip, nan): their specs, their schedule and what they do to a model."""

from __future__ import annotations

import itertools
import math
import struct
from typing import Any, Callable

import pytest
import torch

from unbroken.faults.chaos import check_chaos_specs
from unbroken.faults.fail_at import FaultSpec, fail_at, format_fail_at, parse_fail_at
from unbroken.faults.gray import GrayFaults
from unbroken.faults.injector import NodeFaults, PhaseFaults

pytestmark = pytest.mark.timeout(60)


def test_parse_gray_kinds() -> None:
    assert parse_fail_at("step=3:worker=1:slow:factor=3:for=4,step=2:worker=0:bitflip:target=param,"
                         "step=5:worker=1:nan,step=1:worker=0:how=slow:factor=1.5") == (
        FaultSpec(step=3, target="worker", index=1, how="slow", factor=3.0, for_steps=4),
        FaultSpec(step=2, target="worker", index=0, how="bitflip", tensor="param"),
        FaultSpec(step=5, target="worker", index=1, how="nan"),
        fail_at(step=1, worker=0, how="slow", factor=1.5),
    )


@pytest.mark.parametrize("text", ["step=3:worker=1:slow:factor=3.0:for=4", "step=0:worker=2:slow:factor=1.25",
                                  "step=2:worker=0:bitflip:target=grad,step=2:worker=0:bitflip:target=param",
                                  "step=5:worker=1:nan,step=6:worker=1:stop:for=2.0"])
def test_round_trip(text: str) -> None:
    specs = parse_fail_at(text)
    assert format_fail_at(specs) == text and parse_fail_at(text) == specs


def test_bad_input_is_refused_with_what_would_be_accepted() -> None:
    text = ("step=1:worker=0:slow,"  # no factor
            "step=1:worker=0:slow:factor=1,"  # a factor <= 1 slows nothing
            "step=1:worker=0:slow:factor=0.5:for=0,"
            "step=1:worker=0:slow:factor=nan:for=2.5,"
            "step=1:worker=0:bitflip,"  # no target
            "step=1:worker=0:bitflip:target=optimizer,"
            "step=1:node=0:nan,"  # one worker's
            "step=1:worker=0:nan:phase=backward:back=3,"
            "step=1:worker=0:kill:factor=2,"
            "step=1:worker=0:nan:target=grad")
    with pytest.raises(ValueError) as e:
        parse_fail_at(text)
    assert str(e.value).splitlines()[1:] == [
        "  item 'step=1:worker=0:slow': slow needs factor=F; expected a finite number > 1",
        "  item 'step=1:worker=0:slow:factor=1': factor='1'; expected a finite number > 1 (the compute takes "
        "factor times as long)",
        "  item 'step=1:worker=0:slow:factor=0.5:for=0': factor='0.5'; expected a finite number > 1 (the compute "
        "takes factor times as long)",
        "  item 'step=1:worker=0:slow:factor=0.5:for=0': for='0'; with slow, expected an integer number of "
        "steps >= 1",
        "  item 'step=1:worker=0:slow:factor=nan:for=2.5': factor='nan'; expected a finite number > 1 (the "
        "compute takes factor times as long)",
        "  item 'step=1:worker=0:slow:factor=nan:for=2.5': for='2.5'; with slow, expected an integer number of "
        "steps >= 1",
        "  item 'step=1:worker=0:bitflip': bitflip needs target=grad or target=param (missing)",
        "  item 'step=1:worker=0:bitflip:target=optimizer': bitflip needs target=grad or target=param "
        "(target='optimizer')",
        "  item 'step=1:node=0:nan': nan is one worker's gray failure; use worker=I",
        "  item 'step=1:worker=0:nan:phase=backward:back=3': nan picks its own points of the step and kills "
        "nobody; drop phase= and back=",
        "  item 'step=1:worker=0:kill:factor=2': factor='2' only applies to slow; drop it or use slow",
        "  item 'step=1:worker=0:nan:target=grad': target='grad' only applies to bitflip; drop it or use bitflip",
    ]


def test_spec_construction_checks_the_same() -> None:
    with pytest.raises(ValueError, match=r"factor=1\.0: expected a finite number > 1"):
        fail_at(step=1, worker=0, how="slow", factor=1.0)
    with pytest.raises(ValueError, match=r"for=0: expected an integer number of steps >= 1"):
        fail_at(step=1, worker=0, how="slow", factor=2.0, for_steps=0)
    with pytest.raises(ValueError, match=r"target='x': expected one of grad, param"):
        fail_at(step=1, worker=0, how="bitflip", tensor="x")
    with pytest.raises(ValueError, match=r"how=nan: a gray failure is one worker's; use worker=I"):
        fail_at(step=1, node=0, how="nan")


def test_chaos_slows_a_worker_but_cannot_flip_its_bits() -> None:
    check_chaos_specs(parse_fail_at("step=1:worker=0:slow:factor=2:for=3"))
    with pytest.raises(ValueError) as e:
        check_chaos_specs(parse_fail_at("step=1:worker=0:nan,step=2:worker=1:bitflip:target=param"))
    assert str(e.value).splitlines()[1:] == [
        "  step=1:worker=0:nan: nan changes the worker's own gradient or parameters; use unbroken train --fail-at",
        "  step=2:worker=1:bitflip:target=param: bitflip changes the worker's own gradient or parameters; use "
        "unbroken train --fail-at"]


def test_the_agent_hands_gray_specs_to_the_worker_and_never_blames_them_for_a_death() -> None:
    specs = parse_fail_at("step=2:worker=1:slow:factor=3,step=4:worker=1:nan,step=5:worker=1:kill")
    p = NodeFaults(specs, node=0, workers_per_node=2, start_step=0)
    assert [i.spec.how for i in p.due(10)] == ["kill"], "no signal for a gray failure"
    assert [p.plan[i].how for i in p.worker_faults(1, from_step=0)] == ["slow", "nan"]
    q = NodeFaults(specs[:2], node=0, workers_per_node=2, start_step=0)
    assert not q.on_death(1, progress=3).injected, "a slow worker that dies was not killed by its slowness"
    assert q.worker_faults(1, from_step=3) == (1,), "the slow fault ended with the process; the nan is to come"


class Hooks:
    """The step protocol's hook registry, as ``StepProtocol.on`` keeps it."""

    def __init__(self) -> None:
        self.hooks: dict[str, list[Callable[[int], None]]] = {}

    def on(self, phase: str, hook: Callable[[int], None]) -> None:
        self.hooks.setdefault(phase, []).append(hook)

    def run(self, phase: str, step: int) -> None:
        for hook in self.hooks.get(phase, []):
            hook(step)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def _flat(model: torch.nn.Module, grad: bool) -> torch.Tensor:
    return torch.cat([(p.grad if grad else p).detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("tensor", ["grad", "param"])
def test_bitflip_flips_one_exponent_bit_of_one_element_once(tensor: str) -> None:
    events: list[dict[str, Any]] = []
    spec = fail_at(step=3, worker=1, how="bitflip", tensor=tensor)
    model, hooks = _model(), Hooks()
    PhaseFaults([spec], events.append, model).install(hooks.on)
    grad = tensor == "grad"
    before_p, before_g = _flat(model, False).clone(), _flat(model, True).clone()
    for step in (2, 3, 3, 4):  # a retried step 3 does not flip again
        hooks.run("forward", step)
        hooks.run("backward", step)
    (e,) = events
    assert e["event"] == "fault_injected" and e["by"] == "worker" and e["worker"] == 1 and e["step"] == 3
    assert e["spec"] == "step=3:worker=1:bitflip:target=" + tensor and e["tensor"] == tensor and e["applied"]
    assert 23 <= e["bit"] <= 30, "an exponent bit of a float32"
    after = _flat(model, grad)
    changed = (after != (before_g if grad else before_p)).nonzero().flatten().tolist()
    assert len(changed) == 1
    assert torch.equal(_flat(model, not grad), before_p if grad else before_g), "the other tensor is untouched"
    x = struct.unpack("<I", struct.pack("<f", e["before"]))[0]
    assert struct.unpack("<f", struct.pack("<I", x ^ (1 << e["bit"])))[0] == e["after"] == after[changed[0]]
    names = [n for n, _ in model.named_parameters()]
    offset = sum(p.numel() for p in list(model.parameters())[:names.index(e["param"])])
    assert changed == [offset + e["index"]]
    # Seeded by the spec: the same spec on the same model hits the same element and bit.
    again: list[dict[str, Any]] = []
    model2, hooks2 = _model(), Hooks()
    PhaseFaults([spec], again.append, model2).install(hooks2.on)
    hooks2.run("forward", 3)
    hooks2.run("backward", 3)
    assert [(a["param"], a["index"], a["bit"]) for a in again] == [(e["param"], e["index"], e["bit"])]


def test_nan_makes_one_gradient_element_nan_after_the_backward() -> None:
    events: list[dict[str, Any]] = []
    model, hooks = _model(), Hooks()
    PhaseFaults([fail_at(step=0, worker=0, how="nan")], events.append, model).install(hooks.on)
    hooks.run("forward", 0)
    assert torch.isfinite(_flat(model, True)).all(), "nothing happens before the backward"
    hooks.run("backward", 0)
    (e,) = events
    assert math.isfinite(e["before"]) and math.isnan(e["after"]) and e["bit"] is None
    assert int(torch.isnan(_flat(model, True)).sum()) == 1 and torch.isfinite(_flat(model, False)).all()


def test_nan_given_twice_fires_in_two_backward_passes() -> None:
    """A spec given twice: the step's first two computations non-finite (a retry of the step sees the second)."""
    events: list[dict[str, Any]] = []
    model, hooks = _model(), Hooks()
    spec = fail_at(step=1, worker=0, how="nan")
    PhaseFaults([spec, spec], events.append, model).install(hooks.on)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        hooks.run("backward", 1)
        events.append({"nan": int(torch.isnan(_flat(model, True)).sum())})
    assert [e.get("nan", "fault") for e in events] == ["fault", 1, "fault", 1, 0]
    assert events[0]["index"] == events[2]["index"], "the same element: the same spec's seed"


def test_a_gradient_fault_without_gradients_writes_into_the_sums_buffer() -> None:
    """HSDP: the gradient shards are copied into the reduction buffer and dropped before the backward hook point;
    the fault writes into the buffer's slice of the parameters' local gradients, in parameter order."""
    events: list[dict[str, Any]] = []
    model, hooks = _model(), Hooks()
    for p in model.parameters():
        p.grad = None
    n = sum(p.numel() for p in model.parameters())
    sums = torch.zeros(n + 3)  # the gradients, then the buffer's scalars
    PhaseFaults([fail_at(step=0, worker=0, how="nan"), fail_at(step=0, worker=0, how="bitflip", tensor="grad")],
                events.append, model, lambda: sums).install(hooks.on)
    hooks.run("backward", 0)
    nan, flip = events
    names = [name for name, _ in model.named_parameters()]
    offsets = dict(zip(names, [0, *itertools.accumulate(p.numel() for p in model.parameters())]))
    assert nan["applied"] and math.isnan(sums[offsets[nan["param"]] + nan["index"]])
    assert flip["applied"] and float(sums[offsets[flip["param"]] + flip["index"]]) == flip["after"] != 0.0
    assert torch.isfinite(sums[n:]).all() and int(torch.isnan(sums).sum()) == 1


def test_slow_sleeps_factor_minus_one_times_the_measured_compute_in_its_window() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    events: list[dict[str, Any]] = []
    gray = GrayFaults((fail_at(step=2, worker=0, how="slow", factor=3.0, for_steps=2),), _model(), events.append,
                      clock=lambda: now[0], sleep=sleep)
    hooks = Hooks()
    gray.install(hooks.on)
    for step in range(6):
        hooks.run("forward", step)
        now[0] += 0.5  # the compute
        hooks.run("backward", step)
    assert slept == [1.0, 1.0], "steps 2 and 3 only, (3 - 1) x 0.5 s each"
    (e,) = events
    assert (e["step"], e["how"], e["factor"], e["for_steps"], e["compute_s"]) == (2, "slow", 3.0, 2, 0.5)
