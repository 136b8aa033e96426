"""A joiner's admission never aborts the members' step in flight (real processes, signals, gloo).

The leader announces an admission in a step's reduction and admits at that step's boundary, where every
member waits for the admitting view (:mod:`unbroken.runtime.view_changes`). So the only aborted attempts of a
run whose one fault is a kill are those of the kill's own step, and the step a worker rejoins at is
committed in the view that admitted it, at its first attempt.
"""

from __future__ import annotations

import pytest

from _faults import check_invariants, failover_config, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 120
"""Steps of the run; the job is held back while the killed worker, forked again from its node's template, gets
ready (``pace``), so it rejoins before the end however slow the machine."""


def test_rejoin_aborts_no_attempt_of_the_members(tmp_path, corpus_overrides):
    """Three nodes of one worker (the failover benchmark's shape); worker 1 is SIGKILLed by its agent at
    step 4 and comes back once step 6 is committed."""
    cfg = failover_config(corpus_overrides, STEPS)
    job = run_job(cfg, tmp_path / "run", nodes=3, workers_per_node=1, restart="on-failure",
                  fail_at="step=4:worker=1:kill:back=6", pace=True)
    check_invariants(job, live=[0, 1, 2])
    (rejoined,) = job.events("rejoined", worker=1)
    back, gen = rejoined["step"], rejoined["gen"]
    (kill,) = job.events("fault_injected", worker=1)
    aborted = job.events("attempt_aborted")
    assert aborted, "the kill aborted the attempt of its step"
    # The agent fires the kill once it reads progress 4: the signal lands in that step or, on a busy machine, in
    # the next one. Either way one step's attempt is aborted, and only by the kill.
    steps = {a["step"] for a in aborted}
    assert len(steps) == 1 and kill["progress"] <= min(steps) <= kill["progress"] + 1, \
        f"attempts aborted beyond the kill's step: {[(a['step'], a['worker'], a['reason']) for a in aborted]}"
    assert {a["worker"] for a in aborted} <= {0, 2}
    assert not [a for a in aborted if a["step"] == back], "the admission aborted the members' step"
    assert job.commit_gen(back) == gen and job.committers(back) == {0, 1, 2}, \
        "the rejoin step is committed in the admitting view, by every member and the joiner"
    works = [r for r in job.records if r.get("kind") == "work" and r["step"] == back and r["worker"] in (0, 2)]
    assert {r["gen"] for r in works} == {gen}, "no member computed the rejoin step in the view before"
