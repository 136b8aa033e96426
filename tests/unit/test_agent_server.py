"""The agents' fork server (:mod:`unbroken.agent.agent_server`): real forks, real exit statuses."""

from __future__ import annotations

import os
import sys

import pytest

from unbroken.agent.agent_server import AgentServer
from unbroken.store.backend import SECRET_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")


def test_an_agent_forked_by_the_server_runs_as_asked_and_its_exit_is_reported(tmp_path):
    server = AgentServer()
    try:
        assert server.ready and server.alive()
        log = tmp_path / "agent0.log"
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        # The agent gets the environment asked for, not the server's: without the job's secret (and none in
        # the empty run directory) it refuses to start, with exit 2, as a fresh `python -m
        # unbroken.agent.command` would.
        agent = server.spawn(["--node-rank", "0", "--nnodes", "1", "--workers-per-node", "1", "--store",
                              "127.0.0.1:1", "--run-dir", str(tmp_path / "run")], log=log, env=env)
        assert agent is not None and agent.pid != server.proc.pid
        assert agent.wait(timeout=60) == 2 and agent.poll() == 2
        text = log.read_text()
        assert text.startswith("unbroken agent: node 0: no job secret"), text
        bad = server.spawn(["--no-such-option"], log=log, env=env)
        assert bad is not None and bad.wait(timeout=60) == 2
        assert "error: the following arguments are required: --nnodes" in log.read_text()
    finally:
        server.close()
    assert not server.alive() and server.proc.returncode == 0, "closing its input ends the server"
