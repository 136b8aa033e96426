"""One training process: builds the model, runs the step protocol, writes metrics.

Started by an agent as ``python -m unbroken.runtime.worker ...``. Worker ``w``
owns slot ``w``; each step it computes the items the step protocol assigns
(its own slot, or more while peers are down), the protocol reduces and commits
them across the live workers, and every member applies the same reduced
gradient, so parameters stay identical everywhere.

A worker started with ``--join`` (a restart or a replacement) asks to join,
is admitted at a step boundary and receives the full training state from a
live peer before it trains.

Exit codes: 0 done, 3 fenced (declared dead by the others), 4 no live worker
left, 1 any other error.

Invariants: every member holds bitwise-identical parameters after every step;
the view's first member writes metrics, progress and checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from unbroken.config import Config, config_hash
from unbroken.data import BatchSampler, PreparedData, prepare_data
from unbroken.faults.fail_at import FaultSpec, parse_fail_at
from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.adapter import LlamaAdapter
from unbroken.mecefo.gradients import GradLayout, SlotWork, apply_step, compute_gradient_sums
from unbroken.models import build_model, resolve_device, validation_loss
from unbroken.models.optim import build_optimizer, lr_at
from unbroken.runtime.checkpoint import AsyncCheckpointer, load_checkpoint, training_state
from unbroken.runtime.membership import EXIT_FENCED, Fenced, Membership, NoLiveWorker, View, ViewChanged, connect_store
from unbroken.runtime.process_group import CollectiveFailed
from unbroken.runtime.protocol import AlternatingProtocol, MemberDied, PlainProtocol, StepProtocol
from unbroken.runtime.state_transfer import pack_state, unpack_state

logger = logging.getLogger(__name__)

EXIT_NO_LIVE_WORKER = 4
JOIN_POLL_S = 0.01
_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything a worker process is told on its command line."""

    run_dir: Path
    worker: int
    world: int
    store: str
    join: bool = False
    resume: Path | None = None
    faults: tuple[FaultSpec, ...] = ()


@dataclasses.dataclass(kw_only=True)
class Warm:
    """What a warm standby prepares before it knows which worker it will be."""

    data: PreparedData
    model: torch.nn.Module


def warm_up(cfg: Config, device: torch.device) -> Warm:
    """Load the data and build the model: the slow part of a worker's start besides imports."""
    d = cfg.data
    data = prepare_data(source=d.source, vocab_size=d.vocab_size, val_fraction=d.val_fraction,
                        cache_dir=d.cache_dir, token_dtype=d.token_dtype, max_bytes=d.max_bytes)
    model = build_model(cfg.model.preset, vocab_size=data.vocab_size, seq_len=d.seq_len,
                        max_seq_len=cfg.model.max_seq_len, seed=cfg.train.seed, device=device)
    return Warm(data=data, model=model)


class Trainer:
    """Model, optimizer and data of one worker, plus its side of the step protocol."""

    def __init__(self, cfg: Config, spec: WorkerSpec, membership: Membership, warm: Warm | None = None) -> None:
        self.cfg, self.spec, self.m = cfg, spec, membership
        self.device = resolve_device(cfg.train.device, spec.worker)
        d = cfg.data
        warm = warm or warm_up(cfg, self.device)
        data = warm.data
        self.sampler = BatchSampler(data.train, seed=cfg.train.seed, n_slots=cfg.train.workers,
                                    micro_batch=d.micro_batch, seq_len=d.seq_len)
        self.val_sampler = BatchSampler(data.val, seed=cfg.train.seed, n_slots=1, micro_batch=d.micro_batch,
                                        seq_len=d.seq_len)
        self.model = warm.model
        self.adapter = LlamaAdapter(self.model, rank=cfg.mecefo.rank, tau=cfg.mecefo.tau)
        self.layout = GradLayout(self.model, self.adapter)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.hash = config_hash(cfg)
        if spec.resume is not None:
            load_checkpoint(spec.resume, self.model, self.optimizer, config_hash=self.hash)
        self.events = JsonlWriter(spec.run_dir / "events" / f"w{spec.worker}.jsonl")
        protocol_cls = {"takeover": StepProtocol, "restart": PlainProtocol,
                        "alternate": AlternatingProtocol}[cfg.fault.recovery]
        self.protocol = protocol_cls(
            membership=membership, n_slots=cfg.train.workers, micro_batch=d.micro_batch, policy=cfg.mecefo.policy,
            device=self.device, timeout_s=cfg.train.timeout_s, compute=self._compute,
            pack_state=lambda: pack_state(self.model, self.optimizer),
            load_state=lambda flat: unpack_state(flat, self.model, self.optimizer),
            events=self.events, fault_hook=self._fault_hook,
        )
        self.metrics: JsonlWriter | None = None
        self.checkpointer: AsyncCheckpointer | None = None

    def _compute(self, step: int, items: list[SlotWork]) -> torch.Tensor:
        return compute_gradient_sums(self.model, self.adapter, self.layout, items, step=step,
                                     micro_batch=self.cfg.data.micro_batch, batch_fn=self.sampler.batch,
                                     device=self.device)

    def _fault_hook(self, phase: str, step: int) -> None:
        for f in self.spec.faults:
            if f.step == step and (f.phase == phase or (f.phase == "any" and phase == "forward")):
                self.events.write({"kind": "event", "event": "fault_self", "worker": self.spec.worker,
                                   "step": step, "phase": phase, "how": f.how})
                os.kill(os.getpid(), _SIGNALS[f.how])

    # -- start ----------------------------------------------------------------

    def start(self) -> int:
        """Enter the job (first view or as a joiner); returns the first step to train."""
        t0 = time.perf_counter()
        if not self.spec.join:
            view = self._wait_view(lambda v: self.spec.worker in v.members)
            try:
                self.protocol.adopt(view)
            except (CollectiveFailed, ViewChanged, MemberDied) as exc:
                # A member died (or was judged dead) before the first step: go on without it, as in
                # any step; its agent restarts it and it rejoins.
                self.protocol.reconfigure_at_start(view.step, f"{type(exc).__name__}: {exc}")
            return view.step
        self.m.request_join({"pid": os.getpid(), "config_hash": self.hash, "t": time.time()})
        gen = -1
        while True:
            view = self._wait_view(lambda v, g=gen: self.spec.worker in v.joiners and v.gen > g)
            try:
                self.protocol.adopt(view)
                break
            except (CollectiveFailed, ViewChanged, MemberDied) as exc:
                # Someone died during the admission: the next view of that step admits us again.
                logger.warning("admission in view %d failed (%s); waiting for the next", view.gen, exc)
                gen = view.gen
        self.protocol.need_exchange = True
        self.events.write({"kind": "event", "event": "rejoined", "worker": self.spec.worker, "gen": view.gen,
                           "step": view.step, "wait_s": time.perf_counter() - t0})
        return view.step

    def _wait_view(self, accept: Callable[[View], bool]) -> View:
        deadline = time.monotonic() + max(self.cfg.train.timeout_s, 600.0 if self.spec.join else 0.0)
        while time.monotonic() < deadline:
            if self.m.store.check(["done"]) or self.m.store.check(["failed"]):
                raise SystemExit(0)
            if self.m.store.check(["gen"]):
                view = self.m.current_view()
                if self.spec.worker not in view.members and view.gen > 0 and self.spec.join is False:
                    raise Fenced(f"worker {self.spec.worker} is not in view {view.gen}")
                if accept(view):
                    return view
            time.sleep(JOIN_POLL_S)
        raise TimeoutError(f"worker {self.spec.worker} was not admitted within the timeout")

    # -- the loop -------------------------------------------------------------

    def train(self, start: int) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        tokens_per_step = t.workers * cfg.data.micro_batch * cfg.data.seq_len
        last: dict[str, Any] = {}
        t_prev = time.perf_counter()
        for step in range(start, t.steps):
            lr = lr_at(step, cfg=cfg.optim, total_steps=t.steps)
            buf, items = self.protocol.run_step(step)
            grad_norm = apply_step(self.layout, buf, self.optimizer, lr=lr, grad_clip=cfg.optim.grad_clip)
            view = self.protocol.view
            done = step + 1
            self.events.write({"kind": "commit", "step": step, "gen": view.gen, "worker": self.spec.worker})
            now = time.perf_counter()
            dt, t_prev = now - t_prev, now
            last = {"kind": "train", "step": done, "loss": self.layout.loss_sum(buf) / self.layout.token_count(buf),
                    "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                    "tokens": done * tokens_per_step, "generation": view.gen, "live_workers": len(view.members),
                    "degraded": sorted(set(range(t.workers)) - set(view.members))}
            if view.members[0] == self.spec.worker:
                self._lead(done, last)
            if done < t.steps:
                self.protocol.admit_joiners(done)
        if self.checkpointer:
            self.checkpointer.wait()
        if self.protocol.view.members[0] == self.spec.worker:
            self.m.store.set("done", "1")
        return last

    def _lead(self, done: int, last: dict[str, Any]) -> None:
        """Duties of the view's first member: metrics, validation, checkpoints, progress."""
        t = self.cfg.train
        if self.metrics is None:
            self.metrics = JsonlWriter(self.spec.run_dir / "metrics.jsonl")
            self.checkpointer = AsyncCheckpointer(self.spec.run_dir, config_hash=self.hash)
        if done % t.log_every == 0 or done == t.steps:
            self.metrics.write(dict(last))
        if (t.val_every and done % t.val_every == 0) or done == t.steps:
            self._validate(done)
        self.checkpointer.poll()
        if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.steps:
            self.checkpointer.save(done, training_state(self.model, self.optimizer), {"loss": last["loss"]})
        self.m.store.set("progress", str(done))

    def _validate(self, step: int) -> None:
        """Validation on the leader only: it must not depend on who else is alive."""
        val_loss = validation_loss(self.model, self.val_sampler.batch, self.cfg.train.val_batches, self.device)
        self.metrics.write({"kind": "val", "step": step, "val_loss": val_loss,
                            "val_ppl": float(torch.exp(torch.tensor(min(val_loss, 50.0))))})

    def param_digest(self) -> str:
        h = hashlib.sha256()
        for p in self.layout.params:
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()


def load_run_config(run_dir: Path, world: int) -> Config:
    cfg = Config.from_dict(json.loads((run_dir / "config.json").read_text()))
    torch.set_num_threads(cfg.train.threads_per_worker or max(1, (os.cpu_count() or 1) // world))
    return cfg


def run(spec: WorkerSpec, *, store: dist.Store | None = None, warm: Warm | None = None) -> int:
    """Run one worker to completion; returns the process exit code."""
    cfg = load_run_config(spec.run_dir, spec.world)
    store = store or connect_store(spec.store, timeout_s=cfg.train.timeout_s)
    membership = Membership(store, spec.worker, heartbeat_timeout_s=cfg.fault.heartbeat_timeout_s,
                            heartbeat_store=connect_store(spec.store, timeout_s=cfg.train.timeout_s))
    membership.start_heartbeat()
    trainer = Trainer(cfg, spec, membership, warm)
    try:
        last = trainer.train(trainer.start())
    except Fenced as exc:
        logger.error("fenced: %s", exc)
        return EXIT_FENCED
    except NoLiveWorker as exc:
        store.compare_set("failed", "", f"no live worker left: {exc}")
        return EXIT_NO_LIVE_WORKER
    finally:
        membership.stop()
    report = {"worker": spec.worker, "steps": cfg.train.steps, "param_digest": trainer.param_digest(),
              "last": last, "gen": trainer.protocol.view.gen}
    out = spec.run_dir / "workers" / f"w{spec.worker}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)
    return 0


def standby(run_dir: Path, world: int, store_addr: str, node: int) -> tuple[WorkerSpec, dist.Store, Warm] | None:
    """Be a warm standby of ``node``: prepare, announce, wait to be handed a worker id.

    Contract (see :mod:`unbroken.agent._standby`): write ``standby/<node>/ready`` =
    pid; claim an offer ``standby/<node>/assign`` = ``"<w>"`` by compare-and-set
    to ``claimed:<pid>``; read ``standby/<node>/faults``. Returns None when the
    job ends first.
    """
    cfg = load_run_config(run_dir, world)
    store = connect_store(store_addr, timeout_s=cfg.train.timeout_s)
    warm = warm_up(cfg, resolve_device(cfg.train.device, node))
    key, me = f"standby/{node}/assign", f"claimed:{os.getpid()}"
    store.set(f"standby/{node}/ready", str(os.getpid()))
    while True:
        if store.check(["done"]) or store.check(["failed"]):
            return None
        if store.check([key]):
            offer = store.get(key).decode()
            if offer.isdigit() and store.compare_set(key, offer, me).decode() == me:
                faults = store.get(f"standby/{node}/faults").decode() if store.check([f"standby/{node}/faults"]) else ""
                logger.info("standby of node %d becomes worker %s", node, offer)
                spec = WorkerSpec(run_dir=run_dir, worker=int(offer), world=world, store=store_addr, join=True,
                                  faults=parse_fail_at(faults) if faults else ())
                return spec, store, warm
        time.sleep(0.005)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m unbroken.runtime.worker")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--worker", type=int, default=None, help="global worker id (its home slot)")
    ap.add_argument("--world", type=int, required=True, help="number of slots")
    ap.add_argument("--store", required=True, help="HOST:PORT of the coordination store")
    ap.add_argument("--join", action="store_true", help="join a running job (restart or replacement)")
    ap.add_argument("--resume", type=Path, default=None, help="committed checkpoint directory")
    ap.add_argument("--faults", default="", help="fail-at specs this worker inflicts on itself")
    ap.add_argument("--standby", action="store_true", help="warm standby: wait to be assigned a worker id")
    ap.add_argument("--node-rank", type=int, default=0, help="node whose standby this is")
    a = ap.parse_args(argv)
    if a.worker is None and not a.standby:
        ap.error("--worker is required unless --standby is given")
    who = f"standby{a.node_rank}" if a.standby else f"w{a.worker}"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{who} pid{os.getpid()}] %(name)s: %(message)s")
    if a.standby:
        got = standby(a.run_dir, a.world, a.store, a.node_rank)
        code = 0 if got is None else run(got[0], store=got[1], warm=got[2])
    else:
        spec = WorkerSpec(run_dir=a.run_dir, worker=a.worker, world=a.world, store=a.store, join=a.join,
                          resume=a.resume, faults=parse_fail_at(a.faults) if a.faults else ())
        code = run(spec)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Abandoned gloo groups may hold threads blocked on fenced peers: do not wait for them.
    os._exit(code)


if __name__ == "__main__":
    main()
