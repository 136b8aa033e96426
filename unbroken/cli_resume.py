"""``unbroken train``'s layout of nodes and workers, and what ``--resume`` takes: the run's saved config, the
options it accepts, and its workers (the global batch kept when they change)."""

from __future__ import annotations

import argparse
import json

from unbroken.cli_parser import DEFAULT_PRESET
from unbroken.config import Config, config_from_dict

__all__ = ["RESUME_CONFLICTS", "RESUME_OVERRIDES", "resume_config", "train_layout"]


RESUME_CONFLICTS = (("preset", "--preset"), ("config", "--config"), ("steps", "--steps"),
                    ("faults", "--faults"), ("cluster_workers", "--cluster-workers"), ("out", "--out"),
                    ("overwrite", "--overwrite"))
"""Options of a new run that ``--resume`` cannot take (the run keeps its saved config and directory)."""
RESUME_OVERRIDES = ("train.shard_optimizer", "train.shard_degree", "model.parallelize", "train.checkpoint_every_s",
                    "fault.store_timeout_s", "train.steps")
"""Config fields ``--resume`` may change: where the state lives (and HSDP's sharding recipe), how often it is
checkpointed by time, and how long to wait for the store, not what is trained; and ``train.steps``, which extends
(or shortens) the run beyond the step it resumes from (``optim.schedule=wsd`` keeps its stable phase going)."""


def resume_config(args: argparse.Namespace, overrides: list[str]) -> Config:
    """The saved config of the run ``--resume`` names, once it is known to be resumable.

    Raises:
        ValueError: other config options were given; the directory holds no run; the run has neither a
            complete snapshot in shared memory nor a committed checkpoint. Each message names the option or
            directory and what to do.
        CheckpointError: committed checkpoints exist but none is intact, and memory holds no snapshot.
    """
    from unbroken.agent.resume_point import resume_point
    from unbroken.job.resume_vocab import check_resume_vocabulary
    from unbroken.job.run_dir import RUN_CONFIG, saved_config

    run = args.resume
    allowed = [o for o in overrides if o.lstrip("-").partition("=")[0] in RESUME_OVERRIDES]
    given = [flag + ("" if value is True else f" {value}") for name, flag in RESUME_CONFLICTS
             if (value := getattr(args, name, None)) is not None and value is not False] + \
        [f"--{o}" for o in overrides if o not in allowed]
    if given:
        raise ValueError(f"--resume {run} continues the run with its saved config ({run / RUN_CONFIG}) in its own "
                         f"directory, so it takes none of: {', '.join(given)}; drop them (--fail-at, --workers, --nodes, "
                         f"--workers-per-node, --standby, --spare-nodes, --restart and --{'/--'.join(RESUME_OVERRIDES)} are "
                         f"accepted), or start a new run with --out")
    saved = saved_config(run) if run.is_dir() else None
    if saved is None:
        what = "no such directory" if not run.exists() else "not a directory" if not run.is_dir() else \
            f"holds no unbroken run (no {RUN_CONFIG} with a run's config)"
        raise ValueError(f"--resume {run}: {what}; give the directory of a run made by unbroken train "
                         f"(e.g. runs/{DEFAULT_PRESET}-w4)")
    try:
        cfg = config_from_dict(saved)
    except ValueError as exc:
        raise ValueError(f"--resume {run}: its {RUN_CONFIG} does not load: {exc}") from None
    if allowed:
        from unbroken.config.loading import apply_overrides

        cfg = apply_overrides(cfg, allowed)
    cfg, same_layout = _resume_workers(args, cfg)
    # snapshot memory (of the run's own layout) or a committed checkpoint, else NothingToResume naming both
    point = resume_point(run, cfg, memory_usable=same_layout)
    check_resume_vocabulary(run, point.checkpoint, cfg)  # the data's vocabulary is the one it was trained on
    if cfg.train.steps <= point.step:
        raise ValueError(f"--resume {run}: train.steps={cfg.train.steps}, but the run has trained {point.step} steps "
                         f"already; give --train.steps={point.step + 1} or more")
    return cfg


def _resume_workers(args: argparse.Namespace, cfg: Config) -> tuple[Config, bool]:
    """The resumed run's config on the workers ``--workers``/``--nodes``/``--workers-per-node`` ask for (its
    global batch kept), and whether that is the layout its snapshot memory was written by.

    Raises:
        ValueError: the run's global batch cannot be split over that many workers (names the fix).
    """
    from unbroken.agent.launcher import keep_global_batch, saved_layout
    from unbroken.config import validate

    workers = args.workers if args.workers is not None else \
        (args.nodes or 1) * args.workers_per_node if args.workers_per_node is not None else None
    if workers is not None and workers != cfg.train.workers:
        cfg.train.workers = workers
        cfg = keep_global_batch(cfg, args.resume)
        problems = validate(cfg)
        if problems:
            raise ValueError(f"--resume {args.resume} on {workers} workers: {'; '.join(problems)}")
    return cfg, saved_layout(args.resume) in (None, train_layout(args, cfg))


def train_layout(args: argparse.Namespace, cfg: Config) -> tuple[int, int]:
    """``(nodes, workers per node)`` with ``nodes * per_node == train.workers``; ``--resume`` keeps the run's
    own layout (its ``layout.json``) unless told otherwise: its snapshot memory is kept per node."""
    if args.resume is not None and args.nodes is None and args.workers_per_node is None:
        layout = args.resume / "layout.json"
        if layout.is_file():
            saved = json.loads(layout.read_text())
            if saved.get("nodes", 0) * saved.get("workers_per_node", 0) == cfg.train.workers:
                return int(saved["nodes"]), int(saved["workers_per_node"])
    nodes = args.nodes or 1
    if nodes < 1:
        raise ValueError(f"--nodes {nodes}: need at least 1")
    if args.workers_per_node is not None:
        if args.workers_per_node < 1 or nodes * args.workers_per_node != cfg.train.workers:
            raise ValueError(f"--nodes {nodes} x --workers-per-node {args.workers_per_node} must equal "
                             f"train.workers={cfg.train.workers} and be >= 1; drop --workers or make them agree")
        return nodes, args.workers_per_node
    if cfg.train.workers % nodes:
        raise ValueError(f"train.workers={cfg.train.workers} is not a multiple of --nodes {nodes}; "
                         f"give --workers-per-node")
    return nodes, cfg.train.workers // nodes


# ---------------------------------------------------------------------------
# bench
