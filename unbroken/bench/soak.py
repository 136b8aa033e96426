"""Chaos soak: a job under a long run of random outside faults, and whether it lost anything.

``unbroken bench soak`` starts ``unbroken train`` (default ``debug``, 4 workers
on 2 nodes, a warm standby per node unless ``--no-standby``) and plays a
hostile environment beside it, the way an operator would try it: every ``--interval A B`` seconds
(uniform, seeded) it picks one live process among the job's workers (whatever
incarnation: a worker in its stride, a joiner still starting or loading, a
standby promoted a moment ago) and standbys (the pids the run directory's
``pids/`` files name at that moment) and sends it SIGKILL or, with
probability ``--stop-share``, SIGSTOP; a stopped process that is still alive
is continued 1-10 s later (a machine that stalled and came back; the job has
fenced it by then, or it rejoins the run as it was). Faults go on until
``--faults`` have been sent, whatever the job does meanwhile; then the job
runs to its end undisturbed.

If the faults outrun recovery and the job stops (the launcher exits non-zero:
the restore circuit breaker), the soak does what the job's message says:
``unbroken train --resume RUN`` (faults continue against the resumed job if
any are left to send), up to ``--max-resumes`` times.

The verdict reads the run's own records (:func:`unbroken.report.run_report.summarize_run`):
steps committed against the configured steps, the ledger's check (every
(step, slot, row) trained exactly once: rows never and twice), failures
survived, restores from memory, resumes. Writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from unbroken.bench._args import parse_with_overrides
from unbroken.faults.chaos import alive, read_pid, send
from unbroken.jsonl import JsonlTail

KILL, STOP = "SIGKILL", "SIGSTOP"


def _targets(run: Path) -> list[tuple[str, int]]:
    """(role, pid) of every live worker and standby the run's pid files name now."""
    out = []
    for path in sorted((run / "pids").glob("*")):
        role = "worker" if path.name.startswith("w") else "standby" if path.name.startswith("standby") else None
        pid = read_pid(path) if role is not None else None
        if pid is not None and alive(pid):
            out.append((f"{role}:{path.name}", pid))
    return out


class _Progress:
    """The newest committed step of the run's metrics (0 before the first), followed line by line."""

    def __init__(self, run: Path) -> None:
        self.tail, self.step = JsonlTail(run / "metrics.jsonl"), 0

    def __call__(self) -> int:
        self.step = max([self.step] + [int(r["step"]) for r in self.tail.read_new() if r.get("kind") == "train"])
        return self.step


class Chaos:
    """Sends the faults; keeps what it sent."""

    def __init__(self, run: Path, a: argparse.Namespace) -> None:
        self.run, self.a, self.committed = run, a, _Progress(run)
        self.rng = random.Random(a.seed)
        self.sent: list[dict[str, Any]] = []
        self.stopped: list[tuple[float, int]] = []  # (continue at, pid)
        self.next_at = time.monotonic() + self.rng.uniform(*a.interval)

    @property
    def done(self) -> bool:
        return len(self.sent) >= self.a.faults and not self.stopped

    def tick(self, t0: float) -> None:
        now = time.monotonic()
        for at, pid in [s for s in self.stopped if s[0] <= now]:
            self.stopped.remove((at, pid))
            self._continue(pid)
        if len(self.sent) >= self.a.faults or now < self.next_at:
            return
        self.next_at = now + self.rng.uniform(*self.a.interval)
        targets = _targets(self.run)
        if not targets:
            return
        role, pid = self.rng.choice(targets)
        how = STOP if self.rng.random() < self.a.stop_share else KILL
        if not send(pid, signal.SIGSTOP if how == STOP else signal.SIGKILL):
            return
        if how == STOP:
            self.stopped.append((now + self.rng.uniform(1.0, 10.0), pid))
        self.sent.append({"t": round(now - t0, 2), "wall": time.time(), "target": role, "pid": pid, "signal": how,
                          "committed": self.committed()})

    def release(self) -> None:
        """Continue every process still stopped (the soak is ending)."""
        for _, pid in self.stopped:
            self._continue(pid)
        self.stopped.clear()

    def _continue(self, pid: int) -> None:
        """SIGCONT to a process this soak stopped; its fault record keeps when (``cont_wall``)."""
        if send(pid, signal.SIGCONT):
            for f in reversed(self.sent):
                if f["pid"] == pid and f["signal"] == STOP:
                    f.setdefault("cont_wall", time.time())
                    break


def _launch(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--faults", type=int, default=200, help="outside faults to send (default 200)")
    ap.add_argument("--interval", type=float, nargs=2, default=(1.0, 3.5), metavar=("A", "B"),
                    help="seconds between faults, uniform in [A, B] (default 1.0 3.5)")
    ap.add_argument("--stop-share", type=float, default=1 / 3, help="share of SIGSTOP among faults (default 1/3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-resumes", type=int, default=5)
    ap.add_argument("--no-standby", action="store_true",
                    help="no warm standby per node (an HSDP job, train.shard_degree > 1, restarts whole replicas)")
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument("--run-dir", type=Path, default=Path("runs/soak"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/soak.json"))
    a, overrides = parse_with_overrides(ap, argv)
    if a.faults < 1 or not 0 <= a.stop_share <= 1 or not 0 < a.interval[0] <= a.interval[1]:
        ap.error("need --faults >= 1, 0 <= --stop-share <= 1 and 0 < A <= B for --interval")
    run = a.run_dir
    run.parent.mkdir(parents=True, exist_ok=True)
    log = run.parent / f"{run.name}.log"
    log.write_text("")
    base = [sys.executable, "-c", "import sys; from unbroken.cli import main; sys.exit(main())", "train"]
    standby = [] if a.no_standby else ["--standby"]
    first = base + ["--preset", a.preset, "--steps", str(a.steps), "--nodes", str(a.nodes), "--workers",
                    str(a.workers), *standby, "--out", str(run), "--overwrite"] + [f"--{o}" for o in overrides]
    chaos, t0 = Chaos(run, a), time.monotonic()
    launches: list[dict[str, Any]] = []
    proc = _launch(first, log)
    launches.append({"t": 0.0, "resume": False})
    try:
        while True:
            if time.monotonic() - t0 > a.timeout_s:
                raise TimeoutError(f"the soak ran past --timeout-s {a.timeout_s}")
            rc = proc.poll()
            if rc is not None:
                launches[-1].update(rc=rc, at_step=chaos.committed(), t_end=round(time.monotonic() - t0, 2))
                if rc == 0:
                    break
                if len(launches) > a.max_resumes:
                    break
                chaos.release()
                proc = _launch(base + ["--resume", str(run), *standby], log)
                launches.append({"t": round(time.monotonic() - t0, 2), "resume": True})
                continue
            if chaos.committed() > 0 or launches[-1]["resume"]:
                chaos.tick(t0)
            time.sleep(0.05)
    finally:
        chaos.release()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return _verdict(a, run, chaos, launches, time.monotonic() - t0)


def _verdict(a: argparse.Namespace, run: Path, chaos: Chaos, launches: list[dict[str, Any]],
             wall_s: float) -> dict[str, Any]:
    from unbroken.bench.capacity import summarize as capacity
    from unbroken.report.run_report import summarize_run
    from unbroken.runtime.ledger import read_events

    s = summarize_run(run)
    by: dict[str, int] = {}
    for f in chaos.sent:
        key = f"{f['signal']} {f['target'].split(':')[0]}"
        by[key] = by.get(key, 0) + 1
    committed = chaos.committed()
    result = {
        "benchmark": "soak", "preset": a.preset, "nodes": a.nodes, "workers": a.workers, "seed": a.seed,
        "standby": not a.no_standby,
        "interval_s": list(a.interval), "stop_share": a.stop_share, "wall_s": round(wall_s, 1),
        "faults_sent": len(chaos.sent), "faults_by_kind": by,
        "faults_window_s": chaos.sent[-1]["t"] if chaos.sent else 0.0,
        "steps": a.steps, "committed": committed, "lost_steps": a.steps - committed,
        "finished": launches[-1].get("rc") == 0, "launches": launches, "resumes": len(launches) - 1,
        "failures_survived": s["failures"], "restores": s["snapshots"].get("restores", []),
        "ledger": {k: s[k] for k in s if k.startswith(("rows_", "ledger", "exactly"))},
        "capacity": capacity(read_events(run), chaos.sent),
        "faults": chaos.sent, "run_dir": str(run),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    _print(result)
    print(f"  wrote {a.out}")
    return result


def _print(r: dict[str, Any]) -> None:
    print(f"chaos soak: {r['faults_sent']} outside faults in {r['faults_window_s']:.0f} s "
          f"({', '.join(f'{v} {k}' for k, v in sorted(r['faults_by_kind'].items()))})")
    standby = " + a standby each" if r.get("standby", True) else ""
    print(f"  job: {r['nodes']} nodes x {r['workers'] // r['nodes']} workers{standby}, {r['preset']}, "
          f"{r['steps']} steps; wall {r['wall_s']:.0f} s")
    print(f"  committed {r['committed']} of {r['steps']} steps (lost {r['lost_steps']}), "
          f"finished: {r['finished']}, resumes: {r['resumes']}")
    print(f"  failures survived {r['failures_survived']}, restores from memory {len(r['restores'])}")
    print(f"  ledger: {json.dumps(r['ledger'])}")
    c = r["capacity"]
    q = c["back_s"]
    print(f"  workers lost {c['losses']}, back {c['back']} ({', '.join(f'{k} {v}' for k, v in c['by_how'].items())}); "
          f"back at full strength after p50 {_s(q['p50'])}, p90 {_s(q['p90'])}, p99 {_s(q['p99'])}, max {_s(q['max'])}")
    if c["slower_than_target"]:
        print(f"  {c['slower_than_target']} back later than {c['target_s']:.0f} s: "
              f"{c['slower_with_another_loss_meanwhile']} while another worker was lost too (its admission waited "
              f"for a step boundary, the steps for that loss to be detected), {c['slower_hit_again']} hit again "
              f"as it came back")
        for x in c.get("slower_for_no_reason_found", [])[:10]:
            print(f"    no other loss and no new fault meanwhile: worker {x['worker']} back after {x['back_s']:.2f} s "
                  f"({x['cause']}, {x['how']})")
    for x in c["never_back"]:
        print(f"  never back: worker {x['worker']} lost at {x['lost_at']:.1f} ({x['cause']})")
    print(f"  gaps from an exit to the next start: {c['gaps']}, unexplained {len(c['unexplained_gaps'])}")
    for g in c["unexplained_gaps"][:10]:
        print(f"    worker {g['worker']}: {g['gap_s']:.1f} s, the agent said {g['why']}")


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"
