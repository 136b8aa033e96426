"""Low-rank weight gradients for linear maps (MeCeFO's third approximation).

For ``y = W x`` with ``W`` of shape (m, n), let ``V`` (n, r) hold the top-r right
singular vectors of ``W`` itself. The approximate weight gradient is

    G_W ~= G_y^T (X V) V^T

so the forward keeps only ``X V`` (one r-wide row per token) instead of ``X``
(n wide); the input gradient ``G_y W`` stays exact.

Invariants:
    - the input gradient is exact; only the weight gradient is projected onto
      the span of ``V`` (with ``r = n <= m`` that span is everything, so the
      gradient is exact up to rounding);
    - tensors saved for backward: ``X V`` and the weight (a parameter); ``V``
      is held by reference (it lives in the basis cache), so the activation
      memory is ``B*T*r`` elements per linear map instead of ``B*T*n``;
    - a :class:`LowRankBasis` computes ``V`` for a key at most once per period
      ``step // tau``, from the weight as it is at the first request of that
      period, with ``torch.linalg.svd`` in float32 on the detached weight;
      any change of period (forwards or backwards) recomputes it.

Shape suffixes: N rows of X (tokens, B*T flattened), I input width n, O output
width m, R rank r.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["LowRankBasis", "check_rank_tau", "lowrank_linear", "svd_flops"]


def check_rank_tau(rank: int, tau: int) -> None:
    """Raise ValueError unless ``rank >= 1`` and ``tau >= 1``."""
    if rank < 1:
        raise ValueError(f"rank={rank} must be >= 1 (MecefoConfig.rank)")
    if tau < 1:
        raise ValueError(f"tau={tau} must be >= 1 (MecefoConfig.tau)")


class LowRankBasis:
    """Cache of the top-r right singular vectors of named weights, refreshed every tau steps.

    Args:
        rank: r, the number of singular vectors kept (>= 1).
        tau: refresh period in steps (>= 1).

    Attributes:
        svd_count: number of SVDs computed so far (for tests and cost reports).

    Raises:
        ValueError: ``rank`` or ``tau`` below 1.
    """

    def __init__(self, *, rank: int, tau: int) -> None:
        check_rank_tau(rank, tau)
        self.rank = rank
        self.tau = tau
        self.svd_count = 0
        self._cache: dict[str, tuple[int, torch.Tensor]] = {}

    def get(self, key: str, weight: torch.Tensor, *, step: int) -> torch.Tensor:
        """``V`` (n, r) for ``weight`` (m, n), in the weight's dtype and device.

        Recomputed when ``step // tau`` differs from the period of the cached
        value (or nothing is cached for ``key``); otherwise the cached value is
        returned even though the weight has changed since: that staleness is
        what amortises the SVD.

        Raises:
            ValueError: ``rank`` exceeds ``min(m, n)``.
        """
        period = step // self.tau
        cached = self._cache.get(key)
        if cached is not None and cached[0] == period:
            return cached[1]
        v_IR = self._compute(key, weight)
        self._cache[key] = (period, v_IR)
        return v_IR

    def clear(self) -> None:
        """Forget every cached basis (the next request of each key recomputes it)."""
        self._cache.clear()

    def _compute(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        m, n = weight.shape
        if self.rank > min(m, n):
            raise ValueError(
                f"rank={self.rank} exceeds the rank of {key} (shape {(m, n)}); "
                f"use a rank <= {min(m, n)}"
            )
        if weight.is_meta:
            # Shape-only runs (cost counting on the meta device) need no values.
            return torch.empty(n, self.rank, dtype=weight.dtype, device=weight.device)
        self.svd_count += 1
        # float32 whatever the parameter dtype: bf16 SVD is unsupported/inaccurate.
        _, _, vh_RI = torch.linalg.svd(weight.detach().float(), full_matrices=False)
        return vh_RI[: self.rank].T.contiguous().to(weight.dtype)


def svd_flops(m: int, n: int) -> int:
    """Floating-point operations of one thin SVD (U, S and V) of an m x n matrix.

    Golub & Van Loan's count for the R-SVD (Matrix Computations, 4th ed.,
    Fig. 8.6.1): ``6 p q^2 + 20 q^3`` with ``p = max(m, n)``, ``q = min(m, n)``.
    FlopCounterMode does not count ``linalg_svd``, so cost reports add this.
    """
    p, q = max(m, n), min(m, n)
    return 6 * p * q * q + 20 * q**3


class _LowRankLinear(torch.autograd.Function):
    """``y = x W^T`` with the weight gradient projected onto ``V``; saves ``x V``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                v_IR: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, weight)
        # Only what backward needs: X V replaces X when the weight wants a gradient.
        xv = x @ v_IR.to(x.dtype) if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(xv, weight)
        # Not saved as an activation: V is resident in the basis cache anyway.
        ctx.v_IR = v_IR
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx: Any,
                 g_y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        xv, weight = ctx.saved_tensors
        v_IR = ctx.v_IR
        g_x = g_w = None
        # Casts keep backward valid when forward ran under autocast (g_y then has
        # the autocast dtype, weight and x their own).
        if ctx.needs_input_grad[0]:
            g_x = (g_y @ weight.to(g_y.dtype)).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            g_NO = g_y.reshape(-1, g_y.shape[-1])
            xv_NR = xv.reshape(-1, xv.shape[-1]).to(g_NO.dtype)
            # (O x N)(N x R) first, then (O x R)(R x I): never forms an N x I product.
            g_w = ((g_NO.T @ xv_NR) @ v_IR.to(g_NO.dtype).T).to(weight.dtype)
        return g_x, g_w, None


def lowrank_linear(x: torch.Tensor, weight: torch.Tensor, v_IR: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` whose weight gradient is ``G_y^T (X V) V^T``.

    Args:
        x: input (..., n).
        weight: (m, n), no bias.
        v_IR: (n, r) basis, normally from :meth:`LowRankBasis.get`; no gradient flows to it.

    Returns:
        y (..., m), the exact forward value.
    """
    return _LowRankLinear.apply(x, weight, v_IR.detach())
