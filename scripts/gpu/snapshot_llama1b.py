"""GPU check: pinned bytes and copy time of one worker's snapshot of ``llama-1b``.

Run on a machine with CUDA: ``python scripts/gpu/snapshot_llama1b.py [--workers-per-node 8]``.
Builds ``llama-1b`` (fp32 parameters, AdamW moments) on the GPU and takes the snapshot of
worker 0 of a node of ``L`` workers (one node, no parity: its stripes are 1/L of the state), as
that worker's snapshotter does every step: the device-to-host copy of the bytes it writes on a
side stream into pinned memory, then the write into shared memory (on as many threads as the
job gives such a worker). Also times the same with
``L = 1`` (the whole state, what every worker staged before) when the host has room. Prints
one JSON line: pinned bytes, stage seconds (the copy off the GPU), write seconds (into shared
memory), GB/s of each.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import torch

from unbroken.models import build_model
from unbroken.store.view import View
from unbroken.snapshot.segment import SHM_DIR, remove_segments
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import describe, tensors_of
from unbroken.runtime.snapshot_hooks import write_threads


def _state(dev: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model("llama-1b", vocab_size=32000, seq_len=1024, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # the moments an optimizer step would create, without a step's memory
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return model, opt


def _one(model: torch.nn.Module, opt: torch.optim.Optimizer, dev: torch.device, per_node: int) -> dict[str, float]:
    job = os.urandom(6).hex()
    node_of = {w: 0 for w in range(per_node)}
    threads = write_threads(per_node)  # as the job gives a worker of a node of per_node
    snap = Snapshotter(job_id=job, node=0, worker=0, node_of=node_of, every=1, redundancy="none", parity=0,
                       config_hash="gpu", state=lambda: tensors_of(model, opt, dev), on_event=lambda *a, **k: None,
                       write_threads=threads)
    try:
        out = {}
        for attempt in ("first", "second"):  # the first also allocates the pinned buffer
            t0 = time.perf_counter()
            snap.take(1, View(gen=0, members=tuple(node_of), step=1))
            snap.wait()
            total = time.perf_counter() - t0
            last = snap.last or {}
            out[attempt] = {"total_s": total, "stage_s": last.get("stage_seconds"), "write_s": last.get("seconds")}
        gb = snap.pinned_bytes / 1e9
        second = out["second"]
        return {"workers_per_node": per_node, "write_threads": threads, "pinned_gb": gb, "first_total_s": out["first"]["total_s"],
                "stage_s": second["stage_s"], "write_s": second["write_s"], "total_s": second["total_s"],
                "stage_gb_s": gb / second["stage_s"] if second["stage_s"] else None,
                "write_gb_s": gb / second["write_s"] if second["write_s"] else None}
    finally:
        snap.close()
        remove_segments(job)


def main() -> None:
    per_node = int(sys.argv[sys.argv.index("--workers-per-node") + 1]) if "--workers-per-node" in sys.argv else 8
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    model, opt = _state(dev)
    size = describe(tensors_of(model, opt, dev)).nbytes
    free_shm = shutil.disk_usage(SHM_DIR).free
    rows = [_one(model, opt, dev, per_node)]
    if free_shm > 2.2 * size:  # two buffers of the whole state: what L = 1 needs
        rows.append(_one(model, opt, dev, 1))
    print(json.dumps({"check": "snapshot_llama1b", "device": torch.cuda.get_device_name(dev),
                      "state_gb": size / 1e9, "shm_free_gb": free_shm / 1e9, "rows": rows}))


if __name__ == "__main__":
    main()
