"""A straggler ridden through in a real job (CPU, gloo, 4 workers): a worker slowed 6x gets fewer rows of its
micro-batch, the others take the rest in the same step, exact; after ``fault.straggler_replace_s`` it leaves,
and its replacement (not slowed: the fault ends with its process) rejoins and trains its whole micro-batch
again. Every (step, slot, row) is trained once."""

from __future__ import annotations

import pytest

from _faults import MICRO_BATCH, check_invariants, failover_config, run_job
from unbroken.report.run_report import summarize_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_slow_worker_keeps_a_share_of_its_rows_then_is_replaced(tmp_path, corpus_overrides):
    steps, mb = 30, 2 * MICRO_BATCH
    cfg = failover_config(corpus_overrides, steps, "fault.straggler_factor=1.5", "fault.straggler_steps=2",
                          "fault.straggler_replace_s=1", f"data.micro_batch={mb}")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=4, fail_at="step=2:worker=1:slow:factor=6",
                  restart="on-failure", pace=True)
    check_invariants(job, live=[0, 1, 2, 3])
    flagged = [e for e in job.events("straggler") if e["slow"] == 1]
    assert flagged, f"worker 1, 6x slower from step 2, was never found slow: {job.events('straggler')}"
    start = flagged[0]["step"]
    replaced = job.events("straggler_replaced", worker=1)[0]  # a busy machine may make a replacement look slow too
    left = replaced["step"]
    assert replaced["slow_s"] >= 1 and start <= left
    for step in range(start, left + 1):  # while it is slow: a share of its micro-batch, the rest exact elsewhere
        items = job.committed_items(step)
        own = [i for i in items if i[0] == 1]
        assert own == [(1, 1, 0, own[0][3], "exact")] and own[0][3] < mb, (step, own)
        assert all(i[4] == "exact" for i in items if i[1] == 1), (step, items)
    # The replacement is not slowed (the fault ended with its process): its whole micro-batch in every step after
    # its return, but those of an episode of its own (on a busy machine a process may look slow for a while; and
    # while another worker does, the replacement may take some of that one's rows as well).
    back = job.events("rejoined", worker=1)[-1]
    whole = [s for s in range(back["step"] + 1, steps) if s not in _episode_steps(job, 1, back["step"], steps)]
    assert whole and all([i for i in job.committed_items(s) if i[0] == 1 and i[1] == 1] == [(1, 1, 0, mb, "exact")]
                         for s in whole), "the replacement trains its whole micro-batch"
    report = summarize_run(job.run_dir)
    episode = [e for e in report["stragglers"] if e["worker"] == 1][0]
    assert episode["since"] == start and episode["rows_moved"] > 0


def _episode_steps(job, worker: int, after: int, steps: int) -> set[int]:
    """The steps after ``after`` in which ``worker`` was a straggler: from each ``straggler`` event's step to its
    ``straggler_end``'s (the first step it trains whole again), or the end."""
    ends = sorted(e["step"] for e in job.events("straggler_end") if e["slow"] == worker)
    out: set[int] = set()
    for start in sorted(e["step"] for e in job.events("straggler") if e["slow"] == worker and e["step"] > after):
        out |= set(range(start, next((end for end in ends if end > start), steps)))
    return out
