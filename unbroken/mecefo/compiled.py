"""MeCeFO's approximate block under ``torch.compile``, or eager where it cannot compile.

A job that compiles its blocks (``train.compile``) marks its model with
:func:`compile_approximations` before the adapter is built; the adapter then runs
each approximate block (skip-connected attention, recomputed FFN, low-rank FFN
weight gradients) through an :class:`ApproxPath`: one graph per block call,
traced with ``fullgraph=True``, separate from the exact block's graph, so that
switching modes never recompiles either.

What stays outside the graph, and why: the low-rank bases. They come from a
Python cache keyed by ``step // tau`` (an SVD on refresh, counted in
``svd_count``); traced, the step would become a guard and every step a
recompile (compiled whole, the block recompiled at every step, on guards on
the step and on the cache's period, up to dynamo's recompile limit). The
bases enter the graph as tensor inputs instead, fetched eagerly just before the
call. The rest traces without a break (torch 2.13): ``no_grad`` around the
attention branch, non-reentrant checkpointing of the FFN, the low-rank
``autograd.Function``; our LLaMA's and Hugging Face's blocks alike, every block
of a model sharing one graph (a second with a dynamic batch dimension, a third
for a single row).

Bad input: a block the approximations cannot compile as one graph (a user's
own attention with data-dependent control flow, a call dynamo refuses, a
backend that fails to build its kernels) runs eager from then on, with one
warning naming the block kind and dynamo's reason; the takeover never fails
for it. A failure that surfaces only in the compiled backward is not caught
here (dynamo traces the backward with the forward, so it is rare).

The first approximate step is a takeover's: a worker compiles these graphs at
its start instead (:mod:`unbroken.mecefo.warm_up`), so that a takeover
compiles nothing and a block that cannot compile falls back at the start.

Invariants: the compiled and eager paths compute the same values and
gradients up to floating-point reassociation; a path that has fallen back
never tries to compile again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["APPROX_COMPILE_ATTR", "ApproxPath", "compile_approximations", "compile_backend_of"]

logger = logging.getLogger(__name__)

APPROX_COMPILE_ATTR = "_unbroken_compile_approximations"
"""Attribute of a model marked by :func:`compile_approximations`: the backend's name."""


def compile_approximations(model: torch.nn.Module, *, backend: str) -> None:
    """Mark ``model`` so that a MeCeFO adapter built on it later compiles its approximate blocks with ``backend``."""
    setattr(model, APPROX_COMPILE_ATTR, backend)


def compile_backend_of(model: torch.nn.Module) -> str | None:
    """The backend :func:`compile_approximations` marked ``model`` with; None when it was not marked."""
    backend = getattr(model, APPROX_COMPILE_ATTR, None)
    return backend if isinstance(backend, str) else None


class ApproxPath:
    """Calls an approximate block function compiled with ``backend``, or eagerly (``backend`` None, or after a failure).

    Args:
        fn: the eager function ``fn(block, kind, recompute, x, v1, v2, v3, args, kwargs)``.
        backend: a ``torch.compile`` backend, or None for eager.

    Attributes:
        fallback_reason: why the compiled path was given up (None while it holds, or when never asked for).
    """

    def __init__(self, fn: Callable[..., torch.Tensor], *, backend: str | None) -> None:
        self._eager = fn
        self.backend = backend
        self._compiled = torch.compile(fn, backend=backend, fullgraph=True) if backend is not None else None
        self.fallback_reason: str | None = None

    @property
    def compiled(self) -> bool:
        """True while the approximate blocks run compiled."""
        return self._compiled is not None

    def __call__(self, block: torch.nn.Module, *args: Any) -> torch.Tensor:
        if self._compiled is not None:
            try:
                return self._compiled(block, *args)
            except torch._dynamo.exc.TorchDynamoException as exc:
                # Raised while tracing or building kernels, before any value is computed: eager is a clean retry.
                self._compiled = None
                self.fallback_reason = _reason(exc)
                logger.warning("MeCeFO's approximate blocks of %s run eager: torch.compile (%s) cannot compile "
                               "them as one graph: %s", type(block).__name__, self.backend, self.fallback_reason)
        return self._eager(block, *args)


def _reason(exc: BaseException) -> str:
    """Dynamo's message, its first lines (the rest is a traceback and advice about logs)."""
    lines = [ln.rstrip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = " / ".join(lines[:4]) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"
