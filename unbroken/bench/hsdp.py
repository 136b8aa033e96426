"""HSDP: bytes per rank, and unbroken's cross-replica reduction against torch's own HSDP.

``unbroken bench hsdp`` (JSON to ``--out``):

* **bytes** (deterministic): per rank, the parameters, gradients and AdamW
  moments (fp32) that FSDP2 shards over ``k`` ranks (its ``torch.chunk``
  rule, :func:`unbroken.sharding.hsdp.shard_bytes`), the largest block
  all-gathered for compute (two at once: FSDP prefetches the next), and the
  snapshot memory each of a shard's ``R`` holders keeps (1/R of the shard's
  parameters and moments); for ``tiny``, ``llama-7b`` and a 70 B shape
  (LLaMA-2 70B: D 8192, 80 layers, 8 KV heads, F 28672) at ``k = 8`` across
  8, 64 and 1,024 replicas (and ``k = 32`` for 70 B, which does not fit at 8),
  against an 80 GB card;
* **step** (measured): failure-free step time, 2 replicas x 2 ranks on this
  machine (gloo), of unbroken's layer (FSDP2 inside the replica's own world,
  gradient shards summed across replicas on a view group per shard index:
  :mod:`unbroken.sharding.hsdp`) over torch's plain HSDP (``fully_shard``
  over a ``(replicate, shard)`` mesh, one world), jobs in the order ABBA on
  the same batches, the median step of each job after warm-up.

* **job** (measured): the same in a real job (``train.shard_degree=2``, 2 nodes x 2 workers: each node one
  replica; the step protocol, the ledger and the commit vote around the layer): its median step against
  torch's plain HSDP above (same model, micro-batch and sequence, ABBA); then the faults, one job each: a
  rank killed with the cross-replica reduction in flight (its replica fenced, the step finished by the other
  replica, the replica rejoining whole) and the other replica's node lost later (a replacement node
  brought up 1 s after), and a whole-job kill (every worker SIGKILLed with step 12's cross-replica reduction
  in flight; ``snapshot.every=1``, a checkpoint every 5 steps) restored from snapshot memory, where the
  workers of each shard index snapshot their shards together: stall, steps lost, rows trained never or
  twice, time until the replica is back.

The same ranks (:func:`run_job`) back the test that both give the same
parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from unbroken.bench._args import parse_with_overrides

REPLICAS, SHARDS = 2, 2
SEQ, BATCH, VOCAB = 64, 4, 4096
CARD_BYTES = 80 * 10**9
SHAPE_70B = {"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "ffn_hidden_dim": 28672,
             "vocab_size": 32000}


def _rank(argv: list[str]) -> None:
    """One rank of a job: ``MODE RANK PORT OUT PRESET STEPS`` (see :func:`run_job`)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from unbroken.models.factory import build_model
    from unbroken.runtime.process_group import ViewGroup
    from unbroken.runtime.state_transfer import transfer_state
    from unbroken.sharding.hsdp import GradientShards, fsdp_llama, join_replica, shard_model

    mode, rank, port, out, preset, steps = argv[0], int(argv[1]), int(argv[2]), Path(argv[3]), argv[4], int(argv[5])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    model: torch.nn.Module = build_model(preset, vocab_size=VOCAB, seq_len=SEQ, seed=0)
    replica, index = divmod(rank, SHARDS)
    cpu = torch.device("cpu")
    if mode.startswith("unbroken"):
        mesh = join_replica(store, replica=replica, incarnation=0, index=index, shard_degree=SHARDS, device=cpu,
                            timeout_s=120)
        shard_model(model, mesh)
        cross = ViewGroup(dist.PrefixStore(f"cross/{index}", store), gen=0, rank=replica, size=REPLICAS,
                          device=cpu, timeout_s=120)
        shards = GradientShards(model)
        buf = torch.empty(shards.numel)
    else:
        dist.init_process_group("gloo", store=dist.PrefixStore("reference", store), rank=rank,
                                world_size=REPLICAS * SHARDS)
        fsdp_llama(model, dist.device_mesh.init_device_mesh("cpu", (REPLICAS, SHARDS),
                                                            mesh_dim_names=("replicate", "shard")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    times = []
    for step in range(steps):
        if mode == "unbroken-rejoin" and step == steps // 2:
            # Replica 1 comes back: new processes would build the model from scratch and an empty optimizer;
            # here its ranks do so in place (another seed: nothing of the old state survives), then rank i
            # receives shard i's parameters and moments from rank i of replica 0 over index i's group.
            if replica == 1:
                model = shard_model(build_model(preset, vocab_size=VOCAB, seq_len=SEQ, seed=99), mesh)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
                shards = GradientShards(model)
            transfer_state(lambda t, src: cross.broadcast_into(t, src, lambda: None), model, opt, src=0,
                           rank=replica, receive=replica == 1, device=cpu, chunk_bytes=1 << 16)
        g = torch.Generator().manual_seed(1000 * step + rank)  # rank g's batch of step s: the same in both modes
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        t0 = time.perf_counter()
        logits = model(x)
        if mode.startswith("unbroken"):  # token sums; the step divides by every replica's tokens
            F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum").backward()
            reduced = cross.allreduce(shards.flatten(buf), lambda: None)
            shards.install(reduced, 1.0 / (REPLICAS * SHARDS * BATCH * SEQ))
        else:  # a mean per rank; FSDP averages over the 4 ranks
            F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    full = torch.cat([p.detach().full_tensor().reshape(-1)  # type: ignore[attr-defined]  # a DTensor
                      for p in model.parameters()])
    (out.with_suffix(".bin")).write_bytes(full.numpy().tobytes())
    out.with_suffix(".json").write_text(json.dumps({"step_s": times,
                                                    "local_numel": GradientShards(model).numel}))
    dist.destroy_process_group()


def _ranks(argv: list[str]) -> None:
    """A job's ranks, ``MODE PORT OUT_DIR PRESET STEPS``: this process imports what a rank needs once, then
    forks every rank (each with ``MODE RANK PORT OUT_DIR/MODE<RANK> PRESET STEPS``, :func:`_rank`); it exits 1
    if any rank failed. Where it runs a thread after its imports, each rank starts as a fresh process instead.
    """
    import torch.distributed.fsdp  # noqa: F401 (with the rest of _rank's imports, before the fork)

    import unbroken.runtime.process_group  # noqa: F401
    import unbroken.runtime.state_transfer  # noqa: F401
    import unbroken.sharding.hsdp  # noqa: F401
    from unbroken.agent._process import run_forked
    from unbroken.agent.template import thread_count

    mode, port, out_dir, preset, steps = argv
    args = [[mode, str(r), port, str(Path(out_dir) / f"{mode}{r}"), preset, steps] for r in range(REPLICAS * SHARDS)]
    if thread_count() != 1:
        code = "import sys; from unbroken.bench.hsdp import _rank; _rank(sys.argv[1:])"
        procs = [subprocess.Popen([sys.executable, "-c", code, *a]) for a in args]
        sys.exit(1 if any(p.wait() for p in procs) else 0)
    pids = []
    for a in args:
        pid = os.fork()
        if pid == 0:
            run_forked(lambda: _rank(a))
        pids.append(pid)
    sys.exit(1 if any(os.waitpid(pid, 0)[1] for pid in pids) else 0)


def run_job(mode: str, out_dir: Path, *, preset: str = "debug", steps: int = 3) -> list[dict[str, Any]]:
    """Train 2 replicas x 2 ranks with ``mode`` (``unbroken``, ``torch``, or ``unbroken-rejoin``: replica 1
    rebuilt from scratch halfway and given its shards by replica 0); per rank: its full parameters
    after the last step (``params``, float32 numpy), its step times and its local gradient elements.

    Raises:
        RuntimeError: a rank failed (its stderr's tail).
    """
    import numpy as np
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    outs = [out_dir / f"{mode}{r}" for r in range(REPLICAS * SHARDS)]
    code = "import sys; from unbroken.bench.hsdp import _ranks; _ranks(sys.argv[1:])"
    env = {"OPENBLAS_NUM_THREADS": "1", **os.environ}  # numpy's pool would be a thread in a process that forks
    proc = subprocess.run([sys.executable, "-c", code, mode, str(store.port), str(out_dir), preset, str(steps)],
                          stderr=subprocess.PIPE, text=True, timeout=600, env=env)
    if proc.returncode:
        raise RuntimeError(f"{mode} job failed:\n{proc.stderr[-3000:]}")
    return [{"params": np.fromfile(o.with_suffix(".bin"), dtype=np.float32),
             **json.loads(o.with_suffix(".json").read_text())} for o in outs]


def bytes_table() -> list[dict[str, Any]]:
    """Bytes per rank for ``tiny``, ``llama-7b`` and the 70 B shape at k = 8 (and k = 1, today's layout)."""
    import torch

    from unbroken.models.llama import Transformer, count_parameters, model_args
    from unbroken.sharding.hsdp import shard_bytes

    rows = []
    for name, args in [("tiny", model_args("tiny")), ("llama-7b", model_args("llama-7b")),
                       ("70b", model_args("llama-7b", **SHAPE_70B))]:
        with torch.device("meta"):
            model = Transformer(args)
        shapes = [tuple(p.shape) for p in model.parameters()]
        block = max(sum(p.numel() for p in b.parameters()) for b in model.layers) * 4
        for k in (1, 8, 32) if name == "70b" else (1, 8):
            one = shard_bytes(shapes, k)
            for replicas in (8, 64, 1024):
                snapshot = -(-3 * one // replicas)  # 1/R of the shard's parameters and both moments
                static = 4 * one + (2 * block if k > 1 else 0)  # params, grads, 2 moments; 2 gathered blocks
                rows.append({"model": name, "parameters": count_parameters(args), "shard_degree": k,
                             "replicas": replicas, "params_bytes": one, "grads_bytes": one,
                             "moments_bytes": 2 * one, "gathered_blocks_bytes": 2 * block if k > 1 else 0,
                             "static_bytes": static, "snapshot_bytes": snapshot,
                             "left_for_activations_80GB": CARD_BYTES - static})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken bench hsdp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="bytes,step,job", help="bytes, step, job (default all three)")
    ap.add_argument("--preset", default="tiny", help="model of the step-time part (default tiny)")
    ap.add_argument("--steps", type=int, default=40, help="steps per job (default 40; the first 3 are warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the ABBA order (default 3)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/hsdp.json"))
    a, overrides = parse_with_overrides(ap, argv)
    if overrides:
        ap.error("unbroken bench hsdp takes no config overrides")
    parts = set(a.parts.split(","))
    if not parts <= {"bytes", "step", "job"} or a.steps < 5 or a.rounds < 1:
        ap.error("--parts is one or more of bytes, step, job; --steps at least 5; --rounds at least 1")
    result: dict[str, Any] = {"benchmark": "hsdp", "replicas": REPLICAS, "shard_degree": SHARDS}
    if "bytes" in parts:
        result["bytes"] = bytes_table()
        _print_bytes(result["bytes"])
    if "step" in parts or "job" in parts:
        result["step"] = _step_ratio(a.preset, a.steps, with_job="job" in parts, rounds=a.rounds)
    if "job" in parts:
        result["job"] = _job_faults(a.preset)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")
    return result


def _step_ratio(preset: str, steps: int, *, with_job: bool = False, rounds: int = 1) -> dict[str, Any]:
    """torch's plain HSDP against unbroken's layer, and with ``with_job`` against a real job: ``rounds`` of the
    order ABBA (ABCCBA with the job); each mode's figure is the mean of its jobs' median steps, and the ratio
    of each round is reported too (the spread a shared machine gives)."""
    medians: dict[str, list[float]] = {"torch": [], "unbroken": [], **({"job": []} if with_job else {})}
    order = (("torch", "unbroken", "job", "job", "unbroken", "torch") if with_job
             else ("torch", "unbroken", "unbroken", "torch")) * rounds
    with tempfile.TemporaryDirectory() as tmp:
        for i, mode in enumerate(order):
            if mode == "job":
                run = _launch_job(Path(tmp) / f"job{i}", preset, max(steps, 20))
                train = [r for r in _read(run / "metrics.jsonl") if r["kind"] == "train"]
                medians[mode].append(statistics.median(r["step_time_s"] for r in train[3:]))
                continue
            ranks = run_job(mode, Path(tmp), preset=preset, steps=steps)
            medians[mode].append(statistics.median(max(r["step_s"][i] for r in ranks) for i in range(3, steps)))
    ratio = statistics.mean(medians["unbroken"]) / statistics.mean(medians["torch"])
    out: dict[str, Any] = {"preset": preset, "steps": steps, "warmup": 3, "rounds": rounds, "median_step_s": medians,
                           "ratio": ratio, "ratio_per_round": _per_round(medians, "unbroken", rounds)}
    print(f"failure-free step, {REPLICAS} replicas x {SHARDS} ranks, {preset}, gloo on this machine (ABBA): "
          f"torch HSDP {statistics.mean(medians['torch']) * 1e3:.1f} ms, unbroken's layer "
          f"{statistics.mean(medians['unbroken']) * 1e3:.1f} ms, ratio {ratio:.3f}")
    if with_job:
        out["job_ratio"] = statistics.mean(medians["job"]) / statistics.mean(medians["torch"])
        out["job_ratio_per_round"] = _per_round(medians, "job", rounds)
        print(f"  the real job (train.shard_degree={SHARDS}, {REPLICAS} nodes: vote, ledger, commit) "
              f"{statistics.mean(medians['job']) * 1e3:.1f} ms: ratio to torch HSDP {out['job_ratio']:.3f} "
              f"(rounds: {', '.join(f'{r:.3f}' for r in out['job_ratio_per_round'])})")
    return out


def _per_round(medians: dict[str, list[float]], mode: str, rounds: int) -> list[float]:
    """``mode``'s ratio to torch in each round (each mode ran twice per round)."""
    return [statistics.mean(medians[mode][2 * r:2 * r + 2]) / statistics.mean(medians["torch"][2 * r:2 * r + 2])
            for r in range(rounds)]


def _read(path: Path) -> list[dict[str, Any]]:
    from unbroken.jsonl import read_jsonl

    return read_jsonl(path)


def _job_config(preset: str, steps: int, *extra: str) -> Any:
    from unbroken.config import load_config

    return load_config(preset_name=preset, overrides=[
        f"train.steps={steps}", f"train.workers={REPLICAS * SHARDS}", f"train.shard_degree={SHARDS}",
        "mecefo.policy=spread", f"data.seq_len={SEQ}", f"data.micro_batch={BATCH}", f"data.vocab_size={VOCAB}",
        "train.val_every=0", "train.val_batches=1", "train.checkpoint_every_s=0", *extra])


def _launch_job(run: Path, preset: str, steps: int, *extra: str, **kw: Any) -> Path:
    from unbroken.agent.launcher import launch

    launch(_job_config(preset, steps, *extra), run, nodes=REPLICAS, workers_per_node=SHARDS, **kw)
    return run


def _job_faults(preset: str) -> dict[str, Any]:
    """A rank killed mid-reduction, then the other replica's node lost; a whole-job kill restored."""
    from unbroken.report.run_report import summarize_run

    steps, kill, node = 90, 15, 50
    with tempfile.TemporaryDirectory() as tmp:
        run = _launch_job(Path(tmp) / "faults", preset, steps, restart="on-failure", replace_lost_nodes_s=1.0,
                          fail_at=f"step={kill}:worker=3:kill:phase=allreduce,step={node}:node=1:kill")
        faults = summarize_run(run)
        events = _read(run / "events" / "agent1.jsonl")
        fenced = [e["worker"] for e in events if e.get("event") == "fence"
                  and (e.get("reason") or {}).get("how") == "replica"]
        whole = ",".join(f"step=12:worker={w}:kill:phase=allreduce" for w in range(REPLICAS * SHARDS))
        run = _launch_job(Path(tmp) / "restore", preset, 30, "train.checkpoint_every=5", "snapshot.every=1",
                          restart="on-failure", fail_at=whole)
        restore = summarize_run(run)
    first = [x["down_to_back_s"] for x in faults["rejoins"] if x["step"] < node]
    second = [x["down_to_back_s"] for x in faults["rejoins"] if x["step"] >= node]
    out = {
        "preset": preset, "steps": steps, "normal_step_s": faults["normal_step_s"],
        "rank_killed_mid_reduction": {"at_step": kill, "worker": 3, "siblings_fenced": fenced,
                                      "stall_s": _stall(faults, kill),
                                      "replica_back_s": first},
        "node_lost": {"at_step": node, "node": 1, "stall_s": _stall(faults, node),
                      "replacement_delay_s": 1.0, "replica_back_s": second},
        "lost_steps": faults["lost_steps"],
        "rows_never_or_twice": faults["rows_trained_never"] + faults["rows_trained_twice"],
        "whole_job_killed": {"at_step": 12, "restores": restore["snapshots"]["restores"],
                             "steps_redone": [12 - r["step"] for r in restore["snapshots"]["restores"]],
                             "lost_steps": restore["lost_steps"],
                             "rows_never_or_twice": restore["rows_trained_never"] + restore["rows_trained_twice"]},
    }
    print(f"faults, {preset}, {REPLICAS} nodes x {SHARDS} (one replica each), normal step "
          f"{out['normal_step_s'] * 1e3:.0f} ms:")
    k = out["rank_killed_mid_reduction"]
    print(f"  worker 3 killed mid-reduction at step {kill}: siblings fenced {k['siblings_fenced']}, stall "
          f"{_s(k['stall_s'])}, replica back after {_s(k['replica_back_s'])}")
    n = out["node_lost"]
    print(f"  node 1 lost at step {node} (replacement after 1.0 s): stall {_s(n['stall_s'])}, replica back "
          f"after {_s(n['replica_back_s'])}")
    print(f"  steps lost {out['lost_steps']}, rows trained never or twice {out['rows_never_or_twice']}")
    w = out["whole_job_killed"]
    restored = [(r["source"], r["step"]) for r in w["restores"]]
    print(f"  every worker killed at step 12 (a snapshot every step): restored from {restored} "
          f"(steps redone {w['steps_redone']}), steps lost {w['lost_steps']}, rows never or twice "
          f"{w['rows_never_or_twice']}")
    return out


def _s(seconds: float | list[float] | None) -> str:
    """Seconds as printed: ``0.23 s``, ``[0.31, 0.24] s``, ``-`` for none."""
    if seconds is None:
        return "-"
    if isinstance(seconds, list):
        return "[" + ", ".join(f"{x:.2f}" for x in seconds if x is not None) + "] s"
    return f"{seconds:.2f} s"


def _stall(report: dict[str, Any], step: int) -> float | None:
    """The stall of the failure at ``step`` (the report's, beyond a normal step)."""
    found = [f["stall_s"] for f in report["failure_details"] if f.get("step") == step and f["stall_s"] is not None]
    return max(found) if found else None


def _print_bytes(rows: list[dict[str, Any]]) -> None:
    gb = 1e9
    print("bytes per rank (fp32 parameters, gradients, AdamW moments; 2 blocks all-gathered; snapshot memory)")
    print(f"{'model':>9} {'k':>2} {'R':>5} {'params':>8} {'grads':>8} {'moments':>8} {'blocks':>7} "
          f"{'static':>8} {'80GB left':>9} {'snapshot':>9}")
    for r in rows:
        print(f"{r['model']:>9} {r['shard_degree']:>2} {r['replicas']:>5} {r['params_bytes'] / gb:>7.3f}G "
              f"{r['grads_bytes'] / gb:>7.3f}G {r['moments_bytes'] / gb:>7.3f}G "
              f"{r['gathered_blocks_bytes'] / gb:>6.3f}G {r['static_bytes'] / gb:>7.2f}G "
              f"{r['left_for_activations_80GB'] / gb:>8.1f}G {r['snapshot_bytes'] / gb:>8.4f}G")
