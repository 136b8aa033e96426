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

With ``--accumulate K`` it measures gradient accumulation instead: for each worker count, the same global
batch as ``K`` accumulated micro-batches per worker (``train.global_batch``) and as one micro-batch of ``K``
times the rows, the two runs alternating ``--repeats`` times (each pair in the other order than the last);
it reports the median tokens/s of each and the median of the pairs' ratios (``accumulation_vs_one``), beside
the same ratio of a plain PyTorch loop on the same model and rows in this process (``plain_accumulation_vs_one``:
forward and backward of K micro-batches accumulated against one of K times the rows, one thread), which is
what accumulation costs before unbroken adds anything.

Unbroken against what a user would run instead (a plain PyTorch loop, eager and
compiled, on the same model and batch), with MFU and memory on a GPU, is run from
the repository: ``python -m benchmarks.throughput_reference``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    ap.add_argument("--accumulate", type=int, default=0, metavar="K",
                    help="compare K accumulated micro-batches per worker with one of K times the rows (0: off)")
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs per worker count with --accumulate")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON result (default benchmarks/results/throughput.json, or throughput_accumulation.json)")
    a, overrides = parse_with_overrides(ap, argv)
    a.overrides = overrides
    counts = [int(w) for w in a.workers.split(",") if w.strip()]
    if not counts or min(counts) < 1:
        raise ValueError(f"--workers {a.workers!r}: need positive comma-separated counts, e.g. 1,2,4")
    if a.accumulate:
        return _accumulation(a, counts)
    a.out = a.out or Path("benchmarks/results/throughput.json")
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


def _accumulation(a: argparse.Namespace, counts: list[int]) -> dict[str, Any]:
    """``--accumulate K``: K accumulated micro-batches per worker against one micro-batch of K times the rows."""
    if a.accumulate < 2 or a.repeats < 1:
        raise ValueError(f"--accumulate {a.accumulate} --repeats {a.repeats}: need K >= 2 and repeats >= 1")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as tmp:
        for n in counts:
            base = load_config(preset_name=a.preset, overrides=a.overrides)
            mb, k = base.data.micro_batch, a.accumulate
            common = [f"train.workers={n}", f"train.steps={a.steps}", "train.val_every=0", "train.val_batches=1"]
            shapes = {"accumulated": [f"data.micro_batch={mb}", f"train.global_batch={n * mb * k}"],
                      "one": [f"data.micro_batch={mb * k}"]}
            got: dict[str, list[float]] = {name: [] for name in shapes}
            for i in range(a.repeats):
                for name in (list(shapes) if i % 2 == 0 else list(shapes)[::-1]):  # alternate who goes first
                    cfg = load_config(preset_name=a.preset, overrides=a.overrides + common + shapes[name])
                    got[name].append(launch_local(cfg, Path(tmp) / f"w{n}-{name}-{i}")["tokens_per_s"])
            med = {name: statistics.median(v) for name, v in got.items()}
            pairs = [a / b for a, b in zip(got["accumulated"], got["one"])]
            rows.append({"workers": n, "micro_batches_per_worker": k, "micro_batch": mb,
                         "global_batch_rows": n * mb * k, "tokens_per_s": got, "median_tokens_per_s": med,
                         "pair_ratios": pairs, "accumulation_vs_one": statistics.median(pairs),
                         "plain_accumulation_vs_one": _plain_accumulation(a, mb, k)})
    result = {"benchmark": "throughput_accumulation", "preset": a.preset, "steps": a.steps, "repeats": a.repeats,
              "overrides": a.overrides, "rows": rows, "machine": machine_description()}
    print(f"{'workers':>8} {'K':>3} {'rows':>6} {'accumulated tok/s':>18} {'one batch tok/s':>16} {'ratio':>6} "
          f"{'plain loop ratio':>16}")
    for r in rows:
        m = r["median_tokens_per_s"]
        print(f"{r['workers']:>8} {r['micro_batches_per_worker']:>3} {r['global_batch_rows']:>6} "
              f"{m['accumulated']:>18,.0f} {m['one']:>16,.0f} {r['accumulation_vs_one']:>6.3f} "
              f"{r['plain_accumulation_vs_one']:>16.3f}")
    out = a.out or Path("benchmarks/results/throughput_accumulation.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


def _plain_accumulation(a: argparse.Namespace, mb: int, k: int, repeats: int = 5) -> float:
    """A plain PyTorch loop's time for one micro-batch of ``k * mb`` rows over its time for ``k`` accumulated
    micro-batches of ``mb`` rows (same model, same rows, one thread; the median of ``repeats`` pairs)."""
    import time

    import torch
    import torch.nn.functional as F

    from unbroken.job.builder import build_job
    from unbroken.models.hf_llama import logits_of

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = load_config(preset_name=a.preset, overrides=a.overrides + [f"data.micro_batch={mb * k}",
                                                                         "train.workers=1"])
        job = build_job(cfg, torch.device("cpu"), None)
        model = job.model
        x, y = job.sampler.batch(0, 0, (0, mb * k))

        def loss_of(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            logits = logits_of(model(xs))
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ys.reshape(-1))

        def one() -> float:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss_of(x, y).backward()
            return time.perf_counter() - t0

        def accumulated() -> float:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            for i in range(k):
                (loss_of(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) / k).backward()
            return time.perf_counter() - t0

        one(), accumulated()  # warm-up
        return statistics.median(one() / accumulated() for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)


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
