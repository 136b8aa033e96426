"""Files an agent writes into or reads from the run directory besides logs and events."""

from __future__ import annotations

import json
import os
from pathlib import Path

from unbroken.jsonl import read_jsonl

__all__ = ["fired_before", "last_self_fault", "last_worker_record", "newest_adopted_gen", "write_layout"]


def fired_before(run_dir: Path, node: int) -> set[str]:
    """Specs this node fired (or saw fire) in earlier attempts of the run: a resume must not repeat them."""
    events = read_jsonl(run_dir / "events" / f"agent{node}.jsonl")
    return {e["spec"] for e in events if e.get("event") in ("fault_injected", "worker_exit") and e.get("spec")}


def last_self_fault(run_dir: Path, worker: int) -> tuple[int, str] | None:
    """The step and phase of the fault ``worker`` injected into itself, when that is the last record of its
    event file.

    The worker writes ``fault_self`` just before the signal, so a worker found dead with it last was in that
    step, although the job's progress (steps committed) may still read the step before.
    """
    last = last_worker_record(run_dir, worker)
    return (int(last["step"]), str(last.get("phase"))) if last.get("event") == "fault_self" else None


def last_worker_record(run_dir: Path, worker: int) -> dict:
    """The last complete record of ``worker``'s event file ({} if none): only the tail of the file is read,
    and a torn last line is skipped."""
    try:
        with (Path(run_dir) / "events" / f"w{worker}.jsonl").open("rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - 16384))
            complete = fh.read().split(b"\n")[:-1]  # what follows the last newline is torn (or empty)
    except FileNotFoundError:
        return {}
    try:
        last = json.loads(complete[-1]) if complete else {}
    except ValueError:
        return {}
    return last if isinstance(last, dict) else {}


def newest_adopted_gen(run_dir: Path, worker: int, pid: int, since: float, chunk: int = 1 << 16) -> int | None:
    """The generation of the newest view the incarnation ``pid`` of ``worker`` adopted (its ``view_adopted``
    record), or None if it adopted none. The event file is read backwards from its end, and only as far as
    the records written since ``since`` (the incarnation's wall-clock start): one chunk, most of the time."""
    path = Path(run_dir) / "events" / f"w{worker}.jsonl"
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        return None
    with fh:
        end = fh.seek(0, os.SEEK_END)
        tail = b""  # the start of a line whose beginning lies in the next chunk back
        while end > 0:
            start = max(0, end - chunk)
            fh.seek(start)
            lines = (fh.read(end - start) + tail).split(b"\n")
            tail, end = (lines.pop(0) if start > 0 else b""), start
            for line in reversed(lines):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn last line, or an empty one
                if not isinstance(rec, dict):
                    continue
                if rec.get("event") == "view_adopted" and rec.get("pid") == pid:
                    return int(rec["gen"])
                if float(rec.get("time", since)) < since:
                    return None
    return None


def was_admitted(run_dir: Path, worker: int, pid: int) -> bool:
    """Did the incarnation ``pid`` of ``worker`` join a view (its ``start_phases`` record, written once it was
    admitted)? Reads the worker's whole event file: only when a forked worker died of an error of its own."""
    path = Path(run_dir) / "events" / f"w{worker}.jsonl"
    return path.exists() and any(r.get("event") == "start_phases" and r.get("pid") == pid for r in read_jsonl(path))


def write_layout(run_dir: Path, node: int, nnodes: int, workers_per_node: int) -> None:
    """``layout.json``: nodes and workers per node, identical from every agent (read by ``unbroken chaos``
    to map node targets to workers, and by workers to place snapshot stripes)."""
    path = run_dir / "layout.json"
    tmp = path.with_name(f".layout.{node}.tmp")
    tmp.write_text(json.dumps({"nodes": nnodes, "workers_per_node": workers_per_node}))
    os.replace(tmp, path)
