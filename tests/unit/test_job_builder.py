"""The one job builder and the one metrics writer: determinism, reuse of a prepared model, checks, cadence."""

from __future__ import annotations

import math

import pytest
import torch

from unbroken.config import load_config
from unbroken.job import (
    MetricsWriter,
    Schedule,
    build_job,
    check_model_fits,
    prepare,
    schedule_for,
    train_record,
    val_record,
)
from unbroken.jsonl import read_jsonl
from unbroken.models.optim import lr_at

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")
TRAIN_KEYS = {"kind", "step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tokens"}


def _cfg(corpus_overrides: list[str], *extra: str):
    return load_config(preset_name="debug", overrides=[
        *corpus_overrides, "train.workers=2", "data.micro_batch=2", "train.device=cpu", *extra])


def test_two_builds_are_bitwise_equal(corpus_overrides):
    cfg = _cfg(corpus_overrides)
    a, b = build_job(cfg, CPU), build_job(cfg, CPU)
    assert a.model is not b.model
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    for x, y in zip(a.sampler.batch(0, 0), b.sampler.batch(0, 0)):
        assert torch.equal(x, y)
    assert a.sampler.n_slots == 2 and a.val_sampler.n_slots == 1
    assert a.info == b.info and a.info.keys() == {"vocab_size", "train_tokens", "val_tokens"}
    assert sorted(id(p) for g in a.optimizer.param_groups for p in g["params"]) == sorted(map(id, a.layout.params))


def test_optimizer_takes_the_optim_section(corpus_overrides):
    cfg = _cfg(corpus_overrides, "optim.lr=0.01", "optim.beta2=0.99", "optim.eps=1e-6", "optim.weight_decay=0.05")
    decay, no_decay = build_job(cfg, CPU).optimizer.param_groups
    assert (decay["lr"], decay["betas"], decay["eps"]) == (0.01, (0.9, 0.99), 1e-6)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])


def test_build_job_reuses_a_prepared_model(corpus_overrides):
    cfg = _cfg(corpus_overrides)
    prepared = prepare(cfg, CPU)
    job = build_job(cfg, CPU, prepared)
    assert job.model is prepared.model and job.data is prepared.data
    assert list(map(id, job.layout.params)) == [id(p) for p in prepared.model.parameters() if p.requires_grad]


def test_check_model_fits_names_both_lengths():
    cfg = load_config(preset_name="debug", overrides=["data.seq_len=512"])
    with pytest.raises(ValueError, match=r"data\.seq_len=512 .*max_seq_len=256.*raise model\.max_seq_len"):
        check_model_fits(cfg)
    check_model_fits(load_config(preset_name="debug", overrides=["data.seq_len=512", "model.max_seq_len=512"]))


def test_schedule_equals_lr_at():
    cfg = load_config(preset_name="debug", overrides=["train.steps=100", "optim.warmup_steps=10"])
    o, schedule = cfg.optim, schedule_for(cfg)
    assert schedule == Schedule(lr=o.lr, warmup_steps=10, min_lr_ratio=o.min_lr_ratio, total_steps=100)
    for step in (0, 5, 9, 10, 50, 99, 100, 150):
        assert schedule(step) == lr_at(step, lr=o.lr, warmup_steps=10, min_lr_ratio=o.min_lr_ratio, total_steps=100)
    assert schedule(0) == o.lr / 10 and schedule(9) == o.lr
    assert schedule(100) == schedule(150) == o.lr * o.min_lr_ratio


def test_metrics_cadence(tmp_path):
    w = MetricsWriter(tmp_path / "m.jsonl", log_every=5, val_every=10, total_steps=23)
    assert [s for s in range(1, 24) if w.log_due(s)] == [5, 10, 15, 20, 23]
    assert [s for s in range(1, 24) if w.val_due(s)] == [10, 20, 23]
    w.close()
    w = MetricsWriter(tmp_path / "n.jsonl", log_every=1, val_every=0, total_steps=23)
    assert [s for s in range(1, 24) if w.val_due(s)] == [23]
    w.close()
    with pytest.raises(ValueError, match="log_every=0"):
        MetricsWriter(tmp_path / "o.jsonl", log_every=0, val_every=0, total_steps=1)


def test_records_and_step_done(tmp_path):
    seen: list[dict] = []
    rec = train_record(step=10, loss=2.5, lr=1e-3, grad_norm=0.5, step_time_s=0.25, tokens_per_step=100,
                       live_workers=2, degraded=[])
    assert rec.keys() == TRAIN_KEYS | {"live_workers", "degraded"}
    assert (rec["tokens_per_s"], rec["tokens"]) == (400.0, 1000)
    val = val_record(10, 2.0)
    assert val == {"kind": "val", "step": 10, "val_loss": 2.0, "val_ppl": math.exp(2.0)}
    assert val_record(3, 80.0)["val_ppl"] == math.exp(50.0)
    with MetricsWriter(tmp_path / "m.jsonl", log_every=5, val_every=10, total_steps=23, on_record=seen.append) as w:
        assert w.step_done(dict(rec, step=4), lambda: pytest.fail("validation not due")) is None
        assert w.step_done(rec, lambda: 2.0) == seen[-1]
    assert "time" not in rec
    lines = read_jsonl(tmp_path / "m.jsonl")
    assert lines == seen and [(r["kind"], r["step"]) for r in lines] == [("train", 10), ("val", 10)]
    assert lines[0].keys() == rec.keys() | {"time"}
    assert lines[1].keys() == {"kind", "step", "val_loss", "val_ppl", "time"}
