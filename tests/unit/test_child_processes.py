"""How an agent's children live and die: armed by themselves to die with it, adopted when forked, reaped.

Each case runs a small "agent" in a process of its own (making pytest's own
process a subreaper, or killing it, is not an option): real forks, real
signals, real ``prctl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from unbroken.agent._process import PARENT_ENV
from unbroken.agent.template import fork_worker, thread_count

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")


def _python(code: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, **kw)  # type: ignore[call-overload]


def _gone(pid: int) -> bool:
    """Dead (or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_child_whose_agent_is_already_gone_exits_at_once():
    env = {**os.environ, PARENT_ENV: "1"}  # pid 1 is never this child's parent here
    got = _python("""
        from unbroken.agent._process import die_with_parent
        die_with_parent()
        print("still running")
    """, env=env)
    assert got.returncode == 1 and got.stdout == ""


def test_a_spawned_child_dies_with_its_agent(tmp_path):
    log = tmp_path / "child.log"
    agent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from unbroken.agent._process import spawn
        child = spawn([sys.executable, "-c",
                       "from unbroken.agent._process import die_with_parent; die_with_parent(); "
                       "import time; print('armed', flush=True); time.sleep(120)"],
                      log=Path(sys.argv[1]), header="child")
        print(child.pid, flush=True)
        time.sleep(120)
    """), str(log)], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None
        child = int(agent.stdout.readline())
        deadline = time.monotonic() + 30
        while "armed" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "armed" in log.read_text()
    finally:
        agent.kill()
        agent.wait()
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _gone(child), "the child outlived its SIGKILLed agent"


def test_a_grandchild_is_adopted_and_reaped_with_its_exit_status():
    # The template's way: an intermediate forks the worker and exits; the subreaper reaps the worker.
    got = _python("""
        import os, time
        from unbroken.agent._process import ForkedChild, become_subreaper
        assert become_subreaper()
        agent = os.getpid()
        r, w = os.pipe()
        mid = os.fork()
        if mid == 0:
            pid = os.fork()
            if pid == 0:
                while os.getppid() != agent:  # reparented once the intermediate exits
                    time.sleep(0.001)
                os._exit(7)
            os.write(w, str(pid).encode())
            os._exit(0)
        os.close(w)
        os.waitpid(mid, 0)
        child = ForkedChild(int(os.read(r, 32)), ["worker"])
        print(child.wait(timeout=30), child.poll())
    """)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["7", "7"]


def test_the_template_never_forks_with_threads(tmp_path):
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert thread_count() >= 2
        with pytest.raises(RuntimeError, match=r"not fork-safe \([0-9]+ threads\)"):
            fork_worker(["--worker", "0"], str(tmp_path / "w0.log"), os.getpid(), None, [])
    finally:
        stop.set()
        t.join()


def test_the_agent_forks_its_template_only_while_it_runs_no_thread(tmp_path):
    """An agent's first template is a fork of the agent (it inherits the imports), named for ``ps``, its
    replies on a pipe, reaped by the agent; a process that runs a thread starts a fresh one instead."""
    got = _python(f"""
        import json, os, sys, threading, time
        from pathlib import Path
        from unbroken.agent.template_client import _fork_template
        cmd = [sys.executable, "-m", "unbroken.agent.template", "--run-dir", {str(tmp_path / "none")!r},
               "--world", "1", "--node-rank", "0"]
        log = Path({str(tmp_path / "template0.log")!r})
        proc = _fork_template(cmd, log)
        name = ""
        for _ in range(2000):  # it names itself right after the fork
            name = Path(f"/proc/{{proc.pid}}/comm").read_text().strip()
            if name == "unbroken-tmpl":
                break
            time.sleep(0.001)
        reply = json.loads(proc.stdout.readline())  # no config in that run directory: the job cannot start
        print(json.dumps({{"name": name, "reply": reply, "code": proc.wait(timeout=60)}}))
        stop = threading.Event()
        threading.Thread(target=stop.wait).start()
        print(_fork_template(cmd, log) is None)
        stop.set()
    """)
    assert got.returncode == 0, got.stderr
    first, fallback = got.stdout.splitlines()
    forked = json.loads(first)
    assert forked["name"] == "unbroken-tmpl" and forked["code"] == 2
    assert "config" in forked["reply"]["error"], forked
    assert fallback == "True", "a process with a thread never forks its template"
    assert (tmp_path / "template0.log").read_text().startswith("--- ")
