"""The agent's start-up supervision, with real processes, real signals and a real store.

Around the stand-in worker of ``test_agent.py`` (the test plays the rest of the
job and admits nobody, so a restarted worker stays a joiner waiting for
admission): a worker hung before it is admitted is fenced and restarted by its
agent; a member is left to its peers; a hung standby is replaced and never
waited for; a worker offered to the standby is not started beside it by a
restore; the agent's loop keeps beating throughout.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from test_agent import Job, alive, running_job, until
from unbroken.agent._standby import CLAIM_TIMEOUT_S, OFFER_SILENCE_S
from unbroken.store.job_store import JobStore
from unbroken.store.backend import job_secret
from unbroken.store.view import View

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LIVENESS_S = 1.0


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    with running_job(tmp_path / "run") as j:
        yield j


def beating(job: Job, w: int, pid: int, window_s: float = 0.4) -> bool:
    """``pid`` is worker ``w``'s current process and its counter moves."""
    before = job.store.heartbeats([w])[0]
    time.sleep(window_s)
    return job.pid(w) == pid and alive(pid) and job.store.heartbeats([w])[0] > before


def fences(job: Job, w: int) -> list[dict]:
    return [e for e in job.events(event="fence") if e["worker"] == w]


def new_pid(job: Job, w: int, old: int, timeout_s: float = 20.0) -> int:
    until(lambda: job.pid(w) not in (None, old), timeout_s, poll_s=0.001)
    return job.pid(w)  # type: ignore[return-value]


@contextmanager
def agent_beats(job: Job) -> Iterator[list[float]]:
    """Sample the agent's heartbeat counter every 5 ms; yields the list of gaps between its changes (s)."""
    store = JobStore.connect(job.addr, timeout_s=10, secret=job_secret(job.run_dir))
    gaps: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        last, since = store.agent_beat(0, 0), time.monotonic()
        while not stop.wait(0.005):
            count, now = store.agent_beat(0, 0), time.monotonic()
            if count != last:
                gaps.append(now - since)
                last, since = count, now
        gaps.append(time.monotonic() - since)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield gaps
    finally:
        stop.set()
        thread.join(timeout=5)


def test_joiner_stopped_before_admission_is_fenced_and_restarted(job: Job) -> None:
    agent = job.agent("--startup-liveness-s", str(LIVENESS_S), "--startup-deadline-s", "10")
    pids = job.started(0, 1)
    os.kill(pids[0], signal.SIGSTOP)  # a member: judged by its peers (here: nobody), never by its agent
    os.kill(pids[1], signal.SIGKILL)
    joiner = new_pid(job, 1, pids[1])
    until(lambda: beating(job, 1, joiner), 20.0)  # started, asked to join, waits: healthy, left alone
    os.kill(joiner, signal.SIGSTOP)
    t0 = time.monotonic()
    took = until(lambda: fences(job, 1), 60.0, poll_s=0.01)
    fence = fences(job, 1)[0]
    assert fence["pid"] == joiner
    assert fence["reason"]["by"] == "agent" and fence["reason"]["how"] == "startup_silent"
    # Never before its silence passed the limit, by the agent's own clock (how much later is the machine's).
    assert fence["reason"]["silent_s"] >= LIVENESS_S, fence["reason"]
    third = new_pid(job, 1, joiner)
    until(lambda: beating(job, 1, third), 60.0)
    back = time.monotonic() - t0
    assert not alive(joiner)
    exit_ev = [e for e in job.events(event="worker_exit") if e["worker"] == 1][-1]
    assert exit_ev["pid"] == joiner and exit_ev["fenced"] and exit_ev["signal"] == signal.SIGKILL
    assert not exit_ev["clean"] and exit_ev["reason"]["how"] == "startup_silent"
    assert [e["join"] for e in job.events(event="worker_start") if e["worker"] == 1] == [False, True, True]
    time.sleep(2 * LIVENESS_S)
    assert beating(job, 1, third) and len(fences(job, 1)) == 1, "a joiner that beats may wait to be admitted"
    assert not fences(job, 0) and alive(pids[0]), "a member of the view is its peers' to judge"
    os.kill(pids[0], signal.SIGCONT)
    print(f"joiner stopped -> fenced in {took:.2f} s, new incarnation beating after {back:.2f} s")
    job.store.set_done()
    assert agent.wait(timeout=15) == 0


def test_worker_that_never_beats_is_fenced_at_the_deadline(job: Job) -> None:
    deadline_s = 7.0  # above a stand-in's start-up (it imports torch: 1-1.5 s alone, 3-4 s loaded)
    agent = job.agent("--startup-liveness-s", str(LIVENESS_S), "--startup-deadline-s", str(deadline_s))
    pids = job.started(0, 1)
    os.kill(pids[1], signal.SIGKILL)
    joiner = new_pid(job, 1, pids[1])
    os.kill(joiner, signal.SIGSTOP)  # still importing: it never beats
    t0 = time.monotonic()
    took = until(lambda: fences(job, 1), 120.0, poll_s=0.01)
    # Never before the deadline, by the agent's own clock since the start (how late it looks is the machine's).
    reason = fences(job, 1)[0]["reason"]
    assert reason["how"] == "startup_deadline" and reason["limit_s"] == deadline_s
    assert reason["waited_s"] >= deadline_s, reason
    # A later incarnation beats (on a machine slow enough to miss the deadline again, a later one still).
    until(lambda: job.pid(1) not in (None, joiner) and beating(job, 1, job.pid(1)), 120.0)  # type: ignore[arg-type]
    print(f"silent joiner fenced after {took:.2f} s; next one beating after {time.monotonic() - t0:.2f} s")
    job.store.set_done()
    assert agent.wait(timeout=15) == 0


def test_stopped_standby_is_replaced_and_takes_the_next_worker(job: Job) -> None:
    agent = job.agent("--standby", "--startup-liveness-s", str(LIVENESS_S))
    pids = job.started(0, 1)
    until(lambda: job.store.standby_ready_pid(0) is not None, 20.0)
    first = int(job.store.standby_ready_pid(0))
    os.kill(first, signal.SIGSTOP)
    t0 = time.monotonic()
    killed = until(lambda: not alive(first), 60.0, poll_s=0.01)  # SIGKILLed and reaped by the agent's loop
    until(lambda: job.store.standby_ready_pid(0) not in (None, str(first)), 60.0)
    ready = time.monotonic() - t0
    second = int(job.store.standby_ready_pid(0))
    assert alive(second) and int((job.run_dir / "pids" / "standby0").read_text()) == second
    os.kill(pids[0], signal.SIGKILL)
    until(lambda: job.events(event="standby_assign"), 60.0)
    assign = job.events(event="standby_assign")[0]
    assert assign["worker"] == 0 and assign["pid"] == second
    until(lambda: beating(job, 0, second), 60.0)
    print(f"stopped standby killed after {killed:.2f} s; its successor ready after {ready:.2f} s")
    job.store.set_done()
    assert agent.wait(timeout=15) == 0


def test_agent_loop_never_waits_for_a_stopped_standby(job: Job) -> None:
    liveness_s = 2.0  # above OFFER_SILENCE_S: a silent standby is first refused offers, then replaced
    agent = job.agent("--standby", "--startup-liveness-s", str(liveness_s), wpn=3,  # worker 2 keeps the job alive
                      env={"STANDIN_STANDBY_IGNORES_SIGTERM": "1"})  # waiting for its exit would block
    pids = job.started(0, 1, 2)
    until(lambda: job.store.standby_ready_pid(0) is not None, 20.0)
    with agent_beats(job) as gaps:
        # An offer to a standby stopped just now: retracted after CLAIM_TIMEOUT_S, the worker spawned afresh.
        first = int(job.store.standby_ready_pid(0))
        os.kill(first, signal.SIGSTOP)
        t0 = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        fresh0 = new_pid(job, 0, pids[0], timeout_s=60.0)
        spawned = time.monotonic() - t0
        # Spawned once the claim timed out (the agent's own word below); how soon after depends on the machine's
        # load: that the agent's loop never stood still meanwhile is what the heartbeat gaps assert.
        assert fresh0 != first and spawned >= CLAIM_TIMEOUT_S
        until(lambda: not alive(first), 60.0)
        assert f"standby pid {first} did not claim worker 0" in job.output(agent)
        # A standby silent for longer than OFFER_SILENCE_S is offered nothing, then replaced.
        until(lambda: job.store.standby_ready_pid(0) not in (None, str(first)), 60.0)
        second = int(job.store.standby_ready_pid(0))
        os.kill(second, signal.SIGSTOP)
        time.sleep(OFFER_SILENCE_S + 0.2)
        os.kill(pids[1], signal.SIGKILL)
        fresh1 = new_pid(job, 1, pids[1], timeout_s=60.0)
        # No offer: an offer would have waited CLAIM_TIMEOUT_S for the claim, and said so, before spawning.
        assert fresh1 != second
        assert f"standby pid {second} did not claim" not in job.output(agent), "no offer to a silent standby"
        until(lambda: not alive(second), 60.0)
    assert not job.events(event="standby_assign")
    starts = [e for e in job.events(event="worker_start") if e["incarnation"] == 2]
    assert sorted(e["worker"] for e in starts) == [0, 1] and not any(e["standby"] for e in starts)
    # A loop that waited for the stopped standby's claim would stand still for CLAIM_TIMEOUT_S at least.
    assert max(gaps) < CLAIM_TIMEOUT_S, f"the agent's heartbeat stood still for {max(gaps):.3f} s"
    print(f"agent heartbeat: {len(gaps)} beats, longest gap {max(gaps) * 1000:.0f} ms "
          f"(median {sorted(gaps)[len(gaps) // 2] * 1000:.0f} ms)")
    job.store.set_done()
    assert agent.wait(timeout=15) == 0


def running(pid: int) -> bool:
    """``pid`` runs (a zombie, dead and not reaped yet, does not: ``os.kill(pid, 0)`` would say it does)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_worker_offered_to_the_standby_is_not_started_again_by_a_restore(job: Job) -> None:
    """Worker 0 dies and is handed to the standby; before the standby claims it (the claim is held back by a
    gate), a whole-job restore publishes a view naming worker 0. The agent withdraws the offer before it
    starts worker 0 for the restored view, so the standby, let through after that, claims nothing: worker 0
    has exactly one process, the one the agent records (two would both enter the view, and the unrecorded one
    would never be fenced or stopped)."""
    gate = job.run_dir / "claim_gate"
    agent = job.agent("--standby", "--restart", "on-failure", env={"STANDIN_STANDBY_CLAIM_GATE": str(gate)})
    pids = job.started(0, 1)
    until(lambda: job.store.standby_ready_pid(0) is not None, 20.0)
    standby = int(job.store.standby_ready_pid(0))
    os.kill(pids[0], signal.SIGKILL)
    until(lambda: job.store.backend.get("standby/0/assign").startswith(b"{"), 20.0, poll_s=0.001)  # offer pending
    job.store.clear_dead(0)  # as the restoring agent does, then the restored view
    job.store.propose(job.store.view(0), View(gen=1, members=(0, 1), step=0, reason="restored (test)",
                                              restore={"source": "memory", "step": 0}))

    def starts() -> list[dict]:
        return [e for e in job.events(event="worker_start") if e["worker"] == 0]

    # Either the agent withdrew the offer, or (before) it started worker 0 beside the pending offer; had the
    # claim timed out first, the agent spawned worker 0 afresh, once.
    until(lambda: job.events(event="standby_withdrawn") or len(starts()) >= 2, 20.0)
    gate.touch()

    def settled() -> bool:
        recorded = job.pid(0)
        return (job.store.backend.get("standby/0/assign") == b"" and recorded is not None
                and (job.run_dir / "standin" / f"w0.{recorded}.json").exists())

    until(settled, 20.0)
    until(lambda: job.events(event="standby_assign") or job.events(event="standby_withdrawn")
          or "did not claim worker 0" in job.output(agent), 20.0)
    # Every process started as worker 0 (the agent's starts, and the stand-ins that say they are worker 0)
    records = [json.loads(p.read_text())["pid"] for p in (job.run_dir / "standin").glob("w0.*.json")]
    live = sorted({pid for pid in records + [e["pid"] for e in starts()] if running(pid)})
    assert live == [job.pid(0)], f"worker 0 has processes {live}, its agent records {job.pid(0)}"
    assert running(pids[1]) and job.pid(1) == pids[1], "worker 1 was never stopped"
    (withdrawn,) = job.events(event="standby_withdrawn") or [None]
    if withdrawn is not None:  # the usual order: the standby stays one, unassigned
        assert withdrawn["gen"] == 1 and not withdrawn["claimed"]
        assert running(standby) and job.store.standby_ready_pid(0) == str(standby)
        (restart,) = [e for e in starts() if e["incarnation"] == 2]
        assert restart["pid"] == job.pid(0) and not restart["standby"]
        assert "--restore-gen" in json.loads((job.run_dir / "standin" / f"w0.{job.pid(0)}.json").read_text())["argv"]
    job.store.set_done()
    assert agent.wait(timeout=15) == 0

