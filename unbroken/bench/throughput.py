"""Throughput of the data-parallel trainer for several worker counts.

``unbroken bench throughput --preset debug --workers 1,2,4 --out FILE.json``
trains the same config with each worker count, one after the other in one
invocation, and reports the median steady-state tokens/s (the first fifth of
steps is warm-up and dropped) and the scaling ratio against the smallest count.
With ``--precision fp32,bf16`` each worker count runs in both precisions, one
right after the other, and each bf16 row carries its ratio to the fp32 row of
the same count (``bf16_vs_fp32``). Each row also carries what the runtime held
beside the model and optimizer right after its second step's backward pass
(:mod:`unbroken.runtime.held_memory`, the largest of its workers): the live
reduction buffers (one, whatever the count) and every byte held, against the
size of one buffer.

Unbroken against what a user would run instead (a plain PyTorch loop, eager and
compiled, on the same model and batch), with MFU and memory on a GPU, is run from
the repository: ``python -m benchmarks.throughput_reference``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from unbroken.bench._args import parse_with_overrides
from unbroken.bench.machine import machine_description
from unbroken.config import load_config
from unbroken.agent.launcher import launch_local
from unbroken.runtime.held_memory import HELD_ENV


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken bench throughput", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker counts (default 1,2,4)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--precision", default="fp32", help="comma-separated: fp32, bf16 (train.precision)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/throughput.json"))
    a, overrides = parse_with_overrides(ap, argv)
    a.overrides = overrides
    counts = [int(w) for w in a.workers.split(",") if w.strip()]
    if not counts or min(counts) < 1:
        raise ValueError(f"--workers {a.workers!r}: need positive comma-separated counts, e.g. 1,2,4")
    precisions = [p.strip() for p in a.precision.split(",") if p.strip()]
    if not precisions or any(p not in ("fp32", "bf16") for p in precisions):
        raise ValueError(f"--precision {a.precision!r}: need comma-separated fp32 and/or bf16")
    rows: list[dict[str, Any]] = []
    before, os.environ[HELD_ENV] = os.environ.get(HELD_ENV), "1"  # the workers measure what they hold
    try:
        _runs(a, counts, precisions, rows)
    finally:
        if before is None:
            del os.environ[HELD_ENV]
        else:
            os.environ[HELD_ENV] = before
    _ratios(rows)
    result = {"benchmark": "throughput", "preset": a.preset, "steps": a.steps, "rows": rows,
              "machine": machine_description()}
    print(f"{'workers':>8} {'precision':>9} {'tokens/s':>12} {'scaling':>8} {'efficiency':>10} {'bf16/fp32':>9}")
    for r in rows:
        ratio = f"{r['bf16_vs_fp32']:.2f}" if "bf16_vs_fp32" in r else "-"
        print(f"{r['workers']:>8} {r['precision']:>9} {r['tokens_per_s']:>12,.0f} {r['scaling_vs_first']:>8.2f} "
              f"{r['efficiency']:>10.2f} {ratio:>9}")
    for r in rows:
        if (h := r["held"]) is not None:
            print(f"{r['workers']} worker(s), {r['precision']}, after step 2's backward: {h['reduction_buffers']} "
                  f"reduction buffer(s) of {h['buffer_bytes'] / 2 ** 20:.1f} MiB live; held beside model and "
                  f"optimizer {h['held_bytes'] / h['buffer_bytes']:.2f} x one buffer (the CPU's retry copy "
                  f"{h['retry_copy_bytes'] / h['buffer_bytes']:.2f} of it)")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return result


def _runs(a: argparse.Namespace, counts: list[int], precisions: list[str], rows: list[dict[str, Any]]) -> None:
    """Train each count in each precision, one after the other, appending its row to ``rows``."""
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as tmp:
        for n in counts:
            for precision in precisions:  # side by side: both precisions of a count back to back
                cfg = load_config(
                    preset_name=a.preset,
                    overrides=a.overrides + [f"train.workers={n}", f"train.steps={a.steps}", "train.val_every=0",
                                             "train.val_batches=1", f"train.precision={precision}"],
                )
                s = launch_local(cfg, Path(tmp) / f"w{n}-{precision}")
                rows.append({"workers": n, "precision": precision, "tokens_per_s": s["tokens_per_s"],
                             "wall_s": s["wall_s"], "final_loss": s["final_loss"],
                             "global_batch_tokens": n * cfg.data.micro_batch * cfg.data.seq_len,
                             "held": _held(Path(s["run_dir"]))})


def _held(run_dir: Path) -> dict[str, int] | None:
    """The largest of each of the workers' held figures (their reports' ``held_at_backward``)."""
    held = [h for f in sorted((run_dir / "workers").glob("w*.json"))
            if (h := json.loads(f.read_text()).get("held_at_backward"))]
    return {k: max(h[k] for h in held) for k in held[0]} if held else None


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Scaling against the smallest count (per precision) and bf16 against fp32 (per count), in place."""
    for precision in {r["precision"] for r in rows}:
        mine = [r for r in rows if r["precision"] == precision]
        for r in mine:
            r["scaling_vs_first"] = r["tokens_per_s"] / mine[0]["tokens_per_s"]
            r["efficiency"] = r["scaling_vs_first"] / (r["workers"] / mine[0]["workers"])
    fp32 = {r["workers"]: r["tokens_per_s"] for r in rows if r["precision"] == "fp32"}
    for r in rows:
        if r["precision"] == "bf16" and r["workers"] in fp32:
            r["bf16_vs_fp32"] = r["tokens_per_s"] / fp32[r["workers"]]
