"""A job of data-parallel replicas and its failures: the replica engine's cluster and failure taxonomy.

Model (every assumption, stated)
--------------------------------
* ``gpus`` GPUs in ``replicas = gpus / replica_size`` replicas (HSDP: FSDP
  inside a replica of ``replica_size`` ranks, data parallel across); a
  replica is the unit of failure: any rank's loss takes its replica down.
  ``gpus_per_node`` to a node; a node holds ``gpus_per_node / replica_size``
  replicas, or a replica spans ``replica_size / gpus_per_node`` nodes.
* Each rank holds ``state_bytes / replica_size`` (its FSDP shard): what moves
  when a replica rejoins (rank ``i`` from a live replica's rank ``i``) and what
  each rank restores after a whole-job restart; a checkpoint or snapshot of
  the job writes each shard once, ``state_bytes / gpus`` per GPU.
* ``micro_batches`` per rank per step: a missing replica's rows spread over
  the survivors cost each at most ``ceil(k m / (R - k))`` more micro-batches.
* Failures arrive as a Poisson process at the job's rate, each of a kind
  (``mix``, the published taxonomy): ``hardware`` (a node lost: it needs a
  spare node, or waits for one), ``software`` (a process dies; the node is
  fine: the process restarts there) and ``network`` (a node unreachable, or
  with probability ``burst_share`` every node under one switch, ``switch_nodes``
  of them: a correlated burst; they need spares too). Hardware failures hit
  "lemon" nodes more often: a share ``lemon_share`` of the nodes fails
  ``lemon_factor`` times as often as the others (the job's rate is unchanged,
  the targets concentrate).
* A spare pool of ``spare_nodes`` (paid for: in the denominator of goodput);
  a spare taken is replaced after ``replenish_h`` hours (the lost node repaired
  or a new one provisioned). With no spare free a lost node's replicas wait.

Configurations the runtime refuses are refused here with the same reason
(:meth:`ReplicaSpec.check_runtime`): a replica size that does not divide the
GPUs or the node, a spare pool of 0 while node failures are possible, a
snapshot coding group the erasure coder cannot build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from unbroken.snapshot.erasure import MAX_FRAGMENTS

__all__ = ["FAILURE_KINDS", "ReplicaEvent", "ReplicaSpec", "replica_events"]

FAILURE_KINDS = ("hardware", "software", "network")

# Llama 3 (Dubey et al., arXiv 2407.21783, Table 5): of 419 unexpected interruptions in 54 days on 16,384 H100s,
# software bugs 12.9% and NCCL watchdog timeouts 1.7% (software), network switch/cable 8.4% and NIC 1.7%
# (network), the rest hardware (GPU, HBM3, host, ...).
LLAMA3_MIX = {"hardware": 0.753, "software": 0.146, "network": 0.101}


@dataclass(frozen=True, kw_only=True)
class ReplicaSpec:
    """A job of HSDP replicas, its failure process and its spare pool.

    Attributes:
        gpus: GPUs of the job (spares not counted).
        replica_size: ranks of one replica (FSDP inside, data parallel across).
        gpus_per_node: GPUs of one node.
        state_bytes: bytes of the whole training state (parameters and optimizer).
        params: parameter count of the model.
        micro_batches: micro-batches per rank per step.
        tokens_per_micro_batch: tokens of one micro-batch.
        job_mtbf_h: mean hours between failures of the whole job.
        mix: share of each kind of :data:`FAILURE_KINDS` (sums to 1).
        burst_share: share of network failures that take a whole switch's nodes.
        switch_nodes: nodes under one switch (a burst's size).
        lemon_share: share of nodes that are lemons; lemon_factor: how much more often they fail (hardware).
        spare_nodes: spare nodes held; replenish_h: hours until a spare taken is replaced.
        net_repair_h: hours until a node cut off by the network is reachable again (when no spare took over).
        group_nodes, parity: the snapshot's erasure coding (nodes per coding group, parity fragments).
        hours: simulated wall-clock hours.
    """

    gpus: int
    replica_size: int = 8
    gpus_per_node: int = 8
    state_bytes: float
    params: float
    micro_batches: int = 4
    tokens_per_micro_batch: int = 4096
    job_mtbf_h: float
    mix: dict[str, float] = field(default_factory=lambda: dict(LLAMA3_MIX))
    burst_share: float = 0.2
    switch_nodes: int = 4
    lemon_share: float = 0.0
    lemon_factor: float = 1.0
    spare_nodes: int = 16
    replenish_h: float = 2.0
    net_repair_h: float = 0.5
    group_nodes: int = 16
    parity: int = 1
    hours: float = 24.0

    def __post_init__(self) -> None:
        problems = []
        for name in ("gpus", "replica_size", "gpus_per_node", "micro_batches", "tokens_per_micro_batch",
                     "switch_nodes"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("state_bytes", "params", "job_mtbf_h", "replenish_h", "net_repair_h", "hours"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                problems.append(f"{name}={v!r} must be a finite number > 0")
        if set(self.mix) - set(FAILURE_KINDS) or any(not v >= 0 for v in self.mix.values()) or not math.isclose(
                sum(self.mix.values()), 1.0):
            problems.append(f"mix={self.mix} must give shares >= 0 of {', '.join(FAILURE_KINDS)} summing to 1")
        if not (0 <= self.burst_share <= 1 and 0 <= self.lemon_share <= 1 and self.lemon_factor >= 1):
            problems.append(f"burst_share={self.burst_share}, lemon_share={self.lemon_share} must be in [0, 1], "
                            f"lemon_factor={self.lemon_factor} >= 1")
        if self.spare_nodes < 0:
            problems.append(f"spare_nodes={self.spare_nodes} must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def replicas(self) -> int:
        """Data-parallel replicas R."""
        return self.gpus // self.replica_size

    @property
    def nodes(self) -> int:
        """Nodes of the job (spares not counted)."""
        return -(-self.gpus // self.gpus_per_node)

    @property
    def shard_bytes(self) -> float:
        """One rank's unique state: its FSDP shard, what moves in a rejoin or a restore."""
        return self.state_bytes / self.replica_size

    def check_runtime(self) -> None:
        """Refuse what the runtime refuses, with its reason.

        Raises:
            ValueError: replica size not dividing the GPUs or not fitting the nodes, fewer than 2 replicas,
                no spare with node failures possible, a coding group the erasure coder cannot build.
        """
        problems = []
        if self.gpus % self.replica_size:
            problems.append(f"--replica-size {self.replica_size} does not divide --gpus {self.gpus}: the runtime "
                            "builds whole replicas only (train.shard_degree must divide the workers)")
        big, small = max(self.replica_size, self.gpus_per_node), min(self.replica_size, self.gpus_per_node)
        if big % small:
            problems.append(f"--replica-size {self.replica_size} and --gpus-per-node {self.gpus_per_node}: one must "
                            "divide the other (a replica is whole nodes, or a node whole replicas)")
        if self.replicas < 2:
            problems.append(f"{self.replicas} replica(s): a replica's rows need another replica to take them over")
        node_kinds = self.mix.get("hardware", 0.0) + self.mix.get("network", 0.0)
        if self.spare_nodes == 0 and node_kinds > 0:
            problems.append(f"--spare-nodes 0 with node failures (hardware + network share {node_kinds:g}): the "
                            "runtime admits a replacement only from the allocation's spare nodes; hold spares or "
                            "give a --mix without node failures")
        if not 2 <= self.group_nodes <= MAX_FRAGMENTS:
            problems.append(f"--group-nodes {self.group_nodes}: the erasure coder builds at most {MAX_FRAGMENTS} "
                            f"fragments a stripe, one a node (snapshot.group_nodes must be in 2..{MAX_FRAGMENTS})")
        elif self.group_nodes < 2 * (self.parity + 1):
            problems.append(f"--group-nodes {self.group_nodes} is too small for --parity {self.parity}: groups of at "
                            f"least {self.group_nodes // 2} nodes, each needing {self.parity} parity and one data "
                            f"fragment (snapshot.group_nodes >= {2 * (self.parity + 1)})")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class ReplicaEvent:
    """One failure: wall-clock seconds, kind, and the nodes it takes (``software``: the replica's first node)."""

    t: float
    kind: str
    nodes: tuple[int, ...]
    replica: int = -1


def replica_events(spec: ReplicaSpec, seed: int) -> list[ReplicaEvent]:
    """The failures of one seeded realisation of ``spec``, sorted by time (a pure function of its arguments)."""
    rng = np.random.default_rng(seed)
    duration = spec.hours * 3600.0
    n = int(rng.poisson(duration / (spec.job_mtbf_h * 3600.0)))
    times = np.sort(rng.uniform(0.0, duration, size=n))
    p = np.array([spec.mix.get(k, 0.0) for k in FAILURE_KINDS])
    kinds = rng.choice(len(FAILURE_KINDS), size=n, p=p / p.sum())
    lemons = int(round(spec.lemon_share * spec.nodes))
    weights = np.ones(spec.nodes)
    weights[:lemons] = spec.lemon_factor  # which nodes are lemons does not matter: node ids are exchangeable
    weights /= weights.sum()
    out: list[ReplicaEvent] = []
    for t in times:
        kind = FAILURE_KINDS[int(kinds[len(out)])]
        if kind == "software":
            r = int(rng.integers(0, spec.replicas))
            out.append(ReplicaEvent(float(t), kind, (), r))
        elif kind == "hardware":
            out.append(ReplicaEvent(float(t), kind, (int(rng.choice(spec.nodes, p=weights)),)))
        elif rng.uniform() < spec.burst_share:
            first = int(rng.integers(0, -(-spec.nodes // spec.switch_nodes))) * spec.switch_nodes
            out.append(ReplicaEvent(float(t), kind, tuple(range(first, min(spec.nodes, first + spec.switch_nodes)))))
        else:
            out.append(ReplicaEvent(float(t), kind, (int(rng.integers(0, spec.nodes)),)))
    return out
