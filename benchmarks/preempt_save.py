"""SIGTERM to exit with a committed final checkpoint: ``python -m benchmarks.preempt_save [--preset llama-60m]
[--nodes 1] [--workers-per-node 2] [--after-steps 3] [--repeats 1] [--out JSON] [SECTION.FIELD=VALUE ...]``.

A real job (``unbroken train``, its launcher, agents and workers, gloo on the CPU) trains until every worker
committed ``--after-steps`` steps; then its agents get SIGTERM, as a scheduler's preemption sends it. The
figure is the seconds from the signal to the launcher's exit with exit code 75 and the final checkpoint
committed (:mod:`unbroken.agent.preemption`): the step in flight is finished (the one after it too when the
signal came after the view's leader posted the step's reduction), the checkpoint written, the agents and the
launcher exit. Its phases are printed beside it: ``signal_to_last_step_s`` (to the stopped step's commit
record: the step in flight), ``final_checkpoint_write_s``, ``commit_to_exit_s`` (from the checkpoint's commit
record to the launcher's exit: the workers', agents' and launcher's ends), with the job's median step time and
the machine's load. The target: at most 5 s for ``llama-60m`` on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unbroken.agent.preemption import EXIT_PREEMPTED
from unbroken.bench.machine import machine_description
from unbroken.bench.recovery import CASE_OVERRIDES
from unbroken.checkpoint.checkpointer import latest_checkpoint, read_commit
from unbroken.jsonl import read_jsonl

__all__ = ["main", "preempt_once"]

TARGET_S = 5.0
WAIT_S = 600.0
"""Longest a job may take to start and commit its first steps."""


def _commits(run: Path, worker: int) -> int:
    path = run / "events" / f"w{worker}.jsonl"
    return sum(r.get("kind") == "commit" for r in read_jsonl(path)) if path.is_file() else 0


def preempt_once(run: Path, *, preset: str, nodes: int, per_node: int, after_steps: int,
                 overrides: list[str]) -> dict[str, Any]:
    """One job signalled once every worker committed ``after_steps`` steps; its figures."""
    workers = nodes * per_node
    sets = [f"--{o}" for o in CASE_OVERRIDES.get(preset, []) + overrides + [
        "train.val_every=0", "train.val_batches=1"]]
    cmd = [sys.executable, "-m", "unbroken.cli", "train", "--preset", preset, "--nodes", str(nodes),
           "--workers-per-node", str(per_node), "--steps", "100000", "--out", str(run), *sets]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not all(_commits(run, w) >= after_steps for w in range(workers)):
            if proc.poll() is not None or time.monotonic() - t0 > WAIT_S:
                said = proc.stderr.read() if proc.stderr is not None else ""
                raise RuntimeError(f"the job did not train {after_steps} steps: {said[-2000:]}")
            time.sleep(0.01)
        agents = [int((run / "pids" / f"agent{r}").read_text().split()[0]) for r in range(nodes)]
        signalled, signalled_wall = time.monotonic(), time.time()
        for pid in agents:
            os.kill(pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT_S)
        exit_s, exited_wall = time.monotonic() - signalled, time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if proc.returncode != EXIT_PREEMPTED:
        raise RuntimeError(f"exit code {proc.returncode}, not {EXIT_PREEMPTED}: {err[-2000:]}")
    summary = json.loads((run / "summary.json").read_text())
    checkpoint = latest_checkpoint(run)
    stopped = summary["preempted_after_step"]
    assert checkpoint is not None and int(read_commit(checkpoint)["step"]) == stopped, "no final checkpoint"
    steps = [r["step_time_s"] for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"]
    final = [e for f in (run / "events").glob("w*.jsonl") for e in read_jsonl(f)
             if e.get("event") == "final_checkpoint"]
    commit = max(f.stat().st_mtime for f in checkpoint.rglob("*") if f.is_file())  # the commit record is written last
    last_step = max(float(r["time"]) for f in (run / "events").glob("w*.jsonl") for r in read_jsonl(f)
                    if r.get("kind") == "commit" and int(r["step"]) == stopped - 1)  # the stopped step, 0-based
    return {"sigterm_to_exit_s": round(exit_s, 3), "sigterm_to_commit_s": round(commit - signalled_wall, 3),
            "signal_to_last_step_s": round(last_step - signalled_wall, 3),
            "commit_to_exit_s": round(exited_wall - commit, 3),
            "final_checkpoint_write_s": final[0].get("write_s") if final else None, "stopped_after_step": stopped,
            "median_step_s": round(statistics.median(steps[1:] or steps), 3) if steps else None,
            "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.preempt_save", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-60m")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--after-steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here too")
    ap.add_argument("overrides", nargs="*", metavar="SECTION.FIELD=VALUE")
    a = ap.parse_args(argv)
    runs = []
    for _ in range(a.repeats):
        with tempfile.TemporaryDirectory(prefix="preempt_save-") as tmp:
            runs.append(preempt_once(Path(tmp) / "run", preset=a.preset, nodes=a.nodes, per_node=a.workers_per_node,
                                     after_steps=a.after_steps, overrides=a.overrides))
    worst = max(r["sigterm_to_exit_s"] for r in runs)
    result = {"preset": a.preset, "layout": f"{a.nodes}x{a.workers_per_node}", "runs": runs,
              "sigterm_to_exit_s_max": worst, "target_s": TARGET_S, "meets_target": worst <= TARGET_S,
              "load_average_1m": round(os.getloadavg()[0], 2), "machine": machine_description()}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out is not None:
        a.out.write_text(text)
    return result


if __name__ == "__main__":
    main()
