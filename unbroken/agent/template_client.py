"""The agent's side of its node's template process (:mod:`unbroken.agent.template`).

The agent starts the template once its job's config is known, waits for it to
be ready before it starts its first workers (a start-up error there, such as
an import error in a user's factory module, fails the job once, with that
error), then starts every worker and standby by asking the template to fork
one (:meth:`Template.launch`): a cold start costs a fork instead of an
interpreter, the imports, the data and the model.

Supervision: a template that dies, hangs on a request or is not ready within
the start-up deadline is SIGKILLed and replaced after ``RESPAWN_INTERVAL_S``;
after ``MAX_FAILURES`` the node starts its workers as fresh processes for the
rest of its life. Whenever no ready template is there, a start falls back to a
fresh process (:func:`unbroken.agent._process.spawn`): no start ever waits for
a template, except the node's first.

Invariants: the agent reads the template's replies only with a deadline (a
template that hangs costs at most ``REPLY_TIMEOUT_S`` once); a worker forked
from the template is the agent's child (the agent is a subreaper), so it is
reaped, signalled and judged exactly as a spawned one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence

from unbroken.agent._job_error import is_data_error
from unbroken.agent._process import (PARENT_ENV, Child, ForkedChild, LineBuffer, child_env, close_pipes, describe_exit,
                                     log_line, run_forked, send, set_name, spawn)

logger = logging.getLogger(__name__)

REPLY_TIMEOUT_S = 5.0
"""A fork request not answered in this long: the template is hung (it is replaced)."""
RESPAWN_INTERVAL_S = 2.0
"""Least time between two template starts."""
MAX_FAILURES = 3
"""Templates that died or hung before the node gives up on them (fresh processes from then on)."""


class _ForkedTemplate(ForkedChild):
    """A template forked from its agent: :class:`ForkedChild` (its own child) with the request and reply pipes."""

    def __init__(self, pid: int, args: Sequence[str], stdin: BinaryIO, stdout: BinaryIO) -> None:
        super().__init__(pid, args)
        self.stdin, self.stdout = stdin, stdout


def _fork_template(cmd: list[str], log: Path) -> _ForkedTemplate | None:
    """Fork the template from this process (the agent's, early in its life): it inherits the agent's imports,
    so its own start costs only what a worker needs beyond them (about 0.5 CPU-s instead of 2.5 on two
    cores). None, and a fresh interpreter instead, where a fork would be unsafe: the process already runs a
    thread (a fork must copy no lock another thread holds)."""
    from unbroken.agent.template import thread_count

    if thread_count() != 1:
        logger.info("the agent runs %d threads: its template starts as a fresh process", thread_count())
        return None
    log_line(log, "template forked from its agent: " + " ".join(cmd))
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    agent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the template: as the fresh one would be, with the agent's modules already imported
        def body() -> int:
            os.setsid()
            set_name("unbroken-tmpl")
            err = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            os.dup2(requests_r, 0)
            os.dup2(replies_w, 1)
            os.dup2(err, 2)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            os.environ.update({"OPENBLAS_NUM_THREADS": "1", PARENT_ENV: str(agent)})
            from unbroken.agent import template

            return template.main(cmd[3:])

        run_forked(body)
    os.close(requests_r)
    os.close(replies_w)
    return _ForkedTemplate(pid, cmd, os.fdopen(requests_w, "wb"), os.fdopen(replies_r, "rb"))


class TemplateFailed(RuntimeError):
    """The template says the job cannot start on this node (its message is the reason)."""


TemplateProc = subprocess.Popen[bytes] | _ForkedTemplate


def _command(run_dir: Path, node: int, world: int) -> list[str]:
    return [sys.executable, "-m", "unbroken.agent.template", "--run-dir", str(run_dir), "--world", str(world),
            "--node-rank", str(node)]


def _log(run_dir: Path, node: int) -> Path:
    # A spare node's template is named by its agent until the spare takes a node's rank.
    return run_dir / "logs" / (f"template{node}.log" if node >= 0 else f"template-spare{os.getpid()}.log")


def _start_process(cmd: list[str], log: Path, node: int, *, fork: bool) -> TemplateProc:
    """The template's process: with ``fork``, a fork of this (the agent's) process, which has imported torch and
    unbroken already, when it runs no thread yet; else a fresh interpreter."""
    proc: TemplateProc | None = _fork_template(cmd, log) if fork else None
    if proc is None:
        log_line(log, f"node {node} template: " + " ".join(cmd))
        with log.open("ab") as fh:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fh,
                                    start_new_session=True, env=child_env({**os.environ, "OPENBLAS_NUM_THREADS": "1"}))
    logger.info("[node %d] template started (pid %d%s)", node, proc.pid,
                ", forked from the agent" if isinstance(proc, _ForkedTemplate) else "")
    return proc


def _stop_process(proc: TemplateProc) -> None:
    """SIGKILL a template (it holds nothing), reap it, close its pipes."""
    send(proc, signal.SIGKILL)  # type: ignore[arg-type]  # a _ForkedTemplate has what send uses
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        pass
    close_pipes(proc)  # type: ignore[arg-type]


class EarlyTemplate:
    """A node's template process started with its agent's process (:func:`unbroken.agent.command.
    prestart_template`), before the agent has an event log or a start-up deadline: the agent builds its
    :class:`Template` around it once it has them (``Template(..., early=...)``), or stops it."""

    def __init__(self, *, run_dir: Path, node: int, world: int) -> None:
        self.run_dir, self.node, self.world = run_dir, node, world
        self.cmd, self.log = _command(run_dir, node, world), _log(run_dir, node)
        self.started = time.monotonic()
        self.proc: TemplateProc | None = _start_process(self.cmd, self.log, node, fork=True)

    def take_rank(self, node: int) -> None:
        """A spare's template: its agent took node ``node``'s rank."""
        self.node = node

    def hand_over(self) -> TemplateProc | None:
        """Its process, for the agent's :class:`Template` to own from now on (this one forgets it)."""
        proc, self.proc = self.proc, None
        return proc

    def close(self) -> None:
        """Stop it (the job wants no template after all, or the agent leaves first)."""
        if self.proc is not None:
            _stop_process(self.proc)
            self.proc = None


class Template:
    """One node's template process, as its agent sees it.

    Args:
        run_dir, node, world: the job's run directory, this node's rank (-1: a spare's), the job's workers.
        event: the agent's event writer (``event(name, worker, **fields)``).
        ready_timeout_s: the longest a template may take to get ready before it is replaced.
        early: the template started with the agent's process, taken over (None: :meth:`start` one).
    """

    def __init__(self, *, run_dir: Path, node: int, world: int,
                 event: Callable[..., None] = lambda *args, **fields: None, ready_timeout_s: float = 300.0,
                 early: EarlyTemplate | None = None) -> None:
        self.run_dir, self.node, self.world = run_dir, node, world
        self._event, self.ready_timeout_s = event, ready_timeout_s
        self.cmd = early.cmd if early is not None else _command(run_dir, node, world)
        self.log = early.log if early is not None else _log(run_dir, node)
        self.proc: TemplateProc | None = early.hand_over() if early is not None else None
        self.ready = False
        self.enabled = True
        self.failures = 0
        self.forks = 0
        self._started = early.started if early is not None else 0.0
        self._lost_at = 0.0
        self._lines = LineBuffer()
        self._fork_error: str | None = None  # the error the last forked worker that failed died of
        if self.proc is not None:
            logger.info("[node %d] template started with the agent (pid %d)", self.node, self.proc.pid)

    # -- lifecycle ------------------------------------------------------------------

    def take_rank(self, node: int) -> None:
        """A spare's template: its agent took node ``node``'s rank (its log lines name that node from now on)."""
        self.node = node

    def start(self, now: float, *, fork: bool = False) -> None:
        """Start the template: with ``fork``, as a fork of this (the agent's) process, which has imported
        torch and unbroken already, when it runs no thread yet; else as a fresh interpreter."""
        self._lines, self.ready, self._started = LineBuffer(), False, now
        self.proc = _start_process(self.cmd, self.log, self.node, fork=fork)

    def wait_ready(self, timeout_s: float, beat: Callable[[], None]) -> None:
        """The node's first start: wait (beating) until the template is ready, dead or late.

        Raises:
            TemplateFailed: the template could not import or load the job (its error).
        """
        deadline = time.monotonic() + timeout_s
        while self.proc is not None and not self.ready and time.monotonic() < deadline:
            beat()
            self._check(time.monotonic(), wait_s=0.05)
        if self.proc is not None and not self.ready:
            self._lost(f"not ready within {timeout_s:.0f} s")

    def tick(self, now: float) -> None:
        """Notice readiness or death; replace a dead template. Never waits."""
        if self.proc is not None:
            self._check(now, wait_s=0.0)
            if self.proc is not None and not self.ready and now - self._started > self.ready_timeout_s:
                self._lost(f"not ready within {self.ready_timeout_s:.0f} s")
        elif self.enabled and now - self._lost_at >= RESPAWN_INTERVAL_S:
            self.start(now)

    def forked_failed(self, error: str) -> None:
        """A worker forked from the template died of an error of its own before it was admitted (``error``: its
        signature, :func:`unbroken.agent._job_error.death_error`). The same error twice in a row from forked workers:
        the fork itself may be the cause (a library that cannot start in a forked child), so the node starts
        its workers as fresh processes from now on. An error of the job's own recurs there, and the job's
        handling of it goes on as before. An error about the data a worker read (damaged snapshot memory:
        :func:`~unbroken.agent._job_error.is_data_error`) says nothing about the fork and is not counted."""
        if is_data_error(error):
            logger.info("[node %d] a forked worker failed on the data it read (%s): the template is kept",
                        self.node, error)
            return
        if error != self._fork_error:
            self._fork_error = error
            return
        if not self.enabled:
            return
        self.enabled = False
        why = f"two forked workers failed alike ({error})"
        logger.error("[node %d] %s: workers start as fresh processes from now on", self.node, why)
        if self.proc is not None:
            self._lost(why)
        else:
            self._event("template_lost", None, pid=None, why=why)

    def close(self) -> None:
        """Stop the template (it holds nothing: SIGKILL) and reap it."""
        self.enabled = False
        if self.proc is not None:
            self._stop()

    # -- starting a worker ----------------------------------------------------------------

    def launch(self, cmd: Sequence[str], *, log: Path, header: str, env: dict[str, str]) -> Child:
        """Start ``cmd`` (a worker's or standby's command): forked from the template when it is ready,
        else a fresh process. ``env``: what the child's environment must hold beyond the template's (which
        is the agent's when the template started)."""
        child = self._fork(list(cmd), log, header, env) if self.ready else None
        return child if child is not None else spawn(cmd, log=log, header=header)

    def _fork(self, cmd: list[str], log: Path, header: str, env: dict[str, str]) -> ForkedChild | None:
        assert self.proc is not None and self.proc.stdin is not None
        args = _worker_args(cmd)
        if args is None:
            return None
        log_line(log, header + " (forked from the template)")
        try:
            self.proc.stdin.write((json.dumps({"argv": args, "log": str(log), "env": env}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            self._lost(f"did not take a request ({exc})")
            return None
        reply = self._read(REPLY_TIMEOUT_S)
        if reply is None:
            self._lost(f"did not answer a fork request within {REPLY_TIMEOUT_S:.0f} s" if self.proc.poll() is None
                       else f"died ({describe_exit(self.proc.returncode or 0)})")
            return None
        if "pid" not in reply:
            logger.warning("[node %d] the template could not fork (%s): starting a fresh process", self.node,
                           reply.get("error"))
            return None
        self.forks += 1
        return ForkedChild(int(reply["pid"]), cmd)

    # -- internals ----------------------------------------------------------------------

    def _check(self, now: float, *, wait_s: float) -> None:
        assert self.proc is not None
        if not self.ready:
            reply = self._read(wait_s)
            if reply is not None:
                self._on_start(reply)
                return
        if self.proc is not None and self.proc.poll() is not None:
            self._lost(f"died ({describe_exit(self.proc.returncode or 0)})")

    def _on_start(self, reply: dict[str, Any]) -> None:
        assert self.proc is not None
        if "error" in reply:
            message = str(reply["error"])
            self._event("template_failed", None, pid=self.proc.pid, error=message)
            self.close()
            raise TemplateFailed(message)
        if not reply.get("ready"):
            names = ", ".join(str(n) for n in reply.get("thread_names") or []) or "names unknown"
            self._lost(f"not fork-safe ({reply.get('why') or str(reply.get('threads')) + ' threads'} after its start: "
                       f"{names})")
            self.enabled = False  # it would be the same next time
            return
        self.ready = True
        self._event("template_ready", None, pid=self.proc.pid, prepared=bool(reply.get("prepared")),
                    phases=reply.get("phases", {}), cpu_s=reply.get("cpu_s"))
        logger.info("[node %d] template ready (pid %d, %s)", self.node, self.proc.pid,
                    ", ".join(f"{k} {v:.2f} s" for k, v in reply.get("phases", {}).items()))

    def _lost(self, what: str) -> None:
        assert self.proc is not None
        self.failures += 1
        self.ready = False
        logger.warning("[node %d] template pid %d %s: workers start as fresh processes until it is replaced",
                       self.node, self.proc.pid, what)
        self._event("template_lost", None, pid=self.proc.pid, why=what)
        self._stop()
        self._lost_at = time.monotonic()
        if self.failures >= MAX_FAILURES and self.enabled:
            self.enabled = False
            logger.error("[node %d] %d templates lost: workers start as fresh processes from now on (see "
                         "logs/template%d.log)", self.node, self.failures, self.node)

    def _stop(self) -> None:
        """SIGKILL the template (it holds nothing), reap it, close its pipes."""
        assert self.proc is not None
        _stop_process(self.proc)
        self.proc = None

    def _read(self, timeout_s: float) -> dict[str, Any] | None:
        """One reply line, or None when none came within ``timeout_s`` (or the template closed its end)."""
        assert self.proc is not None and self.proc.stdout is not None
        line = self._lines.line(self.proc.stdout.fileno(), timeout_s)
        if line is None:
            return None
        try:
            reply = json.loads(line)
        except ValueError:
            return {"error": f"unreadable reply {line[:200]!r}"}
        return reply if isinstance(reply, dict) else {"error": f"unreadable reply {line[:200]!r}"}


def _worker_args(cmd: list[str]) -> list[str] | None:
    """The arguments after ``python -m unbroken.agent.worker_process`` (None: not that command)."""
    prefix = [sys.executable, "-m", "unbroken.agent.worker_process"]
    return cmd[len(prefix):] if cmd[:len(prefix)] == prefix else None
