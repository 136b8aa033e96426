"""A worker's process: ``python -m unbroken.agent.worker_process`` (started by its agent).

The training itself is :func:`unbroken.runtime.worker_entry.run`; this entry point
owns the process around it: the command line, logging (every line carries the
worker, its view generation and step), the warm-standby wait, and the fault
hooks. Faults enter from outside the runtime: when the agent names fault specs
for this incarnation (``--faults I,J``: indices into the job's fault plan
``--faults-file``), :class:`unbroken.faults.injector.PhaseFaults` is installed
on the step protocol's hook points.

Command line: ``--run-dir DIR --worker ID --world N --store HOST:PORT [--join]
[--resume CKPT] [--faults-file F --faults I,J]``, or ``--standby --node-rank R``
instead of ``--worker``. Exit 0 = finished; 3 = fenced; anything else is a death. An exception that
ends the worker is logged with its traceback and recorded as the last line of its event file
(:func:`unbroken.agent._job_error.record_error`), then the process exits with code 1.

Before anything can create an NCCL group, :func:`survive_nccl_failures` sets
:data:`NCCL_ENVIRONMENT`, so that a peer's death makes the pending collective
fail in its caller (which then moves to the next view) instead of the NCCL
watchdog or its heartbeat monitor tearing the surviving process down.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from unbroken.agent._job_error import record_error
from unbroken.agent._process import STACK_SIGNAL, die_with_parent
from unbroken.faults.fail_at import FaultSpec, fault_selection
from unbroken.faults.injector import PhaseFaults
from unbroken.job.builder import Prepared
from unbroken.runtime.start_phases import StartClock
from unbroken.runtime.worker import StepLogContext, Trainer, WorkerSpec
from unbroken.runtime.worker_entry import run, standby

logger = logging.getLogger(__name__)

NCCL_ENVIRONMENT: dict[str, str] = {
    # 2 = CleanUpOnly: on an NCCL error or timeout the watchdog aborts the communicator and fails
    # the pending work, whose caller raises; the default (3, SkipCleanUp) and 1 (TearDown) kill
    # the process, i.e. every survivor of a peer's death.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # The heartbeat monitor kills a process whose watchdog is stuck (in the abort of a communicator
    # whose peer died, say): that process is a survivor; our failure detector handles hangs.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # wait() must not block: the protocol polls work.is_completed() (never the future, which NCCL
    # completes at enqueue) and runs its checks meanwhile.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    # Who died is decided by the job's failure detector, not by NCCL writing errors to the store.
    "TORCH_NCCL_PROPAGATE_ERROR": "0",
    # No debug dumps (they need the monitor, and delay the abort).
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}
"""torch's NCCL settings under which a worker survives a peer's death (read when a group is created)."""


def survive_nccl_failures(environ: dict[str, str] | None = None) -> None:
    """Set :data:`NCCL_ENVIRONMENT` in ``environ`` (default ``os.environ``), overriding other values.

    Must run before the first NCCL process group is created (torch reads them then).
    """
    env = os.environ if environ is None else environ
    for name, value in NCCL_ENVIRONMENT.items():
        if env.get(name, value) != value:
            logger.warning("%s=%s would kill survivors of a peer's death; using %s", name, env[name], value)
        env[name] = value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m unbroken.agent.worker_process")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--worker", type=int, default=None, help="global worker id (its home slot)")
    ap.add_argument("--world", type=int, required=True, help="number of slots")
    ap.add_argument("--store", required=True, help="HOST:PORT of the coordination store")
    ap.add_argument("--join", action="store_true", help="join a running job (restart or replacement)")
    ap.add_argument("--restore-gen", type=int, default=None,
                    help="with --join: started for the restored view of this generation")
    ap.add_argument("--resume", type=Path, default=None, help="committed checkpoint directory")
    ap.add_argument("--faults-file", type=Path, default=None, help="the job's fault plan (JSON)")
    ap.add_argument("--faults", default="", help="indices of the plan's specs this worker inflicts on itself")
    ap.add_argument("--replica-incarnation", default="0",
                    help="HSDP: names this start of the worker's replica (its ranks rendezvous on it)")
    ap.add_argument("--standby", action="store_true", help="warm standby: wait to be assigned a worker id")
    ap.add_argument("--node-rank", type=int, default=0, help="node whose standby this is")
    return ap


def main(argv: list[str] | None = None, *, forked: bool = False, prepared: Prepared | None = None) -> None:
    """Run a worker (or standby); ends the process. ``forked``: from the node's template
    (:mod:`unbroken.agent.template`), with the data and model it ``prepared`` (None: it could not)."""
    clock = StartClock()  # the interpreter and the imports took the process's age so far (a fork's: none)
    die_with_parent()
    ap = _parser()
    a = ap.parse_args(argv)
    if a.worker is None and not a.standby:
        ap.error("--worker is required unless --standby is given")
    context = StepLogContext(f"standby{a.node_rank}" if a.standby else f"w{a.worker}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(context)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [%(where)s pid{os.getpid()}] "
                                           f"%(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    survive_nccl_failures()
    faulthandler.register(STACK_SIGNAL, all_threads=True)  # a fence for a hang asks where it hung (to the log)
    if forked:
        logger.info("forked from the node's template (%s)",
                    "its data and model" if prepared is not None else "imports only")
        faulthandler.cancel_dump_traceback_later()  # armed by the template: the start did not stall
    worker = a.worker
    try:
        if a.standby:
            got = standby(a.run_dir, a.world, a.store, a.node_rank, prepared=prepared, forked=forked)
            if got is None:
                code = 0
            else:
                context.who, worker = f"w{got.spec.worker}", got.spec.worker
                faults = fault_selection(a.faults_file, got.faults)
                code = run(got.spec, store=got.store, prepared=got.prepared, setup=_setup(context, faults),
                           compilation=got.compilation)
        else:
            spec = WorkerSpec(run_dir=a.run_dir, worker=a.worker, world=a.world, store=a.store, join=a.join,
                              resume=a.resume, replica_incarnation=a.replica_incarnation,
                              restore_gen=a.restore_gen)
            code = run(spec, setup=_setup(context, fault_selection(a.faults_file, a.faults)), clock=clock,
                       prepared=prepared)
    except Exception as exc:
        logger.exception("the worker failed: %s: %s", type(exc).__name__, exc)
        if worker is not None:  # what and where, for its agent (a fault that recurs stops whole-job restores)
            record_error(a.run_dir, worker, exc)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Abandoned gloo groups may hold threads blocked on fenced peers: do not wait for them.
    os._exit(code)


def _setup(context: StepLogContext, faults: tuple[FaultSpec, ...]) -> Callable[[Trainer], None]:
    """Attach the log context and install this worker's phase faults before it starts."""

    def setup(trainer: Trainer) -> None:
        context.follow(trainer)
        if faults:
            PhaseFaults(faults, trainer.events.write, trainer.job.model,
                        lambda: trainer.protocol.sums).install(trainer.protocol.on)
    return setup


if __name__ == "__main__":
    main()
