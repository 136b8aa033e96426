"""Gray failures injected into a real job (CPU, gloo, 2 workers): a slow worker, a flipped bit, a NaN.

Nothing detects them yet: the job trains through a slow worker and applies a wrong
or non-finite gradient like any other. Each scenario asserts that observable effect
and the worker's one ``fault_injected`` event with its detail.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from _faults import Job, check_invariants, failover_config, run_job
from _reference import checkpoint_params, reference_train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def compute_seconds(job: Job, worker: int, step: int) -> float:
    """From ``worker``'s commit of ``step - 1`` to its ledger record of ``step``: its compute of ``step``, in
    its own events (the record precedes its all-reduce, so waiting for a slower peer is not in it)."""
    (done,) = [r["time"] for r in job.records if r.get("kind") == "commit" and r["worker"] == worker
               and r["step"] == step - 1]
    (work,) = [r["time"] for r in job.records if r.get("kind") == "work" and r["worker"] == worker
               and r["step"] == step]
    return work - done


def test_slow_worker_computes_its_steps_factor_times_as_long(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, 10, "train.workers=2", "data.seq_len=128")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=2, fail_at="step=3:worker=1:slow:factor=3:for=5")
    check_invariants(job, live=[0, 1])
    (e,) = job.events("fault_injected")
    assert (e["worker"], e["step"], e["how"], e["factor"], e["for_steps"]) == (1, 3, "slow", 3.0, 5)
    assert e["spec"] == "step=3:worker=1:slow:factor=3.0:for=5" and e["compute_s"] > 0
    ratios = [compute_seconds(job, 1, s) / compute_seconds(job, 0, s) for s in range(3, 8)]
    assert statistics.median(ratios) >= 1.5, f"worker 1's compute over worker 0's, steps 3-7: {ratios}"
    assert job.summary["failures"] == 0 and not job.events("attempt_aborted"), "today the job trains through it"


def test_nan_in_one_workers_gradient_is_applied_everywhere(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, 6, "train.workers=2")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=2, fail_at="step=3:worker=1:nan")
    check_invariants(job, live=[0, 1])
    (e,) = job.events("fault_injected")
    assert (e["worker"], e["step"], e["how"], e["tensor"], e["applied"]) == (1, 3, "nan", "grad", True)
    assert math.isfinite(e["before"]) and math.isnan(e["after"]) and e["param"] and e["index"] >= 0
    norms = {r["step"] - 1: r["grad_norm"] for r in job.train_records()}  # a train record counts committed steps
    assert math.isfinite(norms[2]) and math.isnan(norms[3]), "the reduced gradient of step 3 holds the NaN"
    params = checkpoint_params(job.summary["checkpoint"])
    assert not all(torch.isfinite(p).all() for p in params.values()), "nothing checks: the step applied it"


def test_bitflip_in_one_workers_gradient_changes_the_final_parameters(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, 6, "train.workers=2")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=2, fail_at="step=3:worker=1:bitflip:target=grad")
    check_invariants(job, live=[0, 1])
    (e,) = job.events("fault_injected")
    assert (e["worker"], e["step"], e["how"], e["tensor"], e["applied"]) == (1, 3, "bitflip", "grad", True)
    assert 23 <= e["bit"] <= 30 and e["before"] != e["after"] and e["param"] and e["index"] >= 0
    got, want = checkpoint_params(job.summary["checkpoint"]), reference_train(cfg)
    assert got.keys() == want.keys()
    # The run without the fault equals the reference to this tolerance (test_failover.py's first scenario).
    differ = [n for n in want if not torch.allclose(got[n], want[n], rtol=1e-4, atol=1e-5)]
    assert e["param"] in differ, f"the flipped element's parameter {e['param']} trained as without it"
