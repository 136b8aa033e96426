"""A node's template process: imported once, then forked into workers and standbys on demand.

``python -m unbroken.agent.template --run-dir RUN --world N --node-rank R``,
started by its agent (:mod:`unbroken.agent.template_client`). It imports torch and
unbroken, reads the run's config, loads the user's factory modules and, where
that is safe, prepares the data and the model (built-in data and model on a
CPU job: the same objects a warm standby prepares); then it answers, one JSON
line per request on its stdin, with one JSON line on its stdout:

- at start: ``{"ready": true, "pid": P, "prepared": bool, "phases": {...}, "cpu_s": C}``
  (``C``: the CPU seconds its start took, which its forks no longer spend); when it
  will not fork, ``"ready": false`` with ``why`` and ``thread_names`` (each
  thread's name, ``/proc/self/task/*/comm``: who started the thread that stops it),
  or ``{"error": "..."}`` and exit 2 when the job cannot start here (an import
  error in a factory module, a broken install): the agent fails the job once
  with that message instead of starting workers that would all die of it;
- ``{"argv": [...], "log": PATH, "env": {...}}`` -> ``{"pid": W}``: a worker
  (or standby) ``python -m unbroken.agent.worker_process ARGV`` now runs as
  process ``W``, its output appended to ``PATH``, with ``env`` added to the
  template's environment (the job secret and the launch id its store
  connections pin: the template may start before its agent has read the one
  and connected to learn the other); or ``{"error": "..."}`` (the agent then
  spawns a fresh process).

How a worker is made: the template forks an intermediate process, which forks
the worker and exits at once. The worker is reparented to the agent (a
subreaper, :func:`unbroken.agent._process.become_subreaper`), which reaps it
and reads its exit status as for any child; it never depends on the template,
whose death (or replacement) leaves its workers running. The worker starts its
own session, points stdin at ``/dev/null`` and stdout and stderr at its log,
arms :func:`unbroken.agent._process.die_with_parent` for its agent, and runs the
worker's entry point with what the template prepared.

Invariants: the template has exactly one thread whenever it forks (checked
before every fork; it refuses otherwise): no thread pool of torch, OpenMP or
OpenBLAS, no CUDA context, no process group, no store connection; it exits when
its agent closes its stdin or dies. It calls no ``torch.cuda`` function but
``is_initialized`` (which reads a flag): what it prepares is decided from the
config's ``train.device`` string alone (:func:`unbroken.models.factory.device_kind`;
on a CUDA build ``is_available`` loads NVML or the driver, which start threads),
and a CUDA job's worker resolves and binds its GPU after the fork.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

from unbroken.agent._process import die_with_parent, set_name

# Before numpy loads: OpenBLAS starts its thread pool at import, and a process that forks must have none.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# torch.cuda.is_available() through NVML: it never initialises the CUDA driver, which a fork cannot inherit.
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"

STALL_DUMP_S = 1.5
"""A forked worker that has not logged its first line this long after the fork dumps its stacks to its log."""
REPARENT_TIMEOUT_S = 5.0
"""A forked worker waits at most this long for its intermediate parent to exit."""


def thread_count() -> int:
    """Threads of this process, native ones included (``/proc``; 1 where it cannot be read)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def thread_names() -> list[str]:
    """The name of each thread of this process (``/proc/self/task/*/comm``, by thread id; empty where ``/proc``
    cannot be read): a refusal to fork names them, so a thread that a new image's library starts is found."""
    names = []
    try:
        tids = sorted(os.listdir("/proc/self/task"), key=int)
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return names


def fork_unsafe() -> str | None:
    """Why forking this process now would be unsafe (threads beside this one; a CUDA context, which a child
    cannot use), or None."""
    if (n := thread_count()) != 1:
        return f"{n} threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # never initialises CUDA itself
        return "CUDA initialised"
    return None


def _reply(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _prepare(run_dir: Path) -> tuple[Any, dict[str, float]]:
    """Import everything a worker needs; prepare its data and model where safe. Raises what a worker would."""
    phases: dict[str, float] = {}
    t = time.perf_counter()
    import torch
    import torch._dynamo  # noqa: F401 (imported by every optimizer's constructor: ~1 s, with sympy)

    import unbroken.agent.worker_process  # noqa: F401 (the worker's whole import graph)
    from unbroken.job.builder import prepare
    from unbroken.job.references import resolve_all
    from unbroken.models.factory import device_kind
    from unbroken.runtime.worker_entry import read_run_config

    phases["imports"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    # not load_run_config: it sets the worker's intra-op threads, and more than one starts torch's pool (one
    # thread per extra core: a job of one worker per node lost its template to it); each forked worker sets its own
    cfg = read_run_config(run_dir)
    resolve_all(cfg)  # a factory module that does not load fails here, once, with its line
    phases["config"] = round(time.perf_counter() - t, 3)
    prepared = None
    builtin = not cfg.data.factory and cfg.model.family != "custom"
    # From the config's string alone: resolving a CUDA device here would start NVML's or the driver's threads,
    # and the template could not fork (a CUDA job's worker resolves and binds its GPU after the fork)
    if builtin and device_kind(cfg.train.device) == "cpu":
        t = time.perf_counter()
        torch.set_num_threads(1)  # no intra-op pool in a process that forks; each worker sets its own
        prepared = prepare(cfg, torch.device("cpu"))
        phases["prepare"] = round(time.perf_counter() - t, 3)
    return prepared, phases


def _become_worker(argv: list[str], log: str, agent: int, intermediate: int, prepared: Any,
                   closing: list[int]) -> None:
    """In the forked worker: detach from the template, wait to be the agent's child, run the worker."""
    code = 1
    try:
        os.setsid()
        set_name("unbroken-worker")
        for fd in closing:
            os.close(fd)
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        # Where a start that stalls stands (its log gets every thread's stack; cancelled once the worker logs).
        faulthandler.dump_traceback_later(STALL_DUMP_S, exit=False)
        deadline = time.monotonic() + REPARENT_TIMEOUT_S
        while os.getppid() == intermediate and time.monotonic() < deadline:
            time.sleep(0.0005)
        die_with_parent(agent)  # exits unless the agent is now the parent
        from unbroken.agent import worker_process

        worker_process.main(argv, forked=True, prepared=prepared)  # ends with os._exit
    except SystemExit as exc:  # as a fresh process would exit (a joiner that finds the job finished: 0)
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def fork_worker(argv: list[str], log: str, agent: int, prepared: Any, closing: list[int],
                env: dict[str, str] | None = None) -> int:
    """Fork a worker (module docstring) and return its pid. Raises OSError when a fork fails."""
    if (why := fork_unsafe()) is not None:
        raise RuntimeError(f"the template is not fork-safe ({why})")
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        try:
            os.close(r)
            me = os.getpid()  # not the worker's getppid(): by the time it asks, this process may have exited
            pid = os.fork()   # and the worker been reparented to the agent, which it would then wait to leave
            if pid == 0:
                os.close(w)
                os.environ.update(env or {})
                _become_worker(argv, log, agent, me, prepared, closing)
            os.write(w, f"{pid}\n".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        text = fh.read()
    os.waitpid(intermediate, 0)
    if not text.strip().isdigit():
        raise RuntimeError("the intermediate process did not report the worker's pid")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m unbroken.agent.template")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--node-rank", type=int, default=0)
    a = ap.parse_args(argv)
    agent = os.getppid()
    die_with_parent()
    # Replies go to a private copy of stdout; anything else printed (by a user's module) goes to the log.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(reply_fd, "w")
    try:
        prepared, phases = _prepare(a.run_dir)
    except Exception as exc:  # the job cannot start on this node: say why, once
        traceback.print_exc()
        message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        _reply(out, {"error": message})
        return 2
    why = fork_unsafe()
    names = thread_names() if why is not None else []
    _reply(out, {"ready": why is None, "pid": os.getpid(), "threads": thread_count(), "why": why,
                 **({"thread_names": names} if why is not None else {}),
                 "prepared": prepared is not None, "phases": phases, "cpu_s": round(time.process_time(), 3)})
    if why is not None:
        print(f"template: {why} after start-up ({', '.join(names) or 'names unknown'}): it will not fork",
              file=sys.stderr, flush=True)
        return 2
    for line in sys.stdin:
        try:
            request = json.loads(line)
            env = {str(k): str(v) for k, v in request.get("env", {}).items()}
            pid = fork_worker([str(x) for x in request["argv"]], str(request["log"]), agent, prepared,
                              [reply_fd], env)
        except Exception as exc:  # the agent spawns a fresh process instead
            _reply(out, {"error": f"{type(exc).__name__}: {exc}"})
            continue
        _reply(out, {"pid": pid})
    return 0


if __name__ == "__main__":
    sys.exit(main())
