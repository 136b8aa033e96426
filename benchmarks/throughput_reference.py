"""Unbroken against the plain loop a user would write: ``python -m benchmarks.throughput_reference``.

The same invocation runs, on the same model and batch shape (``benchmarks/plain_loop.py``), a plain PyTorch
loop, eager and (on a GPU, or with ``train.compile=true``) ``torch.compile``d, then unbroken with one worker and
with the ``--workers`` counts (default on a GPU: one worker and one per visible GPU), back to back, and prints
and writes the rows. Each unbroken row carries ``ratio_vs_plain``: its tokens/s over the plain loop's of the same
compile setting times the devices it uses (one per worker on GPUs, the whole machine on a CPU). On a GPU: MFU
(bf16 dense peak) and peak memory; ``--ac none,selective,full`` adds the plain loop's peak memory per activation
checkpointing mode. Throughput by worker count and precision alone: ``unbroken bench throughput``.

With ``--rounds N`` it runs the rows N times, each round in the reverse order of the one before (ABBA: a drift
of the machine weighs on every row alike); a row's figures are the means over the rounds, and each unbroken row
keeps its ratio to the plain loop of every round (``ratio_vs_plain_rounds``), the spread a shared machine gives.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from unbroken.agent.launcher import launch_local
from unbroken.bench.failover import store_per_step
from unbroken.bench._args import parse_with_overrides
from unbroken.bench.machine import machine_description
from unbroken.config import Config, load_config
from unbroken.job.parallelize import resolve_compile
from unbroken.jsonl import read_jsonl
from unbroken.models.factory import resolve_device
from unbroken.runtime.ledger import read_events

from benchmarks.plain_loop import flops_per_token, peak_flops, plain_loop

__all__ = ["main", "reference", "steady_window"]


def steady_window(run_dir: Path, steps: int, tokens_per_step: int) -> dict[str, Any]:
    """Tokens per second over the last half of the steps: total tokens over total time (a mean, so the
    steps that snapshot count as much as they cost; the median would hide them)."""
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    window = [r for r in train if r["step"] > steps // 2]
    seconds = sum(r["step_time_s"] for r in window)
    return {"window_steps": len(window), "window_tokens_per_s": len(window) * tokens_per_step / seconds
            if seconds > 0 else 0.0}


def snapshot_split(run_dir: Path, steps: int) -> dict[str, Any] | None:
    """The last half's steps of worker 0 by what its snapshots did in them: the steps that took one
    (``snapshot``), the other steps a write ran during (``overlapped``), and the rest (``other``); for each,
    the count, median and mean seconds, and the seconds above the others' median (what the snapshots cost
    there). Steps are the times between worker 0's commit records; None if it sealed no snapshot."""
    events = [e for e in read_events(run_dir) if e.get("worker") == 0]
    sealed = [e for e in events if e.get("event") == "snapshot_sealed"]
    if not sealed:
        return None
    ends = {e["step"] + 1: e["time"] for e in events if e.get("kind") == "commit"}
    taking = {e["step"] for e in sealed}
    writes = [(e["started_at"], e["sealed_at"]) for e in sealed]
    groups: dict[str, list[float]] = {"snapshot": [], "overlapped": [], "other": []}
    for done in sorted(ends):
        if done <= steps // 2 or done - 1 not in ends:
            continue
        start, end = ends[done - 1], ends[done]
        kind = ("snapshot" if done in taking else
                "overlapped" if any(a < end and start < b for a, b in writes) else "other")
        groups[kind].append(end - start)
    base = statistics.median(groups["other"]) if groups["other"] else None
    return {k: {"steps": len(v), "median_s": statistics.median(v) if v else None,
                "mean_s": statistics.mean(v) if v else None,
                "above_other_s": sum(v) - len(v) * base if base is not None else None}
            for k, v in groups.items()}


def split_line(split: dict[str, Any]) -> str:
    """:func:`snapshot_split` in one line (the seconds above the others' median only where there were others:
    in a run whose writes never stopped every step overlapped one)."""
    parts = []
    for k, g in split.items():
        if not g["steps"]:
            continue
        above = g.get("above_other_s")
        parts.append(f"{k} steps {g['steps']}, median {g['median_s']:.4f} s"
                     + (f", {above:+.2f} s above the others' median" if k != "other" and above is not None else ""))
    return "; ".join(parts)


def _write_partial(a: argparse.Namespace, entries: list[tuple[str, Any]], runs: list[list[dict[str, Any]]]) -> None:
    """The runs so far into ``a.out`` (``"partial": true``), so that a benchmark stopped by a time limit leaves
    the rows it finished; the full result replaces it at the end."""
    done = [{"entry": [kind, what if kind == "plain" else list(what)], "runs": rs}
            for (kind, what), rs in zip(entries, runs) if rs]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"benchmark": "throughput_reference", "partial": True, "preset": a.preset,
                                 "steps": a.steps, "precision": a.precision, "done": done}, indent=1))


def _keep_logs(run_dir: Path, into: Path) -> None:
    """A run's records (JSON lines, JSON and logs anywhere in it), not its checkpoints or snapshots."""
    for f in run_dir.rglob("*"):
        if f.is_file() and f.suffix in (".jsonl", ".json", ".log", ".txt") and "checkpoints" not in f.parts:
            dst = into / f.relative_to(run_dir)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)


def _cfg(a: argparse.Namespace, *extra: str) -> Config:
    return load_config(preset_name=a.preset, overrides=a.overrides + [
        f"train.steps={a.steps}", "train.val_every=0", "train.val_batches=1", f"train.precision={a.precision}",
        *extra])


def reference(a: argparse.Namespace) -> dict[str, Any]:
    """Run the reference rows; returns the JSON written to ``a.out``."""
    if a.precision not in ("fp32", "bf16"):
        raise ValueError(f"--precision {a.precision!r}: one precision, fp32 or bf16")
    cfg = _cfg(a)
    device = resolve_device(cfg.train.device)
    compiled = resolve_compile(cfg.train.compile, device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    counts = sorted({int(w) for w in a.workers.split(",") if w.strip()} if a.workers_given else
                    ({1, gpus} if gpus else {1}))
    fpt, peak = flops_per_token(cfg), peak_flops(device)
    kinds = {k.strip() for k in a.plain.split(",") if k.strip()}
    if not kinds or kinds - {"eager", "compiled"}:
        raise ValueError(f"--plain {a.plain!r}: need eager and/or compiled")
    modes = [m for m in ([False, True] if compiled else [False]) if ("compiled" if m else "eager") in kinds]
    if compiled and True not in modes:
        modes.append(True)  # unbroken compiles: its ratio needs the compiled plain loop
    settings = [x.strip() for x in a.snapshots.split(",") if x.strip()] or [str(cfg.snapshot.every)]
    entries: list[tuple[str, Any]] = ([("plain", mode) for mode in modes]
                                      + [("unbroken", (n, every)) for n in counts for every in settings])
    runs: list[list[dict[str, Any]]] = [[] for _ in entries]  # each entry's row of every round
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-ref-") as tmp:
        for r in range(a.rounds):
            for i in (range(len(entries)) if r % 2 == 0 else reversed(range(len(entries)))):
                kind, what = entries[i]
                if kind == "plain":
                    runs[i].append({"loop": "plain", "compile": what, "workers": 1,
                                    **plain_loop(cfg, device, compile=what, steps=a.plain_steps or a.steps)})
                    print(f"plain loop, compile={what}: {runs[i][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
                    _write_partial(a, entries, runs)
                    continue
                n, every = what
                runs[i].append(_unbroken_run(a, cfg, n, every, Path(tmp) / f"w{n}-s{every}-r{r}", compiled))
                _write_partial(a, entries, runs)
    rows = _rows(runs, gpus, fpt, peak)
    ac = [{"activation_checkpointing": m, **plain_loop(_cfg(a, f"train.activation_checkpointing={m}"), device,
                                                        compile=False, steps=max(5, a.steps // 3),
                                                        activation_checkpointing=m)}
          for m in (x.strip() for x in a.ac.split(",")) if m]
    result = {"benchmark": "throughput_reference", "preset": a.preset, "steps": a.steps, "rounds": a.rounds,
              "precision": a.precision,
              "device": str(device), "micro_batch": cfg.data.micro_batch, "seq_len": cfg.data.seq_len,
              "flops_per_token": fpt, "peak_flops": peak, "rows": rows, "activation_checkpointing": ac,
              "machine": machine_description()}
    _print(result)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return result


def _unbroken_run(a: argparse.Namespace, cfg: Config, n: int, every: str, run_dir: Path,
                  compiled: bool) -> dict[str, Any]:
    """One unbroken job of ``n`` workers with ``snapshot.every=every`` in ``run_dir``: its row (printed)."""
    run_cfg = _cfg(a, f"train.workers={n}", f"snapshot.every={every}")
    s = launch_local(run_cfg, run_dir)
    row = {"loop": "unbroken", "compile": compiled, "workers": n, "tokens_per_s": s["tokens_per_s"],
           **steady_window(Path(s["run_dir"]), a.steps, cfg.data.micro_batch * cfg.data.seq_len * n),
           "peak_memory_bytes": s.get("peak_memory_bytes"), "compiled_frames": s.get("compiled_frames"),
           "runtime_device_bytes": s.get("device_bytes"),
           "snapshot_every": run_cfg.snapshot.every, "snapshots": s.get("snapshots"), "wall_s": s["wall_s"],
           "snapshot_steps": snapshot_split(Path(s["run_dir"]), a.steps),
           "store_per_step": store_per_step(Path(s["run_dir"]))}
    if a.keep_logs is not None:
        _keep_logs(Path(s["run_dir"]), a.keep_logs / run_dir.name)
    # its final checkpoint is not read here: not kept beside the next jobs' (16 GB each at llama-1b)
    shutil.rmtree(Path(s["run_dir"]) / "checkpoints", ignore_errors=True)
    print(f"unbroken, {n} worker(s), snapshot.every={every}: {s['tokens_per_s']:,.0f} tokens/s (median), "
          f"{row['window_tokens_per_s']:,.0f} over the last half; snapshots {s.get('snapshots')}", flush=True)
    own = s.get("device_bytes") or {}
    print("  the runtime's own bytes on the device: " + (", ".join(f"{k.replace('_', ' ')} {v / 2 ** 20:,.1f} MiB"
                                                              for k, v in own.items()) or "-"), flush=True)
    if row["snapshot_steps"]:
        print("  last half, worker 0: " + split_line(row["snapshot_steps"]), flush=True)
    store = row["store_per_step"]
    if store.get("main_per_step") is not None:
        print(f"  store requests per step and worker: {store['main_per_step']:.2f} by the step, "
              f"{store.get('heartbeat_per_step') or 0:.2f} by the heartbeat thread", flush=True)
    return row


def _rows(runs: list[list[dict[str, Any]]], gpus: int, fpt: float, peak: float | None) -> list[dict[str, Any]]:
    """Each entry's row over the rounds, with its ratio to the plain loop of the same compile setting, its
    snapshot overhead against ``every=0`` of the same workers, and its MFU."""
    rows = [_mean_row(rs) for rs in runs]
    plain = {r["compile"]: r["tokens_per_s"] for r in rows if r["loop"] == "plain"}
    plain_rounds = {rs[0]["compile"]: [x["tokens_per_s"] for x in rs] for rs in runs if rs[0]["loop"] == "plain"}
    unsnapped = {r["workers"]: r["window_tokens_per_s"] for r in rows
                 if r["loop"] == "unbroken" and str(r["snapshot_every"]) == "0"}
    for r, rs in zip(rows, runs):
        devices = r["workers"] if gpus else 1
        if r["loop"] == "unbroken":
            r["ratio_vs_plain"] = r["tokens_per_s"] / (plain[r["compile"]] * devices)
            r["window_ratio_vs_plain"] = r["window_tokens_per_s"] / (plain[r["compile"]] * devices)
            r["ratio_vs_plain_rounds"] = [x["tokens_per_s"] / (p * devices)
                                          for x, p in zip(rs, plain_rounds[r["compile"]])]
            if r["workers"] in unsnapped and str(r["snapshot_every"]) != "0":
                r["snapshot_overhead"] = 1.0 - r["window_tokens_per_s"] / unsnapped[r["workers"]]
        r["mfu"] = r["tokens_per_s"] * fpt / (peak * (r["workers"] if gpus else 1)) if peak else None
    return rows


def _mean_row(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the same row's runs of every round: the last run's fields, its rates the means over the
    rounds (each round's ``tokens_per_s`` kept in ``tokens_per_s_rounds``)."""
    row = dict(rounds[-1])
    for key in ("tokens_per_s", "window_tokens_per_s"):
        if key in row:
            row[key] = sum(x[key] for x in rounds) / len(rounds)
    row["tokens_per_s_rounds"] = [x["tokens_per_s"] for x in rounds]
    return row


def _print(result: dict[str, Any]) -> None:
    gb = 2 ** 30
    print(f"{'loop':>9} {'compile':>7} {'workers':>7} {'snapshots':>9} {'tokens/s':>10} {'MFU':>6} {'vs plain':>8} "
          f"{'window':>10} {'vs plain':>8} {'overhead':>8} {'interval':>8} {'peak GiB':>8}")
    for r in result["rows"]:
        mfu = f"{r['mfu']:.3f}" if r.get("mfu") else "-"
        ratio = f"{r['ratio_vs_plain']:.3f}" if "ratio_vs_plain" in r else "-"
        mem = f"{r['peak_memory_bytes'] / gb:.1f}" if r.get("peak_memory_bytes") else "-"
        window = f"{r['window_tokens_per_s']:,.0f}" if "window_tokens_per_s" in r else "-"
        wratio = f"{r['window_ratio_vs_plain']:.3f}" if "window_ratio_vs_plain" in r else "-"
        over = f"{100 * r['snapshot_overhead']:.1f} %" if "snapshot_overhead" in r else "-"
        interval = str((r.get("snapshots") or {}).get("interval", "-"))
        print(f"{r['loop']:>9} {str(r['compile']):>7} {r['workers']:>7} {str(r.get('snapshot_every', '-')):>9} "
              f"{r['tokens_per_s']:>10,.0f} {mfu:>6} {ratio:>8} {window:>10} {wratio:>8} {over:>8} {interval:>8} "
              f"{mem:>8}")
    for r in result["rows"]:
        if len(r.get("ratio_vs_plain_rounds", ())) > 1:
            print(f"unbroken, {r['workers']} worker(s), snapshot.every={r['snapshot_every']}: ratio to the plain loop "
                  f"per round {', '.join(f'{x:.3f}' for x in r['ratio_vs_plain_rounds'])}")
    for r in result["rows"]:
        snaps = r.get("snapshots") or {}
        if snaps.get("every") == "auto":
            write, cost = snaps.get("slowest_write_s"), snaps.get("cost_s")
            print(f"unbroken, {r['workers']} worker(s), snapshot.every=auto: interval {snaps.get('interval')}, "
                  f"writes of {f'{write:.3f} s' if write is not None else '(none steady)'}, each costing the "
                  f"training {f'{cost:.3f} s' if cost is not None else '(not measured)'}; settled "
                  f"{snaps.get('settled')}, {snaps.get('taken')} taken, {snaps.get('skipped')} skipped")
    for r in result["activation_checkpointing"]:
        mem = f"{r['peak_memory_bytes'] / gb:.1f} GiB" if r.get("peak_memory_bytes") else "-"
        print(f"activation checkpointing {r['activation_checkpointing']:>9}: peak {mem}, "
              f"{r['tokens_per_s']:,.0f} tokens/s (plain eager loop)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the command line (``--section.field=value`` overrides too) and run :func:`reference`."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.throughput_reference", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--workers", default=None, help="comma-separated worker counts of the unbroken rows (default 1; "
                                                    "on a GPU 1 and one per visible GPU)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--precision", default="fp32", help="fp32 or bf16 (train.precision)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/throughput_reference.json"))
    ap.add_argument("--ac", default="", help="activation checkpointing modes to measure the plain loop's peak memory "
                                             "for (none,selective,full)")
    ap.add_argument("--snapshots", default="", help="snapshot.every settings to run unbroken with, side by side "
                                                    "(e.g. 0,auto; default: the config's)")
    ap.add_argument("--plain", default="eager,compiled",
                    help="the plain loops to run (eager, compiled; compiled only where compile is on)")
    ap.add_argument("--plain-steps", type=int, default=None, help="steps of each plain loop (default --steps)")
    ap.add_argument("--rounds", type=int, default=1, help="run the rows this many times, each round in the reverse "
                                                          "order of the last (default 1)")
    ap.add_argument("--keep-logs", type=Path, default=None,
                    help="copy each unbroken job's metrics, events, summary and logs (not its checkpoints) here")
    a, overrides = parse_with_overrides(ap, argv)
    a.overrides = overrides
    a.workers_given, a.workers = a.workers is not None, a.workers or "1"
    if a.rounds < 1:
        ap.error("--rounds: at least 1")
    return reference(a)


if __name__ == "__main__":
    main()
