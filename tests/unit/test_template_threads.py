"""The node's template process stays one thread after it prepared a job, whatever threads a worker will use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.config import load_config

PROBE = r"""
import sys
from pathlib import Path
from unbroken.agent import template
prepared, phases = template._prepare(Path(sys.argv[1]))
print(template.thread_count(), prepared is not None)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.timeout(120)
def test_the_template_of_a_job_whose_workers_use_two_threads_is_still_one_thread(tmp_path: Path):
    # A worker's intra-op threads are set from the config; more than one starts torch's thread pool, and a
    # template holding it cannot fork (a job of one worker per node lost its template so, on every GPU host):
    # the template reads the config without setting them, each forked worker sets its own.
    cfg = load_config(preset_name="debug", overrides=["train.threads_per_worker=2"])
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    # (the launcher builds the corpus cache before any template: with a cold cache, tokenizing it here would
    # start the tokenizer's own pool, which TOKENIZERS_PARALLELISM=false keeps out of this probe)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True,
                          timeout=100, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "True"]


def test_a_template_with_threads_or_a_cuda_context_is_not_forked(monkeypatch):
    # (CUDA cannot be initialised on a machine without it: its state is what torch reports, set here)
    import torch

    from unbroken.agent import template

    monkeypatch.setattr(template, "thread_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert template.fork_unsafe() is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a child could not use the parent's context
    assert template.fork_unsafe() == "CUDA initialised"
    with pytest.raises(RuntimeError, match=r"not fork-safe \(CUDA initialised\)"):
        template.fork_worker(["x"], "/dev/null", os.getpid(), None, [])
    monkeypatch.setattr(template, "thread_count", lambda: 3)
    assert template.fork_unsafe() == "3 threads"
