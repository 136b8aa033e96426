"""The single-process simulator: equals the data-parallel trainer without failures,
follows a hand-made failure trace under every policy, trains every row once."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from _reference import checkpoint_params
from unbroken.cli import main as cli_main
from unbroken.config import load_config
from unbroken.faults.traces import FailureTrace, Outage
from unbroken.jsonl import read_jsonl
from unbroken.mecefo.takeover import POLICIES, degraded_slots
from unbroken.job.simulator import live_at, simulate
from unbroken.agent.launcher import launch_local

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _cfg(corpus_overrides, workers: int, steps: int, *extra: str):
    return load_config(preset_name="debug", overrides=corpus_overrides + [
        f"train.workers={workers}", f"train.steps={steps}", "train.val_every=0", "train.val_batches=2",
        "optim.warmup_steps=2", "optim.eps=1e-6", *extra])
# eps=1e-6: see tests/integration/test_data_parallel.py (sign flips of Adam's first
# updates on near-zero gradients under a different summation order).


def test_no_failure_equals_data_parallel_trainer(tmp_path, corpus_overrides):
    cfg = _cfg(corpus_overrides, 2, 6)
    trained = launch_local(cfg, tmp_path / "dp")
    simulated = simulate(cfg, tmp_path / "sim")
    assert simulated["degraded_fraction"] == 0.0 and simulated["approx_row_fraction"] == 0.0
    want = checkpoint_params(trained["checkpoint"])
    got = load_file(str(tmp_path / "sim" / "final_params.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    assert simulated["final_loss"] == pytest.approx(trained["final_loss"], rel=1e-4)
    assert simulated["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-4)


# Steps 0 and 4 healthy; one failure (1-3), two adjacent failures (2), two non-adjacent (5-6).
TRACE = FailureTrace(n_workers=4, n_steps=8, outages=(
    Outage(worker=2, start_step=1, end_step=4),
    Outage(worker=3, start_step=2, end_step=3),
    Outage(worker=0, start_step=5, end_step=7),
    Outage(worker=2, start_step=5, end_step=8),
))


def _rows_trained(rec: dict) -> Counter:
    rows = Counter()
    for items in rec["assignment"].values():
        for slot, a, b, _ in items:
            rows.update((slot, r) for r in range(a, b))
    return rows


@pytest.mark.parametrize("policy", POLICIES)
def test_explicit_trace_every_row_once(tmp_path, corpus_overrides, policy):
    mb = 4
    cfg = _cfg(corpus_overrides, 4, 8, f"mecefo.policy={policy}", f"data.micro_batch={mb}", "mecefo.rank=4")
    summary = simulate(cfg, tmp_path / "run", trace=TRACE)
    train = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    for rec in train:
        s = rec["step"] - 1
        down = TRACE.down_at(s)
        assert rec["live_workers"] == sorted(set(range(4)) - down)
        assert [d["slot"] for d in rec["degraded"]] == sorted(down)
        expected = POLICIES[policy].assign(n_slots=4, live=rec["live_workers"], micro_batch=mb)
        assert rec["degraded"] == degraded_slots(expected, 4)
        assert _rows_trained(rec) == Counter({(k, r): 1 for k in range(4) for r in range(mb)}), f"step {s}"
        assert rec["waited"] is False and math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"])
    assert summary["degraded_fraction"] == pytest.approx(6 / 8)
    assert summary["policy"] == policy and summary["trace"] == "explicit" and summary["waited_steps"] == 0
    assert json.loads((tmp_path / "run" / "trace.json").read_text()) == TRACE.to_json()
    assert math.isfinite(summary["val_ppl"])


def test_all_down_step_waits_for_first_returner(tmp_path, corpus_overrides):
    trace = FailureTrace(n_workers=2, n_steps=4, outages=(
        Outage(worker=0, start_step=1, end_step=3),
        Outage(worker=1, start_step=1, end_step=2),
    ))
    assert live_at(trace, 1) == (frozenset({1}), True)
    cfg = _cfg(corpus_overrides, 2, 4, "data.micro_batch=2", "mecefo.rank=4", "mecefo.policy=neighbor")
    summary = simulate(cfg, tmp_path / "run", trace=trace)
    train = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["waited"] for r in train] == [False, True, False, False]
    assert train[1]["live_workers"] == [1] and train[1]["assignment"] == {"1": [[1, 0, 2, "approx"],
                                                                                [0, 0, 2, "approx"]]}
    assert summary["waited_steps"] == 1


def test_bad_inputs_write_nothing(tmp_path, corpus_overrides):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="no one to take over"):
        simulate(_cfg(corpus_overrides, 1, 2, "fault.trace=high"), out)
    with pytest.raises(ValueError, match="unknown failure trace 'often'"):
        simulate(_cfg(corpus_overrides, 2, 2, "fault.trace=often"), out)
    with pytest.raises(ValueError, match="does not fit"):
        simulate(_cfg(corpus_overrides, 2, 2), out, trace=TRACE)
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="--overwrite"):
        simulate(_cfg(corpus_overrides, 2, 2), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_cli_simulate(tmp_path, corpus_overrides):
    out = tmp_path / "cli"
    rc = cli_main(["simulate", "--preset", "debug", "--slots", "4", "--trace", "high", "--policy", "neighbor",
                   "--steps", "3", "--out", str(out), "--data.micro_batch=2", "--train.val_batches=1",
                   *(f"--{o}" for o in corpus_overrides)])
    assert rc == 0
    for name in ("config.json", "trace.json", "metrics.jsonl", "summary.json", "final_params.safetensors"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trace"] == "high" and summary["workers"] == 4 and summary["steps"] == 3
    assert cli_main(["simulate", "--steps", "3", "--out", str(out), *(f"--{o}" for o in corpus_overrides)]) == 2


def test_max_down_one_failure_at_a_time(tmp_path, corpus_overrides):
    cfg = _cfg(corpus_overrides, 4, 8, "fault.trace=high", "fault.max_down=1", "mecefo.policy=neighbor",
               "data.micro_batch=2", "mecefo.rank=4")
    summary = simulate(cfg, tmp_path / "run")
    trace = FailureTrace.from_json(json.loads((tmp_path / "run" / "trace.json").read_text()))
    assert trace.max_down == 1 and trace.deferred > 0 and trace.most_down() == 1
    train = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["live_workers"] for r in train] == [sorted(set(range(4)) - trace.down_at(s)) for s in range(8)]
    assert min(len(r["live_workers"]) for r in train) == 3
    # One worker down: its successor computes both micro-batches approximately, 2 of the 4 slots' rows.
    degraded = sum(1 for r in train if r["degraded"])
    assert summary["approx_row_fraction"] == pytest.approx(degraded * 2 / (8 * 4))
    assert (summary["max_down"], summary["most_down"], summary["deferred_failures"]) == (1, 1, trace.deferred)
    uncapped = FailureTrace(n_workers=4, n_steps=8, outages=(Outage(worker=0, start_step=1, end_step=5),
                                                              Outage(worker=1, start_step=2, end_step=3)))
    with pytest.raises(ValueError, match="2 workers down at once, more than fault.max_down=1"):
        simulate(cfg, tmp_path / "other", trace=uncapped)
    assert not (tmp_path / "other").exists()
