"""One training process: builds the model, runs the step protocol, writes metrics.

Started by the launcher as ``python -m unbroken.runtime.worker ...``. Worker ``i``
owns slot ``i``; each step it computes its slot's gradient sums
(:func:`unbroken.mecefo.gradients.compute_gradient_sums`), the step protocol
reduces them across workers, and every worker applies the same reduced gradient,
so parameters stay identical everywhere.

Invariants: worker ``i`` trains exactly ``batch(step, i)`` at every step; all
workers hold bitwise-identical parameters after every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unbroken.config import Config, config_hash
from unbroken.data import BatchSampler, prepare_data
from unbroken.mecefo.adapter import LlamaAdapter
from unbroken.mecefo.gradients import GradLayout, SlotWork, apply_step, compute_gradient_sums
from unbroken.models import build_model
from unbroken.runtime.checkpoint import AsyncCheckpointer, load_checkpoint, training_state
from unbroken.jsonl import JsonlWriter
from unbroken.models.optim import build_optimizer, lr_at
from unbroken.runtime.step import StepProtocol, resolve_device

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything a worker process is told on its command line."""

    run_dir: Path
    rank: int
    world: int
    store: str
    resume: Path | None = None


class Trainer:
    """State and loop of one data-parallel worker."""

    def __init__(self, cfg: Config, spec: WorkerSpec) -> None:
        self.cfg, self.spec = cfg, spec
        self.device = resolve_device(cfg.train.device, spec.rank)
        data = prepare_data(
            source=cfg.data.source,
            vocab_size=cfg.data.vocab_size,
            val_fraction=cfg.data.val_fraction,
            cache_dir=cfg.data.cache_dir,
            token_dtype=cfg.data.token_dtype,
            max_bytes=cfg.data.max_bytes,
        )
        d = cfg.data
        self.sampler = BatchSampler(
            data.train, seed=cfg.train.seed, n_slots=cfg.train.workers, micro_batch=d.micro_batch, seq_len=d.seq_len
        )
        self.val_sampler = BatchSampler(data.val, seed=cfg.train.seed, n_slots=1, micro_batch=d.micro_batch, seq_len=d.seq_len)
        self.model = build_model(
            cfg.model.preset,
            vocab_size=data.vocab_size,
            seq_len=d.seq_len,
            max_seq_len=cfg.model.max_seq_len,
            seed=cfg.train.seed,
            device=self.device,
        )
        self.adapter = LlamaAdapter(self.model)
        self.layout = GradLayout(self.model, self.adapter)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.hash = config_hash(cfg)
        self.start_step = 0
        if spec.resume is not None:
            commit = load_checkpoint(spec.resume, self.model, self.optimizer, config_hash=self.hash)
            self.start_step = int(commit["step"])
        self.protocol = StepProtocol(
            rank=spec.rank, world=spec.world, timeout_s=cfg.train.timeout_s, device=self.device
        )
        self.metrics = JsonlWriter(spec.run_dir / "metrics.jsonl") if spec.rank == 0 else None
        self.checkpointer = AsyncCheckpointer(spec.run_dir, config_hash=self.hash) if spec.rank == 0 else None

    def train(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        tokens_per_step = t.workers * cfg.data.micro_batch * cfg.data.seq_len
        wall0 = time.perf_counter()
        last: dict[str, Any] = {}
        for step in range(self.start_step, t.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg=cfg.optim, total_steps=t.steps)
            work = [SlotWork(slot=self.spec.rank, rows=(0, cfg.data.micro_batch), mode="exact")]
            buf = compute_gradient_sums(
                self.model, self.adapter, self.layout, work,
                step=step, micro_batch=cfg.data.micro_batch, batch_fn=self.sampler.batch, device=self.device,
            )
            buf = self.protocol.reduce(buf)
            grad_norm = apply_step(self.layout, buf, self.optimizer, lr=lr, grad_clip=cfg.optim.grad_clip)
            dt = time.perf_counter() - t0
            loss = self.layout.loss_sum(buf) / self.layout.token_count(buf)
            last = {"kind": "train", "step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                    "wall_s": time.perf_counter() - wall0, "tokens": (step + 1) * tokens_per_step}
            if self.metrics and ((step + 1) % t.log_every == 0 or step + 1 == t.steps):
                self.metrics.write(dict(last))
            done = step + 1
            if (t.val_every and done % t.val_every == 0) or done == t.steps:
                self._validate(done)
            if self.checkpointer:
                self.checkpointer.poll()
                if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.steps:
                    self.checkpointer.save(done, training_state(self.model, self.optimizer), {"loss": loss})
        if self.checkpointer:
            self.checkpointer.wait()
        return last

    @torch.no_grad()
    def _validate(self, step: int) -> None:
        """Validation batches are split round-robin across workers, then summed."""
        self.model.eval()
        acc = torch.zeros(2, dtype=torch.float64)
        for i in range(self.spec.rank, self.cfg.train.val_batches, self.spec.world):
            x, y = self.val_sampler.batch(i, 0)
            logits = self.model(x.to(self.device))
            acc[0] += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), y.to(self.device).reshape(-1), reduction="sum"))
            acc[1] += y.numel()
        acc = self.protocol.reduce(acc)
        self.model.train()
        val_loss = float(acc[0] / acc[1])
        if self.metrics:
            self.metrics.write({"kind": "val", "step": step, "val_loss": val_loss,
                                "val_ppl": float(torch.exp(torch.tensor(min(val_loss, 50.0))))})

    def param_digest(self) -> str:
        h = hashlib.sha256()
        for p in self.layout.params:
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()


def run(spec: WorkerSpec) -> None:
    """Run one worker to completion and write its report ``workers/w<rank>.json``."""
    cfg = Config.from_dict(json.loads((spec.run_dir / "config.json").read_text()))
    threads = cfg.train.threads_per_worker or max(1, (os.cpu_count() or 1) // spec.world)
    torch.set_num_threads(threads)
    host, port = spec.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=cfg.train.timeout_s))
    trainer = Trainer(cfg, spec)
    backend = "nccl" if trainer.device.type == "cuda" and cfg.train.backend != "gloo" else "gloo"
    dist.init_process_group(
        backend, store=dist.PrefixStore("g0/", store), rank=spec.rank, world_size=spec.world,
        timeout=timedelta(seconds=cfg.train.timeout_s),
    )
    try:
        last = trainer.train()
        report = {"rank": spec.rank, "steps": trainer.cfg.train.steps, "param_digest": trainer.param_digest(),
                  "last": last, "start_step": trainer.start_step}
        out = spec.run_dir / "workers" / f"w{spec.rank}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m unbroken.runtime.worker")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True, help="HOST:PORT of the coordination store")
    ap.add_argument("--resume", type=Path, default=None, help="committed checkpoint directory")
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [w{a.rank}] %(name)s: %(message)s",
    )
    run(WorkerSpec(run_dir=a.run_dir, rank=a.rank, world=a.world, store=a.store, resume=a.resume))


if __name__ == "__main__":
    main()
