"""``fault.max_down`` in the real runtime: an agent holds a signal fault while the job is at the cap.

Real agent, real stand-in worker processes, real signals, the real store; the
test plays the survivors (views) and the metrics leader (progress), as in
``test_agent.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from test_agent import alive, running_job, until
from unbroken.config import Config
from unbroken.store.view import View

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def test_second_failure_waits_until_the_first_worker_is_back(tmp_path: Path) -> None:
    cfg = Config()
    cfg.fault.max_down = 1
    with running_job(tmp_path / "run", cfg) as job:
        agent = job.agent("--fail-at", "step=3:worker=1:kill:back=5,step=4:worker=2:kill:back=8", wpn=3,
                          timeout_s=30.0)
        pids = job.started(0, 1, 2)
        v0 = job.store.current_view()
        job.store.set_progress(3)
        until(lambda: job.events(event="worker_exit"), 5.0)
        v1 = job.store.propose(v0, View(gen=v0.gen + 1, members=(0, 2), step=3, reason="dead [1]"))
        job.store.set_progress(4)  # worker 2's fault is due, but worker 1 is down: it waits
        until(lambda: job.events(event="fault_deferred"), 5.0)
        (deferred,) = job.events(event="fault_deferred")
        assert (deferred["spec"], deferred["progress"], deferred["max_down"]) == ("step=4:worker=2:kill:back=8", 4, 1)
        job.store.set_progress(5)  # worker 1 restarts and asks to join; not yet a member, so still down
        until(lambda: any(e["worker"] == 1 and e["join"] for e in job.events(event="worker_start")), 5.0)
        time.sleep(0.3)
        assert alive(pids[2]) and len(job.events(event="worker_exit")) == 1
        # Step 6 committed, then worker 1 a member again: worker 2's fault fires now (in this order: the agent
        # may act on the view at once, and the fault's return step counts from the progress it fires at).
        job.store.set_progress(6)
        job.store.propose(v1, View(gen=v1.gen + 1, members=(0, 1, 2), step=6, reason="joined [1]"))
        until(lambda: len(job.events(event="worker_exit")) == 2, 5.0)
        exits = job.events(event="worker_exit")
        assert [(e["worker"], e["progress"], e["restart_at_step"]) for e in exits] == [(1, 3, 5), (2, 6, 10)], \
            "the waiting fault keeps its outage length: back 4 steps after it fired"
        injected = job.events(event="fault_injected")
        assert [(e["spec"], e["progress"]) for e in injected] == [("step=3:worker=1:kill:back=5", 3),
                                                                  ("step=4:worker=2:kill:back=8", 6)]
        job.store.set_done()
        assert agent.wait(timeout=15) == 0
