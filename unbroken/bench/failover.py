"""Failover benchmark: overhead, stall per failure, time back to full strength, throughput under a trace.

``unbroken bench failover --preset debug --nodes 2 --workers-per-node 2 --out FILE.json``
runs, side by side in one invocation, on one machine (nodes on loopback):

1. **overhead**: failure-free step time of the fault-tolerant step protocol
   relative to plain data parallelism, no faults, median step time after
   warm-up; target <= 1.03. Measured twice: in one job whose steps alternate
   between the two (``fault.recovery=alternate``: same processes, cores and
   group, so drift between runs cancels; the reported ratio), and from
   separate runs of each (``fault.recovery=restart`` vs ``takeover``),
   interleaved;
2. **stall per crash / per hang**: SIGKILL mid-forward and SIGSTOP of a worker;
   the survivors' gap between consecutive applied steps minus a normal step
   (``unbroken report``); targets <= 0.5 s and <= heartbeat timeout + 0.5 s;
3. **lost steps and samples**: from the ledger; target 0;
4. **back to full strength**: from a worker's kill to its re-admission, with a
   warm standby, started cold from the node's template process (target <= 2 s)
   and started cold as a fresh process (``fault.template=false``), and the
   members' stall when it is admitted (the gap ending at its rejoin step minus a
   normal step);
5. **node loss** (``--parts node``): node 1's agent, workers and standby
   SIGKILLed together; loss → both its workers back at full strength, with a
   spare node (``spare_nodes=1``: it takes the rank once the node's agent and
   workers are known dead) and without (a replacement agent 1 s later, as the
   demo's scheduler plays it); target <= 5 s;
6. **throughput under a failure trace** (default ``high``) relative to
   failure-free, for each takeover policy, and for checkpoint-restart (plain data
   parallelism; any failure restarts every worker from the last checkpoint) with
   the steps it had to redo. Throughput = committed tokens / wall-clock from the
   first to the last applied step.

The stall per crash and per hang over repeated runs, with where it went and the attempts a rejoin aborted, is a
study in the repository that runs its jobs through this module: ``python -m benchmarks.failover_stall``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from unbroken.agent.launcher import launch
from unbroken.report.run_report import summarize_run
from unbroken.bench.machine import machine_description
from unbroken.bench._args import parse_with_overrides
from unbroken.config import Config, load_config
from unbroken.runtime.recovery import recovery
from unbroken.jsonl import read_jsonl


def _cfg(a: argparse.Namespace, *extra: str) -> Config:
    return load_config(preset_name=a.preset, overrides=a.overrides + [
        f"train.steps={a.steps}", "train.val_every=0", "train.val_batches=1", *extra])


def _run(a: argparse.Namespace, tmp: Path, name: str, cfg: Config, **kw: Any) -> dict[str, Any]:
    run_dir = tmp / name
    summary = launch(cfg, run_dir, nodes=a.nodes, workers_per_node=a.workers_per_node, store=a.store, **kw)
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    steady = [r["step_time_s"] for r in train[max(3, len(train) // 5):]]
    span = train[-1]["time"] - train[0]["time"] if len(train) > 1 else float("nan")
    tokens = (len(train) - 1) * cfg.train.workers * cfg.data.micro_batch * cfg.data.seq_len
    out = {"name": name, "run_dir": str(run_dir), "median_step_s": statistics.median(steady),
           "throughput_tokens_per_s": tokens / span, "summary": summary}
    if recovery(cfg.fault.recovery).survives_failures:
        out["report"] = summarize_run(run_dir)
    return out


def store_per_step(run_dir: Path) -> dict[str, Any]:
    """The store's requests per trained step of a failure-free run, from the workers' reports: the main
    connection's (the step's own: votes, and the leader's duties) and the heartbeat thread's, each a mean over
    the workers, with the mean time of one request."""
    out: dict[str, Any] = {}
    reports = [json.loads(p.read_text()) for p in sorted((Path(run_dir) / "workers").glob("w*.json"))]
    for conn in ("main", "heartbeat"):
        rows = [(r["store"][conn], r["store"]["steps"]) for r in reports if r.get("store") and r["store"]["steps"]]
        if rows:
            out[f"{conn}_per_step"] = statistics.fmean(u["round_trips"] / n for u, n in rows)
            trips = sum(u["round_trips"] for u, _ in rows)
            out[f"{conn}_us_per_request"] = 1e6 * sum(u["seconds"] for u, _ in rows) / trips if trips else None
    return out


def _overhead(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    plain, ft, store = [], [], []
    for rep in range(a.repeats):
        plain.append(_run(a, tmp, f"plain{rep}", _cfg(a, "fault.recovery=restart"))["median_step_s"])
        run = _run(a, tmp, f"takeover{rep}", _cfg(a))
        ft.append(run["median_step_s"])
        store.append(store_per_step(Path(run["run_dir"])))
    # One job whose steps alternate between plain data parallelism (even) and the protocol (odd).
    alt = _cfg(a, "fault.recovery=alternate", "train.log_every=1", f"train.steps={2 * a.steps}")
    run_dir = tmp / "alternate"
    launch(alt, run_dir, nodes=a.nodes, workers_per_node=a.workers_per_node, store=a.store)
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    steady = train[max(4, len(train) // 5):]
    by_kind = {k: [r["step_time_s"] for r in steady if (r["step"] - 1) % 2 == k] for k in (0, 1)}
    return {"plain_step_s": plain, "takeover_step_s": ft,
            "ratio_separate_runs": statistics.median(ft) / statistics.median(plain) if plain else None,
            "alternating": {"steps_each": len(by_kind[0]), "plain_median_s": statistics.median(by_kind[0]),
                            "takeover_median_s": statistics.median(by_kind[1]),
                            "plain_mean_s": statistics.fmean(by_kind[0]),
                            "takeover_mean_s": statistics.fmean(by_kind[1])},
            "ratio": statistics.median(by_kind[1]) / statistics.median(by_kind[0]), "target": 1.03,
            "store_per_step": store}


def _failures(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    s0 = a.steps // 4
    crash = _run(a, tmp, "crash", _cfg(a), standby=True, fail_at=(
        f"step={s0}:worker=1:kill:phase=forward:back={s0 + 1},"
        f"step={2 * s0}:worker=2:kill:phase=allreduce:back={2 * s0 + 1},"
        f"step={3 * s0}:worker=3:kill:phase=forward:back={3 * s0 + 1}"))
    hang = _run(a, tmp, "hang", _cfg(a), standby=True, fail_at=f"step={s0}:worker=2:stop:phase=forward:back={s0 + 1}")
    # A cold start imports torch and rebuilds everything: give it enough steps to get back in.
    cold = _run(a, tmp, "rejoin_cold", _cfg(a, f"train.steps={max(a.steps, 200)}"), standby=False,
                fail_at=f"step={s0}:worker=1:kill:back={s0 + 1}")
    # The same, every worker a fresh interpreter (no template process): what the template saves.
    fresh = _run(a, tmp, "rejoin_fresh", _cfg(a, f"train.steps={max(a.steps, 200)}", "fault.template=false"),
                 standby=False, fail_at=f"step={s0}:worker=1:kill:back={s0 + 1}")
    hb = _cfg(a).fault.heartbeat_timeout_s

    def stalls(r: dict[str, Any]) -> list[float]:
        return [f["stall_s"] for f in r["report"]["failure_details"] if f["stall_s"] is not None]

    def back(r: dict[str, Any]) -> list[float]:
        return [x["down_to_back_s"] for x in r["report"]["rejoins"] if x["down_to_back_s"] is not None]

    def admission(r: dict[str, Any]) -> list[float]:
        """The members' stall when a worker is admitted: the gap ending at its rejoin step minus a normal step."""
        at = {x["step"]: x["time"] for x in read_jsonl(Path(r["run_dir"]) / "metrics.jsonl") if x["kind"] == "train"}
        steps = [x["step"] for x in r["report"]["rejoins"]]
        return [at[s] - at[s - 1] - r["report"]["normal_step_s"] for s in steps if s in at and s - 1 in at]

    return {
        "crash_stall_s": stalls(crash), "crash_target_s": 0.5,
        "hang_stall_s": stalls(hang), "hang_target_s": hb + 0.5, "heartbeat_timeout_s": hb,
        "lost_steps": sum(r["report"]["lost_steps"] for r in (crash, hang, cold, fresh)),
        "rows_never_or_twice": sum(r["report"]["rows_trained_never"] + r["report"]["rows_trained_twice"]
                                   for r in (crash, hang, cold, fresh)),
        "back_to_full_strength_s": {"warm_standby": back(crash) + back(hang), "cold_start": back(cold),
                                    "cold_start_fresh_process": back(fresh)},
        "cold_start_target_s": 2.0,
        "rejoin_stall_s": {"warm_standby": admission(crash) + admission(hang), "cold_start": admission(cold),
                           "cold_start_fresh_process": admission(fresh)},
    }


NODE_REPLACEMENT_S = 1.0
"""Without a spare, the scheduler brings the lost node's replacement this long after the loss (as the demo)."""


def _node(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    if a.nodes < 2:
        raise ValueError("--parts node needs --nodes 2 or more (node 1 is lost)")
    s0 = a.steps // 4
    # Enough steps for a replacement that imports everything cold to get back in before the end.
    cfg = _cfg(a, f"train.steps={max(a.steps, 200)}")
    runs = {name: _run(a, tmp, f"node_{name}", cfg, standby=True, fail_at=f"step={s0}:node=1:kill",
                       replace_lost_nodes_s=NODE_REPLACEMENT_S, spare_nodes=spares)
            for name, spares in (("spare", 1), ("replacement", 0))}

    def back(r: dict[str, Any]) -> list[float]:
        lost = set(range(a.workers_per_node, 2 * a.workers_per_node))
        return [x["down_to_back_s"] for x in r["report"]["rejoins"]
                if x["down_to_back_s"] is not None and x["worker"] in lost]

    return {"target_s": 5.0, "replacement_delay_s": NODE_REPLACEMENT_S,
            "back_to_full_strength_s": {name: back(r) for name, r in runs.items()},
            "stall_s": {name: [f["stall_s"] for f in r["report"]["failure_details"] if f["stall_s"] is not None]
                        for name, r in runs.items()},
            "lost_steps": sum(r["report"]["lost_steps"] for r in runs.values()),
            "rows_never_or_twice": sum(r["report"]["rows_trained_never"] + r["report"]["rows_trained_twice"]
                                       for r in runs.values())}


def _trace(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    extra = [f"fault.job_hours={a.job_hours}", f"train.checkpoint_every={a.checkpoint_every}"]
    base = _run(a, tmp, "trace_none", _cfg(a, *extra))
    rows = {"none": {"throughput_ratio": 1.0, "tokens_per_s": base["throughput_tokens_per_s"]}}
    for policy in a.policies.split(","):
        r = _run(a, tmp, f"trace_{policy}", _cfg(a, *extra, f"fault.trace={a.trace}", f"mecefo.policy={policy}"),
                 standby=True)
        rows[policy] = {"throughput_ratio": r["throughput_tokens_per_s"] / base["throughput_tokens_per_s"],
                        "tokens_per_s": r["throughput_tokens_per_s"], "failures": r["summary"]["failures"],
                        "lost_steps": r["report"]["lost_steps"], "degraded_steps": r["report"]["degraded_steps"],
                        "stall_median_s": r["report"]["stall_per_failure_s"]["median"],
                        "ledger_ok": r["report"]["ledger_ok"]}
    cr = _run(a, tmp, "trace_restart", _cfg(a, *extra, f"fault.trace={a.trace}", "fault.recovery=restart"))
    rows["checkpoint-restart"] = {
        "throughput_ratio": cr["throughput_tokens_per_s"] / base["throughput_tokens_per_s"],
        "tokens_per_s": cr["throughput_tokens_per_s"], "restarts": len(cr["summary"]["job_restarts"]),
        "lost_steps": cr["summary"]["steps_redone"]}
    return {"trace": a.trace, "job_hours": a.job_hours, "steps": a.steps, "checkpoint_every": a.checkpoint_every,
            "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken bench failover", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=2,
                    help="separate plain and protocol runs for the overhead, interleaved (0: only the alternating job)")
    ap.add_argument("--trace", default="high")
    ap.add_argument("--job-hours", type=float, default=2.0,
                    help="wall-clock hours the trace runs stand for (scales the trace to --steps)")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="persistent checkpoints (checkpoint-restart)")
    ap.add_argument("--policies", default="neighbor,spread,spread-approx")
    ap.add_argument("--parts", default="overhead,failures,trace",
                    help="which measurements to run: overhead, failures, node, trace")
    ap.add_argument("--store", default=None, metavar="etcd://HOST:PORT[,...]",
                    help="every job's store on this etcd cluster (default: embedded); see also unbroken bench store")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/failover.json"))
    a, overrides = parse_with_overrides(ap, argv)
    a.overrides = overrides
    parts = {"overhead": _overhead, "failures": _failures, "node": _node, "trace": _trace}
    unknown = set(a.parts.split(",")) - set(parts)
    if unknown:
        raise ValueError(f"--parts: unknown {', '.join(sorted(unknown))}; valid: {', '.join(parts)}")
    result: dict[str, Any] = {"benchmark": "failover", "preset": a.preset, "store": a.store or "embedded",
                              "nodes": a.nodes,
                              "workers_per_node": a.workers_per_node, "machine": machine_description()}
    with tempfile.TemporaryDirectory(prefix="unbroken-failover-") as tmp:
        for name in a.parts.split(","):
            result[name] = parts[name](a, Path(tmp))
    _print(result)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {a.out}")
    return result


def _print(r: dict[str, Any]) -> None:
    if "overhead" in r:
        o = r["overhead"]
        alt = o["alternating"]
        print(f"failure-free step time, protocol / plain DP, steps alternating in one job: {o['ratio']:.3f} "
              f"(median of {alt['steps_each']} steps each; means {alt['takeover_mean_s'] / alt['plain_mean_s']:.3f})"
              f"  (target <= {o['target']})")
        if o["ratio_separate_runs"] is not None:
            print(f"  the same from {len(o['plain_step_s'])} separate runs of each, interleaved: "
                  f"{o['ratio_separate_runs']:.3f}")
        for s in o.get("store_per_step", []):
            if s:
                print(f"  store requests per failure-free step and worker: {s['main_per_step']:.2f} by the step "
                      f"({s['main_us_per_request'] or 0:.0f} us each), {s['heartbeat_per_step']:.2f} by the "
                      f"heartbeat thread ({s['heartbeat_us_per_request'] or 0:.0f} us each)")
    if "failures" in r:
        f = r["failures"]
        print(f"stall per crash (s): {[round(x, 3) for x in f['crash_stall_s']]}  (target <= {f['crash_target_s']})")
        print(f"stall per hang  (s): {[round(x, 3) for x in f['hang_stall_s']]}  (target <= {f['hang_target_s']})")
        print(f"lost steps: {f['lost_steps']}  rows never/twice: {f['rows_never_or_twice']}")
        b = f["back_to_full_strength_s"]
        print(f"kill -> back at full strength (s): warm standby {[round(x, 2) for x in b['warm_standby']]}, "
              f"cold start forked from the template {[round(x, 2) for x in b['cold_start']]} "
              f"(target <= {f.get('cold_start_target_s', 2.0)}), "
              f"cold start as a fresh process {[round(x, 2) for x in b.get('cold_start_fresh_process', [])]}")
        if "rejoin_stall_s" in f:
            j = f["rejoin_stall_s"]
            print(f"members' stall at a rejoin (s): warm standby {[round(x, 3) for x in j['warm_standby']]}, "
                  f"cold start {[round(x, 3) for x in j['cold_start']]}")
    if "node" in r:
        n = r["node"]
        b, st = n["back_to_full_strength_s"], n["stall_s"]
        print(f"node lost -> both its workers back (s): with a spare node {[round(x, 2) for x in b['spare']]}, "
              f"a replacement {n['replacement_delay_s']} s later {[round(x, 2) for x in b['replacement']]} "
              f"(target <= {n['target_s']}); stall {[round(x, 3) for x in st['spare']]} / "
              f"{[round(x, 3) for x in st['replacement']]}; lost steps {n['lost_steps']}, rows never/twice "
              f"{n['rows_never_or_twice']}")
    if "trace" in r:
        t = r["trace"]
        print(f"throughput under trace {t['trace']!r} ({t['steps']} steps standing for {t['job_hours']} h):")
        for name, row in t["rows"].items():
            rest = {k: v for k, v in row.items() if k not in ("throughput_ratio", "tokens_per_s")}
            print(f"  {name:>18}: {row['throughput_ratio']:.3f} of failure-free  {rest}")
