"""GPU check of a restore at memory speed, and of the template on a GPU host.

Run on a machine with CUDA: ``python scripts/gpu/restore_load.py [--preset llama-1b]``.

1. Builds the preset's model and AdamW state on the GPU (bf16 parameters where the preset's precision says),
   snapshots it into this node's memory (one worker, one node: the fragments are the state's own bytes),
   then restores it three times into a fresh GPU model through pinned blocks copied on side streams
   (:mod:`unbroken.snapshot.device_blocks`), checking every tensor bit for bit after the first.
2. Starts the template's preparation of a ``train.device=cuda`` job in a fresh process and checks it still
   has one thread and no CUDA context (so it forks on this host).

Prints one JSON line: state bytes, the inventory's and the loads' GB/s, the template's threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from unbroken.config import load_config
from unbroken.job.builder import build_job
from unbroken.store.view import View
from unbroken.snapshot.restore import alone, decide, inventory, restore_from_memory
from unbroken.snapshot.segment import remove_segments
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of

TEMPLATE_PROBE = r"""
import json, sys
from pathlib import Path
from unbroken.agent import template
prepared, phases = template._prepare(Path(sys.argv[1]))
print(json.dumps({"threads": template.thread_count(), "names": template.thread_names(),
                  "why": template.fork_unsafe(), "prepared": prepared is not None}))
"""


def _job(preset: str, dev: torch.device, seed: int):  # noqa: ANN202 - a Job
    cfg = load_config(preset_name=preset, overrides=["data.seq_len=128", f"train.seed={seed}"])
    job = build_job(cfg, dev)
    for p in job.model.parameters():
        p.grad = torch.randn_like(p)
    job.optimizer.step()
    torch.cuda.synchronize(dev)
    return cfg, job


def _restore_check(preset: str, dev: torch.device) -> dict[str, object]:
    cfg, job = _job(preset, dev, seed=0)
    ident, node_of = os.urandom(6).hex(), {0: 0}
    snap = Snapshotter(job_id=ident, node=0, worker=0, node_of=node_of, every=1, redundancy="parity", parity=1,
                       config_hash="gpu", state=lambda: tensors_of(job.model, job.optimizer, dev),
                       on_event=lambda *a, **k: None)
    try:
        snap.take(1, View(gen=0, members=(0,), step=1))
        snap.wait()
        snap.close()
        t0 = time.perf_counter()
        inv = inventory(ident, 0, config_hash="gpu")
        inventory_s = time.perf_counter() - t0
        spec = decide([inv], checkpoint=None, members_of=lambda nodes: [0])
        _, fresh = _job(preset, dev, seed=1)
        loads = []
        for _ in range(3):
            stats = restore_from_memory(spec, job=ident, node=0, node_of=node_of, members=(0,), me=0,
                                        broadcast=alone, model=fresh.model, optimizer=fresh.optimizer, device=dev)
            loads.append(stats["gb_s"])
            if len(loads) == 1:
                want, got = tensors_of(job.model, job.optimizer, dev), tensors_of(fresh.model, fresh.optimizer, dev)
                bad = [k for k in want if not (torch.equal(want[k], got[k]) and want[k].dtype == got[k].dtype)]
                assert not bad, f"restored tensors differ: {bad[:5]}"
        return {"state_bytes": stats["bytes"], "inventory_gb_s": inv["bytes"] / inventory_s / 1e9,
                "load_gb_s": loads, "threads": stats["threads"]}
    finally:
        remove_segments(ident)


def _template_check() -> dict[str, object]:
    cfg = load_config(preset_name="debug", overrides=["train.device=cuda"])
    with tempfile.TemporaryDirectory() as run:
        (Path(run) / "config.json").write_text(json.dumps(cfg.to_dict()))
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        done = subprocess.run([sys.executable, "-c", TEMPLATE_PROBE, run], capture_output=True, text=True,
                              timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["threads"] == 1 and got["why"] is None, f"the template would not fork on this host: {got}"
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-350m")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    result = {"preset": a.preset, "restore": _restore_check(a.preset, dev), "template": _template_check()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
