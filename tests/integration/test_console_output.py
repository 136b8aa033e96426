"""``unbroken train`` writing to a pipe (a log): whole lines, never wrapped, and a line per event.

A real job (3 workers, CPU, gloo) through the command line, stdout a pipe and
``COLUMNS=40``: every status line holds all its fields on one line although it
is much longer than 40 columns, no line is a fragment of another, the injected
kill and the rejoin each print an event line, and ``RUN/events.jsonl`` holds
them with the file each came from. A warm standby brings the killed worker
back within a few steps, so the run stays short.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 150
"""Enough short steps for the standby to rejoin after step 8 before the run ends."""
SMALL = ["train.val_every=0", "train.val_batches=1", "optim.warmup_steps=2", "optim.eps=1e-6",
         "data.micro_batch=4", "data.seq_len=32", "mecefo.policy=neighbor"]
"""The failover tests' small steps (``tests/integration/_faults.py``)."""
STATUS = re.compile(r"step (\d+)/150  loss \d+\.\d{4}  [\d,]+ tok/s(?:  ETA \w+)?  g(\d+)  live ([0-3])/3  degraded "
                    r"(-|[\d,]+)(  stall (-|\d+\.\d\d s \(step \d+\)))?(?:  (?:MFU \d+\.\d%|\d+\.\d\d TFLOP/s))?"
                    r"(?:  mem \d+\.\d GiB)?(  lr \d\.\d\de[-+]\d\d)?")
VAL = re.compile(r"step \d+/150  val loss \d+\.\d{4}  ppl \d+\.\d\d")
EVENT = re.compile(r"step \d+  g(\d+|-)  \S.*")


def _unbroken() -> list[str]:
    script = Path(sys.executable).parent / "unbroken"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "unbroken.cli"]


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory, corpus_overrides) -> tuple[subprocess.CompletedProcess[str], Path]:
    # Worker 1 kills itself in step 5's forward pass, before its all-reduce: a kill from outside could land
    # mid-reduction, where a survivor whose reduction broke while the other's completed leaves and rejoins too
    # (right, but another story than the one these lines tell).
    run = tmp_path_factory.mktemp("console") / "run"
    overrides = [f"--{o}" for o in corpus_overrides + SMALL]
    cmd = [*_unbroken(), "train", "--preset", "debug", "--workers", "3", "--steps", str(STEPS), "--out", str(run),
           "--standby", "--fail-at", "step=5:worker=1:kill:phase=forward:back=8", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env={**os.environ, "COLUMNS": "40"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, run


def test_every_line_is_whole_and_unwrapped(piped_run):
    proc, _ = piped_run
    lines = proc.stdout.splitlines()
    summary = lines.index("run summary")
    progress, table = lines[:summary], lines[summary + 1:]
    for line in progress:  # a wrapped line would leave a fragment that is neither
        assert STATUS.fullmatch(line) or EVENT.fullmatch(line) or VAL.fullmatch(line), f"not a whole line: {line!r}"
    assert all(re.fullmatch(r"  \w+ +\S.*", line) for line in table), table
    statuses = [STATUS.fullmatch(line) for line in progress if STATUS.fullmatch(line)]
    assert max(len(line) for line in progress) <= 80, "a log line fits the terminal width fallback"
    steps = [int(m.group(1)) for m in statuses]
    assert steps == sorted(steps) and steps[-1] == STEPS
    assert len(steps) >= 20  # every 5% of the run, and after events
    last = statuses[-1]
    assert (last.group(3), last.group(4)) == ("3", "-"), "at the end all three train again"
    assert "\x1b" not in proc.stdout and "\r" not in proc.stdout, "no terminal control in a log"


def test_failure_and_rejoin_have_event_lines(piped_run):
    proc, _ = piped_run
    events = [line for line in proc.stdout.splitlines() if EVENT.fullmatch(line) and not STATUS.fullmatch(line)]
    # Killed in step 5 (the line may name step 6 when the agent reaps it after the step committed).
    assert [e for e in events if re.fullmatch(r"step [56]  g\d+  worker 1 died \(SIGKILL\): 2 of 3 live; "
                                              r"restart at step 8", e)], events
    assert [e for e in events if re.search(r"  new view in \d+\.\d\d s: 2 of 3 live \(0,2\), slot 1 degraded$", e)]
    assert [e for e in events if re.search(r"  worker 2 covers slot 1 rows 0-4 \(approx\)$", e)], events
    assert [e for e in events if re.search(r"  worker 1 rejoined after \d+\.\d s$", e)], events
    after = next(i for i, line in enumerate(proc.stdout.splitlines()) if "died (SIGKILL)" in line)
    degraded = [m for m in map(STATUS.fullmatch, proc.stdout.splitlines()[after:]) if m]
    assert ("2", "1") in [(m.group(3), m.group(4)) for m in degraded], "the status after the failure"


def test_events_file_holds_the_run_events(piped_run):
    _, run = piped_run
    merged = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert all(e["kind"] == "event" and e["source"].startswith("events/") for e in merged)
    (death,) = [e for e in merged if e["event"] == "worker_exit" and e.get("signal") == 9]
    assert (death["source"], death["worker"]) == ("events/agent0.jsonl", 1) and death["progress"] in (5, 6)
    (rejoin,) = [e for e in merged if e["event"] == "rejoined"]
    assert (rejoin["source"], rejoin["worker"]) == ("events/w1.jsonl", 1)
    assert merged.index(death) < merged.index(rejoin)
    views = Counter((e["event"], e["gen"]) for e in merged if e["event"] in ("view_adopted", "reconfigured"))
    assert views and set(views.values()) == {1}, "a view change once, not once per member"
    assert {e["event"] for e in merged} >= {"worker_start", "fault_self", "attempt_aborted", "takeover"}
