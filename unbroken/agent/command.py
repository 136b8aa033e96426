"""Run one node's agent as a process: ``python -m unbroken.agent.command`` (or ``unbroken agent``).

The supervisor itself is :class:`unbroken.agent.agent.Agent`; this module owns
the process around it: arguments, logging, and signals: SIGINT stops the agent and
its workers; SIGTERM and SIGUSR1 stop the job with a final checkpoint (a second one at once).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from unbroken.agent._process import become_subreaper
from unbroken.agent.template_client import EarlyTemplate
from unbroken.monitor import watch_job

if TYPE_CHECKING:
    from unbroken.agent.options import AgentOptions


def prestart_template(argv: Sequence[str] | None) -> EarlyTemplate | None:
    """Start the node's template process as a fork of this one, once the agent's imports are done and before
    it starts a thread: the template imports only what a worker needs beyond the agent (its start costs a
    fifth of a fresh interpreter's CPU, and no later than one would be ready, whose imports are a superset).

    Only where the run directory already holds the job's config and it wants a template (a node whose
    run directory is filled from the store later starts its template once it has the config, as a fresh
    process: the agent runs threads by then).
    """
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--spare", action="store_true")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--workers-per-node", type=int, default=1)
    ap.add_argument("--from-slurm", action="store_true")
    try:
        a, _ = ap.parse_known_args(argv)
        cfg = json.loads((a.run_dir / "config.json").read_text()) if a.run_dir is not None else None
    except (OSError, ValueError, SystemExit):
        return None  # the real parser says what is wrong
    node = -1 if a.spare else a.node_rank
    if a.from_slurm:  # a task of srun: its index is the node rank, a spare's lies beyond --nnodes
        from unbroken.agent.slurm import SLURM_PROCID

        task = os.environ.get(SLURM_PROCID, "")
        if not task.isdigit():
            return None  # the real parser says what is wrong
        node = int(task) if int(task) < a.nnodes else -1
    if not isinstance(cfg, dict) or not cfg.get("fault", {}).get("template", True) or not become_subreaper():
        return None
    # OpenBLAS (loaded with numpy, by torch) starts a thread per core unless told otherwise, and a process
    # that forks must run none; the agent does no linear algebra. A user's own setting is kept (the template
    # then starts fresh).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import unbroken.agent.agent  # noqa: F401 (torch and the agent's modules, before the fork)

    return EarlyTemplate(run_dir=a.run_dir, node=node, world=a.nnodes * a.workers_per_node)


def run_agent(opts: AgentOptions, *, worker_cmd: Sequence[str] | None = None,
              template: EarlyTemplate | None = None) -> int:
    """Run an agent in this process (main thread): SIGINT stops it and its workers; the first SIGTERM or
    SIGUSR1 stops the job with a final checkpoint (:mod:`unbroken.agent.preemption`), a second one at once.

    Returns:
        0 when the job is done.
    Raises:
        AgentError: with the exit code and the reason; ValueError: bad options.
    """
    from unbroken.agent.agent import Agent

    agent = Agent(opts, worker_cmd=worker_cmd, template=template)

    def on_signal(signum: int, frame: Any) -> None:
        agent.interrupt(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        with watch_job(opts.run_dir, enabled=opts.host_store) as watch:  # under a scheduler node 0 runs the monitor
            code = agent.run()
            watch.end(finished=code == 0, message=f"node 0's agent exited with code {code}; see {opts.run_dir}/logs")
            return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None, *, worker_cmd: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m unbroken.agent.command``; returns the exit code."""
    template = None if worker_cmd else prestart_template(sys.argv[1:] if argv is None else argv)
    from unbroken.agent.agent import AgentError
    from unbroken.agent.options import add_agent_args, options_from

    ap = argparse.ArgumentParser(prog="python -m unbroken.agent.command", description=__doc__.splitlines()[0])
    add_agent_args(ap)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_agent(options_from(a), worker_cmd=worker_cmd, template=template)
    except AgentError as exc:
        print(f"unbroken agent: {exc}", file=sys.stderr)
        return exc.code
    except ValueError as exc:
        print(f"unbroken agent: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
