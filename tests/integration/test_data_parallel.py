"""Multi-process data-parallel training equals single-process training; resume is exact."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from _reference import checkpoint_params, reference_train
from unbroken.config import load_config
from unbroken.agent.launcher import launch_local

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
