"""A child's death is known from the kill, not from the reap (:mod:`unbroken.agent._exit_watch`): real children,
real signals, real shared memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from unbroken.agent._exit_watch import exiting_returncode
from unbroken.agent._process import ForkedChild
from unbroken.agent._reaper import reap_dying, seen_exits
from unbroken.agent._supervision import Incarnation

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not os.path.isfile("/proc/self/stat"), reason="reads /proc/<pid>/stat")]

HOLDER = textwrap.dedent("""
    import mmap, os, sys, time
    path, size = sys.argv[1], int(sys.argv[2])
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, size)
    mem = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    for at in range(0, size, mmap.PAGESIZE):  # every page mapped: the teardown unmaps them all
        mem[at] = 1
    print("ready", flush=True)
    time.sleep(600)
""")


def _exited(pid: int) -> bool:
    """Whether the child can be reaped now (it is not reaped: WNOWAIT)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _zombie(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _exited(pid):
        assert time.monotonic() < deadline, f"child {pid} did not exit within {timeout_s} s"
        time.sleep(0.001)


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


def test_a_sigkilled_child_holding_shared_memory_is_seen_dead_no_later_than_it_can_be_reaped():
    segment = Path("/dev/shm") / f"unbroken-test-exit-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(segment), str(1 << 30)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        assert exiting_returncode(proc.pid) is None  # alive
        os.kill(proc.pid, signal.SIGKILL)
        t0, seen, reapable = time.perf_counter(), None, None
        while reapable is None:
            assert time.perf_counter() - t0 < 60, "the child never exited"
            if seen is None and (rc := exiting_returncode(proc.pid)) is not None:  # asked first, each turn
                seen = (time.perf_counter() - t0, rc)
            if _exited(proc.pid):
                reapable = time.perf_counter() - t0
        # Seen while the kernel still unmapped its gigabyte (or, at the latest, in the turn it became reapable).
        assert seen is not None and seen[1] == -signal.SIGKILL, seen
        assert seen[0] <= reapable, (seen, reapable)
        print(f"seen dying after {seen[0] * 1e3:.2f} ms, reapable after {reapable * 1e3:.2f} ms")
    finally:
        proc.kill()
        proc.wait(timeout=30)
        segment.unlink(missing_ok=True)


@pytest.mark.parametrize("how, code", [("kill", -signal.SIGKILL), ("exit", 3)])
def test_a_dead_child_not_yet_reaped_is_reported_with_its_status(how: str, code: int):
    proc = _child("import os, sys, time; sys.stdout.buffer.write(b'up\\n'); sys.stdout.flush(); "
                  + ("time.sleep(600)" if how == "kill" else "os._exit(3)"))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        if how == "kill":
            os.kill(proc.pid, signal.SIGKILL)
        _zombie(proc.pid)
        assert exiting_returncode(proc.pid) == code  # a zombie: dead, and not reaped (nobody waited for it)
        assert proc.wait(timeout=10) == code
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_running_stopped_and_cleanly_exited_children_are_not_reported_early():
    proc = _child("import sys, time; sys.stdout.buffer.write(b'up\\n'); sys.stdout.flush(); time.sleep(600)")
    clean = _child("pass")
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        assert exiting_returncode(proc.pid) is None
        os.kill(proc.pid, signal.SIGSTOP)  # a worker stopped by a fault is hung, not dead
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert exiting_returncode(proc.pid) is None
        _zombie(clean.pid)
        assert exiting_returncode(clean.pid) is None  # status 0: known only once reaped
        assert clean.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)


class _Reaper:
    """The agent's reaping alone (:func:`seen_exits`, then :func:`reap_dying`, as its reaper does each tick):
    what it records of each death."""

    def __init__(self, inc: Incarnation) -> None:
        self.workers = {inc.worker: inc}
        self.dying: list[tuple[Incarnation, float]] = []
        self.deaths: list[tuple[int, int, str]] = []
        self.events: list[dict[str, Any]] = []

    def reap(self, now: float) -> None:
        self.deaths += [(inc.worker, rc, seen) for inc, rc, seen in seen_exits(self.workers, self.dying, now)]
        reap_dying(self.dying, self._event)

    def _event(self, event: str, worker: int | None, **fields: Any) -> None:
        self.events.append({"event": event, "worker": worker, **fields})


class _NotReapableYet(ForkedChild):
    """A child whose reap the kernel holds back (a GPU worker's teardown) until ``release`` is set."""

    release = False

    def poll(self) -> int | None:
        return super().poll() if self.release else None


def test_the_agent_records_a_death_seen_dying_at_once_and_reaps_it_later():
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    proc = _NotReapableYet(pid, ["sleeper"])
    inc = Incarnation(worker=1, proc=proc, incarnation=2, join=False, started=time.monotonic(), mark_at_spawn=None)
    reaper = _Reaper(inc)
    try:
        reaper.reap(time.monotonic())
        assert reaper.deaths == [] and 1 in reaper.workers  # running
        os.kill(pid, signal.SIGKILL)
        _zombie(pid)  # dead; its reap held back
        reaper.reap(time.monotonic())
        assert reaper.deaths == [(1, -signal.SIGKILL, "exiting")] and reaper.workers == {}
        assert [d[0] for d in reaper.dying] == [inc] and reaper.events == []
        proc.release = True
        reaper.reap(time.monotonic())
        assert reaper.dying == [] and len(reaper.deaths) == 1  # recorded once
        assert [(e["event"], e["worker"], e["pid"]) for e in reaper.events] == [("worker_reaped", 1, pid)]
        assert reaper.events[0]["teardown_s"] >= 0 and proc.returncode == -signal.SIGKILL
    finally:
        if proc.returncode is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
