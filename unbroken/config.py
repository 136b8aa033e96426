"""Typed configuration: one dataclass per section, named presets, overrides.

A run is fully described by a :class:`Config`. Presets are functions returning a
``Config``; a variant calls its base and changes a few fields. TOML files and
``--section.field=value`` overrides map onto the same dataclasses, and every
problem in them is reported at once in a single ``ValueError``.

Invariant: ``Config.from_dict(cfg.to_dict()) == cfg`` and
``config_hash(cfg)`` depends only on fields that change what is trained.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, get_args, get_origin

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

logger = logging.getLogger(__name__)

@dataclass(kw_only=True)
class ModelConfig:
    """Which model to train."""

    preset: str = "debug"
    """Name of a model shape in ``unbroken.models.MODEL_PRESETS``."""
    max_seq_len: int | None = None
    """Override the preset's longest sequence (rotary table size)."""


@dataclass(kw_only=True)
class DataConfig:
    """Corpus, tokenizer and batch layout."""

    source: str = "stdlib"
    """``stdlib`` (the interpreter's own sources), a directory of ``.txt`` files,
    or a pre-tokenized ``.bin``/``.npy`` token file."""
    vocab_size: int = 4096
    """BPE vocabulary trained on text sources; the stated vocabulary of a token file."""
    seq_len: int = 128
    """Tokens per row."""
    micro_batch: int = 8
    """Rows per slot per step; the global batch is ``workers * micro_batch`` rows."""
    val_fraction: float = 0.05
    """Share of documents (by file-name hash) held out for validation."""
    max_bytes: int | None = None
    """Use only the first documents of a text corpus up to this many bytes."""
    cache_dir: str | None = None
    """Tokenizer/token cache; default ``$UNBROKEN_CACHE_DIR`` or ``~/.cache/unbroken``."""
    token_dtype: Literal["uint16", "uint32"] | None = None
    """Element type of a raw ``.bin`` token file when it has no JSON sidecar."""


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    warmup_steps: int = 20
    """Linear warm-up length."""
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


@dataclass(kw_only=True)
class TrainConfig:
    """The run itself."""

    steps: int = 200
    """Optimizer steps to train."""
    workers: int = 4
    """Data-parallel slots (one worker per slot when nothing fails)."""
    seed: int = 0
    """Seed of initialisation and data order."""
    log_every: int = 1
    """Write a metrics line every this many steps."""
    val_every: int = 50
    """Validation loss every this many steps (0 disables; always at the end)."""
    val_batches: int = 4
    """Validation micro-batches per evaluation."""
    checkpoint_every: int = 0
    """Persistent checkpoint every this many steps (0 disables)."""
    keep_checkpoints: int = 3
    """Committed checkpoints kept on disk (>= 1): after each commit, older
    committed ones beyond the newest this many are deleted, and so are
    incomplete directories older than the newest committed one."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where workers compute; ``auto`` picks CUDA when available."""
    host: str = "127.0.0.1"
    """Address the coordination store listens on."""
    port: int = 0
    """Store port; 0 picks a free one."""
    threads_per_worker: int = 0
    """torch intra-op threads per worker (0: cores / workers, at least 1)."""
    timeout_s: float = 120.0
    """Longest wait for any blocking call once training runs."""


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
    fail_at: str = ""
    """Explicit faults, e.g. ``step=40:worker=2:kill,step=90:node=1:kill``."""
    heartbeat_timeout_s: float = 2.0
    """A worker silent for this long is declared hung."""
    progress_timeout_s: float = 30.0
    """A member whose main thread makes no progress (no new phase of its step: forward, backward,
    all-reduce, vote) for this long while its peers wait for it is declared hung, even though its
    heartbeat thread still beats (a main thread stuck outside Python). Longer than the slowest
    phase of a step: a forward or backward pass of the largest micro-batch a worker computes."""
    recovery: str = "takeover"
    """One of :data:`unbroken.runtime.recovery.RECOVERIES`: ``takeover``: survivors finish the step and carry on (unbroken);
    ``restart``: plain data parallelism, any failure restarts every worker from
    the last persistent checkpoint (for comparison); ``alternate`` (a
    measurement, not a way to train): even steps plain data parallelism, odd
    steps the takeover protocol, so one job times both side by side; a failure
    on a plain step is not survived."""


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "mecefo": MecefoConfig,
    "fault": FaultConfig,
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

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build from nested dicts, validating every field; all errors at once."""
        cfg = cls()
        errors: list[str] = []
        for section, values in data.items():
            if section not in SECTIONS:
                errors.append(f"unknown section {section!r}; valid: {', '.join(SECTIONS)}")
                continue
            if not isinstance(values, dict):
                errors.append(f"section {section!r} must be a table, got {values!r}")
                continue
            for name, value in values.items():
                err = _set_field(getattr(cfg, section), section, name, value, from_text=False)
                if err:
                    errors.append(err)
        errors += validate(cfg)
        _raise_all(errors)
        return cfg


# ---------------------------------------------------------------------------
# presets


def _debug() -> Config:
    cfg = Config()
    cfg.model.preset = "debug"
    cfg.data.seq_len = 64
    cfg.data.micro_batch = 8
    return cfg


def _tiny() -> Config:
    cfg = Config()
    cfg.model.preset = "tiny"
    cfg.data.seq_len = 128
    cfg.data.micro_batch = 16
    cfg.optim.lr = 2e-3
    return cfg


def _paper_shape(model: str) -> Callable[[], Config]:
    def preset() -> Config:
        cfg = Config()
        cfg.model.preset = model
        cfg.data.vocab_size = 32000
        cfg.data.seq_len = 256
        cfg.data.micro_batch = 8
        cfg.optim.lr = 1e-3
        cfg.optim.warmup_steps = 100
        return cfg

    return preset


PRESETS: dict[str, Callable[[], Config]] = {
    "debug": _debug,
    "tiny": _tiny,
    "llama-60m": _paper_shape("llama-60m"),
    "llama-350m": _paper_shape("llama-350m"),
    "llama-1b": _paper_shape("llama-1b"),
    "llama-7b": _paper_shape("llama-7b"),
}


def preset(name: str) -> Config:
    """Return a fresh config of the named preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name]()


# ---------------------------------------------------------------------------
# loading and overrides


def load_config(
    *, preset_name: str = "debug", file: str | Path | None = None, overrides: list[str] = ()
) -> Config:
    """Preset, then a TOML file, then ``section.field=value`` overrides.

    Raises:
        ValueError: listing every unknown section/field and every bad value.
    """
    cfg = preset(preset_name)
    errors: list[str] = []
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        with path.open("rb") as fh:
            try:
                data = tomllib.load(fh)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
        for section, values in data.items():
            if section not in SECTIONS or not isinstance(values, dict):
                errors.append(f"{path}: unknown section {section!r}; valid: {', '.join(SECTIONS)}")
                continue
            for name, value in values.items():
                err = _set_field(getattr(cfg, section), section, name, value, from_text=False)
                if err:
                    errors.append(f"{path}: {err}")
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().lstrip("-").partition(".")
        if not sep or not dot:
            errors.append(f"override {item!r} is not of the form section.field=value")
            continue
        if section not in SECTIONS:
            errors.append(f"unknown section {section!r} in {item!r}; valid: {', '.join(SECTIONS)}")
            continue
        err = _set_field(getattr(cfg, section), section, name, text, from_text=True)
        if err:
            errors.append(err)
    if not errors:
        errors = validate(cfg)
    _raise_all(errors)
    return cfg


def validate(cfg: Config) -> list[str]:
    """Cross-field checks; returns messages (empty when valid)."""
    errs: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errs.append(msg)

    t, d, o, m, f = cfg.train, cfg.data, cfg.optim, cfg.mecefo, cfg.fault
    need(t.workers >= 1, f"train.workers={t.workers}: need at least 1 worker")
    need(t.steps >= 1, f"train.steps={t.steps}: need at least 1 step")
    need(t.log_every >= 1, f"train.log_every={t.log_every}: must be >= 1")
    need(t.val_every >= 0, f"train.val_every={t.val_every}: must be >= 0 (0 disables)")
    need(t.val_batches >= 1, f"train.val_batches={t.val_batches}: must be >= 1")
    need(t.checkpoint_every >= 0, f"train.checkpoint_every={t.checkpoint_every}: must be >= 0")
    need(t.keep_checkpoints >= 1,
         f"train.keep_checkpoints={t.keep_checkpoints}: must be >= 1 (the newest committed checkpoints to keep)")
    need(0 <= t.port <= 65535, f"train.port={t.port}: must be in 0..65535 (0 picks a free port)")
    need(math.isfinite(t.timeout_s) and t.timeout_s > 0, f"train.timeout_s={t.timeout_s}: must be a finite number > 0")
    need(t.threads_per_worker >= 0, f"train.threads_per_worker={t.threads_per_worker}: must be >= 0")
    need(d.seq_len >= 1, f"data.seq_len={d.seq_len}: must be >= 1")
    need(d.micro_batch >= 1, f"data.micro_batch={d.micro_batch}: must be >= 1")
    need(d.vocab_size >= 2, f"data.vocab_size={d.vocab_size}: must be >= 2")
    need(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction}: must be in (0, 1)")
    need(d.max_bytes is None or d.max_bytes > 0, f"data.max_bytes={d.max_bytes}: must be > 0")
    need(o.lr > 0, f"optim.lr={o.lr}: must be > 0")
    need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
    need(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be >= 0")
    need(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip}: must be >= 0 (0 disables)")
    need(m.rank >= 1, f"mecefo.rank={m.rank}: must be >= 1")
    need(m.tau >= 1, f"mecefo.tau={m.tau}: must be >= 1")
    for key, value, names in (("mecefo.policy", m.policy, _policy_names()),
                                ("fault.recovery", f.recovery, _recovery_names())):
        need(value in names, f"{key}={value!r}: expected one of {', '.join(names)}")
    need(math.isfinite(f.job_hours) and f.job_hours > 0, f"fault.job_hours={f.job_hours}: must be a finite number > 0")
    need(
        f.cluster_workers is None or f.cluster_workers >= t.workers,
        f"fault.cluster_workers={f.cluster_workers}: must be >= train.workers={t.workers} (or none)",
    )
    need(math.isfinite(f.heartbeat_timeout_s) and f.heartbeat_timeout_s > 0,
         f"fault.heartbeat_timeout_s={f.heartbeat_timeout_s}: must be a finite number > 0")
    need(f.progress_timeout_s >= f.heartbeat_timeout_s,
         f"fault.progress_timeout_s={f.progress_timeout_s}: must be >= fault.heartbeat_timeout_s="
         f"{f.heartbeat_timeout_s} (a phase of a step takes longer than a heartbeat)")
    from unbroken.models import MODEL_PRESETS  # local: keeps `import unbroken.config` light

    need(
        cfg.model.preset in MODEL_PRESETS,
        f"model.preset={cfg.model.preset!r}: unknown; valid: {', '.join(MODEL_PRESETS)}",
    )
    return errs


def config_hash(cfg: Config) -> str:
    """Stable hash of everything that changes what is trained (not ports or logging)."""
    d = cfg.to_dict()
    for volatile in ("host", "port", "log_every", "threads_per_worker", "timeout_s", "keep_checkpoints"):
        d["train"].pop(volatile, None)
    d["data"].pop("cache_dir", None)
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


def _raise_all(errors: list[str]) -> None:
    if errors:
        lines = "\n  - ".join(errors)
        raise ValueError(f"{len(errors)} configuration error(s):\n  - {lines}")


REMOVED_FIELDS: dict[str, str] = {
    "train.backend": "the collective backend follows the device (gloo on CPU, NCCL on CUDA)",
}
"""Fields that no longer exist, and why. A saved ``config.json``, a TOML file or an
override that still names one loads: the value is ignored with a logged warning
(it never changed what was trained), and :func:`config_diff` skips it."""


def _set_field(obj: Any, section: str, name: str, value: Any, *, from_text: bool) -> str | None:
    if f"{section}.{name}" in REMOVED_FIELDS:
        logger.warning("config field %s.%s=%r is no longer read (ignored): %s", section, name, value,
                       REMOVED_FIELDS[f"{section}.{name}"])
        return None
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if name not in fields:
        return f"unknown field {section}.{name}; valid fields: {', '.join(fields)}"
    hint = typing.get_type_hints(type(obj))[name]
    try:
        coerced = _coerce(value, hint, from_text)
        if f"{section}.{name}" in _REGISTRY_CHOICES:
            _expect_one_of(coerced, _REGISTRY_CHOICES[f"{section}.{name}"]())
        setattr(obj, name, coerced)
    except ValueError as exc:
        return f"{section}.{name}={value!r}: {exc}"
    return None


def _policy_names() -> tuple[str, ...]:
    # Local: the registry imports torch; `import unbroken.config` stays light.
    from unbroken.mecefo.takeover import POLICIES

    return tuple(POLICIES)


def _recovery_names() -> tuple[str, ...]:
    from unbroken.runtime.recovery import RECOVERIES  # local, as above

    return tuple(RECOVERIES)


_REGISTRY_CHOICES: dict[str, Callable[[], tuple[str, ...]]] = {
    "mecefo.policy": _policy_names,
    "fault.recovery": _recovery_names,
}
"""Fields whose accepted values a registry defines, checked like a ``Literal``."""


def _expect_one_of(value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"expected one of {', '.join(map(str, choices))}")


def _coerce(value: Any, hint: Any, from_text: bool) -> Any:
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = get_args(hint)
        if type(None) in options and (value is None or (from_text and str(value).lower() in ("none", "null", ""))):
            return None
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(value, opt, from_text)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError("; ".join(errors))
    if origin is Literal:
        _expect_one_of(value, get_args(hint))
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return str(value).lower() in ("1", "true", "yes", "on")
        raise ValueError("expected a boolean (true/false)")
    if hint is int:
        if isinstance(value, bool):
            raise ValueError("expected an integer")
        if isinstance(value, int):
            return value
        if from_text:
            try:
                return int(str(value).replace("_", ""))
            except ValueError:
                pass
        raise ValueError("expected an integer")
    if hint is float:
        if isinstance(value, bool) or not (isinstance(value, (int, float)) or from_text):
            raise ValueError("expected a number")
        try:
            number = float(value)
        except ValueError:
            raise ValueError("expected a number") from None
        if not math.isfinite(number):  # no float field means anything as inf or nan (timeouts would overflow)
            raise ValueError("expected a finite number (not inf or nan)")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        raise ValueError("expected a string")
    raise ValueError(f"unsupported field type {hint!r}")  # pragma: no cover
