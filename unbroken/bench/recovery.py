"""Recovery benchmark: ``unbroken bench recovery``: where the seconds of a recovery go, phase by phase.

Real jobs, real kills: each case (``PRESET:NODESxWORKERS``) is launched and,
mid-step (``phase=backward`` of ``--kill-step``), its workers kill themselves
with SIGKILL:

- part ``one``: the last worker of the job (its agent restarts it at once; it
  rejoins at a step boundary, from its node's snapshot memory or a peer's
  transfer, while the others train on);
- part ``all``: every worker of the job (the agents restore the whole job from
  snapshot memory). A case of one worker runs ``one`` only: it is the same;
- part ``final``: the end of a job without a kill, from the last step's commit
  to the final checkpoint's commit, the workers' exit and the launcher's
  return (:mod:`unbroken.bench.recovery_final`). Every job's row carries its end too.

Two studies in the repository measure in one process: the state's load (the
inventory's and the load's GB/s into the live state and into a forked worker),
``python -m benchmarks.recovery_load``, and the final checkpoint's write against
torch DCP's Hugging Face writer, ``python -m benchmarks.final_checkpoint_write``.

Each recovery's phases are read from the run's own events
(:mod:`unbroken.report.recovery_phases`), in seconds after the kill: death
seen, process ready, restore or admission decided, state loaded (bytes and
GB/s), first step done, steps back at the median step time; the machine's load
average is printed with them (a 2-core machine shared with others is noisy:
run it twice).

``unbroken bench recovery`` on a CPU runs ``debug:2x2`` and ``llama-60m:1x1``
(``--data.seq_len=64 --data.micro_batch=2``); on a GPU give ``--cases
llama-1b:1x1 --train.device=cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from unbroken.agent.launcher import launch
from unbroken.bench._args import parse_with_overrides
from unbroken.bench.recovery_final import end_phases
from unbroken.report.recovery_phases import recoveries
from unbroken.bench.machine import machine_description
from unbroken.config import load_config
from unbroken.runtime.ledger import read_events

__all__ = ["main"]

CASE_OVERRIDES = {"llama-60m": ["data.seq_len=64", "data.micro_batch=2"]}
"""What a case of a preset needs on top of the command line's overrides (a CPU's step of llama-60m)."""
PHASES = ("death_seen", "process_ready", "decided", "state_loaded", "first_step", "steps_back")
PARTS = ("one", "all", "final")
END = ("checkpoint_committed", "workers_exited", "job_returned")


def _case(text: str) -> tuple[str, int, int]:
    """``PRESET:NODESxWORKERS`` -> ``(preset, nodes, workers per node)``."""
    try:
        name, shape = text.split(":")
        nodes, per = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise ValueError(f"--cases: {text!r} is not PRESET:NODESxWORKERS (e.g. debug:2x2)") from None
    if nodes < 1 or per < 1:
        raise ValueError(f"--cases: {text!r} needs at least one node and one worker per node")
    return name, nodes, per


def _run(a: argparse.Namespace, overrides: list[str], case: str, part: str, run: Path) -> dict[str, Any]:
    name, nodes, per = _case(case)
    world = nodes * per
    cfg = load_config(preset_name=name, overrides=CASE_OVERRIDES.get(name, []) + overrides + [
        f"train.steps={a.steps}", "train.val_every=0", "train.val_batches=1",
        f"snapshot.every={a.snapshot_every}", f"train.workers={world}"])
    killed = [] if part == "final" else [world - 1] if part == "one" else list(range(world))
    fail_at = ",".join(f"step={a.kill_step}:worker={w}:kill:phase=backward" for w in killed)
    load_before = os.getloadavg()
    summary = launch(cfg, run, nodes=nodes, workers_per_node=per, fail_at=fail_at)
    returned = time.time()
    events = read_events(run)
    found = recoveries(events)
    return {"case": case, "part": part, "preset": name, "nodes": nodes, "workers_per_node": per,
            "killed": killed, "steps": summary.get("steps"), "load_average": [list(load_before), list(os.getloadavg())],
            "recovery": found[0] if found else None, "recoveries": len(found),
            "end": end_phases(events, a.steps, returned)}


def _cell(x: float | None) -> str:
    return f"{x:7.3f}" if isinstance(x, (int, float)) else f"{'-':>7}"


def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'case':<16}{'part':<5}" + "".join(f"{p:>14}" for p in PHASES) + f"{'load GB/s':>11}{'step s':>8}"
    lines = ["seconds after the kill:", head]
    for r in (r for r in rows if r["part"] != "final"):
        rec = r["recovery"] or {}
        gbs = (rec.get("load") or {}).get("gb_s")
        lines.append(f"{r['case']:<16}{r['part']:<5}" + "".join(f"{_cell(rec.get(p)):>14}" for p in PHASES)
                     + f"{_cell(gbs):>11}{_cell(rec.get('median_step_s')):>8}")
        if rec.get("inventory_s") is not None:
            lines.append(f"{'':<21}inventory {rec['inventory_s']} s, decision {rec.get('decision_s')} s after all "
                         f"died; death seen while {'/'.join(rec.get('seen_while', []))}, reaped {_cell(rec.get('reaped')).strip()}")
        lines.append(f"{'':<21}load average {r['load_average'][0][0]:.2f} before, {r['load_average'][1][0]:.2f} after")
    ended = [r for r in rows if r.get("end")]
    if ended:
        lines += ["seconds after the last step's commit:",
                  f"{'case':<16}{'part':<6}" + "".join(f"{p:>22}" for p in END) + f"{'GB':>8}{'GB/s':>8}{'writers':>9}"]
        for r in ended:
            e = r["end"]
            lines.append(f"{r['case']:<16}{r['part']:<6}" + "".join(f"{_cell(e.get(p)):>22}" for p in END)
                         + f"{_cell(e.get('checkpoint_gb')):>8}{_cell(e.get('checkpoint_write_gb_s')):>8}"
                         + f"{e.get('writers') or '-':>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken bench recovery", description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="debug:2x2,llama-60m:1x1", help="PRESET:NODESxWORKERS, comma-separated")
    ap.add_argument("--parts", default="one,all,final",
                    help="one: the last worker killed; all: every worker; final: a job's end and its final checkpoint "
                         "(the state's load in one process: python -m benchmarks.recovery_load)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--kill-step", type=int, default=11, help="the step during whose backward the kill comes")
    ap.add_argument("--snapshot-every", default="2", help="snapshot.every of the jobs")
    ap.add_argument("--keep", type=Path, default=None, help="keep the runs under this folder (default: removed)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/recovery.json"))
    a, overrides = parse_with_overrides(ap, argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    if not parts or set(parts) - set(PARTS):
        ap.error(f"--parts: {a.parts!r}; valid: {', '.join(PARTS)}")
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    for c in cases:
        _case(c)  # every malformed case refused before any job runs
    if not 0 < a.kill_step < a.steps:
        ap.error(f"--kill-step={a.kill_step}: a step of the job, between 1 and --steps - 1 ({a.steps - 1})")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="unbroken-recovery-") as tmp:
        where = a.keep or Path(tmp)
        for case in cases:
            _, nodes, per = _case(case)
            for part in parts if nodes * per > 1 else [p for p in parts if p != "all"]:
                rows.append(_run(a, overrides, case, part, where / f"{case.replace(':', '-')}-{part}"))
    result = {"benchmark": "recovery", "cases": cases, "parts": parts, "steps": a.steps, "kill_step": a.kill_step,
              "snapshot_every": a.snapshot_every, "overrides": overrides, "rows": rows,
              "machine": machine_description()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str))
    if rows:
        print(_table(rows))
    print(f"wrote {a.out}")
    return result
