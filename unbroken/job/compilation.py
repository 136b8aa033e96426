"""What one process compiles under ``train.compile``: its frames, its seconds, the job's compile cache.

:class:`Compilation` is made once per worker or standby process when the job
compiles: it times every compilation (dynamo's outermost compile spans: a frame,
a lazily compiled backward), loads the job's compile cache before the first step
(:mod:`unbroken.job.compile_cache`), writes it when asked, and reports per
process what it compiled, how long that took and how many graphs came from a
cache. :func:`compile_ahead` is a warm standby's forward and backward of one
micro-batch of the real shapes (no optimizer step), so that the step it takes
over with compiles nothing.

Invariants: one :class:`Compilation` per process (its timer is a process-wide
hook of dynamo's, removed by :meth:`Compilation.close`); :func:`compile_ahead`
changes no parameter and leaves no gradient behind.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from unbroken.config import Config
from unbroken.job.builder import Prepared, build_samplers
from unbroken.job.compile_cache import CACHE_FILE, load_compile_cache, save_compile_cache
from unbroken.job.parallelize import compile_stats, parallelize, resolve_compile
from unbroken.mecefo.gradients import token_loss_sum
from unbroken.models.hf_llama import logits_of
from unbroken.models.precision import autocast

__all__ = ["Compilation", "compile_ahead"]

logger = logging.getLogger(__name__)


class Compilation:
    """This process's compilations (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        from torch._dynamo.callback import callback_handler

        self.device = device
        self.seconds = 0.0
        self._since: float | None = None
        self.cache: dict[str, Any] = {"loaded": False, "why": "not looked for"}
        """What :meth:`load` found."""
        self.written: dict[str, Any] | None = None
        """What :meth:`save` last wrote (None: this process wrote no cache)."""
        self._built_when_written: int | None = None
        """AOTAutograd's cache misses when this process last wrote the job's cache or loaded it (None: neither)."""
        self.ahead: dict[str, Any] | None = None
        """A standby's :func:`compile_ahead`: frames and seconds."""
        self._write_failed = False  # a failure to write the cache was logged already (it is logged once)
        self._handler = callback_handler
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def ahead_failed(self, exc: BaseException) -> None:
        """:func:`compile_ahead` raised ``exc``: the process compiles when it takes over, as without a cache."""
        self.ahead = {"error": f"{type(exc).__name__}: {exc}"}

    def moved_to(self, device: torch.device) -> None:
        """The process's job runs on ``device`` (a standby that compiled ahead became a worker)."""
        self.device = device

    @classmethod
    def of(cls, cfg: Config, device: torch.device) -> Compilation | None:
        """A process's compilation record when ``cfg`` compiles on ``device``; None when it does not."""
        return cls(device) if resolve_compile(cfg.train.compile, device) else None

    def _start(self, *_args: object) -> None:
        self._since = time.perf_counter()

    def _end(self, *_args: object) -> None:
        if self._since is not None:
            self.seconds += time.perf_counter() - self._since
            self._since = None

    def close(self) -> None:
        """Stop timing (the hook is dynamo's, process-wide)."""
        self._handler.remove_start_callback(self._start)
        self._handler.remove_end_callback(self._end)

    def load(self, run_dir: Path, *, secret: str, config_hash: str) -> dict[str, Any]:
        """Load the job's compile cache, if there is a valid one (else compile from scratch); returns what happened."""
        self.cache = load_compile_cache(run_dir / CACHE_FILE, secret=secret, config_hash=config_hash,
                                        device=self.device)
        if self.cache["loaded"]:
            self._built_when_written = self.stats()["cache_misses"]
            logger.info("loaded the job's compile cache: %s, %d kernels, %.1f MB in %.2f s",
                        ", ".join(f"{n} {kind}" for kind, n in self.cache["artifacts"].items()),
                        self.cache["kernels"], self.cache["bytes"] / 1e6, self.cache["seconds"])
        return self.cache

    def should_write(self) -> bool:
        """This process compiled frames and the job has no cache it could load (its graphs go there, whether
        built or found in the machine's own cache), or it built graphs that no cache held (a validation pass's, a
        new shape's) since it loaded or last wrote the job's cache."""
        s = self.stats()
        if self._built_when_written is None:
            return s["frames"] > 0
        return s["cache_misses"] > self._built_when_written

    def save(self, run_dir: Path, *, secret: str, config_hash: str, writer: dict[str, Any]) -> dict[str, Any] | None:
        """Write the job's compile cache from every graph this process compiled or found in a cache; returns what
        was written, None when nothing was.

        Never raises: the cache only spares later processes their compiling, so whatever fails writing it
        (the disk, torch's own serialisation of its artifacts) leaves the run going and later processes
        compiling as this one did. The first failure is logged (a warning), the later ones of this process
        only at debug level; :attr:`written` holds the error. It is not tried again before another graph is
        built.
        """
        self._built_when_written = self.stats()["cache_misses"]
        try:
            self.written = save_compile_cache(run_dir / CACHE_FILE, secret=secret, config_hash=config_hash,
                                              device=self.device, writer=writer)
        except Exception as exc:  # noqa: BLE001 - an optimisation's failure must never end a worker
            self.written = {"error": f"{type(exc).__name__}: {exc}"}
            log = logger.debug if self._write_failed else logger.warning
            log("could not write the job's compile cache (%s): the run goes on, later processes compile as this "
                "one did", self.written["error"], exc_info=not self._write_failed)
            self._write_failed = True
            return None
        if self.written is not None:
            logger.info("wrote the job's compile cache: %.1f MB (%d kernels) in %.2f s",
                        self.written["bytes"] / 1e6, self.written["kernels"], self.written["seconds"])
        return self.written

    def stats(self) -> dict[str, Any]:
        """Frames compiled by this process (a recompile is one more), seconds spent compiling, and how many
        graphs AOTAutograd found in a cache (``cache_hits``) or built (``cache_misses``); with what :meth:`load`
        found (``cache``), what :meth:`save` wrote (``written``) and a standby's compile ahead (``ahead``)."""
        from torch._dynamo.utils import counters

        aot = counters["aot_autograd"]
        return {"frames": compile_stats().get("compiled_frames", 0), "seconds": round(self.seconds, 3),
                "cache_hits": int(aot.get("autograd_cache_hit", 0)),
                "cache_misses": int(aot.get("autograd_cache_miss", 0)),
                "cache": self.cache, "written": self.written, "ahead": self.ahead}


def compile_ahead(cfg: Config, prepared: Prepared, device: torch.device, compilation: Compilation) -> dict[str, Any]:
    """Compile ``prepared``'s model as the job will run it: one forward and backward of a whole micro-batch
    (slot 0 of step 0: the real shapes) on ``device``, no optimizer step, gradients dropped.

    The model is parallelized here as :func:`~unbroken.job.builder.build_job` would (it is then left as it is),
    and the loss compiled as the job compiles it: the graphs are the ones a worker's exact step runs.
    Returns (and records as ``compilation.ahead``) the frames and seconds it took.
    """
    before, t0 = compilation.stats(), time.perf_counter()
    model = prepared.model
    parallelize(model, compile=True, activation_checkpointing=cfg.train.activation_checkpointing)
    sampler, _ = build_samplers(cfg, prepared.data)
    x, y = (t.to(device) for t in sampler.batch(0, 0, (0, cfg.data.micro_batch)))
    with autocast(device, cfg.train.precision):
        loss = torch.compile(token_loss_sum)(logits_of(model(x)), y)
    loss.backward()
    for p in model.parameters():
        p.grad = None
    after = compilation.stats()
    compilation.ahead = {"frames": after["frames"] - before["frames"], "seconds": round(time.perf_counter() - t0, 3),
                         "cache_hits": after["cache_hits"] - before["cache_hits"]}
    return compilation.ahead
