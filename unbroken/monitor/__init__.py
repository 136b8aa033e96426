"""Watching a run: TensorBoard, Weights & Biases, a Prometheus endpoint and webhook alerts.

One process per job (:mod:`unbroken.monitor.process`, started by :func:`watch_job` from the launcher, or
from the agent of node 0 under a scheduler) follows ``metrics.jsonl`` and the events and feeds the sinks
the config's ``monitor`` section names. Invariants: nothing here runs in a worker or on a step's path; a
slow, failing or unreachable service is said once with its reason and retried with backoff, and never stops
or slows the training; one TensorBoard directory and one W&B run per job, across leader changes,
``--resume`` and requeues.
"""

from unbroken.monitor.watch import JobWatch, watch_job

__all__ = ["JobWatch", "watch_job"]
