"""MeCeFO convergence study: final validation perplexity under failure traces, per takeover policy.

``python -m benchmarks.mecefo_convergence [--presets tiny] [--steps N] [--traces ...] [--policies ...]``
trains each preset once without failures and once per (failing trace, policy)
with the single-process simulator (:mod:`unbroken.job.simulator`), 4 slots by
default: ``1 + 4 traces x 3 policies = 13`` runs. ``--cluster-workers job,16,64``
runs every failing trace once per entry: ``job`` takes the preset's failure rate
as the job's own, ``N`` as that of an N-worker cluster the job is part of
(``fault.cluster_workers``; a regime is then labelled ``high@64``). It reports each run's final
validation perplexity relative to the failure-free run of its preset, writes
JSON (``--out``) and plots the training/validation loss curves and the
relative perplexities (``--plot``).

Every run of a preset and seed shares the config, the seed (so the initial
weights and the data order) and the trace seed; only the trace and the policy
differ. ``--seeds 0,1,2`` repeats every point per seed, each against the
failure-free run of its own seed (mean and range reported);
``--seeds-per-point low=1,spread=1`` runs fewer seeds for the points of a
trace or a policy. ``--max-down 1`` caps the workers down at once
(``fault.max_down``); ``--global-batch 32`` holds the global batch while
``--slots`` changes (``data.micro_batch = global batch / slots``). The target:
``high`` within +2% perplexity of the failure-free run with ``neighbor`` (the
MeCeFO paper reports +1.6% to +2.2%), ``spread-approx`` no worse, and
``spread`` equal to the failure-free run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from unbroken.bench._args import parse_with_overrides
from unbroken.bench.machine import machine_description
from unbroken.config import Config, config_from_dict, load_config
from unbroken.mecefo.takeover import POLICIES

from benchmarks._final_eval import full_split_validation

DEFAULT_TRACES = ("none", "low", "mid", "high", "extreme")
TARGET_REL_PPL = 0.02
"""``high`` + ``neighbor`` should stay within this relative perplexity of the failure-free run."""
EXACT_REL_PPL = 1e-4
"""``spread`` counts as equal to the failure-free run within this relative perplexity (float summation order)."""


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.mecefo_convergence", description=__doc__.splitlines()[0],
                                 epilog="Other --section.field=value arguments override the config of every run.")
    ap.add_argument("--presets", default="tiny", help="comma-separated config presets (default tiny)")
    ap.add_argument("--traces", default=",".join(DEFAULT_TRACES), help="comma-separated failure traces; "
                    "the failure-free run 'none' is always added as the baseline")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated takeover policies")
    ap.add_argument("--slots", type=int, default=4, help="data-parallel slots (train.workers)")
    ap.add_argument("--cluster-workers", default="job",
                    help="comma-separated: 'job' (a preset's failure rate is the job's own) and/or cluster sizes "
                    "N >= --slots (the job is part of an N-worker cluster failing at that rate); each failing "
                    "trace runs once per entry (default job)")
    ap.add_argument("--steps", type=int, default=720,
                    help="optimizer steps per run (default 720: ~0.45 s each for tiny on 2 shared cores)")
    ap.add_argument("--micro-batch", type=int, default=None, help="rows per slot (data.micro_batch; default 8, "
                    "or --global-batch / --slots)")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="rows per step over all slots, held whatever --slots (a multiple of --slots)")
    ap.add_argument("--max-down", type=int, default=None,
                    help="at most this many workers down at once (fault.max_down; default: no cap)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds; every point runs once per seed")
    ap.add_argument("--seeds-per-point", default="",
                    help="fewer seeds for some points: comma-separated NAME=K, NAME a trace, a policy or "
                    "TRACE/POLICY; a point runs the first K seeds of the smallest K naming it (K=0 skips it)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per row (data.seq_len)")
    ap.add_argument("--val-batches", type=int, default=16, help="validation micro-batches per evaluation")
    ap.add_argument("--evals", type=int, default=10, help="validation evaluations per run (for the curves)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (1 is fastest on a shared CPU)")
    ap.add_argument("--jobs", type=int, default=1, help="runs trained at the same time, one process each")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/mecefo_convergence.json"))
    ap.add_argument("--plot", type=Path, default=Path("docs/mecefo_convergence.png"))
    ap.add_argument("--runs-dir", type=Path, default=None, help="keep every run directory here (default: temporary)")
    ap.add_argument("--full-val", action="store_true",
                    help="also evaluate every run's final parameters on the whole validation split, in order (the "
                    "same windows for every seed), and report the changes and targets on it too")
    ap.add_argument("--reuse", action="store_true",
                    help="with --runs-dir: read back runs of the same config finished there instead of training "
                    "them again (a study grown or resumed piece by piece)")
    a, overrides = parse_with_overrides(ap, argv)
    for name in ("slots", "steps", "micro_batch", "global_batch", "seq_len", "val_batches", "evals", "threads",
                 "jobs"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if a.reuse and a.runs_dir is None:
        ap.error("--reuse needs --runs-dir (where the finished runs are)")
    if a.max_down is not None and not 0 <= a.max_down < a.slots:
        ap.error(f"--max-down={a.max_down} must be in 0..{a.slots - 1} (fewer than --slots={a.slots}: a live "
                 "worker must take over)")
    try:
        a.cluster_workers = _clusters(a.cluster_workers, a.slots)
        a.micro_batch = micro_batch_for(a.slots, a.global_batch, a.micro_batch)
        a.seeds = _seeds(a.seeds)
        a.seeds_per_point = _per_point(a.seeds_per_point)
    except ValueError as e:
        ap.error(str(e))
    return a, overrides


def micro_batch_for(slots: int, global_batch: int | None, micro_batch: int | None) -> int:
    """Rows per slot: ``micro_batch`` (default 8), or ``global_batch / slots`` when the global batch is given.

    Raises:
        ValueError: ``slots`` does not divide ``global_batch`` (the message lists the slot counts that
            do), or both are given and disagree.
    """
    if global_batch is None:
        return 8 if micro_batch is None else micro_batch
    if global_batch % slots:
        fits = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
        raise ValueError(f"--slots={slots} does not divide --global-batch={global_batch} into whole rows per slot; "
                         f"slot counts that do: {', '.join(map(str, fits))}")
    if micro_batch is not None and micro_batch * slots != global_batch:
        raise ValueError(f"--micro-batch={micro_batch} x --slots={slots} != --global-batch={global_batch}; "
                         "give one of --micro-batch and --global-batch")
    return global_batch // slots


def _seeds(text: str) -> list[int]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() for t in items) or len(set(items)) != len(items):
        raise ValueError(f"--seeds {text!r}: need distinct integers >= 0, comma-separated (e.g. 0,1,2)")
    return [int(t) for t in items]


def _per_point(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, _, k = item.partition("=")
        if not (name and k.isdigit()):
            raise ValueError(f"--seeds-per-point {text!r}: each entry is NAME=K with K >= 0 "
                             "(e.g. low=1,spread=1,mid/spread=0)")
        out[name] = int(k)
    return out


def _seeds_of(a: argparse.Namespace, trace: str, policy: str) -> list[int]:
    """The seeds one (trace, policy) point runs with."""
    names = (trace, policy, f"{trace}/{policy}")
    k = min([v for name, v in a.seeds_per_point.items() if name in names], default=len(a.seeds))
    return a.seeds[:k]


def _clusters(text: str, slots: int) -> list[int | None]:
    """``job,16,64`` -> ``[None, 16, 64]``."""
    out: list[int | None] = []
    for item in (t.strip() for t in text.split(",")):
        if item == "job":
            out.append(None)
        elif item.isdigit() and int(item) >= slots:
            out.append(int(item))
        else:
            raise ValueError(f"--cluster-workers {text!r}: each entry is 'job' or an integer >= --slots={slots}")
    return list(dict.fromkeys(out))


def regime(trace: str, cluster_workers: int | None) -> str:
    """Label of a failure regime: ``high`` (the job's own rate) or ``high@64`` (a 64-worker cluster's)."""
    return trace if cluster_workers is None else f"{trace}@{cluster_workers}"


def _split(text: str, valid: tuple[str, ...] | None, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if valid is not None and t not in valid]
    if not items or unknown:
        raise ValueError(f"--{what} {text!r}: need a comma-separated subset of {', '.join(valid or ())}")
    return items


def _config(a: argparse.Namespace, overrides: list[str], preset: str, trace: str, policy: str,
            cluster_workers: int | None = None, seed: int = 0) -> Config:
    return load_config(preset_name=preset, overrides=overrides + [
        f"fault.cluster_workers={'none' if cluster_workers is None else cluster_workers}",
        f"fault.max_down={'none' if a.max_down is None else a.max_down}", f"train.seed={seed}",
        f"train.workers={a.slots}", f"train.steps={a.steps}", f"data.micro_batch={a.micro_batch}",
        f"data.seq_len={a.seq_len}", f"train.val_batches={a.val_batches}",
        f"train.val_every={max(1, a.steps // a.evals)}", f"fault.trace={trace}", f"mecefo.policy={policy}",
    ])


def run_one(cfg_dict: dict[str, Any], out_dir: str, threads: int, reuse: bool = False,
            full_val: bool = False) -> dict[str, Any]:
    """Simulate one config (in this process or a pool worker) and return its row with loss curves.

    With ``reuse``, a finished run of the same config already in ``out_dir`` (its ``summary.json``
    written, its ``config.json`` equal to ``cfg_dict``) is read back instead of trained again. With
    ``full_val``, its final parameters are also evaluated on the whole validation split
    (``benchmarks/_final_eval.py``).
    """
    import torch

    from unbroken.jsonl import read_jsonl
    from unbroken.job.simulator import simulate

    out = Path(out_dir)
    if reuse and _finished_run(out, cfg_dict):
        summary = json.loads((out / "summary.json").read_text())
    else:
        torch.set_num_threads(threads)
        summary = simulate(config_from_dict(cfg_dict), out, overwrite=True)
    records = read_jsonl(out / "metrics.jsonl")
    return {
        "summary": summary, "full_val": full_split_validation(out, cfg_dict) if full_val else None,
        "train_curve": [[r["step"], r["loss"]] for r in records if r["kind"] == "train"],
        "val_curve": [[r["step"], r["val_loss"]] for r in records if r["kind"] == "val"],
    }


def _finished_run(out: Path, cfg_dict: dict[str, Any]) -> bool:
    """A finished run of the same config is in ``out``.

    The stored config is read through the loader, so a run written before a
    field existed matches a config holding that field at its default.
    """
    try:
        if not (out / "summary.json").is_file():
            return False
        return config_from_dict(json.loads((out / "config.json").read_text())).to_dict() == cfg_dict
    except (OSError, ValueError):
        return False


Job = tuple[str, str, "str | None", int, Config]
"""One run: preset, regime label, policy (``None``: the failure-free baseline), seed, config."""


def _run_all(jobs: list[Job], a: argparse.Namespace, runs_dir: Path) -> list[dict[str, Any]]:
    """Train every (preset, trace, policy, seed) config; rows in the order of ``jobs``."""
    args = [(cfg.to_dict(), str(runs_dir / f"{p}-{t}-{pol or 'baseline'}-s{seed}"), a.threads, a.reuse,
             a.full_val) for p, t, pol, seed, cfg in jobs]
    if a.jobs == 1:
        results = []
        for (preset, trace, policy, seed, _), arg in zip(jobs, args):
            results.append(run_one(*arg))
            s = results[-1]["summary"]
            print(f"  {preset:>8} {trace:>8} {policy or '-':>14} seed {seed}: val ppl {s['val_ppl']:9.3f}  "
                  f"({s['wall_s']:.0f} s)", flush=True)
    else:
        with ProcessPoolExecutor(max_workers=a.jobs, mp_context=get_context("spawn")) as pool:
            results = list(pool.map(run_one, *zip(*args)))
    rows = []
    for (preset, trace, policy, seed, cfg), res in zip(jobs, results):
        s = res["summary"]
        rows.append({
            "preset": preset, "trace": trace, "cluster_workers": cfg.fault.cluster_workers, "policy": policy,
            "seed": seed, "max_down": cfg.fault.max_down, "val_ppl": s["val_ppl"], "val_loss": s["val_loss"],
            "final_loss": s["final_loss"], "degraded_fraction": s["degraded_fraction"],
            "down_fraction": s["down_fraction"], "approx_row_fraction": s["approx_row_fraction"],
            "outages": s["outages"], "deferred_failures": s.get("deferred_failures", 0),
            "most_down": s.get("most_down"), "wall_s": s["wall_s"],
            "val_ppl_full": res["full_val"]["val_ppl"] if res["full_val"] else None,
            "val_full_tokens": res["full_val"]["tokens"] if res["full_val"] else None,
            "train_curve": res["train_curve"], "val_curve": res["val_curve"],
        })
    return rows


def _relative(rows: list[dict[str, Any]], key: str = "val_ppl",
              prefix: str = "") -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """Adds ``rel_ppl`` (``key`` / failure-free ``key`` of the same preset and seed - 1) and
    ``ppl_per_row`` (rel_ppl / rows approximated, both in %) to each row, names prefixed with ``prefix``;
    returns preset -> trace -> policy -> {mean, min, max, n, seeds, approx_row_fraction, ppl_per_row}."""
    base = {(r["preset"], r["seed"]): r[key] for r in rows if r["trace"] == "none"}
    table: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    rel_key, per_key = f"{prefix}rel_ppl", f"{prefix}ppl_per_row"
    for r in rows:
        r[rel_key] = r[key] / base[(r["preset"], r["seed"])] - 1.0
        r[per_key] = r[rel_key] / r["approx_row_fraction"] if r["approx_row_fraction"] > 0 else None
        if r["trace"] != "none":
            cell = table.setdefault(r["preset"], {}).setdefault(r["trace"], {}).setdefault(r["policy"], {"runs": []})
            cell["runs"].append(r)
    for by_trace in table.values():
        for by_policy in by_trace.values():
            for policy, cell in by_policy.items():
                runs = cell.pop("runs")
                rel = [r[rel_key] for r in runs]
                per_row = [r[per_key] for r in runs if r[per_key] is not None]
                by_policy[policy] = {
                    "mean": statistics.fmean(rel), "min": min(rel), "max": max(rel), "n": len(rel),
                    "seeds": [r["seed"] for r in runs],
                    "approx_row_fraction": statistics.fmean(r["approx_row_fraction"] for r in runs),
                    "degraded_fraction": statistics.fmean(r["degraded_fraction"] for r in runs),
                    "ppl_per_row": statistics.fmean(per_row) if per_row else None,
                }
    return table


def _targets(table: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    """The targets on the seed means of every ``high`` regime."""
    out: dict[str, Any] = {}
    for preset, by_trace in table.items():
        for label, high in by_trace.items():
            if label.split("@")[0] != "high":
                continue
            key = f"{preset}/{label}"
            if "neighbor" in high:
                out[f"{key}/neighbor_within_2pct"] = high["neighbor"]["mean"] <= TARGET_REL_PPL
            if "neighbor" in high and "spread-approx" in high:
                out[f"{key}/spread_approx_no_worse_than_neighbor"] = (
                    high["spread-approx"]["mean"] <= high["neighbor"]["mean"])
            if "spread" in high:
                out[f"{key}/spread_equals_failure_free"] = abs(high["spread"]["mean"]) <= EXACT_REL_PPL
    return out


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def _plot(rows: list[dict[str, Any]], presets: list[str], policies: list[str], path: Path,
          table: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> None:
    """Training loss (moving average), validation loss (first seed), relative perplexity bars (seed mean,
    min-max range) and every run's change against its fraction of rows approximated, per preset."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg, no pyplot global state

    fig = Figure(figsize=(21, 4.2 * len(presets)), layout="constrained")
    axes = fig.subplots(len(presets), 4, squeeze=False)
    colors = {"none": "black", "low": "tab:green", "mid": "tab:blue", "high": "tab:orange", "extreme": "tab:red"}
    styles = dict(zip(POLICIES, ("-", "--", ":")))
    for (ax_train, ax_val, ax_bar, ax_frac), preset in zip(axes, presets):
        mine = [r for r in rows if r["preset"] == preset]
        first = min(r["seed"] for r in mine)
        for r in (r for r in mine if r["seed"] == first):
            label = "failure-free" if r["policy"] is None else f"{r['trace']} / {r['policy']}"
            kw = {"color": colors.get(r["trace"].split("@")[0], "gray"), "linestyle": styles.get(r["policy"], "-"),
                  "linewidth": 1.0, "label": label}
            steps, losses = zip(*r["train_curve"])
            ax_train.plot(steps, _smooth(list(losses), max(1, len(losses) // 25)), **kw)
            if r["val_curve"]:
                ax_val.plot(*zip(*r["val_curve"]), marker=".", **kw)
        ax_train.set(title=f"{preset}: training loss (moving average, seed {first})", xlabel="step", ylabel="loss")
        ax_val.set(title=f"{preset}: validation loss (seed {first})", xlabel="step", ylabel="loss")
        ax_val.legend(fontsize=7, ncol=2)
        _bars(ax_bar, table.get(preset, {}), policies)
        ax_bar.set_title(f"{preset}: final val perplexity vs failure-free")
        _by_fraction(ax_frac, [r for r in mine if r["policy"] is not None], policies)
        ax_frac.set_title(f"{preset}: perplexity change vs rows approximated")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _bars(ax: Any, by_trace: dict[str, dict[str, dict[str, Any]]], policies: list[str]) -> None:
    traces = list(by_trace)
    width = 0.8 / max(1, len(policies))
    for j, policy in enumerate(policies):
        cells = [by_trace[t].get(policy) for t in traces]
        xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(traces))]
        mean = [100 * c["mean"] if c else math.nan for c in cells]
        err = [[100 * (c["mean"] - c["min"]) if c else 0 for c in cells],
               [100 * (c["max"] - c["mean"]) if c else 0 for c in cells]]
        ax.bar(xs, mean, width, yerr=err, capsize=2, label=policy)
    ax.axhline(100 * TARGET_REL_PPL, color="gray", linestyle="--", linewidth=0.8, label="+2% target")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(traces)), traces)
    ax.set_ylabel("val perplexity change (%), seed mean and range")
    ax.legend(fontsize=7)


def _by_fraction(ax: Any, rows: list[dict[str, Any]], policies: list[str]) -> None:
    """Each failing run as a point: fraction of rows approximated (x) against perplexity change (y)."""
    markers = dict(zip(POLICIES, ("o", "s", "^")))
    for policy in policies:
        pts = sorted((100 * r["approx_row_fraction"], 100 * r["rel_ppl"]) for r in rows if r["policy"] == policy)
        if pts:
            ax.plot(*zip(*pts), marker=markers.get(policy, "o"), linestyle="", label=policy)
    ax.axhline(100 * TARGET_REL_PPL, color="gray", linestyle="--", linewidth=0.8, label="+2% target")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set(xlabel="rows approximated (%)", ylabel="val perplexity change (%)")
    ax.legend(fontsize=7)


def _print_table(rows: list[dict[str, Any]], table: dict[str, dict[str, dict[str, dict[str, Any]]]],
                 policies: list[str], key: str = "val_ppl", what: str = "val ppl") -> None:
    for preset, by_trace in table.items():
        base = [r[key] for r in rows if r["preset"] == preset and r["trace"] == "none"]
        print(f"\n{preset}: failure-free {what} {statistics.fmean(base):.3f} (mean of {len(base)} seed(s)); "
              f"change of final {what}, seed mean [min, max] (rows approximated):")
        print(f"{'trace':>12} {'degraded':>9} " + " ".join(f"{p:>30}" for p in policies))
        for trace, by_policy in by_trace.items():
            degraded = statistics.fmean(c["degraded_fraction"] for c in by_policy.values())
            cells = " ".join(
                f"{100 * c['mean']:>+7.2f}% [{100 * c['min']:+.1f},{100 * c['max']:+.1f}] "
                f"({100 * c['approx_row_fraction']:.1f}%)".rjust(30) if (c := by_policy.get(p)) else f"{'-':>30}"
                for p in policies)
            print(f"{trace:>12} {degraded:>8.0%} {cells}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a, overrides = _parse(argv)
    presets = _split(a.presets, None, "presets")
    traces = [t for t in _split(a.traces, DEFAULT_TRACES, "traces") if t != "none"]
    policies = _split(a.policies, tuple(POLICIES), "policies")
    jobs: list[Job] = []
    for preset in presets:
        # With no failure nothing is approximated, so one baseline per seed serves every policy.
        jobs += [(preset, "none", None, seed, _config(a, overrides, preset, "none", policies[0], seed=seed))
                 for seed in a.seeds]
        jobs += [(preset, regime(t, n), p, seed, _config(a, overrides, preset, t, p, n, seed))
                 for t in traces for n in a.cluster_workers for p in policies for seed in _seeds_of(a, t, p)]
    t0 = time.perf_counter()
    print(f"mecefo-convergence: {len(jobs)} runs of {a.steps} steps, {a.jobs} at a time", flush=True)
    with tempfile.TemporaryDirectory(prefix="unbroken-convergence-") as tmp:
        rows = _run_all(jobs, a, a.runs_dir or Path(tmp))
    wall_s = time.perf_counter() - t0
    table = _relative(rows)
    cfg = jobs[0][4]
    result = {
        "benchmark": "mecefo-convergence", "presets": presets, "traces": ["none", *traces], "policies": policies,
        "settings": {"slots": a.slots, "steps": a.steps, "micro_batch": a.micro_batch,
                     "global_batch": a.micro_batch * a.slots, "seq_len": a.seq_len, "max_down": a.max_down,
                     "seeds": a.seeds, "seeds_per_point": a.seeds_per_point,
                     "val_batches": a.val_batches, "threads": a.threads, "jobs": a.jobs, "overrides": overrides,
                     "job_hours": cfg.fault.job_hours,
                     "cluster_workers": a.cluster_workers, "rank": {j[0]: j[4].mecefo.rank for j in jobs},
                     "tau": cfg.mecefo.tau, "lr": cfg.optim.lr, "data_source": cfg.data.source},
        "rel_val_ppl": {p: {t: {pol: c["mean"] for pol, c in bt.items()} for t, bt in by.items()}
                        for p, by in table.items()},
        "rel_val_ppl_stats": table, "targets": _targets(table), "runs": rows, "wall_s": wall_s,
        "machine": machine_description(),
    }
    _print_table(rows, table, policies)
    print(f"\ntargets: {result['targets']}")
    if a.full_val:
        full = _relative(rows, "val_ppl_full", "full_")
        result.update(rel_val_ppl_full_stats=full, targets_full_split=_targets(full))
        _print_table(rows, full, policies, "val_ppl_full", "val ppl on the whole validation split")
        print(f"\ntargets on the whole validation split: {result['targets_full_split']}")
    print(f"wall time {wall_s:.0f} s")
    _plot(rows, presets, policies, a.plot, table)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out} and {a.plot}")
    return result


if __name__ == "__main__":
    main()
