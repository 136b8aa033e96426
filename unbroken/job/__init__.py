"""unbroken.job: one training job, built once and recorded once, for every runner.

- :mod:`unbroken.job.builder`: config → data, samplers, model, MeCeFO adapter,
  gradient layout, optimizer and learning-rate schedule (:func:`build_job`),
  plus the checks and parts the launchers' preflight and a warm standby need;
- :mod:`unbroken.job.metrics`: the ``train``/``val`` records of
  ``metrics.jsonl`` and their cadence (:class:`MetricsWriter`);
- :mod:`unbroken.job.simulator`: one process playing every worker under a
  failure trace (import it from there: it is not re-exported, so a worker
  importing this package does not load the failure traces and policies).

Invariants: the trainer, the simulator and preflight build the same job from
the same config (same data, same seeds, bitwise-equal initial parameters);
``build_job`` and the records are pure functions of the config, the device and
what was trained; nothing here talks to ``torch.distributed``.
"""

from unbroken.job.builder import (
    Job,
    Prepared,
    build_data,
    build_job,
    build_samplers,
    check_model_fits,
    data_info,
    prepare,
)
from unbroken.job.schedule import Schedule, schedule_for
from unbroken.job.metrics import MetricsWriter, train_record, val_record

__all__ = [
    "Job",
    "MetricsWriter",
    "Prepared",
    "Schedule",
    "build_data",
    "build_job",
    "build_samplers",
    "check_model_fits",
    "data_info",
    "prepare",
    "schedule_for",
    "train_record",
    "val_record",
]
