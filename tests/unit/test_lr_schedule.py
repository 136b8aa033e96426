"""Learning-rate schedules: exact rates at chosen steps, WSD's extension property, the refusals, and a user's
optimizer keeping its own rate unless a schedule is named."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from unbroken.config import Config, load_config, validate
from unbroken.job import Schedule, build_job, schedule_for
from unbroken.job.builder import build_data, check_model_parts
from unbroken.mecefo.gradients import SlotWork
from unbroken.models.optim import lr_at

pytestmark = pytest.mark.timeout(120)

EXACT = 1e-12


def _schedule(kind: str, total: int = 10, **kw: object) -> Schedule:
    args: dict = {"lr": 1.0, "warmup_steps": 2, "min_lr_ratio": 0.1, "total_steps": total, "kind": kind, **kw}
    return Schedule(**args)


def test_cosine_default_is_todays_curve() -> None:
    cfg = Config()
    assert cfg.optim.schedule == "auto" and schedule_for(cfg).kind == "cosine"
    s = _schedule("cosine")
    assert [s(k) for k in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert s(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)), abs=EXACT)  # 0.55
    assert s(10) == s(50) == pytest.approx(0.1, abs=EXACT)
    for step in range(12):
        assert s(step) == lr_at(step, lr=1.0, warmup_steps=2, min_lr_ratio=0.1, total_steps=10)


@pytest.mark.parametrize(("shape", "want"), [
    ("linear", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1]),
    ("cosine", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.1 + 0.9 * (0.5 + 0.5 * math.sqrt(0.5)), 0.55,
                0.1 + 0.9 * (0.5 - 0.5 * math.sqrt(0.5)), 0.1]),
    ("sqrt", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.55, 0.1 + 0.9 * (1 - math.sqrt(0.5)),
              0.1 + 0.9 * (1 - math.sqrt(0.75)), 0.1]),
])
def test_wsd_warms_up_holds_the_peak_and_decays_over_the_last_steps(shape: str, want: list[float]) -> None:
    s = _schedule("wsd", decay_steps=4, decay_shape=shape)
    assert [s(k) for k in range(10)] == pytest.approx(want, abs=EXACT)
    assert s(10) == pytest.approx(0.1, abs=EXACT)  # past the end: the floor


def test_linear_and_constant() -> None:
    lin = _schedule("linear")
    assert [lin(k) for k in (0, 1, 2, 6, 9, 10, 20)] == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.2125, 0.1, 0.1],
                                                                      abs=EXACT)
    const = _schedule("constant")
    assert [const(k) for k in (0, 1, 2, 9, 10_000)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def _run(steps: int, *extra: str) -> Config:
    return load_config(preset_name="debug", overrides=[f"train.steps={steps}", "optim.warmup_steps=10", *extra])


def test_extending_a_wsd_run_keeps_every_rate_before_its_decay_and_cosine_bends() -> None:
    wsd = ["optim.schedule=wsd", "optim.decay_steps=20"]
    short, longer = schedule_for(_run(100, *wsd)), schedule_for(_run(150, *wsd))
    assert [short(k) for k in range(80)] == [longer(k) for k in range(80)]  # trained before the extension
    assert [longer(k) for k in range(10, 130)] == [longer.lr] * 120  # the stable phase goes on ...
    assert short(80) < short.lr and longer(149) == pytest.approx(longer.lr * longer.min_lr_ratio, abs=EXACT)
    # ... and the decay is the same curve, moved to the new end
    assert [short(k) for k in range(80, 100)] == [longer(k) for k in range(130, 150)]
    cos_short, cos_long = schedule_for(_run(100)), schedule_for(_run(150))
    assert [cos_short(k) for k in range(11)] == [cos_long(k) for k in range(11)]
    assert cos_long(50) > cos_short(50)  # cosine stretches over the new length: the curve bends


@pytest.mark.parametrize(("overrides", "messages"), [
    (["optim.schedule=wsd"], ["optim.decay_steps=0: optim.schedule='wsd' needs >= 1"]),
    (["optim.schedule=wsd", "optim.decay_steps=95"],
     ["optim.warmup_steps=10 + optim.decay_steps=95 > train.steps=100: warm-up and decay must fit"]),
    (["optim.decay_steps=5"],
     ["optim.decay_steps=5 with optim.schedule='auto': decay_steps is for optim.schedule='wsd' only"]),
    (["optim.schedule=none"], ["optim.schedule='none' keeps the optimizer's own learning rate",
                               "use optim.schedule='constant'"]),
    (["optim.decay_shape=exp"], ["optim.decay_shape='exp': expected one of linear, cosine, sqrt"]),
    (["optim.schedule=step"], ["optim.schedule='step': expected one of auto, cosine, wsd, linear, constant, none"]),
])
def test_bad_schedules_are_refused_naming_field_value_and_fix(overrides: list[str], messages: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        _run(100, *overrides)
    for message in messages:
        assert message in str(err.value)


def test_every_schedule_error_is_reported_at_once() -> None:
    cfg = _run(100)
    cfg.optim.schedule, cfg.optim.decay_steps, cfg.optim.min_lr_ratio = "none", 3, 2.0
    errs = validate(cfg)
    assert any(e.startswith("optim.schedule='none'") for e in errs)
    assert any(e.startswith("optim.decay_steps=3 with optim.schedule='none'") for e in errs)
    assert any(e.startswith("optim.min_lr_ratio=2.0") for e in errs)


FACTORY = '''
import torch


def sgd(model, ctx):
    return torch.optim.SGD(model.parameters(), lr=0.05)
'''


def _applied_lr(cfg: Config) -> tuple[float, list[float]]:
    job = build_job(cfg, torch.device("cpu"))
    mb = cfg.data.micro_batch
    reduced = job.gradient_sums(0, [SlotWork(slot=s, rows=(0, mb)) for s in range(cfg.train.workers)])
    lr, _ = job.apply(0, reduced)
    return lr, [g["lr"] for g in job.optimizer.param_groups]


def test_a_user_optimizer_keeps_its_rate_unless_a_schedule_is_named(tmp_path: Path, corpus_overrides: list[str],
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "opt.py").write_text(FACTORY)
    base = [*corpus_overrides, "train.workers=2", "data.micro_batch=2", "train.device=cpu", "optim.lr=0.2",
            "optim.warmup_steps=0", f"optim.factory={tmp_path / 'opt.py'}:sgd"]
    own = load_config(preset_name="debug", overrides=base)
    assert schedule_for(own).kind == "none"
    assert _applied_lr(own) == (0.05, [0.05])
    with caplog.at_level(logging.INFO, logger="unbroken.job.builder"):
        check_model_parts(own, build_data(own))
    assert [r.getMessage() for r in caplog.records if r.name == "unbroken.job.builder"] == [
        "learning rate: optim.factory's optimizer keeps its own (optim.schedule=none); name a schedule in "
        "optim.schedule to have the job set it every step"]
    named = load_config(preset_name="debug", overrides=[*base, "optim.schedule=constant"])
    assert _applied_lr(named) == (0.2, [0.2])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="unbroken.job.builder"):
        check_model_parts(named, build_data(named))
    assert [r.getMessage() for r in caplog.records if r.name == "unbroken.job.builder"] == [
        "learning rate: constant, peak 0.2 after 0 warm-up steps"]
