"""The final checkpoint's write in one process, against torch DCP's Hugging Face writer:
``python -m benchmarks.final_checkpoint_write [--presets debug,llama-60m] [--checkpoint-dir DIR]``.

The preset's state (model and AdamW moments after one step) written the way the runtime writes its final
checkpoint (:func:`~unbroken.checkpoint.writer.write_state` from the live state, several writers, each file
hashed as it is written, then sealed) and the way torch DCP's Hugging Face writer writes it (``async_save``
staging a copy, the files written, then every file read again for its sha256: the runtime's path before),
alternately, ``--repeats`` times each, into one directory (``--checkpoint-dir``: put it where checkpoints go;
the default is the system's temporary directory). A job's end, from its last step's commit to the launcher's
return: ``unbroken bench recovery --parts final``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from unbroken.bench._args import parse_with_overrides
from unbroken.bench.machine import machine_description
from unbroken.bench.recovery import CASE_OVERRIDES
from unbroken.checkpoint.dcp import dcp
from unbroken.checkpoint.files import seal_files
from unbroken.checkpoint.writer import write_state
from unbroken.config import Config, load_config
from unbroken.job.builder import build_job
from unbroken.models.factory import resolve_device
from unbroken.state.training_state import capture

__all__ = ["main", "write_figures"]


def _ours(state: dict[str, torch.Tensor], out: Path) -> float:
    t0 = time.perf_counter()
    written = write_state(out, state)
    seal_files(out, written.files)
    return time.perf_counter() - t0


def _dcp(state: dict[str, torch.Tensor], out: Path) -> float:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp().async_save(state, storage_writer=dcp().HuggingFaceStorageWriter(str(out)), no_dist=True).result()
    seal_files(out)
    return time.perf_counter() - t0


def write_figures(cfg: Config, directory: Path | None = None, *, repeats: int = 3) -> dict[str, Any]:
    """Seconds and GB/s of the two ways of writing ``cfg``'s state (see the module docstring), alternately."""
    device = resolve_device(cfg.train.device)
    job = build_job(cfg, device)
    for p in job.model.parameters():
        p.grad = torch.randn_like(p)
    job.optimizer.step()
    state = capture(job.model, job.optimizer)
    size = sum(t.numel() * t.element_size() for t in state.values())
    times: dict[str, list[float]] = {"unbroken": [], "dcp_hf": []}
    root = Path(tempfile.mkdtemp(prefix="unbroken-final-", dir=directory))
    try:
        for i in range(repeats):
            for name, write in [("unbroken", _ours), ("dcp_hf", _dcp)][:: 1 if i % 2 == 0 else -1]:
                out = root / f"{name}-{i}"
                out.mkdir()
                times[name].append(round(write(state, out), 4))
                shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    return {"state_bytes": size, "directory": str(directory or tempfile.gettempdir()), "seconds": times,
            "gb_s": {k: round(size / v / 1e9, 3) for k, v in best.items()},
            "dcp_over_unbroken": round(best["dcp_hf"] / best["unbroken"], 2)}


def _line(name: str, f: dict[str, Any]) -> str:
    def secs(xs: list[float]) -> str:
        return " ".join(f"{x:.2f}" for x in xs)

    return (f"{name}: final checkpoint of {f['state_bytes'] / 1e9:.2f} GB into {f['directory']}: unbroken "
            f"{secs(f['seconds']['unbroken'])} s ({f['gb_s']['unbroken']} GB/s), torch DCP's HF writer with a "
            f"sha256 pass {secs(f['seconds']['dcp_hf'])} s ({f['gb_s']['dcp_hf']} GB/s); DCP / unbroken "
            f"{f['dcp_over_unbroken']}x")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Write each preset's state both ways (``--section.field=value`` overrides apply to all), print and write
    the JSON (``--out``)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.final_checkpoint_write",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="debug,llama-60m", help="comma-separated config presets")
    ap.add_argument("--checkpoint-dir", type=Path, default=None,
                    help="where the checkpoints are written (default: the temporary directory)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/final_checkpoint_write.json"))
    a, overrides = parse_with_overrides(ap, argv)
    finals = {}
    for name in (p.strip() for p in a.presets.split(",") if p.strip()):
        cfg = load_config(preset_name=name, overrides=CASE_OVERRIDES.get(name, []) + overrides)
        finals[name] = write_figures(cfg, a.checkpoint_dir, repeats=a.repeats)
        print(_line(name, finals[name]), flush=True)
    result = {"benchmark": "final_checkpoint_write", "overrides": overrides, "final": finals,
              "machine": machine_description()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
