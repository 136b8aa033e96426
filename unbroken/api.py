"""The Python API: train your own model on your own data, fault-tolerant, with a few lines.

.. code-block:: python

    import unbroken

    def build_model(ctx: unbroken.BuildContext) -> torch.nn.Module: ...      # logits (B, T, V)
    def build_data(ctx: unbroken.BuildContext): ...       # .batch(step, slot, rows) or a dataset of token rows
    def build_optimizer(model, ctx): ...                   # optional; default AdamW from cfg.optim

    if __name__ == "__main__":
        cfg = unbroken.Config()
        cfg.train.steps = 100
        unbroken.train(cfg, model=build_model, data=build_data, optimizer=build_optimizer,
                       run_dir="runs/mine", nodes=1, workers_per_node=4)

The job runs exactly as ``unbroken train`` does (agents, workers, step
protocol, takeover, checkpoints, ledger). The factories reach the worker
processes as references in the run's config (:mod:`unbroken.job.references`):
a top-level function of an importable module, or of the script itself, which
each worker loads as a module (its ``if __name__ == "__main__":`` block does
not run there). Nothing is pickled.

Each worker calls the factories itself, with a :class:`BuildContext`; they must
build the same thing everywhere (checked at start, :mod:`unbroken.job.consistency`).

Invariants: :func:`job_config` returns a new config and leaves its argument
alone; a config it returns trains the same job wherever it is loaded (the same
code at the same path on every machine).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any, Callable

from unbroken.config import config_from_dict
from unbroken.config import Config
from unbroken.job.references import reference_of

__all__ = ["job_config", "run_node", "train"]

logger = logging.getLogger(__name__)

Factory = Callable[..., Any] | str
"""A top-level function (or class), or its reference text ``module:function`` / ``/path/file.py:function``."""


def job_config(config: Config, *, model: Factory | None = None, data: Factory | None = None,
               optimizer: Factory | None = None, parallelize: Factory | None = None) -> Config:
    """A copy of ``config`` naming the factories (``model.family='custom'`` when a model factory is given).

    Args:
        model: ``model(ctx) -> torch.nn.Module``, forward ``(B, T)`` token ids to ``(B, T, V)``
            logits (or an output with ``.logits``). None: the config's ``model.family``
            (``llama`` or ``hf-llama``).
        data: ``data(ctx)`` returning a source with ``batch(step, slot, rows) -> (inputs, targets)``
            (optionally ``validation_batch(i)`` and ``vocab_size``) or a map-style dataset
            of ``seq_len + 1`` token rows. None: ``data.source``.
        optimizer: ``optimizer(model, ctx) -> torch.optim.Optimizer``; the ``optim``
            section's schedule sets its learning rate every step. None: AdamW.
        parallelize: ``parallelize(model, mesh)``, with ``train.shard_degree`` > 1: shards the model in
            place over its replica's mesh (your ``fully_shard`` units; compile, checkpointing). None:
            ``fully_shard`` per transformer block, then the root.

    Raises:
        ValueError: a factory other processes cannot find (lambda, nested function), or an invalid config.
    """
    cfg = copy.deepcopy(config)
    if model is not None:
        cfg.model.family = "custom"
        cfg.model.factory = reference_of(model, field="model")
    if data is not None:
        cfg.data.factory = reference_of(data, field="data")
    if optimizer is not None:
        cfg.optim.factory = reference_of(optimizer, field="optimizer")
    if parallelize is not None:
        cfg.model.parallelize = reference_of(parallelize, field="parallelize")
    return config_from_dict(cfg.to_dict())  # validates every field, all errors at once


def train(config: Config, *, run_dir: str | Path, model: Factory | None = None, data: Factory | None = None,
          optimizer: Factory | None = None, parallelize: Factory | None = None, nodes: int = 1,
          workers_per_node: int | None = None,
          fail_at: str = "", standby: bool = False, overwrite: bool = False,
          on_record: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train on this machine: ``nodes`` agents of ``workers_per_node`` workers each, spawned here.

    The factories are those of :func:`job_config`. Before anything is written,
    the data factory is called and the model factory builds the model once on
    the CPU in this process, so a bad factory fails here with its message.

    Args:
        workers_per_node: default ``config.train.workers // nodes``.
        fail_at: faults to inject, e.g. ``"step=20:worker=1:kill"`` (see ``unbroken train --help``).
        standby: a warm standby worker on every node.
        on_record: called with each ``metrics.jsonl`` record as it is written.

    Returns:
        The run's summary (also in ``<run_dir>/summary.json``).

    Raises:
        ValueError: bad input (nothing written). ``unbroken.agent.launcher.JobFailed``:
            the job could not go on (a worker that built another model, a
            non-deterministic data source, no live worker left).
    """
    from unbroken.agent.launcher import launch  # local: importing unbroken stays light

    cfg = job_config(config, model=model, data=data, optimizer=optimizer, parallelize=parallelize)
    if nodes < 1:
        raise ValueError(f"nodes={nodes}: need at least 1")
    wpn = workers_per_node if workers_per_node is not None else max(1, cfg.train.workers // nodes)
    return launch(cfg, run_dir, nodes=nodes, workers_per_node=wpn, overwrite=overwrite, fail_at=fail_at,
                  standby=standby, on_record=on_record)


def run_node(config: Config, *, run_dir: str | Path, node_rank: int, nnodes: int, workers_per_node: int,
             store: str, model: Factory | None = None, data: Factory | None = None,
             optimizer: Factory | None = None, parallelize: Factory | None = None, standby: bool = False) -> int:
    """Be node ``node_rank``'s agent of a cluster job (one call per machine); node 0 hosts the store.

    Writes ``<run_dir>/config.json`` (the :func:`job_config`) unless the same is
    there, then runs the agent until the job ends. Every machine needs the
    factories' code at the same path and ``UNBROKEN_JOB_SECRET`` set to the
    same value (or a shared ``run_dir``).

    Returns:
        The agent's exit code (0: the job is done).

    Raises:
        ValueError: bad input, or a ``config.json`` in ``run_dir`` for another job.
    """
    from unbroken.agent.command import run_agent  # local, as above
    from unbroken.agent.options import AgentOptions

    cfg = job_config(config, model=model, data=data, optimizer=optimizer, parallelize=parallelize)
    cfg.train.workers = nnodes * workers_per_node
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path, text = run_dir / "config.json", json.dumps(cfg.to_dict(), indent=1)
    if path.is_file() and json.loads(path.read_text()) != cfg.to_dict():
        raise ValueError(f"{path} holds another job's config; use an empty run_dir")
    path.write_text(text)
    opts = AgentOptions(node_rank=node_rank, nnodes=nnodes, workers_per_node=workers_per_node, store=store,
                        run_dir=run_dir, standby=standby, host_store=node_rank == 0)
    return run_agent(opts)
