"""Multi-process data-parallel training equals single-process training; resume is exact."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from _reference import checkpoint_params, reference_train
from unbroken.config import load_config
from unbroken.agent.launcher import launch_local
from unbroken.cli import main
from unbroken.runtime.ledger import check_ledger

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _cfg(corpus_overrides, workers: int, steps: int, *extra: str):
    return load_config(preset_name="debug", overrides=corpus_overrides + [
        f"train.workers={workers}", f"train.steps={steps}", "train.val_every=0", "train.val_batches=2",
        "optim.warmup_steps=2", "optim.eps=1e-6", *extra])
# Adam's first updates are close to lr * sign(g): for elements whose gradient is
# near zero, summation-order noise (per-slot sums vs one global batch) would flip
# the sign and give lr-sized differences. eps=1e-6 damps exactly those elements,
# so parameters can be compared at float tolerance. The gradients themselves are
# compared strictly in tests/unit/test_gradients.py.


@pytest.mark.parametrize("workers", [2, 4])
def test_data_parallel_equals_single_process(tmp_path, corpus_overrides, workers):
    cfg = _cfg(corpus_overrides, workers, 6)
    summary = launch_local(cfg, tmp_path / "run")
    assert summary["workers_agree"], "workers ended with different parameters"
    assert summary["steps"] == 6
    got = checkpoint_params(summary["checkpoint"])
    want = reference_train(cfg)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_resume_equals_uninterrupted(tmp_path, corpus_overrides):
    cfg = _cfg(corpus_overrides, 2, 8, "train.checkpoint_every=4")
    full = launch_local(cfg, tmp_path / "full")
    # A run that stopped after its step-4 checkpoint: copy it and drop what came later.
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step_0000008")
    (part / "summary.json").unlink()
    resumed = launch_local(cfg, part, resume=True)
    assert resumed["resumed_from"].endswith("step_0000004")
    assert resumed["workers_agree"]
    assert resumed["param_digest"] == full["param_digest"], "resumed run differs from the uninterrupted one"
    steps = [json.loads(line)["step"] for line in (part / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == list(range(1, 9)), "metrics must hold each step once after a resume"


def test_resume_with_more_steps_extends_a_wsd_run_as_if_it_had_been_planned(tmp_path, corpus_overrides, capsys):
    """An 8-step WSD run, resumed from its step-4 checkpoint with train.steps=12, trains exactly the 12-step run:
    steps 0-3 were in the stable phase of both, and the decay moved to the new end."""
    wsd = ("optim.schedule=wsd", "optim.decay_steps=2", "train.checkpoint_every=4")
    launch_local(_cfg(corpus_overrides, 2, 8, *wsd), tmp_path / "short")
    shutil.rmtree(tmp_path / "short" / "checkpoints" / "step_0000008")
    (tmp_path / "short" / "summary.json").unlink()
    longer = _cfg(corpus_overrides, 2, 12, *wsd)
    resumed = launch_local(longer, tmp_path / "short", resume=True)
    assert resumed["resumed_from"].endswith("step_0000004") and resumed["steps"] == 12
    full = launch_local(longer, tmp_path / "full")
    assert resumed["param_digest"] == full["param_digest"], "the extended run differs from one planned that long"
    saved = json.loads((tmp_path / "short" / "config.json").read_text())
    assert saved["train"]["steps"] == 12
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "short" / "metrics.jsonl").read_text().splitlines())
           if r["kind"] == "train"]
    assert lrs == [r["lr"] for r in map(json.loads, (tmp_path / "full" / "metrics.jsonl").read_text().splitlines())
                   if r["kind"] == "train"]
    # the CLI takes --train.steps with --resume, and refuses a run no longer than what it has trained
    assert main(["train", "--resume", str(tmp_path / "short"), "--train.steps=12"]) == 2
    assert "train.steps=12, but the run has trained 12 steps already; give --train.steps=13 or more" in \
        capsys.readouterr().err


@pytest.mark.parametrize("workers", [2, 4])
def test_global_batch_accumulates_to_single_process(tmp_path, corpus_overrides, workers):
    """One global batch of 8 micro-batches, trained by 2 workers x 4 accumulated micro-batches and by 4 x 2,
    equals a plain single-process loop over the same rows."""
    base = _cfg(corpus_overrides, workers, 4)
    cfg = _cfg(corpus_overrides, workers, 4, f"train.global_batch={8 * base.data.micro_batch}")
    assert cfg.n_slots == 8
    summary = launch_local(cfg, tmp_path / "run")
    assert summary["workers_agree"] and summary["steps"] == 4
    got = checkpoint_params(summary["checkpoint"])
    want = reference_train(cfg)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    works = [json.loads(line) for f in sorted((tmp_path / "run" / "events").glob("*.jsonl"))
             for line in f.read_text().splitlines() if '"work"' in line]
    per_worker = {w["worker"]: sorted(item[0] for item in w["items"]) for w in works if w["step"] == 0}
    assert per_worker == {w: list(range(w, 8, workers)) for w in range(workers)}


def test_resume_on_half_the_workers_trains_the_same_rows(tmp_path, corpus_overrides, capsys):
    """A 4-worker run resumed from its step-4 checkpoint on 2 workers keeps its global batch (4 micro-batches,
    2 per worker now): the same rows per step as the 4-worker run, and the same parameters up to reduction
    order."""
    cfg = _cfg(corpus_overrides, 4, 8, "train.checkpoint_every=4")
    full = launch_local(cfg, tmp_path / "full")
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step_0000008")
    (part / "summary.json").unlink()
    assert main(["train", "--resume", str(part), "--workers", "2"]) == 0
    capsys.readouterr()
    saved = json.loads((part / "config.json").read_text())
    assert (saved["train"]["workers"], saved["train"]["global_batch"]) == (2, 4 * cfg.data.micro_batch)
    resumed = json.loads((part / "summary.json").read_text())
    assert resumed["resumed_from"].endswith("step_0000004") and resumed["workers_agree"]
    mb = cfg.data.micro_batch
    # steps 0-3 by the 4 workers, 4-7 again by the 2 (what the 4 did after their checkpoint is superseded)
    ledger = check_ledger(part, n_slots=4, micro_batch=mb, steps=8, n_workers=2)
    assert ledger.ok and ledger.committed == 8, ledger.to_json()
    resumed_at = json.loads((part / "events" / "resume.jsonl").read_text())["time"]
    works = [r for f in sorted((part / "events").glob("w*.jsonl")) for r in map(json.loads, f.read_text().splitlines())
             if r["kind"] == "work" and r["time"] > resumed_at]
    for step in range(4, 8):
        got = {w["worker"]: [it[:3] for it in w["items"]] for w in works if w["step"] == step}
        assert got == {0: [[0, 0, mb], [2, 0, mb]], 1: [[1, 0, mb], [3, 0, mb]]}, (step, got)
    a, b = checkpoint_params(full["checkpoint"]), checkpoint_params(resumed["checkpoint"])
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)
    # a global batch that cannot be split over the workers asked for is refused with the fix
    assert main(["train", "--resume", str(part), "--workers", "8", "--train.steps=12"]) == 2
    assert "fewer than train.workers=8" in capsys.readouterr().err
