"""Run every GPU check of ``scripts/gpu`` and print one table (and write it as JSON).

Run on a machine with CUDA: ``python scripts/gpu/run_all.py [--out FILE] [--skip NAME,...]``.
Each check runs in its own process with a time limit; its last JSON line is its result. Then the
CUDA-only tests run (``tests/unit/test_cuda_placement.py``, ``test_snapshot_staging.py``,
``test_collective_completion.py``); the two-GPU kill scenario among them runs where two GPUs are
present and says it skipped otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CHECKS: list[tuple[str, list[str], int]] = [
    ("completion", ["completion.py"], 60),
    ("setup_death", ["nccl_setup_death.py"], 60),
    ("snapshot_tiny", ["snapshot_cuda.py"], 90),
    ("kill_restore", ["kill_restore.py", "--job"], 200),
    ("snapshot_llama1b", ["snapshot_llama1b.py"], 150),
    ("fused_adamw", ["fused_adamw.py"], 60),
    ("restore_load", ["restore_load.py"], 150),
    ("final_checkpoint", ["final_checkpoint.py"], 300),
    ("compile_cache", ["compile_cache.py"], 420),
]
TESTS = ["tests/unit/test_cuda_placement.py", "tests/unit/test_snapshot_staging.py",
         "tests/unit/test_collective_completion.py", "tests/unit/test_checkpoint_writer.py"]


def _run(cmd: list[str], limit: int) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT)
        return done.returncode, done.stdout + done.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, out, time.perf_counter() - t0


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else None
    skip = set(sys.argv[sys.argv.index("--skip") + 1].split(",")) if "--skip" in sys.argv else set()
    head = {"gpus": torch.cuda.device_count(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": ".".join(str(v) for v in torch.cuda.nccl.version())}
    results: dict[str, object] = {"machine": head}
    for name, args, limit in CHECKS:
        if name in skip:
            continue
        rc, text, secs = _run([sys.executable, str(HERE / args[0]), *args[1:]], limit)
        results[name] = {"rc": rc, "seconds": round(secs, 1), "result": _last_json(text),
                         **({"tail": text[-1500:]} if rc or _last_json(text) is None else {})}
        print(f"{name}: rc={rc} {secs:.1f}s {json.dumps(results[name]['result'])}", flush=True)
    if "tests" not in skip:
        rc, text, secs = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TESTS], 150)
        results["cuda_tests"] = {"rc": rc, "seconds": round(secs, 1), "tail": text[-2500:]}
        print(f"cuda_tests: rc={rc} {secs:.1f}s\n{text[-2500:]}", flush=True)
    print("\n| check | ok | figures |\n|---|---|---|")
    for name, r in results.items():
        if name == "machine":
            continue
        res = r.get("result") or {}  # type: ignore[union-attr]
        ok = r["rc"] == 0 and res.get("ok", res.get("exact", True)) is not False  # type: ignore[index]
        figures = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()
                   if k not in ("check", "job_verdict", "job_stderr_tail")}
        print(f"| {name} | {'yes' if ok else 'NO'} | {json.dumps(figures)[:400]} |")
    print(json.dumps(head))
    if out is not None:
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
