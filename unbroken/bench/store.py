"""Store benchmark: the embedded store and a 3-member etcd cluster, side by side in one run.

``unbroken bench store --preset tiny --out benchmarks/results/store.json`` starts
its own etcd cluster on loopback (:class:`~unbroken.store.local_etcd.LocalEtcd`;
or give ``--store etcd://...`` with ``UNBROKEN_STORE_PIDS`` for the member kill)
and measures, alternating the two stores so that drift cancels:

1. **operation latency**: median of each job-store operation (set, get,
   compare-and-set, add, check, multi_get of 4 keys) from a client process;
2. **failure-free step time**: median step time after warm-up of the same short job
   on each store, ``--repeats`` pairs in ABBA order (TCP, etcd, etcd, TCP, ...): the
   ratio etcd / embedded store of each pair, their median (target <= 1.02) and spread;
   and, exact counts, the requests one worker's heartbeat thread sends per second
   (and how many keep its lease alive);
3. **store operations per step**: the step protocol's own requests per step
   (counted exactly, in-process, over 100 and 400 steps); and requests the etcd members served (their
   ``grpc_server_handled_total`` for the KV and lease services), per committed step and
   per worker, over the first and the second half of the steady steps of a run
   (equal halves: O(1) per step, independent of the step count); also per second,
   with the CPU time the members used per second (they share the machine's cores);
4. **watch or poll** (``--parts watch``, not run by default): from a put to the
   wake-up of a client waiting for the key, an etcd watch against the polling ``get``;
5. **stall per crash and per hang** on each store (``unbroken report``'s stall:
   the survivors' gap between applied steps minus a normal step);
6. **etcd leader loss**: the leader is SIGKILLed mid-run (``store=I:kill``); its
   stall (the longest step around the kill minus the median step) and the steps
   lost (target: <= 1 s, 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, cast

import requests
import torch

from unbroken.agent.launcher import launch
from unbroken.bench._args import parse_with_overrides
from unbroken.store.local_etcd import LocalEtcd
from unbroken.report.run_report import summarize_run
from unbroken.bench.machine import machine_description
from unbroken.config import Config, load_config
from unbroken.faults.store_loss import STORE_PIDS_ENV
from unbroken.jsonl import JsonlWriter, read_jsonl
from unbroken.mecefo.takeover import takeover_policy
from unbroken.store.etcd_client import parse_etcd
from unbroken.store.job_store import JobStore
from unbroken.runtime.membership import Membership
from unbroken.runtime.protocol import StepJob, StepProtocol
from unbroken.store.view import View

__all__ = ["main"]


def _cfg(a: argparse.Namespace, *extra: str) -> Config:
    return load_config(preset_name=a.preset, overrides=a.overrides + [
        f"train.steps={a.steps}", "train.val_every=0", "train.val_batches=1", *extra])


def _etcd_requests(url: str) -> int:
    """KV and lease requests served so far by the cluster's live members (their Prometheus counters)."""
    total = 0
    for host, port in parse_etcd(url)[0]:
        try:
            text = requests.get(f"http://{host}:{port}/metrics", timeout=2.0).text
        except requests.RequestException:
            continue  # a member killed by the benchmark
        total += sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                     if line.startswith("grpc_server_handled_total{")
                     and any(f'grpc_service="etcdserverpb.{svc}"' in line for svc in ("KV", "Lease")))
    return total


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` used so far (0 for one that is gone)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def _member_pids(cluster: LocalEtcd | None) -> list[int]:
    if cluster is not None:
        return [p.pid for p in cluster.procs if p is not None]
    path = os.environ.get(STORE_PIDS_ENV)
    return [int(v) for v in json.loads(Path(path).read_text()).values()] if path else []


def _latency(url: str, ops: int) -> dict[str, dict[str, float]]:
    """Median microseconds per operation, the embedded store and etcd alternating op by op."""
    tcp_host = JobStore.host("127.0.0.1", 0, clients=2, secret="bench")
    stores = {"tcp": JobStore.connect(f"127.0.0.1:{tcp_host.port}", timeout_s=10, secret="bench"),
              "etcd": JobStore.create_on_etcd(url, timeout_s=10, secret="bench-latency", job={"bench": "store"})}
    for s in stores.values():
        for k in ("a", "b", "c", "d"):
            s.backend.set(k, "1")
    cases: dict[str, Callable[[Any], object]] = {
        "set": lambda b: b.set("a", "1"), "get": lambda b: b.get("a"),
        "compare_set": lambda b: b.compare_set("a", "1", "1"), "add": lambda b: b.add("n", 1),
        "check": lambda b: b.check(["a"]), "multi_get_4": lambda b: b.multi_get(["a", "b", "c", "d"])}
    out: dict[str, dict[str, float]] = {name: {} for name in stores}
    for op, fn in cases.items():
        samples: dict[str, list[float]] = {name: [] for name in stores}
        for _ in range(ops):
            for name, s in stores.items():
                t0 = time.perf_counter()
                fn(s.backend)
                samples[name].append(time.perf_counter() - t0)
        for name in stores:
            out[name][op] = 1e6 * statistics.median(samples[name])
    stores["etcd"].backend.clear()  # type: ignore[attr-defined]
    return out


class _ConstantJob:
    """A job of one slot whose gradient is a constant: only the protocol's store traffic is measured."""

    n_slots, micro_batch, device = 1, 2, torch.device("cpu")
    model = optimizer = None

    def gradient_sums(self, step: int, items: list[Any]) -> torch.Tensor:
        return torch.ones(4)


def _protocol_requests(url: str, tmp: Path) -> dict[str, float]:
    """etcd requests the step protocol itself sends per step (one member, no heartbeat thread), over runs of
    100 and 400 steps: a count, not a timing, so it is exact; equal figures mean O(1) per step."""
    out = {}
    for steps in (100, 400):
        store = JobStore.create_on_etcd(url, timeout_s=10, secret=f"bench-protocol-{steps}", job={"bench": "store"})
        m = Membership(store, 0, heartbeat_timeout_s=5.0)
        store.beat(0)
        p = StepProtocol(m, cast(StepJob, _ConstantJob()), policy=takeover_policy("spread"), timeout_s=10,
                         events=JsonlWriter(tmp / f"protocol{steps}.jsonl"))
        store.publish_initial(View(gen=0, members=(0,), step=0))
        p.adopt(store.current_view())
        p.run_step(0)
        before = store.backend.round_trips  # type: ignore[attr-defined]
        for step in range(1, steps + 1):
            p.run_step(step)
        out[f"per_step_over_{steps}_steps"] = (store.backend.round_trips - before) / steps  # type: ignore[attr-defined]
        store.backend.clear()  # type: ignore[attr-defined]
    return out


def _heartbeat_requests(url: str, seconds: float = 4.0) -> dict[str, float]:
    """etcd requests per second of one worker's heartbeat thread (exact count, in-process), and how many of
    them keep its lease alive (the requests the lease adds to plain counters)."""
    store = JobStore.create_on_etcd(url, timeout_s=10, secret="bench-heartbeat", job={"bench": "store"})
    m = Membership(store, 0, heartbeat_timeout_s=2.0)
    store.publish_initial(View(gen=0, members=(0,), step=0))
    m.start_heartbeat()
    backend = store.backend
    time.sleep(0.5)
    before, leases, t0 = backend.round_trips, backend.lease_round_trips, time.monotonic()  # type: ignore[attr-defined]
    time.sleep(seconds)
    n, n_lease, dt = (backend.round_trips - before, backend.lease_round_trips - leases,  # type: ignore[attr-defined]
                      time.monotonic() - t0)
    m.stop()
    backend.clear()  # type: ignore[attr-defined]
    return {"per_s": n / dt, "lease_per_s": n_lease / dt, "seconds": dt}


def _watch_vs_poll(url: str, rounds: int = 20) -> dict[str, Any]:
    """Milliseconds from a put to the wake-up of a client waiting for that key: an etcd watch (etcd3gw, through
    the gateway) against the backend's polling ``get``; and whether a watch's timeout fires."""
    from etcd3gw.client import Etcd3Client
    from etcd3gw.exceptions import WatchTimedOut

    backend = JobStore.create_on_etcd(url, timeout_s=10, secret="bench-watch", job={"bench": "store"}).backend
    host, port = parse_etcd(url)[0][backend.cluster.current]  # type: ignore[attr-defined]
    client = Etcd3Client(host=host, port=port, timeout=5, api_path="/v3/")
    t0 = time.monotonic()
    try:
        client.watch_once(backend.ns + "never", timeout=0.5)  # type: ignore[attr-defined]
        timeout_fires = None
    except WatchTimedOut:
        timeout_fires = time.monotonic() - t0
    wake: dict[str, list[float]] = {"watch": [], "poll": []}
    for i in range(rounds):
        for how in wake:
            key, put_at = f"{how}{i}", [0.0]

            def writer(key: str = key, put_at: list[float] = put_at) -> None:
                time.sleep(0.1)
                put_at[0] = time.monotonic()
                backend.set(key, "1")

            thread = threading.Thread(target=writer)
            thread.start()
            if how == "watch":
                client.watch_once(backend.ns + key, timeout=5)  # type: ignore[attr-defined]
            else:
                backend.get(key)
            woke = time.monotonic()
            thread.join()
            wake[how].append(1e3 * (woke - put_at[0]))
    backend.clear()  # type: ignore[attr-defined]
    return {"wake_ms_median": {k: statistics.median(v) for k, v in wake.items()},
            "wake_ms_max": {k: max(v) for k, v in wake.items()}, "watch_timeout_0.5s_fired_after_s": timeout_fires}


def _run(a: argparse.Namespace, tmp: Path, name: str, cfg: Config, store: str | None,
         probe: Callable[[int], None] | None = None, **kw: Any) -> dict[str, Any]:
    run_dir = tmp / name
    on_record = (lambda r: probe(r["step"]) if r.get("kind") == "train" else None) if probe else None
    summary = launch(cfg, run_dir, nodes=a.nodes, workers_per_node=a.workers_per_node, store=store,
                     on_record=on_record, **kw)
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    steady = [r["step_time_s"] for r in train[max(3, len(train) // 5):]]
    return {"run_dir": str(run_dir), "median_step_s": statistics.median(steady), "train": train,
            "summary": summary, "report": summarize_run(run_dir)}


def _steady(a: argparse.Namespace, tmp: Path, url: str, pids: list[int]) -> dict[str, Any]:
    """Failure-free step time: ``--repeats`` pairs of short jobs, the embedded store and etcd alternating in ABBA order
    (drift cancels); per-pair ratios, their median and spread; etcd requests per step over two halves."""
    pairs: list[dict[str, Any]] = []
    halves: list[dict[str, Any]] = []
    workers = a.nodes * a.workers_per_node
    for rep in range(a.repeats):
        medians: dict[str, float] = {}
        for name in ("tcp", "etcd") if rep % 2 == 0 else ("etcd", "tcp"):
            if name == "tcp":
                medians["tcp"] = _run(a, tmp, f"steady_tcp{rep}", _cfg(a), None)["median_step_s"]
                continue
            marks = {a.steps // 4: 0.0, a.steps // 2 + a.steps // 8: 0.0, a.steps: 0.0}
            seen: dict[int, tuple[int, float, float]] = {}

            def probe(step: int) -> None:
                if step in marks and step not in seen:
                    seen[step] = (_etcd_requests(url), time.monotonic(), _cpu_s(pids))

            medians["etcd"] = _run(a, tmp, f"steady_etcd{rep}", _cfg(a), url, probe=probe)["median_step_s"]
            (s0, (r0, t0, c0)), (s1, (r1, _, _)), (s2, (r2, t2, c2)) = sorted(seen.items())
            halves.append({"first_half": (r1 - r0) / (s1 - s0) / workers,
                           "second_half": (r2 - r1) / (s2 - s1) / workers,
                           "per_worker_per_s": (r2 - r0) / (t2 - t0) / workers, "steps": [s0, s1, s2],
                           "members_cpu_s_per_s": (c2 - c0) / (t2 - t0) if pids else None})
        pairs.append({**medians, "ratio": medians["etcd"] / medians["tcp"]})
    ratios = sorted(p["ratio"] for p in pairs)
    return {"pairs": pairs, "ratio_etcd_vs_tcp": statistics.median(ratios), "ratio_min_max": [ratios[0], ratios[-1]],
            "median_step_s": {n: [p[n] for p in pairs] for n in ("tcp", "etcd")},
            "protocol_requests": _protocol_requests(url, tmp), "heartbeat_requests": _heartbeat_requests(url),
            "target": 1.02, "etcd_requests_per_worker_per_step": halves}


def _faults(a: argparse.Namespace, tmp: Path, url: str, cluster: LocalEtcd | None) -> dict[str, Any]:
    s0 = a.steps // 3
    out: dict[str, Any] = {}
    for name, store in (("tcp", None), ("etcd", url)):
        crash = _run(a, tmp, f"crash_{name}", _cfg(a), store, fail_at=f"step={s0}:worker=1:kill:phase=forward")
        hang = _run(a, tmp, f"hang_{name}", _cfg(a), store, fail_at=f"step={s0}:worker=1:stop:phase=forward")
        out[name] = {"crash_stall_s": [f["stall_s"] for f in crash["report"]["failure_details"]],
                     "hang_stall_s": [f["stall_s"] for f in hang["report"]["failure_details"]],
                     "lost_steps": crash["report"]["lost_steps"] + hang["report"]["lost_steps"]}
    if cluster is None and not os.environ.get(STORE_PIDS_ENV):
        out["leader_loss"] = None  # cannot kill a member of a cluster we do not know the pids of
        return out
    leader = cluster.leader() if cluster is not None else 0
    if cluster is not None:
        os.environ[STORE_PIDS_ENV] = str(cluster.pids_file)
    try:
        r = _run(a, tmp, "leader_loss", _cfg(a), url, fail_at=f"step={s0}:store={leader}:kill")
    finally:
        if cluster is not None:
            cluster.restart_member(leader)
    (fired,) = read_jsonl(Path(r["run_dir"]) / "events" / "store.jsonl")
    after = [x for x in r["train"] if x["time"] > fired["time"]][:3]
    out["leader_loss"] = {"member": leader, "at_committed_step": fired["committed"],
                          "stall_s": max(x["step_time_s"] for x in after) - r["median_step_s"],
                          "steps_after": [round(x["step_time_s"], 3) for x in after],
                          "median_step_s": r["median_step_s"], "failures": r["summary"]["failures"],
                          "lost_steps": r["report"]["lost_steps"], "target_stall_s": 1.0}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken bench store", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=6,
                    help="pairs of failure-free runs, one on each store, alternating in ABBA order")
    ap.add_argument("--ops", type=int, default=300, help="samples per operation for the latencies")
    ap.add_argument("--store", default=None, help="an etcd cluster to use (default: start 3 members on loopback)")
    ap.add_argument("--parts", default="latency,steady,faults", help="which measurements to run")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/store.json"))
    a, overrides = parse_with_overrides(ap, argv)
    a.overrides = overrides
    unknown = set(a.parts.split(",")) - {"latency", "steady", "faults", "watch"}
    if unknown:
        raise ValueError(f"--parts: unknown {', '.join(sorted(unknown))}; valid: latency, steady, faults, watch")
    cluster = None if a.store else LocalEtcd(3)
    url = a.store or cluster.url  # type: ignore[union-attr]
    result: dict[str, Any] = {"benchmark": "store", "preset": a.preset, "nodes": a.nodes, "steps": a.steps,
                              "workers_per_node": a.workers_per_node, "etcd": url, "machine": machine_description()}
    try:
        with tempfile.TemporaryDirectory(prefix="unbroken-store-") as tmp:
            if "latency" in a.parts:
                result["latency_us"] = _latency(url, a.ops)
            if "steady" in a.parts:
                result["steady"] = _steady(a, Path(tmp), url, _member_pids(cluster))
            if "watch" in a.parts:
                result["watch"] = _watch_vs_poll(url)
            if "faults" in a.parts:
                result["faults"] = _faults(a, Path(tmp), url, cluster)
    finally:
        if cluster is not None:
            cluster.stop()
    _print(result)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {a.out}")
    return result


def _print(r: dict[str, Any]) -> None:
    if "latency_us" in r:
        lat = r["latency_us"]
        print("median latency (us):  " + "  ".join(f"{op} {lat['tcp'][op]:.0f}/{lat['etcd'][op]:.0f}"
                                                   for op in lat["tcp"]) + "  (embedded/etcd)")
    if "steady" in r:
        s = r["steady"]
        print(f"failure-free step time etcd / embedded store: {s['ratio_etcd_vs_tcp']:.3f} (median of "
              f"{len(s['pairs'])} pairs; target <= {s['target']}); medians {s['median_step_s']}")
        print(f"  per-pair ratios (ABBA order): {[round(p['ratio'], 3) for p in s['pairs']]}; "
              f"min {s['ratio_min_max'][0]:.3f}, max {s['ratio_min_max'][1]:.3f}")
        hb = s["heartbeat_requests"]
        print(f"  one worker's heartbeat thread: {hb['per_s']:.1f} etcd requests per second, {hb['lease_per_s']:.2f} "
              f"of them for its lease (exact count)")
        pr = s["protocol_requests"]
        print("  the step protocol's own etcd requests per step (exact count, one member): "
              + ", ".join(f"{v:.2f} {k.replace('_', ' ')}" for k, v in pr.items()))
        for h in s["etcd_requests_per_worker_per_step"]:
            print(f"  etcd requests per worker per step: {h['first_half']:.1f} (steps {h['steps'][0]}-{h['steps'][1]})"
                  f", {h['second_half']:.1f} (steps {h['steps'][1]}-{h['steps'][2]}); "
                  f"{h['per_worker_per_s']:.1f} per worker per second; the members used "
                  f"{h['members_cpu_s_per_s'] or 0:.2f} CPU-s per s")
    if "watch" in r:
        w = r["watch"]
        print(f"waiting for a key, put to wake-up (ms, median/max): watch {w['wake_ms_median']['watch']:.1f}/"
              f"{w['wake_ms_max']['watch']:.1f}, polling get {w['wake_ms_median']['poll']:.1f}/"
              f"{w['wake_ms_max']['poll']:.1f}; a 0.5 s watch timeout fired after "
              f"{w['watch_timeout_0.5s_fired_after_s']} s")
    if "faults" in r:
        f = r["faults"]
        for name in ("tcp", "etcd"):
            print(f"{name:>4}: stall per crash {f[name]['crash_stall_s']} s, per hang {f[name]['hang_stall_s']} s, "
                  f"lost steps {f[name]['lost_steps']}")
        if f.get("leader_loss"):
            x = f["leader_loss"]
            print(f"etcd leader killed at step {x['at_committed_step']}: stall {x['stall_s']:.3f} s "
                  f"(target <= {x['target_stall_s']}), failures {x['failures']}, lost steps {x['lost_steps']}")
