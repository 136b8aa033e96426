"""Declarative fault-injection specs: what to break, where, and when.

This module only parses and validates; the injector that sends the signals
lives elsewhere. The string form (``--fail-at``) is a comma-separated list of
items, each a colon-separated list of fields::

    step=40:worker=2:kill,step=90:node=1:kill,step=120:worker=0:stop:for=3.5

Fields of an item, in any order:

* ``step=N`` (required): the training step during which the fault fires;
* exactly one of ``worker=I``, ``node=I`` or ``store=I``: the target;
  ``store=I`` is the job's store: member ``I`` of its etcd cluster, or
  (``store=0``, the only one) the launcher hosting the embedded store, fired
  by the launcher with ``kill`` only (:mod:`unbroken.faults.store_loss`);
* ``kill`` | ``stop`` | ``term`` | ``block`` (bare word, or ``how=...``;
  default ``kill``): SIGKILL, SIGSTOP (a hang), SIGTERM; ``block``: the
  worker's main thread blocks for good (a read on a pipe nobody writes) while
  its heartbeat thread beats on, a hang only progress detection finds (worker
  targets only; with ``phase=any`` it blocks at ``forward``);
* ``phase=forward|backward|allreduce|update|allgather|confirm|restore|finish|any`` (default ``any``):
  where in the step (``update``: before a sharded run's optimizer update of the
  worker's range, ``allgather``: with the all-gather of the new parameters in
  flight, both with ``train.shard_optimizer`` only; ``confirm``: right after the
  worker voted to commit the step, which it does once every member holds the
  reduced gradient, or, sharded, the gathered parameters; ``restore``: when the
  worker enters a view that restores the job at ``step`` (after every worker
  died, or at ``--resume``), before it arrives in the view's group); ``finish``:
  after the last step (``step`` = the run's step count), the leader's final
  checkpoint begun and not committed yet);
* ``for=SECONDS`` (only with ``stop``): send SIGCONT after that long; absent
  means the process stays stopped. With ``slow``: ``for=STEPS``, see below.
* gray failures, worker targets only, each at points of the step it chooses
  itself (no ``phase=``, no ``back=``: the worker does not die of them):
  ``slow:factor=F`` (``F`` > 1): the worker's compute (forward and backward)
  takes ``F`` times as long from ``step`` on, for ``for=STEPS`` steps
  (integer >= 1) or to the end; it ends with the worker's process.
  ``bitflip:target=grad|param``: one bit of one element of the worker's local
  gradient (after its backward) or parameters (before its forward) flipped
  during ``step``; ``nan``: one element of the worker's local gradient set to
  NaN during ``step`` (:mod:`unbroken.faults.gray`).
* ``back=STEP`` (optional, > ``step``): the failed worker(s) come back once the
  job has committed ``STEP`` steps (an absolute step, like ``step``); the
  agent restarts them as joiners then. Not with ``node=I:kill``: a killed
  node's agent is gone, nobody is left on it to restart anything.

Invariants: every ``FaultSpec`` is valid on its own (construction checks it);
``parse_fail_at`` keeps the order of the items and reports every problem of
the whole string in one ``ValueError``; ``parse_fail_at(format_fail_at(s)) == s``.
"""

from __future__ import annotations

import math
import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Literal, get_args

from unbroken.faults.traces import FailureTrace

__all__ = ["FaultSpec", "fail_at", "format_fail_at", "parse_fail_at", "read_fault_plan", "trace_to_faults",
           "write_fault_plan"]

Target = Literal["worker", "node", "store"]
How = Literal["kill", "stop", "term", "block", "slow", "bitflip", "nan"]
Tensor = Literal["grad", "param"]
Phase = Literal["forward", "backward", "allreduce", "update", "allgather", "confirm", "restore", "finish", "any"]

_TARGETS: tuple[str, ...] = get_args(Target)
_HOWS: tuple[str, ...] = get_args(How)
_PHASES: tuple[str, ...] = get_args(Phase)
_TENSORS: tuple[str, ...] = get_args(Tensor)
GRAY: tuple[str, ...] = ("slow", "bitflip", "nan")
"""The kinds of a worker that neither dies nor hangs: it is slow, or silently wrong."""
_KEYS = ("step", "worker", "node", "store", "how", "phase", "for", "back", "factor", "target")


def _is_int(x: object) -> bool:
    # bool is an int subclass; step=True is a bug, not step 1.
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """One fault: at ``step``, do ``how`` to ``target`` number ``index`` during ``phase``.

    Attributes:
        step: training step (>= 0) during which the fault fires.
        target: ``"worker"`` (one training process) or ``"node"`` (an agent
            and all its workers).
        index: worker or node number (>= 0).
        how: ``"kill"`` (SIGKILL), ``"stop"`` (SIGSTOP, a hang), ``"term"`` (SIGTERM),
            ``"block"`` (the main thread blocks; worker targets only); gray failures
            (worker targets only): ``"slow"``, ``"bitflip"``, ``"nan"``.
        phase: part of the step in which to fire; ``"any"`` leaves it to the injector.
        duration_s: for ``stop`` only: send SIGCONT after this many seconds;
            ``None`` = stay stopped.
        back_step: restart the failed worker(s) once this many steps are
            committed (> ``step``); ``None`` = the agent's restart policy decides.
        factor: for ``slow`` only (required): the compute takes this many times as long (> 1).
        for_steps: for ``slow`` only: it lasts this many steps (>= 1); ``None`` = to the end.
        tensor: for ``bitflip`` only (required): ``"grad"`` or ``"param"``.
    """

    step: int
    target: Target
    index: int
    how: How
    phase: Phase = "any"
    duration_s: float | None = None
    back_step: int | None = None
    factor: float | None = None
    for_steps: int | None = None
    tensor: Tensor | None = None

    def __post_init__(self) -> None:
        problems = _spec_problems(self)
        if problems:
            raise ValueError(f"invalid fault spec {self!r}: " + "; ".join(problems))


def _spec_problems(s: FaultSpec) -> list[str]:
    problems = []
    if not (_is_int(s.step) and s.step >= 0):
        problems.append(f"step={s.step!r}: expected an integer >= 0")
    if s.target not in _TARGETS:
        problems.append(f"target={s.target!r}: expected one of {', '.join(_TARGETS)}")
    if not (_is_int(s.index) and s.index >= 0):
        problems.append(f"{s.target}={s.index!r}: expected an integer >= 0")
    if s.how not in _HOWS:
        problems.append(f"how={s.how!r}: expected one of {', '.join(_HOWS)}")
    if s.how == "block" and s.target == "node":
        problems.append("how=block: only a worker's main thread can block; use worker=I")
    if s.phase not in _PHASES:
        problems.append(f"phase={s.phase!r}: expected one of {', '.join(_PHASES)}")
    if s.duration_s is not None:
        if s.how != "stop":
            problems.append(f"for={s.duration_s!r}: only how=stop takes a duration; drop it or use stop")
        elif isinstance(s.duration_s, bool) or not (
            isinstance(s.duration_s, (int, float)) and 0 < s.duration_s < math.inf
        ):
            problems.append(f"for={s.duration_s!r}: expected a finite number of seconds > 0")
    if s.back_step is not None:
        if not (_is_int(s.back_step) and _is_int(s.step) and s.back_step > s.step):
            problems.append(f"back={s.back_step!r}: expected an integer step > step={s.step!r}")
        elif s.target == "node" and s.how == "kill":
            problems.append(f"back={s.back_step}: a killed node's agent is gone and cannot restart its workers; "
                            "drop back= or use worker= targets")
    if s.target == "store" and (s.how != "kill" or s.phase != "any" or s.back_step is not None):
        problems.append(f"store={s.index}: a store target takes kill only, with no phase= or back=")
    return problems + _gray_problems(s)


def _gray_problems(s: FaultSpec) -> list[str]:
    """The fields of a gray failure (``slow``, ``bitflip``, ``nan``) and the fields only they take."""
    problems = []
    if s.how in GRAY:
        if s.target != "worker":
            problems.append(f"how={s.how}: a gray failure is one worker's; use worker=I")
        if s.phase != "any" or s.back_step is not None:
            problems.append(f"how={s.how}: picks its own points of the step and kills nobody; drop phase= and back=")
    if s.how == "slow":
        if isinstance(s.factor, bool) or not (isinstance(s.factor, (int, float)) and 1 < s.factor < math.inf):
            problems.append(f"factor={s.factor!r}: expected a finite number > 1 (the compute takes factor times "
                            "as long)")
    elif s.factor is not None:
        problems.append(f"factor={s.factor!r}: only how=slow takes a factor; drop it or use slow")
    if s.for_steps is not None:
        if s.how != "slow":
            problems.append(f"for_steps={s.for_steps!r}: only how=slow lasts a number of steps")
        elif not (_is_int(s.for_steps) and s.for_steps >= 1):
            problems.append(f"for={s.for_steps!r}: expected an integer number of steps >= 1")
    if s.how == "bitflip":
        if s.tensor not in _TENSORS:
            problems.append(f"target={s.tensor!r}: expected one of {', '.join(_TENSORS)}")
    elif s.tensor is not None:
        problems.append(f"target={s.tensor!r}: only how=bitflip takes a target tensor; drop it or use bitflip")
    return problems


def fail_at(
    *,
    step: int,
    worker: int | None = None,
    node: int | None = None,
    how: str = "kill",
    phase: str = "any",
    duration_s: float | None = None,
    back: int | None = None,
    factor: float | None = None,
    for_steps: int | None = None,
    tensor: str | None = None,
) -> FaultSpec:
    """Build a ``FaultSpec`` for tests: ``fail_at(step=5, worker=1, how="kill", back=9)``,
    ``fail_at(step=3, worker=0, how="slow", factor=3.0, for_steps=4)``.

    Raises:
        ValueError: not exactly one of ``worker`` / ``node``, or an invalid field.
    """
    if (worker is None) == (node is None):
        raise ValueError(
            f"fail_at(step={step!r}, worker={worker!r}, node={node!r}): give exactly one of worker= or node="
        )
    target: Target = "worker" if worker is not None else "node"
    index = worker if worker is not None else node
    assert index is not None
    return FaultSpec(step=step, target=target, index=index, how=how, phase=phase,  # type: ignore[arg-type]
                     duration_s=duration_s, back_step=back, factor=factor, for_steps=for_steps,
                     tensor=tensor)  # type: ignore[arg-type]


def _parse_int(item: str, key: str, value: str, problems: list[str]) -> int | None:
    try:
        n = int(value)
    except ValueError:
        problems.append(f"item {item!r}: {key}={value!r} is not an integer; expected an integer >= 0")
        return None
    if n < 0:
        problems.append(f"item {item!r}: {key}={value!r} is negative; expected an integer >= 0")
        return None
    return n


def _item_fields(item: str, problems: list[str]) -> dict[str, str]:
    """The ``key=value`` fields of one item (a bare kill/stop/term is ``how``), appending problems."""
    fields: dict[str, str] = {}
    for raw in item.split(":"):
        part = raw.strip()
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            if part in _HOWS:
                key, value = "how", part
            else:
                problems.append(
                    f"item {item!r}: {part!r} is neither key=value nor one of {', '.join(_HOWS)}"
                )
                continue
        if key not in _KEYS:
            problems.append(f"item {item!r}: unknown key {key!r} (={value!r}); expected one of {', '.join(_KEYS)}")
        elif key in fields:
            problems.append(f"item {item!r}: {key} given twice ({fields[key]!r} and {value!r}); keep one")
        else:
            fields[key] = value
    return fields


def _parse_item(
    item: str, n_workers: int | None, n_nodes: int | None, problems: list[str]
) -> FaultSpec | None:
    """Parse one item, appending its problems; ``None`` if it has any."""
    before = len(problems)
    fields = _item_fields(item, problems)

    step = None
    if "step" not in fields:
        problems.append(f"item {item!r}: missing step=N")
    else:
        step = _parse_int(item, "step", fields["step"], problems)

    targets = [t for t in _TARGETS if t in fields]
    index = None
    if len(targets) != 1:
        what = "more than one of worker=, node=, store=" if targets else "none of worker=, node=, store="
        problems.append(f"item {item!r}: {what}; give exactly one")
    else:
        index = _parse_int(item, targets[0], fields[targets[0]], problems)
        bound = {"worker": n_workers, "node": n_nodes}.get(targets[0])
        if index is not None and bound is not None and index >= bound:
            problems.append(
                f"item {item!r}: {targets[0]}={index} out of range; expected 0..{bound - 1} "
                f"(n_{targets[0]}s={bound})"
            )

    how = fields.get("how", "kill")
    if how not in _HOWS:
        problems.append(f"item {item!r}: how={how!r}; expected one of {', '.join(_HOWS)}")
    phase = fields.get("phase", "any")
    if phase not in _PHASES:
        problems.append(f"item {item!r}: phase={phase!r}; expected one of {', '.join(_PHASES)}")
    duration_s = None
    gray = _parse_gray(item, how, fields, problems)
    if "for" in fields and how == "slow":
        pass  # a number of steps (_parse_gray)
    elif "for" in fields:
        try:
            duration_s = float(fields["for"])
        except ValueError:
            duration_s = math.nan
        if not 0 < duration_s < math.inf:
            problems.append(f"item {item!r}: for={fields['for']!r}; expected a finite number of seconds > 0")
        elif how != "stop":
            problems.append(f"item {item!r}: for={fields['for']!r} only applies to stop; drop it or use stop")

    back = None
    if "back" in fields:
        back = _parse_int(item, "back", fields["back"], problems)
        if back is not None and step is not None and back <= step:
            problems.append(f"item {item!r}: back={back} is not after step={step}; expected back > step")
        elif back is not None and targets == ["node"] and how == "kill":
            problems.append(f"item {item!r}: back= with node=...:kill: a killed node's agent is gone and cannot "
                            "restart its workers; drop back= or target workers")

    if targets == ["store"] and (how != "kill" or phase != "any" or back is not None):
        problems.append(f"item {item!r}: a store target takes kill only, with no phase= or back=")
    elif how in GRAY and targets and targets != ["worker"]:
        problems.append(f"item {item!r}: {how} is one worker's gray failure; use worker=I")
    if how in GRAY and ("phase" in fields or "back" in fields):
        problems.append(f"item {item!r}: {how} picks its own points of the step and kills nobody; "
                        "drop phase= and back=")
    if len(problems) > before:
        return None
    assert step is not None and index is not None
    return FaultSpec(step=step, target=targets[0], index=index, how=how, phase=phase,  # type: ignore[arg-type]
                     duration_s=duration_s, back_step=back, **gray)


def _parse_gray(item: str, how: str, fields: dict[str, str], problems: list[str]) -> dict[str, Any]:
    """The gray failure's fields of one item (``factor``, ``for`` in steps, ``target``), appending problems."""
    out: dict[str, Any] = {}
    if how == "slow":
        if "factor" not in fields:
            problems.append(f"item {item!r}: slow needs factor=F; expected a finite number > 1")
        else:
            try:
                factor = float(fields["factor"])
            except ValueError:
                factor = math.nan
            if not 1 < factor < math.inf:
                problems.append(f"item {item!r}: factor={fields['factor']!r}; expected a finite number > 1 "
                                "(the compute takes factor times as long)")
            out["factor"] = factor
        if "for" in fields:
            try:
                n = int(fields["for"])
            except ValueError:
                n = 0
            if n < 1:
                problems.append(f"item {item!r}: for={fields['for']!r}; with slow, expected an integer number "
                                "of steps >= 1")
            out["for_steps"] = n
    elif "factor" in fields:
        problems.append(f"item {item!r}: factor={fields['factor']!r} only applies to slow; drop it or use slow")
    if how == "bitflip":
        tensor = fields.get("target")
        if tensor not in _TENSORS:
            got = "missing" if tensor is None else f"target={tensor!r}"
            problems.append(f"item {item!r}: bitflip needs target=grad or target=param ({got})")
        out["tensor"] = tensor
    elif "target" in fields:
        problems.append(f"item {item!r}: target={fields['target']!r} only applies to bitflip; drop it or use "
                        "bitflip")
    return out


def parse_fail_at(
    text: str, *, n_workers: int | None = None, n_nodes: int | None = None
) -> tuple[FaultSpec, ...]:
    """Parse the ``--fail-at`` string form (module docstring); empty text gives ``()``.

    Args:
        text: e.g. ``"step=40:worker=2:kill,step=120:worker=0:stop:for=3.5"``.
        n_workers, n_nodes: when given, indices must be below them.

    Raises:
        ValueError: listing every problem of every item, each with the item,
            the key and value, and what would be accepted.
    """
    if not text.strip():
        return ()
    problems: list[str] = []
    specs = []
    for i, raw in enumerate(text.split(",")):
        item = raw.strip()
        if not item:
            problems.append(f"item {i + 1} is empty; remove the extra comma")
            continue
        spec = _parse_item(item, n_workers, n_nodes, problems)
        if spec is not None:
            specs.append(spec)
    if problems:
        raise ValueError(f"invalid fail-at spec {text!r}:\n  " + "\n  ".join(problems))
    return tuple(specs)


def format_fail_at(specs: Iterable[FaultSpec]) -> str:
    """The string form of ``specs``; ``parse_fail_at`` reads it back unchanged."""
    items = []
    for s in specs:
        fields = [f"step={s.step}", f"{s.target}={s.index}", s.how]
        if s.phase != "any":
            fields.append(f"phase={s.phase}")
        if s.duration_s is not None:
            fields.append(f"for={float(s.duration_s)!r}")  # repr round-trips a float exactly
        if s.factor is not None:
            fields.append(f"factor={float(s.factor)!r}")
        if s.for_steps is not None:
            fields.append(f"for={s.for_steps}")
        if s.tensor is not None:
            fields.append(f"target={s.tensor}")
        if s.back_step is not None:
            fields.append(f"back={s.back_step}")
        items.append(":".join(fields))
    return ",".join(items)


def trace_to_faults(trace: FailureTrace) -> tuple[FaultSpec, ...]:
    """A kill of each outage's worker at its start step, back at its end step, in trace order.

    An outage ``[start, end)`` becomes ``step=start:worker=w:kill:back=end``:
    the worker fails during ``start`` and is restarted once ``end`` steps are
    committed. An outage cut at ``n_steps`` gets ``back=n_steps``: the run is
    over by then, so the worker never returns.
    """
    return tuple(
        FaultSpec(step=o.start_step, target="worker", index=o.worker, how="kill", back_step=o.end_step)
        for o in trace.outages
    )


def write_fault_plan(path: Path, specs: Iterable[FaultSpec]) -> None:
    """Write a job's parsed fault specs, once, as JSON (``{"specs": [{field: value}, ...]}``).

    The launcher (or an agent started by hand) parses ``--fail-at`` and the
    trace once; every agent and worker then reads these typed values, and a
    worker is told which of them are its own by index.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"specs": [dataclasses.asdict(s) for s in specs]}, indent=1))
    os.replace(tmp, path)


def read_fault_plan(path: Path) -> tuple[FaultSpec, ...]:
    """The specs :func:`write_fault_plan` wrote (each validated again on construction).

    Raises:
        ValueError: the file is unreadable or holds an invalid spec (names the file).
    """
    try:
        return tuple(FaultSpec(**d) for d in json.loads(path.read_text())["specs"])
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"fault plan {path}: unreadable ({exc})") from None


def fault_selection(plan_file: Path | None, indices: str) -> tuple[FaultSpec, ...]:
    """The specs of the plan at ``indices`` (``"3,7"``; ``""``: none).

    Raises:
        ValueError: indices without a plan, or out of the plan's range.
    """
    if not indices:
        return ()
    if plan_file is None:
        raise ValueError(f"--faults {indices} needs --faults-file (the job's fault plan)")
    plan = read_fault_plan(plan_file)
    chosen = [int(i) for i in indices.split(",")]
    bad = [i for i in chosen if not 0 <= i < len(plan)]
    if bad:
        raise ValueError(f"--faults {indices}: indices {bad} outside the plan's {len(plan)} specs ({plan_file})")
    return tuple(plan[i] for i in chosen)
