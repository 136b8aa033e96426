"""A straggler ridden through in a real job (CPU, gloo, 4 workers): a worker slowed 6x gets fewer rows of its
micro-batch, the others take the rest in the same step, exact, and every (step, slot, row) is trained once."""

from __future__ import annotations

import pytest

from _faults import MICRO_BATCH, check_invariants, failover_config, run_job
from unbroken.report.run_report import summarize_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MB = MICRO_BATCH


def test_a_slow_worker_keeps_a_share_of_its_rows_and_the_others_take_the_rest(tmp_path, corpus_overrides):
    steps = 16
    cfg = failover_config(corpus_overrides, steps, "fault.straggler_factor=1.5", "fault.straggler_steps=2",
                          f"data.micro_batch={2 * MB}")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=4, fail_at="step=2:worker=1:slow:factor=6")
    check_invariants(job, live=[0, 1, 2, 3])
    mb = 2 * MB
    flagged = [e for e in job.events("straggler") if e["slow"] == 1]
    assert flagged, f"worker 1, 6x slower from step 2, was never found slow: {job.events('straggler')}"
    start = flagged[0]["step"]
    assert start < steps - 1, "found slow before the run's last step"
    for step in range(start, steps):
        items = job.committed_items(step)
        own = [i for i in items if i[0] == 1]
        assert own == [(1, 1, 0, own[0][3], "exact")] and own[0][3] < mb, (step, own)
        taken = [i for i in items if i[1] == 1 and i[0] != 1]
        assert taken and all(i[4] == "exact" for i in taken), (step, taken)
    report = summarize_run(job.run_dir)
    (episode,) = [e for e in report["stragglers"] if e["worker"] == 1]
    assert episode["since"] == start and episode["rows_moved"] > 0
