"""Cross-field checks, the config hash and config differences.

Invariant: ``config_hash(cfg)`` depends only on fields that change what is trained.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING, Any, Callable

from unbroken.config.choices import MODEL_PRESET_NAMES, POLICY_NAMES, RECOVERY_NAMES, REMOVED_FIELDS

if TYPE_CHECKING:
    from unbroken.config.sections import Config

Need = Callable[[bool, str], None]
"""``need(condition, message)``: the message is reported unless the condition holds."""


def validate(cfg: Config) -> list[str]:
    """Cross-field checks; returns messages (empty when valid)."""
    errs: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errs.append(msg)

    for check in (_train_data_optim, _backend, _sharding, _mecefo_fault, _snapshot_model, _monitor):
        check(cfg, need)
    return errs


def _train_data_optim(cfg: Config, need: Need) -> None:
    t, d, o = cfg.train, cfg.data, cfg.optim
    need(t.workers >= 1, f"train.workers={t.workers}: need at least 1 worker")
    need(t.steps >= 1, f"train.steps={t.steps}: need at least 1 step")
    need(t.log_every >= 1, f"train.log_every={t.log_every}: must be >= 1")
    need(t.val_every >= 0, f"train.val_every={t.val_every}: must be >= 0 (0 disables)")
    need(t.val_batches >= 1, f"train.val_batches={t.val_batches}: must be >= 1")
    need(t.checkpoint_every >= 0, f"train.checkpoint_every={t.checkpoint_every}: must be >= 0")
    need(t.checkpoint_every_s >= 0, f"train.checkpoint_every_s={t.checkpoint_every_s}: must be >= 0 seconds "
         f"(0: no checkpoint by time)")
    need(t.keep_checkpoints >= 1,
         f"train.keep_checkpoints={t.keep_checkpoints}: must be >= 1 (the newest committed checkpoints to keep)")
    need(0 <= t.port <= 65535, f"train.port={t.port}: must be in 0..65535 (0 picks a free port)")
    need(math.isfinite(t.timeout_s) and t.timeout_s > 0, f"train.timeout_s={t.timeout_s}: must be a finite number > 0")
    need(t.threads_per_worker >= 0, f"train.threads_per_worker={t.threads_per_worker}: must be >= 0")
    need(d.seq_len >= 1, f"data.seq_len={d.seq_len}: must be >= 1")
    need(d.micro_batch >= 1, f"data.micro_batch={d.micro_batch}: must be >= 1")
    _global_batch(cfg, need)
    need(d.vocab_size >= 2, f"data.vocab_size={d.vocab_size}: must be >= 2")
    need(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction}: must be in (0, 1)")
    need(d.max_bytes is None or d.max_bytes > 0, f"data.max_bytes={d.max_bytes}: must be > 0")
    need(o.lr > 0, f"optim.lr={o.lr}: must be > 0")
    need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
    need(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be >= 0")
    _schedule(cfg, need)
    need(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip}: must be >= 0 (0 disables)")


def _global_batch(cfg: Config, need: Need) -> None:
    t, d = cfg.train, cfg.data
    g, m = t.global_batch, d.micro_batch
    if g == 0 or m < 1 or t.workers < 1:
        return
    need(g > 0, f"train.global_batch={g}: must be >= 0 (0: train.workers x data.micro_batch)")
    if g < 0:
        return
    need(g % m == 0, f"train.global_batch={g} is not a multiple of data.micro_batch={m}: a step is whole "
         f"micro-batches; give train.global_batch={max(m, g // m * m)} or a data.micro_batch that divides {g}")
    need(g // m >= t.workers or g % m != 0, f"train.global_batch={g} is {g // m} micro-batch(es) of data.micro_batch={m}, "
         f"fewer than train.workers={t.workers} (every worker computes at least one); give train.global_batch >= "
         f"{t.workers * m} or data.micro_batch <= {max(1, g // t.workers)}")
    k = t.shard_degree
    need(k <= 1 or g % m != 0 or (g // m) % k == 0, f"train.global_batch={g} is {g // m} micro-batches, not a multiple of "
         f"train.shard_degree={k} (each rank of a replica computes one of its micro-batches); give "
         f"train.global_batch={-(-(g // m) // k) * k * m}")


def _schedule(cfg: Config, need: Need) -> None:
    o, steps = cfg.optim, cfg.train.steps
    need(o.schedule != "none" or bool(o.factory),
         "optim.schedule='none' keeps the optimizer's own learning rate, which the built-in AdamW does not have; "
         "use optim.schedule='constant' (or set optim.factory)")
    if o.schedule != "wsd":
        need(o.decay_steps == 0, f"optim.decay_steps={o.decay_steps} with optim.schedule={o.schedule!r}: "
             "decay_steps is for optim.schedule='wsd' only; set it to 0 or use wsd")
        return
    need(o.decay_steps >= 1, f"optim.decay_steps={o.decay_steps}: optim.schedule='wsd' needs >= 1 (the steps of "
         "its final decay)")
    need(o.warmup_steps + o.decay_steps <= steps,
         f"optim.warmup_steps={o.warmup_steps} + optim.decay_steps={o.decay_steps} > train.steps={steps}: "
         "warm-up and decay must fit in the run; shorten them or raise train.steps")


def _backend(cfg: Config, need: Need) -> None:
    t = cfg.train
    need(not (t.backend == "nccl" and t.device == "cpu"),
         "train.backend='nccl' with train.device='cpu': NCCL runs on GPUs only; use backend auto or gloo")
    need(not (t.backend == "gloo" and t.device != "cpu" and (t.shard_optimizer or t.shard_degree > 1)),
         f"train.backend='gloo' on a GPU with {'train.shard_optimizer' if t.shard_optimizer else 'train.shard_degree'}"
         f": gloo carries the all-reduces and broadcasts of replicated training only (a test topology); use "
         f"backend auto (NCCL) for sharded state")


def _sharding(cfg: Config, need: Need) -> None:
    t, o, f = cfg.train, cfg.optim, cfg.fault
    need(not (t.shard_optimizer and o.factory),
         f"train.shard_optimizer=true with optim.factory={o.factory!r}: sharding needs the built-in AdamW; "
         "drop optim.factory or set train.shard_optimizer=false")
    need(t.shard_degree >= 1, f"train.shard_degree={t.shard_degree}: must be >= 1 (1: no sharding inside a "
         "replica)")
    need(t.shard_degree < 1 or t.workers % t.shard_degree == 0,
         f"train.shard_degree={t.shard_degree} does not divide train.workers={t.workers}: a replica is "
         "shard_degree workers")
    need(not cfg.model.parallelize or t.shard_degree > 1,
         f"model.parallelize={cfg.model.parallelize!r} needs train.shard_degree > 1 (it shards the model inside "
         "a replica)")
    if t.shard_degree > 1:
        need(not t.shard_optimizer, "train.shard_degree>1 with train.shard_optimizer=true: FSDP2 already shards the "
             "moments inside each replica; drop train.shard_optimizer")
        need(not o.factory, f"train.shard_degree>1 with optim.factory={o.factory!r}: HSDP needs the built-in AdamW")
        need(f.recovery == "takeover", f"train.shard_degree>1 with fault.recovery={f.recovery!r}: HSDP runs with "
             "fault.recovery='takeover' only")


def _mecefo_fault(cfg: Config, need: Need) -> None:
    t, m, f = cfg.train, cfg.mecefo, cfg.fault
    need(m.rank >= 1, f"mecefo.rank={m.rank}: must be >= 1")
    need(m.tau >= 1, f"mecefo.tau={m.tau}: must be >= 1")
    for key, value, names in (("mecefo.policy", m.policy, POLICY_NAMES),
                              ("fault.recovery", f.recovery, RECOVERY_NAMES)):
        need(value in names, f"{key}={value!r}: expected one of {', '.join(names)}")
    need(math.isfinite(f.job_hours) and f.job_hours > 0, f"fault.job_hours={f.job_hours}: must be a finite number > 0")
    need(f.straggler_factor == 0 or (math.isfinite(f.straggler_factor) and f.straggler_factor > 1),
         f"fault.straggler_factor={f.straggler_factor}: must be 0 (off) or a number > 1 (a worker that many times "
         f"slower than the median is a straggler; at or below 1 every worker would be one), e.g. 1.5")
    need(f.straggler_steps >= 1, f"fault.straggler_steps={f.straggler_steps}: must be >= 1 (steps in a row)")
    need(math.isfinite(f.straggler_replace_s) and f.straggler_replace_s >= 0,
         f"fault.straggler_replace_s={f.straggler_replace_s}: must be a number of seconds >= 0 (0: never)")
    every = f.param_check_every
    need(every == "auto" or (isinstance(every, int) and every >= 0),
         f"fault.param_check_every={every!r}: must be auto (every step) or a number of steps >= 0 (0: off)")
    need(f.straggler_factor == 0 or t.shard_degree <= 1, f"fault.straggler_factor={f.straggler_factor} with "
         f"train.shard_degree={t.shard_degree}: stragglers are not rebalanced under HSDP; give "
         f"fault.straggler_factor=0")
    need(
        f.cluster_workers is None or f.cluster_workers >= t.workers,
        f"fault.cluster_workers={f.cluster_workers}: must be >= train.workers={t.workers} (or none)",
    )
    need(
        f.max_down is None or 0 <= f.max_down < t.workers,
        f"fault.max_down={f.max_down}: must be in 0..{t.workers - 1} (fewer than train.workers={t.workers}: "
        "a live worker must take over), or none for no cap",
    )
    need(math.isfinite(f.heartbeat_timeout_s) and f.heartbeat_timeout_s > 0,
         f"fault.heartbeat_timeout_s={f.heartbeat_timeout_s}: must be a finite number > 0")
    need(math.isfinite(f.store_timeout_s) and f.store_timeout_s > 0,
         f"fault.store_timeout_s={f.store_timeout_s}: must be a finite number > 0 (seconds the job waits for "
         "its store before it stops)")
    need(f.progress_timeout_s >= f.heartbeat_timeout_s,
         f"fault.progress_timeout_s={f.progress_timeout_s}: must be >= fault.heartbeat_timeout_s="
         f"{f.heartbeat_timeout_s} (a phase of a step takes longer than a heartbeat)")


MAX_GROUP_NODES = 256
"""The most nodes a stripe is coded over: ISA-L's Reed-Solomon (GF(2^8)) codes at most 256 fragments, one a node
(``unbroken.snapshot.erasure.MAX_FRAGMENTS``)."""


def _snapshot_groups(cfg: Config, need: Need) -> None:
    """``snapshot.group_nodes`` in the coder's range, and every group of an even split of a larger job (each holds
    more than ``group_nodes / 2 - 1`` nodes) big enough for ``parity`` parity fragments and one data fragment."""
    sn = cfg.snapshot
    g, p = sn.group_nodes, sn.parity
    if not (isinstance(g, int) and 2 <= g <= MAX_GROUP_NODES):
        need(False, f"snapshot.group_nodes={g!r}: must be a number of nodes in 2..{MAX_GROUP_NODES} (the most "
                    f"nodes one stripe is coded over: the coder, ISA-L's Reed-Solomon, codes at most {MAX_GROUP_NODES} "
                    f"fragments, one a node)")
        return
    if sn.redundancy == "parity" and p >= 1:
        least = 2 * (p + 1)
        larger = f"snapshot.group_nodes in {least}..{MAX_GROUP_NODES} or " if least <= MAX_GROUP_NODES else ""
        need(g >= least,
             f"snapshot.group_nodes={g} is too small for snapshot.parity={p}: a job on more than {g} nodes is "
             f"split into groups of at least {g // 2} nodes, each needing {p} parity and one data fragment; set "
             f"{larger}snapshot.parity <= {max(1, g // 2 - 1)}")


def _snapshot_model(cfg: Config, need: Need) -> None:
    sn = cfg.snapshot
    need(sn.every == "auto" or (isinstance(sn.every, int) and sn.every >= 0),
         f"snapshot.every={sn.every}: must be auto (the smallest interval that keeps pace) or a number of steps "
         ">= 0 (0 disables)")
    need(sn.parity >= 1, f"snapshot.parity={sn.parity}: must be >= 1 (nodes whose loss a snapshot survives)")
    _snapshot_groups(cfg, need)
    need(isinstance(sn.device_staging_bytes, int) and not isinstance(sn.device_staging_bytes, bool)
         and sn.device_staging_bytes >= 0,
         f"snapshot.device_staging_bytes={sn.device_staging_bytes!r}: must be a number of bytes >= 0 (0: no device "
         f"staging, the next optimizer step waits for the copy off the device instead)")
    mo = cfg.model
    need(mo.family == "custom" or not mo.factory,
         f"model.factory={mo.factory!r} is set but model.family={mo.family!r}; set model.family='custom'")
    need(mo.family != "custom" or bool(mo.factory),
         "model.family='custom' needs model.factory ('module:function' returning the model)")
    need(mo.family == "hf-llama" or mo.hf_path is None,
         f"model.hf_path={mo.hf_path!r} is set but model.family={mo.family!r}; set model.family='hf-llama'")
    need(mo.family == "llama" or mo.init_from is None,
         f"model.init_from={mo.init_from!r} is set but model.family={mo.family!r}; it starts the built-in "
         "llama (model.family='llama'); with hf-llama give model.hf_path")
    need(
        cfg.model.preset in MODEL_PRESET_NAMES,
        f"model.preset={cfg.model.preset!r}: unknown; valid: {', '.join(MODEL_PRESET_NAMES)}",
    )


def _monitor(cfg: Config, need: Need) -> None:
    mo = cfg.monitor
    port = mo.prometheus_port
    need(port is None or 0 <= port <= 65535,
         f"monitor.prometheus_port={port}: must be in 0..65535 (0 picks a free port), or none for no endpoint")
    need(bool(mo.prometheus_host.strip()), "monitor.prometheus_host='': give an address to bind (127.0.0.1: this "
         "machine only; 0.0.0.0: every interface)")
    need(not mo.webhook or mo.webhook.startswith(("http://", "https://")),
         f"monitor.webhook={mo.webhook!r}: must be an http:// or https:// URL (a Slack-compatible incoming "
         "webhook), or empty for none")
    need(not mo.wandb or bool(mo.wandb_project.strip()),
         "monitor.wandb=true with monitor.wandb_project='': name the W&B project")
    need(0 <= mo.alert_capacity <= 1, f"monitor.alert_capacity={mo.alert_capacity}: must be a share of the workers "
         "in 0..1 (0: no capacity alert)")
    for name in ("alert_capacity_s", "alert_no_step_s"):
        value = getattr(mo, name)
        need(value >= 0, f"monitor.{name}={value}: must be a number of seconds >= 0")


def config_hash(cfg: Config) -> str:
    """Stable hash of everything that changes what is trained (not ports or logging)."""
    d = cfg.to_dict()
    # shard_optimizer, shard_degree: where the state lives, not what is trained (the update is the same, element
    # for element; a checkpoint holds whole tensors either way). steps: how far to train; --resume may extend a
    # run, whose checkpoints and snapshots must then still load (the schedule's dependence on it is documented)
    for volatile in ("host", "port", "log_every", "threads_per_worker", "timeout_s", "keep_checkpoints",
                     "checkpoint_every_s", "shard_optimizer", "shard_degree", "backend", "steps", "global_batch"):
        d["train"].pop(volatile, None)
    # what is trained is the global batch, not how many workers train it: a run of 4 workers and one of 2 that
    # compute 2 micro-batches each are one job (a default run's hash is as it always was: slots = workers)
    d["train"]["workers"] = cfg.n_slots
    d["data"].pop("cache_dir", None)
    d["model"]["parallelize"] = ""  # HSDP's sharding recipe: where the state lives (as shard_degree)
    d["fault"].pop("store_timeout_s", None)  # how long to wait for the store, not what is trained
    d["fault"].pop("param_check_every", None)  # what is compared, not what is trained
    d.pop("snapshot", None)  # how the state is protected, not what is trained
    d.pop("monitor", None)  # how the run is watched, not what is trained
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Dotted names of fields whose values differ between two ``to_dict()`` forms."""
    out = []
    for section in sorted(set(a) | set(b)):
        sa, sb = a.get(section, {}), b.get(section, {})
        for name in sorted(set(sa) | set(sb)):
            if f"{section}.{name}" in REMOVED_FIELDS:
                continue  # a saved config may still name it; it changes nothing
            if sa.get(name) != sb.get(name):
                out.append(f"{section}.{name}")
    return out
