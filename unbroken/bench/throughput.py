"""Throughput of the data-parallel trainer for several worker counts.

``unbroken bench throughput --preset debug --workers 1,2,4 --out FILE.json``
trains the same config with each worker count, one after the other in one
invocation, and reports the median steady-state tokens/s (the first fifth of
steps is warm-up and dropped) and the scaling ratio against the smallest count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from unbroken.bench._args import parse_with_overrides
from unbroken.config import load_config
from unbroken.agent.launcher import launch_local


def machine_description() -> dict[str, Any]:
    import torch

    return {
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken bench throughput", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker counts")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/throughput.json"))
    a, a.overrides = parse_with_overrides(ap, argv)
    counts = [int(w) for w in a.workers.split(",") if w.strip()]
    if not counts or min(counts) < 1:
        raise ValueError(f"--workers {a.workers!r}: need positive comma-separated counts, e.g. 1,2,4")
    rows = []
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as tmp:
        for n in counts:
            cfg = load_config(
                preset_name=a.preset,
                overrides=a.overrides + [f"train.workers={n}", f"train.steps={a.steps}", "train.val_every=0", "train.val_batches=1"],
            )
            s = launch_local(cfg, Path(tmp) / f"w{n}")
            rows.append({"workers": n, "tokens_per_s": s["tokens_per_s"], "wall_s": s["wall_s"],
                         "global_batch_tokens": n * cfg.data.micro_batch * cfg.data.seq_len})
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["scaling_vs_first"] = r["tokens_per_s"] / base
        r["efficiency"] = r["scaling_vs_first"] / (r["workers"] / rows[0]["workers"])
    result = {"benchmark": "throughput", "preset": a.preset, "steps": a.steps, "rows": rows,
              "machine": machine_description()}
    print(f"{'workers':>8} {'tokens/s':>12} {'scaling':>8} {'efficiency':>10}")
    for r in rows:
        print(f"{r['workers']:>8} {r['tokens_per_s']:>12,.0f} {r['scaling_vs_first']:>8.2f} {r['efficiency']:>10.2f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return result
