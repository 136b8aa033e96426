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


AUDIT = r"""
import inspect, json, sys
from pathlib import Path
import torch
calls = []


def recorded(name, fn):
    def call(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return call


# Every function of torch.cuda records its call (the real one still runs: this machine has no GPU, so none
# of them could start a thread here; on a GPU host is_available() alone loads NVML or the driver).
for name, obj in list(vars(torch.cuda).items()):
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        setattr(torch.cuda, name, recorded(name, obj))
from unbroken.agent import template
prepared, phases = template._prepare(Path(sys.argv[1]))
why = template.fork_unsafe()
print(json.dumps({"calls": sorted(set(calls)), "prepared": prepared is not None, "why": why}))
"""

FLAG_READS = {"is_initialized", "_is_compiled"}
"""The two torch.cuda functions that read a flag and nothing else (whether a context was made in this process,
whether torch was built with CUDA): the template's fork check calls the first, torch._dynamo's import the second."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device, prepared", [("cuda", False), ("auto", True)])
def test_the_template_calls_no_cuda_function_whatever_the_device(tmp_path: Path, device: str, prepared: bool):
    # A CUDA job on a GPU host: the template decides what it prepares from the string alone (a CUDA job's
    # worker builds its data and model after the fork, on its own GPU); ``auto`` on this CPU build is the CPU.
    cfg = load_config(preset_name="debug", overrides=[f"train.device={device}"])
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", AUDIT, str(tmp_path)], capture_output=True, text=True,
                          timeout=100, env=env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert set(got["calls"]) <= FLAG_READS, f"the template called torch.cuda.{sorted(set(got['calls']) - FLAG_READS)}"
    assert got["prepared"] is prepared and got["why"] is None


THREADED_FACTORY = r'''
import ctypes, threading

started = threading.Event()


def _helper() -> None:
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(b"odd-helper"), 0, 0, 0)  # PR_SET_NAME: this thread's comm
    started.set()
    threading.Event().wait()


threading.Thread(target=_helper, daemon=True).start()
started.wait(10)


def make(cfg, device):
    raise AssertionError("never built: the template refuses before any worker")
'''


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names in /proc")
@pytest.mark.timeout(120)
def test_a_template_that_will_not_fork_names_its_threads(tmp_path: Path):
    # A library that starts a thread at import (here the job's own data factory module) makes the template
    # refuse to fork: its ready line says which threads it holds, and so does its log.
    factory = tmp_path / "threaded_factory.py"
    factory.write_text(THREADED_FACTORY)
    cfg = load_config(preset_name="debug", overrides=[f"data.factory={factory}:make"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "unbroken.agent.template", "--run-dir", str(run), "--world", "1"],
                          capture_output=True, text=True, timeout=100, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    ready = json.loads(done.stdout.splitlines()[0])
    assert ready["ready"] is False and ready["why"] == "2 threads"
    assert len(ready["thread_names"]) == 2 and "odd-helper" in ready["thread_names"], ready
    assert "2 threads after start-up (" in done.stderr and "odd-helper" in done.stderr
