"""Fault scheduling: which signal goes to which process at which step (pure).

The agent of node ``R`` (and the outside ``unbroken chaos`` tool) turns the
job's :class:`FaultSpec` list into signals. This module decides *what* fires
*when*; sending the signals is the caller's business, so everything here is
deterministic and unit-testable.

Step semantics. The store key ``progress`` (and the ``step`` of the last train
line in ``metrics.jsonl``) holds ``p``, the number of committed steps: step
``p`` is the one in flight. A spec with ``step=s`` fires as soon as
``p >= s``, i.e. during step ``s``, or at once if the observer only learns of
the progress late. ``back=b`` restarts the failed worker(s) once ``p >= b``: they
are admitted at the end of the first step whose reduction the leader posted
after their process asked to join.

Layout. Worker ``w`` lives on node ``w // workers_per_node``; node ``R`` owns
workers ``R*W .. R*W + W - 1``.

Who fires what:

* ``phase=any`` specs are fired by the target's agent with a real signal:
  ``worker`` + kill/stop/term -> SIGKILL/SIGSTOP/SIGTERM to that worker;
  ``node`` + kill -> SIGKILL to every worker of the node and then to the agent
  itself (a lost node); ``node`` + stop/term -> that signal to every worker of
  the node (the agent lives on and supervises).
* specs with a phase (forward, backward, allreduce, confirm, restore...) target
  one worker, which signals *itself* at that point of the step: the worker's
  entry point installs :class:`PhaseFaults` on the step protocol's hook
  points; the agent tells it which specs of the job's fault plan
  (:func:`~unbroken.faults.fail_at.write_fault_plan`) are its own, by index
  (``--faults``). Node specs must use ``phase=any``.

Concurrency cap. With ``max_down`` (``fault.max_down``) a signal spec that
would take the job past ``max_down`` workers down waits, and every signal
spec after it (first come, first served), until enough workers are back: the
caller passes the workers it sees down (not members of the current view, or
marked dead). A spec that waited ``d`` steps keeps its outage length: its
``back`` moves ``d`` steps later. The count is this node's view of the store:
two agents deciding within the same poll can both fire; a trace drawn under
the same cap (the launcher's) only has two specs waiting at once when a
returning worker is slow to rejoin. Phase specs are the worker's own and are
not held.

Invariants: each spec fires at most once per run, resumes included (the
caller passes the specs that fired before, in ``format_fail_at`` form); a
spec whose step lies before the progress the schedule starts from never fires
(those steps were trained before: a resumed run, or an agent that replaced a
lost one); a death is attributed to at most one injected spec, and only that
spec's ``back`` is used.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable

import torch

from unbroken.faults.fail_at import FaultSpec, format_fail_at
from unbroken.faults.gray import GrayFaults, is_gray

__all__ = ["DeathCause", "Injection", "NodeFaults", "PhaseFaults", "check_faults", "node_of", "signal_for",
           "workers_of"]

_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
"""The signal of each ``how`` that is one (``block`` is not: the worker blocks itself)."""


def signal_for(how: str) -> signal.Signals:
    """The real signal of a spec's ``how``."""
    return _SIGNALS[how]


def node_of(worker: int, workers_per_node: int) -> int:
    return worker // workers_per_node


def workers_of(node: int, workers_per_node: int) -> range:
    return range(node * workers_per_node, (node + 1) * workers_per_node)


def check_faults(specs: Iterable[FaultSpec], *, n_nodes: int, workers_per_node: int,
                 sharded: bool | None = None) -> None:
    """Check that every spec can be carried out on this job's layout.

    Raises:
        ValueError: listing every target out of range and every node spec with
            a phase (a phase is a point in one worker's step; use worker=), and a sharded step's
            phase in a run that is not sharded (``sharded`` None: not known, not checked).
    """
    n_workers = n_nodes * workers_per_node
    problems = []
    for s in specs:
        item = format_fail_at([s])
        if s.target == "store":
            continue  # checked against the store by unbroken.faults.store_loss
        bound = n_workers if s.target == "worker" else n_nodes
        if s.index >= bound:
            problems.append(f"{item}: {s.target}={s.index} out of range; expected 0..{bound - 1} "
                            f"({n_nodes} node(s) x {workers_per_node} worker(s))")
        if s.phase in ("update", "allgather") and sharded is False:
            problems.append(f"{item}: phase={s.phase} is a point of a sharded step only; set "
                            f"train.shard_optimizer=true or pick forward, backward, allreduce or confirm")
        if s.target == "node" and s.phase != "any":
            problems.append(f"{item}: phase={s.phase} needs a worker target (the worker signals itself at "
                            f"that point of its step); use worker=I or drop phase=")
    if problems:
        raise ValueError("fault specs do not fit the job:\n  " + "\n  ".join(problems))


@dataclass(frozen=True, kw_only=True)
class Injection:
    """Signals to send now, for one spec.

    Attributes:
        spec: the spec that fired.
        workers: the target workers (global ids) on this node.
        signal: what to send each of them.
        kill_agent: a lost node: after the workers, the agent SIGKILLs itself.
        resume_after_s: send SIGCONT to the same processes after this long.
    """

    spec: FaultSpec
    workers: tuple[int, ...]
    signal: signal.Signals
    kill_agent: bool = False
    resume_after_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class DeathCause:
    """What a worker's death is attributed to."""

    injected: bool
    back_step: int | None = None
    spec: FaultSpec | None = None


class NodeFaults:
    """The schedule of one node's faults (the agent's view of the job's specs).

    Args:
        specs: all of the job's specs; those of other nodes are ignored.
        node: this node's rank.
        workers_per_node: W.
        start_step: the progress when the schedule starts; earlier specs are dropped.
        fired: specs (``format_fail_at`` of one spec) that fired in an earlier
            attempt of the run; they are dropped too.
        max_down: at most this many workers down at once (module docstring); ``None``: no cap.
    """

    def __init__(self, specs: Iterable[FaultSpec], *, node: int, workers_per_node: int, start_step: int,
                 fired: Collection[str] = (), max_down: int | None = None) -> None:
        self.node, self.w = node, workers_per_node
        self.max_down = max_down
        self.held: set[str] = set()  # specs that waited for the cap at least once (format_fail_at)
        self.plan = tuple(specs)
        self._index = {id(s): i for i, s in enumerate(self.plan)}
        mine = [s for s in self.plan if s.step >= start_step and self._targets(s) and format_fail_at([s]) not in fired]
        # Stable sort keeps the user's order among specs of one step.
        # A block is the worker's own doing (no signal makes a main thread block): it fires in the worker.
        # So are the gray failures (slow, bitflip, nan: unbroken.faults.gray).
        by_signal = [s for s in mine if s.phase == "any" and s.how in _SIGNALS]
        self._signals = sorted(by_signal, key=lambda s: s.step)
        self._phased = sorted((s for s in mine if s not in by_signal), key=lambda s: s.step)
        self._fired: dict[int, FaultSpec] = {}  # worker -> signal spec awaiting its death

    def _targets(self, s: FaultSpec) -> tuple[int, ...]:
        if s.target == "store":
            return ()  # the launcher fires it (unbroken.faults.store_loss)
        if s.target == "node":
            return tuple(workers_of(s.index, self.w)) if s.index == self.node else ()
        return (s.index,) if node_of(s.index, self.w) == self.node else ()

    @property
    def next_step(self) -> int | None:
        """Step of the next signal this node fires itself (``None``: none left)."""
        return self._signals[0].step if self._signals else None

    def due(self, progress: int, down: Collection[int] = ()) -> list[Injection]:
        """Pop the signal specs due at ``progress`` committed steps, in order.

        Args:
            progress: committed steps.
            down: workers of the job that are down now (only read with ``max_down``); the workers
                this node signalled and that have not died yet count as down too.
        """
        out = []
        now_down = set(down) | set(self._fired)
        while self._signals and self._signals[0].step <= progress:
            s = self._signals[0]
            workers = self._targets(s)
            if self.max_down is not None and len(now_down | set(workers)) > self.max_down:
                self.held.add(format_fail_at([s]))
                break  # first come, first served: later specs wait behind this one
            self._signals.pop(0)
            now_down |= set(workers)
            blamed = s
            if s.back_step is not None and progress > s.step and format_fail_at([s]) in self.held:
                # A spec that waited keeps its outage length; the Injection keeps the original (its identity).
                blamed = dataclasses.replace(s, back_step=s.back_step + (progress - s.step))
            for w in workers:
                self._fired[w] = blamed
            out.append(Injection(spec=s, workers=workers, signal=signal_for(s.how),
                                 kill_agent=s.target == "node" and s.how == "kill", resume_after_s=s.duration_s))
        return out

    def waiting(self, progress: int) -> bool:
        """Whether a signal spec is due at ``progress`` (fired at once, or held by the cap)."""
        return bool(self._signals) and self._signals[0].step <= progress

    def resumed(self, worker: int) -> None:
        """A stopped worker was continued and lives on: its next death is not this spec's."""
        self._fired.pop(worker, None)

    def worker_faults(self, worker: int, from_step: int) -> tuple[int, ...]:
        """Indices (into the plan) of the phase specs a new incarnation of ``worker`` carries out.

        Phase specs of ``worker`` before ``from_step`` are dropped: it was not
        running at their step, so they can no longer fire (nor explain a death);
        except ``phase=restore``: a whole-job restore goes back to an earlier step.
        """
        self._phased = [s for s in self._phased
                        if not (s.index == worker and s.step < from_step and s.phase != "restore")]
        return tuple(self._index[id(s)] for s in self._phased if s.index == worker)

    def on_death(self, worker: int, progress: int, fired: tuple[int, str] | None = None) -> DeathCause:
        """Attribute a death of ``worker`` observed at ``progress`` committed steps.

        A signal this node sent wins; otherwise the phase spec the worker named as it killed itself
        (``fired``: the step and phase of its last record, ``fault_self``), else the earliest pending phase
        spec of the worker whose step has begun; otherwise the death is not injected. (A restored job
        trains its steps again: a spec of a later step and an earlier phase spec of the restore point can
        both have begun, and only the one that fired is spent.)
        """
        spec = self._fired.pop(worker, None)
        if spec is None:  # a gray failure kills nobody: a slow fault ends with the worker's process
            self._phased = [s for s in self._phased if not (s.index == worker and is_gray(s) and s.step <= progress)]
        if spec is None and fired is not None:
            step, phase = fired
            for i, s in enumerate(self._phased):
                if s.index == worker and s.step == step and ("forward" if s.phase == "any" else s.phase) == phase:
                    spec = self._phased.pop(i)
                    break
        if spec is None:
            for i, s in enumerate(self._phased):
                # A restore spec explains only the death it named: its step is behind the progress long after.
                if s.index == worker and s.step <= progress and s.phase != "restore":
                    spec = self._phased.pop(i)
                    break
        if spec is None:
            return DeathCause(injected=False)
        return DeathCause(injected=True, back_step=spec.back_step, spec=spec)


class PhaseFaults:
    """A worker's own phase faults: at its step and phase, the worker signals itself.

    Installed from outside the runtime by the worker's entry point on the step
    protocol's hook points (``on(phase, hook)``); ``phase=any`` fires at
    ``forward``. Gray failures (slow, bitflip, nan) act on the worker's model
    instead (:class:`~unbroken.faults.gray.GrayFaults`).

    Args:
        specs: this worker's phase specs.
        record: called with an event dict just before the signal is sent.
        model: the worker's model; needed by gray failures only.
        sums: the gradient sums just computed, for gray failures (:class:`~unbroken.faults.gray.GrayFaults`).
    """

    def __init__(self, specs: Iterable[FaultSpec], record: Callable[[dict[str, Any]], None],
                 model: torch.nn.Module | None = None, sums: Callable[[], torch.Tensor | None] = lambda: None) -> None:
        every = tuple(specs)
        self.specs = tuple(s for s in every if not is_gray(s))
        self.gray = tuple(s for s in every if is_gray(s))
        self.record = record
        self.model, self.sums = model, sums

    def install(self, on: Callable[[Any, Callable[[int], None]], None]) -> None:
        """Register a hook for every phase some spec names.

        Raises:
            ValueError: gray failures without the worker's model.
        """
        if self.gray:
            if self.model is None:
                raise ValueError(f"fault {format_fail_at(self.gray)}: a gray failure needs the worker's model")
            GrayFaults(self.gray, self.model, self.record, sums=self.sums).install(on)
        for phase in sorted({"forward" if s.phase == "any" else s.phase for s in self.specs}):
            on(phase, functools.partial(self._fire, phase))

    def _fire(self, phase: str, step: int) -> None:
        for s in self.specs:
            if s.step == step and ("forward" if s.phase == "any" else s.phase) == phase:
                self.record({"kind": "event", "event": "fault_self", "worker": s.index, "step": step,
                             "phase": phase, "how": s.how})
                if s.how == "block":
                    read_end, _ = os.pipe()
                    os.read(read_end, 1)  # nobody ever writes: the main thread is stuck outside Python for good
                os.kill(os.getpid(), signal_for(s.how))
