"""GPU check of the final checkpoint: a CUDA state written through pinned blocks, read back bit for bit, and a
real job's end.

Run on a machine with CUDA: ``python scripts/gpu/final_checkpoint.py [--preset llama-1b] [--dir /dev/shm]``.

1. The preset's model and AdamW state on the GPU (after one optimizer step), written as the final checkpoint
   is (:func:`unbroken.checkpoint.writer.write_state` from the live CUDA tensors) into ``--dir``, read
   back with DCP's Hugging Face reader and compared bit for bit; seconds and GB/s of the write, beside torch
   DCP's Hugging Face writer with a sha256 pass on the same state (``python -m benchmarks.final_checkpoint_write``).
2. ``unbroken bench recovery --cases PRESET:1x1 --parts final``: a job of ``--steps`` steps on the GPU, from the
   last step's commit to the final checkpoint's commit, the worker's exit and the launcher's return.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's benchmarks/ (run as a file)
from benchmarks.final_checkpoint_write import write_figures  # noqa: E402
from unbroken.bench import recovery
from unbroken.config import load_config
from unbroken.checkpoint.dcp import dcp
from unbroken.job.builder import build_job
from unbroken.checkpoint.writer import write_state
from unbroken.runtime.digest import device_digest
from unbroken.state.training_state import capture


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    overrides = ["train.device=cuda", "train.precision=bf16", "data.seq_len=1024", "train.compile=false"]
    cfg = load_config(preset_name=a.preset, overrides=overrides)
    job = build_job(cfg, torch.device("cuda"))
    for p in job.model.parameters():
        p.grad = torch.randn_like(p)
    job.optimizer.step()
    state = capture(job.model, job.optimizer)
    out = Path(tempfile.mkdtemp(dir=a.dir))
    try:
        torch.cuda.synchronize()
        written = write_state(out, state)
        back = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in state.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp().load(back, storage_reader=dcp().HuggingFaceStorageReader(str(out), thread_count=8), no_dist=True)
        exact = all(torch.equal(back[k], v.cpu()) for k, v in state.items())
        t0 = time.perf_counter()
        digest_gpu = device_digest([p.detach() for p in job.model.parameters()])
        digest_s = time.perf_counter() - t0
        same_digest = digest_gpu == device_digest([p.detach().cpu() for p in job.model.parameters()])
    finally:
        shutil.rmtree(out, ignore_errors=True)
    del job, state, back
    torch.cuda.empty_cache()
    in_process = {a.preset: write_figures(cfg, Path(a.dir))}
    result = recovery.main(["--cases", f"{a.preset}:1x1", "--parts", "final", "--steps", str(a.steps),
                            "--kill-step", "1", "--out", str(Path(a.dir) / "final.json"), *[f"--{o}" for o in overrides]])
    print(json.dumps({"check": "final_checkpoint", "ok": exact and same_digest, "exact": exact,
                      "bytes": written.bytes, "write_s": round(written.seconds, 3), "write_gb_s": written.gb_s,
                      "writers": written.threads, "device_digest_s": round(digest_s, 3),
                      "device_digest_equals_host": same_digest, "in_process": in_process,
                      "job_end": result["rows"][0]["end"] if result["rows"] else None}))


if __name__ == "__main__":
    main()
