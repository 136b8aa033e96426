"""Single-process simulator of data-parallel training under a failure trace.

One process plays the ``cfg.train.workers`` workers of a data-parallel job.
At every step it asks the trace which workers are down, asks the takeover
policy (:mod:`unbroken.mecefo.takeover`) what each live worker computes, runs
:func:`~unbroken.mecefo.gradients.compute_gradient_sums` once per live worker
with that worker's ``SlotWork`` list, adds the buffers in ascending worker order
(the all-reduce) and applies the sum with
:func:`~unbroken.mecefo.gradients.apply_step`: exactly the per-slot gradient and
aggregation code of the real runtime, only the transport differs. The job is
built by :func:`~unbroken.job.builder.build_job` and its metrics written by
:class:`~unbroken.job.metrics.MetricsWriter`, as in the trainer.

Outputs under ``out_dir`` (same rules as the trainer: a directory holding a
run is replaced only with ``overwrite=True``, any other non-empty directory is
refused; nothing is written before every input is validated):

- ``config.json``: the config; ``trace.json``: ``FailureTrace.to_json()``;
- ``metrics.jsonl``: the trainer's ``train`` lines plus ``wall_s``, ``live_workers``
  (ascending ids), ``degraded`` (:func:`~unbroken.mecefo.takeover.degraded_slots`,
  empty when nothing is down), ``assignment`` (``{"worker": [[slot, a, b,
  mode], ...]}``), ``waited`` and ``slowest_worker_s`` (the longest single
  worker's compute time: what a parallel step would take); ``val`` lines as the
  trainer's;
- ``final_params.safetensors`` (the model's ``state_dict``, no pickle) and
  ``summary.json``.

Waiting. With ``min_live=0`` a trace may have every worker down at a step. The
real job then waits for a worker to return; nothing is skipped. The simulator
has no clock for training, so it computes that step at once with the
configuration the job would have when the wait ends: the live workers are those
whose outage covering the step ends first (the first returners, before any
later failure), the assignment is the policy's for that live set, and the line
carries ``"waited": true``. Every other line has ``"waited": false``.

Invariants:

- every ``(step, slot, row)`` is trained exactly once (the policy's invariant);
- with no failure every worker computes its own slot exactly and the run equals
  the data-parallel trainer on the same config, up to float summation order;
- the simulation is a pure function of the config and the trace.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from unbroken.config import Config, config_hash
from unbroken.faults.trace_presets import trace_preset
from unbroken.faults.traces import FailureTrace, generate_trace, step_time_for
from unbroken.job.builder import Job, build_job
from unbroken.job.metrics import MetricsWriter, train_record
from unbroken.job.run_dir import prepare_out_dir
from unbroken.mecefo.takeover import POLICIES, assignment_json, degraded_slots, takeover_policy
from unbroken.models import resolve_device

__all__ = ["build_trace", "live_at", "simulate"]

logger = logging.getLogger(__name__)

FINAL_PARAMS = "final_params.safetensors"


def build_trace(cfg: Config, *, min_live: int = 1) -> FailureTrace:
    """The run's failure trace: ``cfg.fault.trace`` over ``cfg.train.steps`` steps standing for
    ``cfg.fault.job_hours``, seeded with ``cfg.train.seed``, at the job's share of the failures of
    ``cfg.fault.cluster_workers`` workers when that is set, at most ``cfg.fault.max_down`` workers
    down at once (later failures deferred) when that is set.

    Raises:
        ValueError: unknown trace, or a failing trace with fewer than 2 workers.
    """
    t = cfg.train
    return generate_trace(
        cfg.fault.trace, n_workers=t.workers, n_steps=t.steps,
        step_time_s=step_time_for(t.steps, cfg.fault.job_hours), seed=t.seed, min_live=min_live,
        cluster_workers=cfg.fault.cluster_workers, max_down=cfg.fault.max_down,
    )


def live_at(trace: FailureTrace, step: int) -> tuple[frozenset[int], bool]:
    """Live workers that compute ``step``, and whether the step had to wait.

    When every worker is down the step waits for the first returners (module
    docstring): the workers whose outage covering ``step`` ends first.
    """
    down = trace.down_at(step)
    live = frozenset(range(trace.n_workers)) - down
    if live:
        return live, False
    ends = {o.worker: o.end_step for o in trace.outages if o.start_step <= step < o.end_step}
    first = min(ends.values())
    return frozenset(w for w, e in ends.items() if e == first), True


def simulate(
    cfg: Config,
    out_dir: str | Path,
    *,
    trace: FailureTrace | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    overwrite: bool = False,
    min_live: int = 1,
) -> dict[str, Any]:
    """Train ``cfg`` with ``cfg.train.workers`` simulated workers under a failure trace.

    Args:
        cfg: the run; ``mecefo.policy`` picks the takeover policy.
        out_dir: run directory (see the module docstring for its files).
        trace: explicit trace (``n_workers == train.workers``, ``n_steps >=
            train.steps``); default :func:`build_trace` with ``min_live``.
        on_record: called with every metrics record as it is written.
        overwrite: replace a run already in ``out_dir`` (a non-empty directory holding no run is refused).
        min_live: passed to :func:`build_trace` when ``trace`` is None.

    Returns:
        The summary also written to ``summary.json``.

    Raises:
        ValueError: bad policy, trace, sizes or output directory (nothing written).
    """
    out = Path(out_dir)
    trace = _checked_trace(cfg, trace, min_live)
    job = build_job(cfg, resolve_device(cfg.train.device))
    _prepare_out_dir(out, cfg, trace, overwrite=overwrite)
    logger.info("simulating %d workers for %d steps, policy %s, trace %s: %d outages, %.0f%% of steps degraded",
                cfg.train.workers, cfg.train.steps, cfg.mecefo.policy, cfg.fault.trace, len(trace.outages),
                100 * trace.degraded_fraction())
    wall0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    vals: list[dict[str, Any]] = []
    with MetricsWriter.for_run(out / "metrics.jsonl", cfg, on_record=on_record) as metrics:
        for step in range(cfg.train.steps):
            records.append(_train_step(job, trace, step, wall0))
            val = metrics.step_done(records[-1], job.validation_loss)
            if val is not None:
                vals.append(val)
    state = {k: v.detach().cpu().contiguous() for k, v in job.model.state_dict().items()}
    save_file(state, str(out / FINAL_PARAMS))
    summary = _summarise(job, trace, out, records, vals, time.perf_counter() - wall0)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _checked_trace(cfg: Config, trace: FailureTrace | None, min_live: int) -> FailureTrace:
    """Validate policy, trace and worker count together; all problems in one ValueError."""
    n, problems = cfg.train.workers, []
    if cfg.mecefo.policy not in POLICIES:
        problems.append(f"mecefo.policy={cfg.mecefo.policy!r}: unknown; valid: {', '.join(POLICIES)}")
    if trace is None:
        try:
            fails = trace_preset(cfg.fault.trace).fails
        except ValueError as exc:
            problems.append(f"fault.trace: {exc}")
            fails = False
    else:
        fails = bool(trace.outages)
        if trace.n_workers != n or trace.n_steps < cfg.train.steps:
            problems.append(f"trace of {trace.n_workers} workers x {trace.n_steps} steps does not fit "
                            f"train.workers={n}, train.steps={cfg.train.steps}")
        elif cfg.fault.max_down is not None and trace.outages and trace.most_down() > cfg.fault.max_down:
            problems.append(f"trace has {trace.most_down()} workers down at once, more than "
                            f"fault.max_down={cfg.fault.max_down}; draw it with max_down or raise the cap")
    if fails and n < 2:
        problems.append(f"train.workers={n} with failure trace {cfg.fault.trace!r}: no one to take over; "
                        "use train.workers >= 2 or fault.trace=none")
    if problems:
        raise ValueError("simulate: " + "; ".join(problems))
    return trace if trace is not None else build_trace(cfg, min_live=min_live)


def _prepare_out_dir(out: Path, cfg: Config, trace: FailureTrace, *, overwrite: bool) -> None:
    prepare_out_dir(out, cfg, overwrite=overwrite)  # only a directory holding a run is ever replaced
    for name, payload in (("config.json", cfg.to_dict()), ("trace.json", trace.to_json())):
        tmp = out / f"{name}.tmp"
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, out / name)


def _train_step(job: Job, trace: FailureTrace, step: int, wall0: float) -> dict[str, Any]:
    """One optimizer step of the whole job; returns its metrics record."""
    cfg, mb = job.cfg, job.cfg.data.micro_batch
    t0 = time.perf_counter()
    live, waited = live_at(trace, step)
    assignment = takeover_policy(cfg.mecefo.policy).assign(n_slots=cfg.n_slots, live=live, micro_batch=mb,
                                                           n_workers=cfg.train.workers)
    total: torch.Tensor | None = None
    slowest = 0.0
    for worker in sorted(assignment):
        w0 = time.perf_counter()
        buf = job.gradient_sums(step, assignment[worker])
        # Ascending-worker addition stands in for the all-reduce.
        total = buf if total is None else total.add_(buf)
        slowest = max(slowest, time.perf_counter() - w0)
    assert total is not None  # assign() returns at least one worker
    lr, grad_norm = job.apply(step, total)
    dt = time.perf_counter() - t0
    return train_record(
        step=step + 1, loss=job.loss(total), lr=lr, grad_norm=grad_norm,
        step_time_s=dt, tokens_per_step=job.sampler.tokens_per_step, wall_s=time.perf_counter() - wall0,
        live_workers=sorted(live), degraded=degraded_slots(assignment, cfg.n_slots, cfg.train.workers),
        assignment=assignment_json(assignment), waited=waited, slowest_worker_s=slowest,
    )


def _summarise(job: Job, trace: FailureTrace, out: Path, records: list[dict[str, Any]],
               val: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    cfg = job.cfg
    rows = [(item[2] - item[1], item[3]) for r in records for items in r["assignment"].values() for item in items]
    approx_rows = sum(n for n, mode in rows if mode == "approx")
    steady = sorted(r["tokens_per_s"] for r in records[len(records) // 5:]) or [0.0]
    return {
        "run_dir": str(out), "config_hash": config_hash(cfg), "workers": cfg.train.workers,
        "steps": len(records), "policy": cfg.mecefo.policy,
        "trace": trace.preset.name if trace.preset is not None else "explicit",
        "final_loss": records[-1]["loss"] if records else None,
        "val_loss": val[-1]["val_loss"] if val else None, "val_ppl": val[-1]["val_ppl"] if val else None,
        "degraded_fraction": sum(1 for r in records if r["degraded"]) / max(1, len(records)),
        "down_fraction": sum(cfg.train.workers - len(r["live_workers"]) for r in records)
        / max(1, len(records) * cfg.train.workers),
        "approx_row_fraction": approx_rows / max(1, sum(n for n, _ in rows)),
        "waited_steps": sum(1 for r in records if r["waited"]),
        "outages": len(trace.outages), "dropped_failures": trace.dropped,
        "deferred_failures": trace.deferred, "max_down": cfg.fault.max_down, "most_down": trace.most_down(),
        "tokens_per_s": statistics.median(steady), "wall_s": wall_s,
        "final_params": str(out / FINAL_PARAMS), **job.info,
    }

