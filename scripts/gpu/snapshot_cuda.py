"""GPU check of the state layer: snapshots of CUDA state through pinned buffers on a side stream.

Run on a machine with CUDA: ``python scripts/gpu/snapshot_cuda.py``. Builds the ``tiny`` model
and its AdamW state on the GPU, snapshots it (2 nodes x 2 workers of stripes, parity) while the
compute stream keeps running forward/backward passes, restores it into a fresh GPU model and
checks every tensor bit for bit (dtype included). Prints one JSON line: write seconds per worker
and how much of the compute stream's time the snapshots took (side stream vs. none).
"""

from __future__ import annotations

import json
import os
import time

import torch

from unbroken.models import build_model
from unbroken.store.view import View
from unbroken.snapshot.restore import alone, decide, inventory, restore_from_memory
from unbroken.snapshot.segment import remove_segments
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of


def _state(dev: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=4096, seq_len=128).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 4096, (16, 128), device=dev)
    model(x).float().mean().backward()
    opt.step()
    return model, opt


def _compute(model: torch.nn.Module, x: torch.Tensor, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        model(x).float().mean().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    dev = torch.device("cuda", 0)
    model, opt = _state(dev)
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    job = os.urandom(6).hex()
    snaps = [Snapshotter(job_id=job, node=node_of[w], worker=w, node_of=node_of, every=1, redundancy="parity",
                         parity=1, config_hash="gpu", state=lambda: tensors_of(model, opt, dev),
                         on_event=lambda *a, **k: None) for w in node_of]
    view = View(gen=0, members=(0, 1, 2, 3), step=1)
    x = torch.randint(0, 4096, (16, 128), device=dev)
    _compute(model, x, 3)  # warm-up
    alone = _compute(model, x, 20)
    try:
        t0 = time.perf_counter()
        for s in snaps:
            s.take(1, view)
        overlapped = _compute(model, x, 20)  # the compute stream runs while the side stream copies
        for s in snaps:
            s.wait()
        write_s = time.perf_counter() - t0
        for s in snaps:
            s.close()
        fresh, fresh_opt = _state(dev)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in fresh.parameters():
                p.add_(torch.randn_like(p))
        invs = [inventory(job, n, config_hash="gpu") for n in (0, 1)]
        spec = decide(invs, checkpoint=None, members_of=lambda ns: [w for w in node_of if node_of[w] in ns])
        stats = restore_from_memory(spec, job=job, node=0, node_of=node_of, members=(0,), me=0, broadcast=alone,
                                    model=fresh, optimizer=fresh_opt, device=dev)
        a, b = tensors_of(model, opt, dev), tensors_of(fresh, fresh_opt, dev)
        exact = a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) and a[k].dtype == b[k].dtype
                                             for k in a)
        devices = sorted({str(t.device) for t in b.values()})
    finally:
        remove_segments(job)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "exact": exact, "tensor_devices": devices,
                      "state_mb": sum(t.numel() * t.element_size() for t in a.values()) / 1e6,
                      "snapshot_wall_s_4_workers": write_s, "compute_20_steps_s": alone,
                      "compute_20_steps_with_snapshots_s": overlapped, "compute_ratio": overlapped / alone,
                      "restore_s": stats["seconds"], "rebuilt_stripes": stats["rebuilt"]}))


if __name__ == "__main__":
    main()
