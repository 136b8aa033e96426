"""Model-agnostic pieces of MeCeFO's approximate mode for one transformer block.

A block in approximate mode computes the same forward value as in exact mode,
but its backward is cheaper and keeps less memory:

1. **skip-connected attention**: the attention branch runs under
   ``torch.no_grad()`` and its output joins the residual stream as a constant,
   so the block input's gradient flows through the identity only, attention
   parameters get no gradient and no attention activation is saved;
2. **recomputed FFN**: only the FFN branch's input is saved (plus the r-wide
   projection the low-rank output map keeps); the intermediates are recomputed
   during backward (non-reentrant activation checkpointing);
3. **low-rank FFN weight gradients**: see :mod:`unbroken.mecefo.lowrank`.

Invariants:
    - forward values equal exact mode's bit for bit (same kernels, same order);
    - nothing here reads global state: the model adapter passes the branches
      and the low-rank bases captured at forward time, so the recomputation in
      backward uses exactly the bases of the forward even if a later step has
      refreshed the cache meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


__all__ = ["Branch", "recomputed_residual", "skip_connected"]

Branch = Callable[[torch.Tensor], torch.Tensor]
"""A residual branch ``x_BTD -> y_BTD`` (norm and sub-layer)."""


def skip_connected(branch: Branch, x_BTD: torch.Tensor) -> torch.Tensor:
    """``x + branch(x)`` where the branch adds its value but no gradient.

    The branch runs under ``no_grad``: its parameters get no gradient, nothing
    it computes is kept for backward, and ``d out / d x`` is the identity.
    """
    with torch.no_grad():
        y_BTD = branch(x_BTD)
    return x_BTD + y_BTD


def recomputed_residual(branch: Branch, x_BTD: torch.Tensor, *, recompute: bool,
                        tail: Branch | None = None) -> torch.Tensor:
    """``x + tail(branch(x))``; with ``recompute`` only ``x`` is kept for ``branch``, which reruns in backward.

    ``tail`` (default: identity) runs outside the recomputed region: it keeps
    what it saves and is not rerun. Put there a final linear map whose saved
    state is small (a low-rank one keeps ``r`` columns), so that backward does
    not redo its matrix product just to rebuild what the low-rank map saves.

    Non-reentrant checkpointing (``use_reentrant=False``) composes with
    ``.backward()`` on a loss that is not a direct function of ``x``, with
    parameters that are not inputs, and with custom autograd Functions inside.
    """
    y = checkpoint(branch, x_BTD, use_reentrant=False) if recompute else branch(x_BTD)
    if tail is not None:
        y = tail(y)
    return x_BTD + y
