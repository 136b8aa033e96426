"""GPU check: a one-GPU trainer SIGKILLed mid-step comes back from snapshot memory bit for bit.

Run on a machine with CUDA: ``python scripts/gpu/kill_restore.py``. A child process trains the
``tiny`` model with AdamW on the GPU and snapshots every step into shared memory (the worker's
own snapshotter: side stream, pinned staging, seal). After each optimizer step, before its
snapshot starts, it writes the sha256 of every tensor of the state. Once it has passed step 5
it is SIGKILLed while it computes. This process then finds the newest complete snapshot,
restores it into a freshly built GPU model and optimizer and compares every tensor's digest
with what the trainer wrote for that step. Prints one JSON line (``exact``).

With ``--job``, it also runs the real job: ``unbroken train --workers 1`` on the GPU with the
worker killed mid-step (its agent restores the job from snapshot memory) and reports the
verdict lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from unbroken.models import build_model
from unbroken.store.view import View
from unbroken.snapshot.restore import alone, decide, inventory, restore_from_memory
from unbroken.snapshot.segment import remove_segments
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of

VOCAB, SEQ = 4096, 256
DEVICE = torch.device(os.environ.get("UNBROKEN_CHECK_DEVICE", "cuda:0"))
"""``UNBROKEN_CHECK_DEVICE=cpu`` runs the same check on a CPU (a dry run of the script itself)."""


def _fresh(dev: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=VOCAB, seq_len=SEQ, device=dev)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _digests(model: torch.nn.Module, opt: torch.optim.Optimizer, dev: torch.device) -> dict[str, str]:
    return {k: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, t in tensors_of(model, opt, dev).items() if not k.startswith("rng.")}


def trainer(job: str, out: Path) -> None:
    """The child: train and snapshot every step until killed."""
    dev = DEVICE
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    model, opt = _fresh(dev)
    snap = Snapshotter(job_id=job, node=0, worker=0, node_of={0: 0}, every=1, redundancy="none", parity=0,
                       config_hash="gpu", state=lambda: tensors_of(model, opt, dev), on_event=lambda *a, **k: None)
    view = View(gen=0, members=(0,), step=0)
    x = torch.randint(0, VOCAB, (8, SEQ), device=dev)
    step = 0
    while True:
        loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        snap.wait()  # the last step's snapshot is sealed before this step's update (as in a worker)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tmp = out / f".digest-{step}.json"
        tmp.write_text(json.dumps(_digests(model, opt, dev)))
        os.replace(tmp, out / f"digest-{step}.json")
        snap.take(step, view)


def _run_job() -> dict[str, object]:
    """The real job on the GPU: one worker killed mid-step, the job restored from snapshot memory."""
    with tempfile.TemporaryDirectory(prefix="unbroken-gpu-job-") as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "unbroken.cli", "train", "--preset", "debug", "--workers", "1", "--steps", "40",
               "--train.device=cuda", "--fail-at", "step=20:worker=0:kill:phase=backward", "--out", str(run)]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        seconds = time.perf_counter() - t0
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
        events = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()] \
            if (run / "events.jsonl").is_file() else []
        restores = [{"from": e.get("restored_from"), "step": e.get("step")} for e in events
                    if e.get("event") == "job_restore"]
        return {"job_rc": done.returncode, "job_seconds": seconds, "job_steps": summary.get("steps"),
                "job_failures": summary.get("failures"), "job_restores": restores,
                "job_workers_agree": summary.get("workers_agree"),
                "job_stderr_tail": done.stderr[-800:] if done.returncode else ""}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--trainer":
        trainer(sys.argv[2], Path(sys.argv[3]))
        return
    job = os.urandom(6).hex()
    with tempfile.TemporaryDirectory(prefix="unbroken-gpu-kill-") as tmp:
        out = Path(tmp)
        child = subprocess.Popen([sys.executable, __file__, "--trainer", job, str(out)])
        try:
            deadline = time.monotonic() + 240
            while not (out / "digest-6.json").exists():
                if child.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the trainer did not reach step 6 (rc {child.poll()})")
                time.sleep(0.01)
            time.sleep(0.013)  # somewhere inside the next step
            child.send_signal(signal.SIGKILL)
            child.wait(30)
            dev = DEVICE
            spec = decide([inventory(job, 0, config_hash="gpu")], checkpoint=None, members_of=lambda ns: [0])
            model, opt = _fresh(dev)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # the restore must overwrite every byte
            t0 = time.perf_counter()
            stats = restore_from_memory(spec, job=job, node=0, node_of={0: 0}, members=(0,), me=0, broadcast=alone,
                                        model=model, optimizer=opt, device=dev)
            restore_s = time.perf_counter() - t0
            want = json.loads((out / f"digest-{spec['step']}.json").read_text())
            got = _digests(model, opt, dev)
            exact = want == got
            last = max(int(p.stem.split("-")[1]) for p in out.glob("digest-*.json"))
        finally:
            if child.poll() is None:
                child.kill()
            remove_segments(job)
    result = {"check": "kill_restore", "killed_after_step": last, "restored_step": spec["step"],
              "tensors": len(want), "exact": exact, "restore_s": restore_s, "stripes_local": stats["local"]}
    if "--job" in sys.argv:
        result.update(_run_job())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
