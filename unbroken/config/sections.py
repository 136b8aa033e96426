"""The configuration's sections: one keyword-only dataclass each, every field documented.

Invariant: ``config_from_dict(cfg.to_dict()) == cfg`` (:func:`unbroken.config.loading.config_from_dict`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal



@dataclass(kw_only=True)
class ModelConfig:
    """Which model to train."""

    preset: str = "debug"
    """Name of a model shape in ``unbroken.models.MODEL_PRESETS``."""
    max_seq_len: int | None = None
    """Override the preset's longest sequence (rotary table size)."""
    family: Literal["llama", "hf-llama", "custom"] = "llama"
    """``llama``: our model; ``hf-llama``: Hugging Face's ``LlamaForCausalLM`` (``pip install
    unbroken[hf]``), of the preset's shape or loaded from ``model.hf_path``; ``custom``: the model
    returned by ``model.factory`` (the Python API, ``unbroken.train``, sets it)."""
    hf_path: str | None = None
    """``hf-llama`` only: a local directory written by ``save_pretrained`` (safetensors weights;
    nothing is ever downloaded). None: a fresh model of the preset's shape."""
    init_from: str | None = None
    """``llama`` only: start from these Hugging Face Llama weights instead of a random draw: a directory
    written by ``unbroken export --hf`` or ``save_pretrained`` (its ``*.safetensors``), or one safetensors
    file with Hugging Face's names. Shapes must be the preset's (docs/own-model.md). None: random."""
    factory: str = ""
    """``custom`` only: ``module:function`` or ``/path/file.py:function`` returning the model
    (called in every worker with a :class:`unbroken.BuildContext`)."""
    parallelize: str = ""
    """HSDP (``train.shard_degree`` > 1) only: ``module:function`` or ``/path/file.py:function``, called
    as ``parallelize(model, mesh)`` in every worker to shard the model in place over its replica's 1-D
    device mesh (torchtitan's ``parallelize_llama``: your own ``fully_shard`` units, compile, activation
    checkpointing). Every parameter must end up in an FSDP2 unit. Empty: ``fully_shard`` per transformer
    block, then the root. Where the state lives, not what is trained: ``--resume`` may change it (with
    ``train.shard_degree``)."""


@dataclass(kw_only=True)
class DataConfig:
    """Corpus, tokenizer and batch layout."""

    source: str = "stdlib"
    """``stdlib`` (the interpreter's own sources), a directory of ``.txt`` files,
    a pre-tokenized ``.bin``/``.npy`` token file, a directory of such shards and Megatron
    ``.bin``/``.idx`` pairs (``unbroken prepare-data`` writes one), or a Hugging Face dataset saved with
    ``save_to_disk``, ``DIR`` or ``DIR#COLUMN`` (docs/data.md)."""
    vocab_size: int = 4096
    """BPE vocabulary trained on text sources; the stated vocabulary of a token file."""
    seq_len: int = 128
    """Tokens per row."""
    micro_batch: int = 8
    """Rows per micro-batch (a slot of the step); the global batch is ``train.global_batch`` rows."""
    val_fraction: float = 0.05
    """Share of documents (by file-name hash) held out for validation."""
    max_bytes: int | None = None
    """Use only the first documents of a text corpus up to this many bytes."""
    cache_dir: str | None = None
    """Tokenizer/token cache; default ``$UNBROKEN_CACHE_DIR`` or ``~/.cache/unbroken``."""
    token_dtype: Literal["uint16", "uint32"] | None = None
    """Element type of a raw ``.bin`` token file when it has no JSON sidecar."""
    factory: str = ""
    """``module:function`` or ``/path/file.py:function`` returning the training data (a source with
    ``batch(step, slot, rows)`` or a map-style dataset of token rows); empty: ``data.source``."""
    tokenizer: str = ""
    """A ``tokenizer.json`` or a local Hugging Face model directory holding one: text sources are tokenized
    with it instead of a trained BPE, and the vocabulary is its size (``vocab_size`` is then ignored);
    empty: train a BPE."""


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW and the learning-rate schedule (docs/configuration.md, "Learning-rate schedules")."""

    lr: float = 3e-3
    """Peak learning rate."""
    schedule: Literal["auto", "cosine", "wsd", "linear", "constant", "none"] = "auto"
    """``cosine``: warm-up, then cosine decay to the floor at ``train.steps``; ``wsd``: warm-up, the peak,
    then ``decay_steps`` of decay ending at the floor on the last step (a longer ``train.steps`` keeps the
    peak going); ``linear``: as cosine with a straight line; ``constant``: warm-up, then the peak;
    ``none``: the optimizer keeps its own learning rate (``optim.factory`` only); ``auto``: ``cosine`` for
    the built-in AdamW, ``none`` for ``optim.factory``."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine, wsd, linear)."""
    warmup_steps: int = 20
    """Linear warm-up length."""
    decay_steps: int = 0
    """``wsd``: steps of the final decay, the last ones of ``train.steps`` (>= 1; 0 with other schedules)."""
    decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"
    """``wsd``: the decay's shape; ``sqrt`` is ``1 - sqrt(progress)``."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    factory: str = ""
    """``module:function`` or ``/path/file.py:function`` called with ``(model, context)`` returning the
    optimizer; empty: AdamW from this section. It keeps its own learning rate unless ``optim.schedule``
    names a schedule, which then sets it every step."""


@dataclass(kw_only=True)
class TrainConfig:
    """The run itself."""

    steps: int = 200
    """Optimizer steps to train."""
    workers: int = 4
    """Data-parallel workers (processes; one per GPU)."""
    global_batch: int = 0
    """Rows (sequences) per optimizer step, a multiple of ``data.micro_batch``: each worker computes
    ``global_batch / (workers * micro_batch)`` micro-batches a step and accumulates their gradients (the
    step's slots go round-robin over the workers). The job keeps it when workers are lost or when it is
    resumed with another worker count. 0: ``workers * micro_batch`` (one micro-batch per worker)."""
    seed: int = 0
    """Seed of initialisation and data order."""
    log_every: int = 1
    """Write a metrics line every this many steps."""
    val_every: int = 50
    """Validation loss every this many steps (0 disables; always at the end)."""
    val_batches: int = 4
    """Validation micro-batches per evaluation."""
    checkpoint_every: int = 0
    """Persistent checkpoint every this many steps (0: not by steps)."""
    checkpoint_every_s: float = 1800.0
    """Persistent checkpoint once this many seconds passed since the last one (0: not by time), written
    asynchronously by the view's leader (put off while the previous save is still being written), so
    that a job whose every node loses its snapshot memory still keeps something. Sharded runs
    (``train.shard_optimizer``) checkpoint by steps only. With both this and ``checkpoint_every`` at 0,
    only the final checkpoint is written."""
    keep_checkpoints: int = 3
    """Committed checkpoints kept on disk (>= 1): after each commit, older
    committed ones beyond the newest this many are deleted, and so are
    incomplete directories older than the newest committed one."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where workers compute; ``auto`` picks CUDA when available."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """The collectives' backend: ``auto`` is NCCL on CUDA and gloo on the CPU. ``gloo`` on CUDA reduces the
    GPU's tensors through the host and lets several workers share one GPU (a test topology: a one-GPU machine
    then runs the real multi-worker fault path on CUDA); NCCL needs a GPU per worker."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16``: forward and backward under bfloat16 autocast (CPU or CUDA) with float32 master
    weights, optimizer moments, loss and gradient reduction; ``fp32``: float32 throughout."""
    compile: bool | None = None
    """``torch.compile`` each transformer block's exact forward (and the loss), as torchtitan does,
    and MeCeFO's approximate mode as a graph of its own (compiled at each worker's start when the
    policy approximates, so a takeover compiles nothing; eager, with a warning, where it cannot compile). None: on for CUDA, off
    on CPU (where compile time would dominate short jobs). Needs a working compiler toolchain
    (Triton on CUDA, a C++ compiler on CPU),
    checked before training."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in the backward pass, per transformer block: ``full`` every block,
    ``selective`` every second block (torchtitan's per-layer selective), ``none`` keeps them all."""
    host: str = "127.0.0.1"
    """Address the coordination store listens on."""
    port: int = 0
    """Store port; 0 picks a free one."""
    threads_per_worker: int = 0
    """torch intra-op threads per worker (0: cores / workers, at least 1)."""
    timeout_s: float = 120.0
    """Longest wait for any blocking call once training runs."""
    shard_optimizer: bool = False
    """ZeRO-1: each live worker keeps the AdamW moments of only its 1/m slice of the parameters
    (m live workers), updates that slice and all-gathers the parameters inside the step, before
    the commit vote. Optimizer memory per worker falls from 8 bytes per parameter to 8/m plus a
    ring copy of one peer's slice (kept in its node's snapshot memory; a failed worker's slice is
    rebuilt from it with no rollback). Costs one all-gather of the parameters per step and one
    point-to-point copy of the slice, overlapped with the next step. Worth it when the moments do
    not fit beside the model (16 bytes per parameter replicated); a no-op with one worker. Snapshots
    hold the replicated state and keep the ring copies of their step beside it, so whole-job restores
    come from memory (moments from the copies). Needs the built-in AdamW (not ``optim.factory``)."""
    shard_degree: int = 1
    """HSDP: each replica is this many consecutive workers on one node, running FSDP2 (``fully_shard``
    per transformer block, then the root) over a mesh of their own, so parameters, gradients and
    AdamW moments are split ``shard_degree`` ways; unbroken's data parallelism, takeover, two-phase
    commit and ledger run across replicas. The fault unit is the replica: a dead or hung rank takes
    its siblings down with it, the other replicas train its rows in the same step, and it rejoins
    whole, rank ``i`` receiving shard ``i`` from rank ``i`` of a live replica. 1 (the default): every
    worker holds the whole model. Every takeover policy applies (MeCeFO's approximations run inside
    FSDP2). Needs a divisor of the workers per node, no warm standby, and the built-in AdamW. Per-step
    snapshots hold shards (the workers of each shard index snapshot theirs together); checkpoints hold
    whole tensors, gathered by the leader's replica, so another ``shard_degree`` can resume them."""


@dataclass(kw_only=True)
class MecefoConfig:
    """How a failed worker's slot is covered (see ``unbroken.mecefo``)."""

    policy: str = "spread"
    """A takeover policy, a name in the registry ``unbroken.mecefo.takeover.POLICIES``:
    ``spread`` (default: rows split over all survivors, exact; extra load
    1/(n-1) per survivor, same convergence as failure-free), ``neighbor`` (the
    MeCeFO paper: ring successor does both, approximated), ``spread-approx``.
    See docs/benchmarks.md for the figures behind the default."""
    rank: int = 32
    """Rank r of the low-rank FFN weight gradient (32: aggregated FFN gradient
    error below 0.6 on tiny at < 1.75x FLOPs; see docs/benchmarks.md)."""
    tau: int = 50
    """Refresh each FFN weight's top-r right singular vectors every tau steps."""


@dataclass(kw_only=True)
class FaultConfig:
    """Failures to inject and how to detect them."""

    trace: str = "none"
    """Failure trace preset: none, low, mid, high, extreme."""
    job_hours: float = 24.0
    """Wall-clock hours of training the run stands for (scales a trace to steps)."""
    cluster_workers: int | None = None
    """Workers of the cluster whose failure rate the trace preset gives (>=
    train.workers): the job sees ``train.workers / cluster_workers`` of its
    failures. None: the preset's rate is the job's own."""
    max_down: int | None = None
    """At most this many workers down at once (0..train.workers-1): a trace failure that would take the
    job past it is deferred until a worker returns (``unbroken.faults.traces``); 1 is "single-node
    failures only". In the real runtime an agent also holds back a signal fault (``fail_at`` or trace)
    while the job is at the cap. None: no cap."""
    fail_at: str = ""
    """Explicit faults, e.g. ``step=40:worker=2:kill,step=90:node=1:kill``."""
    heartbeat_timeout_s: float = 2.0
    """A worker silent for this long is declared hung."""
    progress_timeout_s: float = 30.0
    """A member whose main thread makes no progress (no new phase of its step: forward, backward,
    all-reduce, vote) for this long while its peers wait for it is declared hung, even though its
    heartbeat thread still beats (a main thread stuck outside Python). Longer than the slowest
    phase of a step: a forward or backward pass of the largest micro-batch a worker computes."""
    store_timeout_s: float = 60.0
    """How long the job waits for its store to answer before it stops (on etcd: for a quorum of the
    cluster's members). Meanwhile every process keeps retrying and says so; past it every worker and
    agent exits, the committed checkpoints and the snapshot memory are kept, and
    ``unbroken train --resume RUN_DIR`` continues once the store answers again. Changes nothing trained."""
    template: bool = True
    """Every node keeps a template process that has imported torch, unbroken and the user's factory modules
    (and, on a CPU job with the built-in data and model, prepared both): workers, joiners and standbys are
    forked from it, so a cold start costs a fork, not an interpreter (:mod:`unbroken.agent.template`).
    ``false``: every worker starts as a fresh process. Changes nothing trained."""
    straggler_factor: float = 0.0
    """A worker whose compute time per row stays above this many times the live workers' median for
    ``straggler_steps`` steps in a row is a straggler: it keeps a share of its rows in proportion to its
    speed and the others take the rest, exact, in the same step, until it is back at or below
    ``(1 + factor) / 2`` for as many steps (:mod:`unbroken.runtime.stragglers`; data parallelism and ZeRO-1,
    not HSDP). 0: off (rows never move for speed, so a run is reproducible bit for bit); 1.5 is a fair value.
    Must be 0 or > 1."""
    straggler_steps: int = 5
    """Steps in a row a worker must be slow (or back) before its rows move (or come back); >= 1."""
    straggler_replace_s: float = 0.0
    """A worker that has been a straggler for this many seconds leaves the job (marked dead, how:
    ``straggler``; event ``straggler_replaced``) and its agent starts a replacement (a warm standby where the
    node has one) that rejoins with the state: a GPU slow for good is not worth its share. 0: never."""
    param_check_every: int | Literal["auto"] = "auto"
    """Every this many steps the replicas' parameter checksums are compared in the step's own reduction
    (:mod:`unbroken.runtime.param_check`): a step whose members' parameters differ is not applied; the members
    outside a strict majority leave fenced and rejoin with the state, and with no strict majority (two workers)
    the job stops naming them; under HSDP each shard index's checksums are compared across the replicas, and a
    replica found wrong leaves whole. 0: off. ``auto``: every step (one read of the parameters: about 0.1-0.2 %
    of one slot's compute for ``debug`` and ``tiny`` on a CPU, ``python -m benchmarks.param_check``)."""
    recovery: str = "takeover"
    """One of :data:`unbroken.runtime.recovery.RECOVERIES`: ``takeover``: survivors finish the step and carry on (unbroken);
    ``restart``: plain data parallelism, any failure restarts every worker from
    the last persistent checkpoint (for comparison); ``alternate`` (a
    measurement, not a way to train): even steps plain data parallelism, odd
    steps the takeover protocol, so one job times both side by side; a failure
    on a plain step is not survived."""


@dataclass(kw_only=True)
class SnapshotConfig:
    """Per-step in-memory snapshots (see ``unbroken.snapshot``)."""

    every: int | Literal["auto"] = "auto"
    """Snapshot the training state into node-agent shared memory every this many steps (0 disables).
    ``auto``: the smallest interval whose staging, coding and write fit inside the steps they overlap,
    measured by every worker and agreed each step (the slowest sets it); the interval chosen and the
    recovery point it implies (at most twice the interval, in steps) are logged and in ``summary.json``.
    A fixed number seals each snapshot before the next step commits (a whole-job failure loses at most
    ``every`` steps); under ``auto`` the write overlaps the following steps."""
    redundancy: Literal["parity", "replica", "none"] = "parity"
    """Protection across nodes: ``parity`` (Reed-Solomon erasure coding, survives the loss of
    ``parity`` nodes of each coding group), ``replica`` (each node's slices also held by the next node), ``none``."""
    parity: int = 1
    """Nodes of each coding group (see ``group_nodes``) whose loss a ``parity`` snapshot survives (< number of
    nodes; at most ``group_nodes // 2 - 1``)."""
    group_nodes: int = 16
    """``parity``: the most nodes one stripe is coded over (2 .. 256: the coder's limit is 256 fragments, one a
    node). A job on more nodes is split into ``ceil(nodes / group_nodes)`` groups of as even sizes as possible
    (they differ by at most one node), each coding its own share of the state with ``parity`` parity fragments:
    the snapshot survives the loss of up to ``parity`` nodes in every group. Smaller groups survive more losses
    across the job, larger ones hold less parity (``parity / (group - parity)`` of the state)."""
    device_staging_bytes: int = 2 << 30
    """On a GPU under ``auto``: the most device memory a worker holds for a snapshot's copy off the device.
    The bytes are copied from the live state straight into pinned host memory between the optimizer step that
    made them and the next one; only what that window cannot carry (measured) is first copied device to
    device into a buffer of at most this size, landed in host memory afterwards. 0: none (the next optimizer
    step waits for the rest instead)."""

@dataclass(kw_only=True)
class MonitorConfig:
    """How the run is watched (``unbroken.monitor``): TensorBoard, Weights & Biases, a Prometheus endpoint and
    webhook alerts, fed by one process per job that follows ``metrics.jsonl`` and the events, never by a
    worker. Changes nothing trained (not in the config hash; ``--resume`` may change it)."""

    tensorboard: bool = False
    """Write TensorBoard event files to ``RUN/tensorboard`` (one directory per job, across ``--resume`` and
    requeues; ``pip install unbroken[monitor]``)."""
    wandb: bool = False
    """Log to a Weights & Biases run, one per job: its id is kept in ``RUN/monitor/wandb_run_id`` and taken
    up again by ``--resume`` and requeues."""
    wandb_project: str = "unbroken"
    """``wandb``: the project."""
    wandb_entity: str = ""
    """``wandb``: the team or user; empty: W&B's default for the logged-in user."""
    wandb_mode: Literal["online", "offline"] = "online"
    """``wandb``: ``offline`` writes the run under ``RUN/wandb`` only (``wandb sync`` uploads it later)."""
    prometheus_port: int | None = None
    """Serve Prometheus metrics (step, loss, tokens/s, live workers, failures...) on this port; 0 picks a free
    one (written to ``RUN/monitor/endpoint.json``); None: no endpoint."""
    prometheus_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds (loopback: only this machine can scrape it)."""
    webhook: str = ""
    """A Slack-compatible webhook URL (``http://`` or ``https://``) the alerts are POSTed to as ``{"text": ...}``;
    empty: ``$UNBROKEN_WEBHOOK`` if set, else no alerts."""
    alert_capacity: float = 0.5
    """Alert when the live workers are fewer than this share of ``train.workers`` for longer than
    ``alert_capacity_s`` (0..1; 0: never)."""
    alert_capacity_s: float = 300.0
    """How long the job may run below ``alert_capacity`` before the alert."""
    alert_no_step_s: float = 600.0
    """Alert when no step was committed for this many seconds (0: never)."""


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "mecefo": MecefoConfig,
    "fault": FaultConfig,
    "snapshot": SnapshotConfig,
    "monitor": MonitorConfig,
}


@dataclass(kw_only=True)
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mecefo: MecefoConfig = field(default_factory=MecefoConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @property
    def param_check_interval(self) -> int:
        """Steps between parameter checks (``fault.param_check_every``, ``auto`` resolved); 0: off."""
        every = self.fault.param_check_every
        return 1 if every == "auto" else every

    @property
    def n_slots(self) -> int:
        """Micro-batches (slots) per optimizer step: ``train.global_batch / data.micro_batch``, or one per worker."""
        if self.train.global_batch:
            return self.train.global_batch // self.data.micro_batch
        return self.train.workers
