"""The loss of the job's store as a fault: ``--fail-at 'step=40:store=I:kill'``, fired by the launcher.

Once the job has committed ``step`` steps the launcher, which watches that
count, kills from outside:

- on etcd (``--store etcd://...``): member ``I`` of the cluster, by SIGKILL to
  the pid found in the JSON file named by ``$UNBROKEN_STORE_PIDS``
  (``{"0": pid, ...}``; :class:`~unbroken.store.local_etcd.LocalEtcd` writes
  one). With three members the job carries on: every client moves to a live
  member within its request timeout.
- on the embedded store (``store=0``, the only one): the launcher process itself,
  which hosts it (SIGKILL: the store's machine is lost). Its agents lose the
  store, stop their workers and exit with a message saying so; the persistent
  checkpoint stays, and ``unbroken train --resume RUN_DIR`` continues from it.

The same end, not injected: an etcd cluster without quorum for
``fault.store_timeout_s`` (every client gives up; the launcher says so with
:func:`store_lost_message`).

Each firing is recorded first in ``RUN/events/store.jsonl`` (event
``store_fault``: step, member, pid, time), so that what follows can be measured
from it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from unbroken.faults.fail_at import FaultSpec, format_fail_at
from unbroken.jsonl import JsonlWriter, read_jsonl
from unbroken.checkpoint.checkpointer import latest_checkpoint, read_commit
from unbroken.store.backend import is_etcd_address

__all__ = ["STORE_PIDS_ENV", "StoreFaults", "store_lost_message"]

logger = logging.getLogger(__name__)

STORE_PIDS_ENV = "UNBROKEN_STORE_PIDS"
"""JSON file of the etcd members' pids (``{"0": pid, ...}``), for ``store=I`` faults on etcd."""


class StoreFaults:
    """The job's ``store=I`` specs, fired by the launcher as committed steps reach them."""

    def __init__(self, specs: Iterable[FaultSpec], *, members: int | None, run_dir: Path) -> None:
        """``members``: the etcd cluster's endpoints; None: the embedded store.

        Raises:
            ValueError: a target out of range, or on etcd no ``$UNBROKEN_STORE_PIDS`` (names the fix).
        """
        self.pending = sorted((s for s in specs if s.target == "store"), key=lambda s: s.step)
        self.members, self.run_dir = members, run_dir
        self.fired: set[str] | None = None  # read at the first tick, once the run directory is prepared
        bound = members or 1
        problems = [f"{format_fail_at([s])}: store={s.index} out of range; expected 0..{bound - 1} "
                    f"({'the embedded store is store=0' if members is None else f'{members} etcd endpoints'})"
                    for s in self.pending if s.index >= bound]
        if self.pending and members is not None and not os.environ.get(STORE_PIDS_ENV):
            problems.append(f"store=I on etcd: set {STORE_PIDS_ENV} to a JSON file {{\"I\": pid}} of the "
                            f"members' processes (the launcher kills member I by its pid)")
        if problems:
            raise ValueError("fault specs do not fit the store:\n  " + "\n  ".join(problems))

    def tick(self, committed: int | None) -> None:
        """Fire every spec whose step the job has reached (``committed`` steps done).

        A spec fired in an earlier attempt of the run (``--resume``) is not fired again.
        """
        if self.fired is None:
            self.fired = {str(e["spec"]) for e in read_jsonl(self.run_dir / "events" / "store.jsonl") if e.get("spec")}
            self.pending = [s for s in self.pending if format_fail_at([s]) not in self.fired]
        while self.pending and committed is not None and committed >= self.pending[0].step:
            self._fire(self.pending.pop(0), committed)

    def _fire(self, spec: FaultSpec, committed: int) -> None:
        if self.members is None:
            pid, what = os.getpid(), "the launcher hosting the embedded store"
        else:
            pids = json.loads(Path(os.environ[STORE_PIDS_ENV]).read_text())
            pid, what = int(pids[str(spec.index)]), f"etcd member {spec.index}"
        writer = JsonlWriter(self.run_dir / "events" / "store.jsonl")
        writer.write({"kind": "event", "event": "store_fault", "spec": format_fail_at([spec]), "step": spec.step,
                      "committed": committed, "member": spec.index, "pid": pid, "time": time.time()})
        writer.close()
        logger.warning("fault %s: SIGKILL to %s (pid %d) after %d committed steps", format_fail_at([spec]), what,
                       pid, committed)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            logger.warning("%s (pid %d) was already gone", what, pid)


def store_lost_message(detail: str, addr: str, run_dir: Path) -> str:
    """What the launcher says when the job stopped because its store at ``addr`` stopped answering."""
    ckpt = latest_checkpoint(run_dir)
    kept = "no committed checkpoint exists" if ckpt is None else \
        f"the newest committed checkpoint is {ckpt} (step {read_commit(ckpt)['step']})"
    again = f" --store {addr}" if is_etcd_address(addr) else ""
    return (f"lost the job store {addr} ({detail}); every agent and worker stopped, {kept} and the nodes' "
            f"snapshot memory is kept; once the store answers again (or with another one), continue with: "
            f"unbroken train --resume {run_dir}{again}")
