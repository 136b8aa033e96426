"""The state's load, in one process: ``python -m benchmarks.recovery_load [--presets debug,llama-60m]``.

The recoveries of real jobs, phase by phase: ``unbroken bench recovery``.

The preset's model and AdamW state on the CPU (or ``train.device``), snapshot
twice into this node's memory (two buffers, as a worker keeps them), then:

- the inventory: every byte checked (``verify``: what a restore after a failed
  restore, or ``--resume``, does) and the seals alone (what a restore's
  decision does), in GB/s of bytes checked;
- the load into the live state (its optimizer's moments present) and into a
  process forked after the model was built and before any optimizer step (a
  worker forked from its node's template: its parameters shared with the
  template, its moments not made yet), in GB/s of state.

Each is run ``repeats`` times; all times are reported (a shared machine's noise
is in them). The forked load is skipped, and says so, when this process runs
threads (a fork would copy their locks) or holds a CUDA context.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from unbroken.agent.template import thread_count
from unbroken.bench._args import parse_with_overrides
from unbroken.bench.machine import machine_description
from unbroken.bench.recovery import CASE_OVERRIDES
from unbroken.config import Config, config_from_dict, load_config
from unbroken.job.builder import build_job, prepare
from unbroken.models.factory import resolve_device
from unbroken.store.view import View
from unbroken.snapshot.restore import alone, decide, inventory, restore_from_memory
from unbroken.snapshot.segment import SECRET_ENV, remove_segments
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of

__all__ = ["load_figures", "main"]

THREADS_GONE_S = 2.0
"""How long the threads of the loads before a fork may take to be gone (joined threads end a moment later)."""
CHILD_TIMEOUT_S = 300.0
"""The forked child's load is waited for at most this long."""


def _forked_load(spec: dict[str, Any], cfg: Config, prepared: Any, job: str, device: torch.device) -> float | None:
    """Seconds of a load in a child forked with the prepared model (None: the child failed or took too long)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker forked from a template: build its job on the prepared model, then load
        code = 1
        try:
            os.close(r)
            fresh = build_job(cfg, device, prepared)
            stats = restore_from_memory(spec, job=job, node=0, node_of={0: 0}, members=(0,), me=0, broadcast=alone,
                                        model=fresh.model, optimizer=fresh.optimizer, device=device)
            os.write(w, json.dumps({"seconds": stats["seconds"]}).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    raw, deadline = b"", time.monotonic() + CHILD_TIMEOUT_S
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)  # too long: it is not a load at memory speed anyway
                raw = b""
                break
            chunk = os.read(r, 4096)
            if not chunk:
                break
            raw += chunk
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)  # it wrote and exited, or was killed: returns at once
    return float(json.loads(raw)["seconds"]) if raw and os.waitstatus_to_exitcode(status) == 0 else None


def load_figures(cfg: Config, *, repeats: int = 3, timeout_s: float = 900.0) -> dict[str, Any]:
    """The inventory's and the load's GB/s for ``cfg``'s state (see the module docstring), measured in a fresh
    process started as a node's template is (one thread: OpenBLAS's pool off), under a job secret of its own
    (the seals authenticated, as a job's are).

    Raises:
        RuntimeError: the measuring process failed or took longer than ``timeout_s`` (its output's end).
    """
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           SECRET_ENV: secrets.token_hex(16)}
    try:
        done = subprocess.run([sys.executable, str(Path(__file__)), "--measure", json.dumps(cfg.to_dict()),
                               str(repeats)], capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the load's measurement took longer than {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"the load's measurement failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _measure(cfg: Config, repeats: int) -> dict[str, Any]:
    """:func:`load_figures` in the measuring process."""
    device = resolve_device(cfg.train.device)
    torch.set_num_threads(1)  # one intra-op thread: no pool, so the forked load can run
    prepared = prepare(cfg, device)
    job = build_job(cfg, device)
    for p in job.model.parameters():
        p.grad = torch.randn_like(p)
    job.optimizer.step()
    ident = os.urandom(6).hex()
    snap = Snapshotter(job_id=ident, node=0, worker=0, node_of={0: 0}, every=1, redundancy="parity", parity=1,
                       config_hash="bench", state=lambda: tensors_of(job.model, job.optimizer, device),
                       on_event=lambda *a, **k: None)
    try:
        for step in (1, 2):
            snap.take(step, View(gen=0, members=(0,), step=step))
            snap.wait()
        snap.close()
        checked, trusted = [], []
        for _ in range(repeats):
            inv = inventory(ident, 0, config_hash="bench", verify=True)
            checked.append(inv["bytes"] / inv["seconds"] / 1e9)
            trusted.append(inventory(ident, 0, config_hash="bench", verify=False)["seconds"])
        spec = decide([inv], checkpoint=None, members_of=lambda nodes: [0])
        assert spec is not None, "the snapshots just taken are not restorable"
        live = [restore_from_memory(spec, job=ident, node=0, node_of={0: 0}, members=(0,), me=0, broadcast=alone,
                                    model=job.model, optimizer=job.optimizer, device=device)
                for _ in range(repeats)]
        state = live[0]["bytes"]
        deadline = time.monotonic() + THREADS_GONE_S
        while thread_count() != 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # a joined thread of the load's pool leaves /proc a moment after its join
        why = "a CUDA context (a fork cannot use it)" if device.type == "cuda" else (
            f"{thread_count()} threads" if thread_count() != 1 else None)
        forked = [_forked_load(spec, cfg, prepared, ident, device) for _ in range(repeats)] if why is None else []
    finally:
        remove_segments(ident)
    return {"state_bytes": state, "checked_bytes": inv["bytes"], "threads": live[0]["threads"],
            "inventory_verify_gb_s": checked, "inventory_seals_s": trusted,
            "load_live_gb_s": [s["gb_s"] for s in live],
            "load_forked_gb_s": [round(state / s / 1e9, 3) if s else None for s in forked],
            "forked": "measured" if why is None else f"skipped: this process holds {why}"}


def _line(name: str, f: dict[str, Any]) -> str:
    def gbs(xs: list[float | None]) -> str:
        return " ".join("-" if x is None else f"{x:.2f}" for x in xs)

    return (f"{name}: {f['state_bytes'] / 1e9:.2f} GB of state, {f['threads']} threads; inventory of every byte "
            f"({f['checked_bytes'] / 1e9:.2f} GB) {gbs(f['inventory_verify_gb_s'])} GB/s, of the seals "
            f"{' '.join(f'{s * 1e3:.1f}' for s in f['inventory_seals_s'])} ms; load into the live state "
            f"{gbs(f['load_live_gb_s'])} GB/s, into a forked worker {gbs(f['load_forked_gb_s']) or f['forked']} GB/s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure each preset's load (``--section.field=value`` overrides apply to all), print and write JSON."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.recovery_load", description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="debug,llama-60m", help="comma-separated config presets")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/recovery_load.json"))
    a, overrides = parse_with_overrides(ap, argv)
    loads = {}
    for name in (p.strip() for p in a.presets.split(",") if p.strip()):
        cfg = load_config(preset_name=name, overrides=CASE_OVERRIDES.get(name, []) + overrides)
        loads[name] = load_figures(cfg, repeats=a.repeats)
        print(_line(name, loads[name]), flush=True)
    result = {"benchmark": "recovery_load", "overrides": overrides, "load": loads, "machine": machine_description()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:  # the measuring process (load_figures)
        print(json.dumps(_measure(config_from_dict(json.loads(sys.argv[2])), int(sys.argv[3]))))
    else:
        main()
