"""A compiling job under ``neighbor`` compiles MeCeFO's approximate graphs at each worker's start, and the takeover
step compiles nothing new (unbroken.mecefo.warm_up, called by the worker's start in runtime/worker_entry.py).

Three workers of the debug model with ``train.compile`` on (CPU: inductor's C++ kernels); worker 1 kills itself
in step 3's forward (in that step however busy the machine, not when its agent next reads the progress) and stays
dead, so worker 2, its ring successor, covers its slot approximated from step 3 to the end. Worker 2 is never the
view's leader, so it runs no validation pass (a graph of its own): every graph it captures after its first step
would be the takeover's. Counted with dynamo's graph counter, never timed.
"""

from __future__ import annotations

import json

import pytest

from _faults import MICRO_BATCH, check_invariants, failover_config, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_approximate_graphs_compile_at_the_start_and_the_takeover_compiles_nothing(tmp_path, corpus_overrides,
                                                                                     monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # compiled from scratch
    # Long timeouts: three processes compile on a shared machine; nothing here depends on them.
    cfg = failover_config(corpus_overrides, 8, "train.compile=true", "fault.progress_timeout_s=600",
                          "fault.heartbeat_timeout_s=600", "train.timeout_s=1200")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=3, fail_at="step=3:worker=1:kill:phase=forward")
    check_invariants(job, live=[0, 2])

    for w in (0, 1, 2):
        (warmed,) = job.events("approx_warmed_up", worker=w)
        assert warmed["rows"] == [MICRO_BATCH] and warmed["compiled"] and warmed["graphs"] > 0, warmed
        (start,) = job.events("start_phases", worker=w)
        assert start["phases"]["approx_compile"] >= warmed["seconds"] - 0.1  # the start's cost, visible

    takeovers = job.events("takeover", worker=2)
    assert takeovers and takeovers[0]["step"] == 3 and ["approx"] == sorted({i[3] for i in takeovers[0]["items"]})
    (first,) = job.events("compiled", worker=2)  # after its first step: every graph the run will need
    report = json.loads((job.run_dir / "workers" / "w2.json").read_text())
    assert report["graphs"] == first["graphs"], "the takeover steps compiled a graph"
    assert report["compile"]["frames"] == first["frames"]
