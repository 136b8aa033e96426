"""Will the snapshots fit? Bytes per node from the config, checked against free shared memory.

A node holds two buffers (the newest sealed snapshot and the one being
written) of its share of the coded state: about ``(1 + m/k) * S / N`` each
(``S`` the state: parameters and both AdamW moments, 12 bytes per fp32
parameter; see :mod:`unbroken.snapshot.plan` for ``k``, ``m`` and the coding
groups: a node of the smallest group holds the most, the figure checked).
"""

from __future__ import annotations

import logging
import os

from unbroken.config import Config
from unbroken.models.llama import count_parameters, model_args
from unbroken.snapshot.cadence import enabled
from unbroken.snapshot.erasure import HEADER
from unbroken.snapshot.plan import plan_for
from unbroken.snapshot.protection import check_coding
from unbroken.snapshot.segment import HEADER_BYTES, SHM_DIR, segment_dir

__all__ = ["check_snapshot_config", "node_bytes", "state_bytes"]

logger = logging.getLogger(__name__)


def state_bytes(cfg: Config, vocab_size: int | None = None) -> int:
    """Bytes of the flat training state: fp32 parameters, exp_avg, exp_avg_sq, step counters, RNG."""
    overrides = {"vocab_size": vocab_size or cfg.data.vocab_size}
    if cfg.model.max_seq_len:
        overrides["max_seq_len"] = cfg.model.max_seq_len
    args = model_args(cfg.model.preset, **overrides)
    n_tensors = 2 + args.n_layers * 9 + 1  # embeddings, output, per block (7 matrices + 2 norms), final norm
    return 12 * count_parameters(args) + 4 * n_tensors + 5056


def node_bytes(cfg: Config, nodes: int, workers_per_node: int, vocab_size: int | None = None) -> int:
    """Shared memory one node needs for the snapshots of ``cfg`` (both buffers)."""
    node_of = {w: w // workers_per_node for w in range(nodes * workers_per_node)}
    s = cfg.snapshot
    plan = plan_for(node_of, node_of, redundancy=s.redundancy, parity=s.parity,
                    state_bytes=state_bytes(cfg, vocab_size), group_nodes=s.group_nodes)
    per_stripe = -(-plan.state_bytes // plan.stripes)
    held = 0
    for group in plan.groups:  # a node of the smallest group (the largest fragments) holds the most
        first = plan.stripes_of(group[0])[0]
        k = plan.k_of(first)
        fragment = -(-per_stripe // k) + (2 * HEADER * k if plan.m else 0)  # parity: its header, the data's
        held = max(held, plan.group_stripes * len(plan.fragments_of(group[0], first)) * fragment)
    return 2 * (held + workers_per_node * (HEADER_BYTES + (64 << 10)))


def check_snapshot_config(cfg: Config, nodes: int, workers_per_node: int, vocab_size: int | None = None) -> int:
    """Refuse a snapshot setting that cannot protect the job as asked; returns the bytes per node.

    Raises:
        ValueError: ``snapshot.parity`` not below the node count (of a job on more than one node: on one
            node there is no other to hold parity, and snapshots protect against worker failures only),
            a coding group the coder cannot build (:func:`unbroken.snapshot.protection.check_coding`),
            or too little free shared memory
            (says how much is needed and what to change).
    """
    s = cfg.snapshot
    if not enabled(s.every):
        return 0
    check_coding(cfg, nodes, workers_per_node)  # whatever the model: the coding does not depend on its size
    if cfg.model.family == "custom" or cfg.model.hf_path:
        # The state's size is known only once the model is built: a full /dev/shm is then reported by the
        # first snapshot (an event and a log line) and training goes on without snapshots.
        logger.info("snapshot memory per node not estimated for a model the config does not describe")
        return 0
    if s.redundancy == "parity" and nodes > 1 and s.parity >= nodes:
        raise ValueError(f"snapshot.parity={s.parity} needs more than {s.parity} nodes, the job has {nodes}: "
                         f"lower snapshot.parity, add nodes, or set snapshot.redundancy=replica or none")
    try:
        segment_dir()  # private, or refused now rather than by the first snapshot
    except PermissionError as exc:
        raise ValueError(f"snapshot memory: {exc}") from None
    need = node_bytes(cfg, nodes, workers_per_node, vocab_size)
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise ValueError(
            f"snapshots need {need / 2**20:.1f} MiB of shared memory per node ({SHM_DIR}), "
            f"{free / 2**20:.1f} MiB are free: enlarge it (mount -o remount,size=... {SHM_DIR}; "
            f"docker --shm-size), use more nodes, set snapshot.redundancy=none (no protection against a "
            f"node loss), or snapshot.every=0 (no snapshots: a job-wide failure goes back to the checkpoint)")
    return need
