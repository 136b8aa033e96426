"""Run one node's agent as a process: ``python -m unbroken.agent.command`` (or ``unbroken agent``).

The supervisor itself is :class:`unbroken.agent.agent.Agent`; this module owns
the process around it: arguments, logging, and SIGTERM/SIGINT, which stop the
agent and its workers.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any, Sequence

from unbroken.agent.agent import Agent, AgentError
from unbroken.agent.options import AgentOptions, add_agent_args, options_from


def run_agent(opts: AgentOptions, *, worker_cmd: Sequence[str] | None = None) -> int:
    """Run an agent in this process (main thread): SIGTERM/SIGINT stop it and its workers.

    Returns:
        0 when the job is done.
    Raises:
        AgentError: with the exit code and the reason; ValueError: bad options.
    """
    agent = Agent(opts, worker_cmd=worker_cmd)

    def on_signal(signum: int, frame: Any) -> None:
        agent.interrupted = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return agent.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None, *, worker_cmd: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m unbroken.agent.command``; returns the exit code."""
    ap = argparse.ArgumentParser(prog="python -m unbroken.agent.command", description=__doc__.splitlines()[0])
    add_agent_args(ap)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_agent(options_from(a), worker_cmd=worker_cmd)
    except AgentError as exc:
        print(f"unbroken agent: {exc}", file=sys.stderr)
        return exc.code
    except ValueError as exc:
        print(f"unbroken agent: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
