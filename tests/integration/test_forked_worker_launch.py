"""A worker forked from the template of an agent started by hand (``unbroken agent``, as under Slurm) pins the
launch its agent joined: the template forks before the agent connects to any store, so the launch id goes with
each fork request, and a forked worker pointed at a store of another launch of the job refuses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from unbroken.config import load_config
from unbroken.store.job_store import JobStore
from unbroken.store.backend import save_secret

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper is Linux's"),
              pytest.mark.timeout(240)]

SECRET = "the job's secret"

AGENT_BY_HAND = """
    import json, sys
    from pathlib import Path
    from unbroken.agent.command import prestart_template

    run_dir, ours, other = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    argv = ["--run-dir", str(run_dir), "--store", ours, "--node-rank", "0", "--nnodes", "1",
            "--workers-per-node", "1"]
    early = prestart_template(argv)  # as `unbroken agent` does: before the agent has connected to any store
    assert early is not None, "no template forked"

    import argparse
    from unbroken.agent._process import ForkedChild
    from unbroken.agent.agent import Agent
    from unbroken.agent.options import add_agent_args, options_from
    from unbroken.agent.template_client import Template

    ap = argparse.ArgumentParser()
    add_agent_args(ap)
    agent = Agent(options_from(ap.parse_args(argv)), template=early)
    agent.join_store()  # the agent's start: it connects to its store and learns the launch
    # as the agent's start does once it has its event log and deadline: its template, around the early one
    agent.template = template = Template(run_dir=run_dir, node=0, world=1, ready_timeout_s=180, early=early)
    template.wait_ready(180, lambda: None)
    assert template.ready, "the template did not get ready"
    cmd = [sys.executable, "-m", "unbroken.agent.worker_process", "--run-dir", str(run_dir), "--worker", "0",
           "--world", "1", "--store", other]  # a store of another launch of the job at the worker's address
    child = agent.launch(cmd, log=run_dir / "logs" / "w0.log", header="worker 0")
    assert isinstance(child, ForkedChild), "not forked from the template"
    print(json.dumps({"code": child.wait(180), "launch": agent.store.launch}))
    template.close()
"""


def test_a_worker_forked_for_an_agent_started_by_hand_refuses_another_launchs_store(tmp_path: Path,
                                                                                    corpus_overrides: list[str]):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    cfg = load_config(preset_name="debug", overrides=[*corpus_overrides, "train.timeout_s=20"])
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_secret(run_dir, SECRET)
    ours = JobStore.host("127.0.0.1", 0, clients=2, secret=SECRET)
    other = JobStore.host("127.0.0.1", 0, clients=2, secret=SECRET)  # a later (or earlier) launch of the job
    try:
        before = dict(other.backend.server._data)
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(AGENT_BY_HAND), str(run_dir),
                               f"127.0.0.1:{ours.port}", f"127.0.0.1:{other.port}"],
                              capture_output=True, text=True, timeout=220, stdin=subprocess.DEVNULL,
                              # (the launcher tokenizes the corpus before any template starts; here the template
                              # does, and the tokenizer's own pool would keep it from forking)
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        assert done.returncode == 0, done.stderr[-3000:]
        got = json.loads(done.stdout.strip().splitlines()[-1])
        log = (run_dir / "logs" / "w0.log").read_text()
        assert got["launch"] == ours.launch
        assert got["code"] != 0, log[-3000:]
        assert f"serves launch {other.launch}, not this process's launch {ours.launch}" in log, log[-3000:]
        assert dict(other.backend.server._data) == before, "the worker wrote nothing to the other launch's store"
    finally:
        ours.close()
        other.close()
