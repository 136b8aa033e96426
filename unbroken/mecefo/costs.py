"""Measuring what a micro-batch costs: FLOPs and activation bytes saved for backward.

Used by ``unbroken.bench.mecefo_cost`` and by anything that needs the measured
(not modelled) cost of exact versus approximate micro-batches.

Invariants:
    - FLOPs are ``torch.utils.flop_counter.FlopCounterMode`` counts (matrix
      products and attention, 2 per multiply-add) plus the CPU flash-attention
      kernels, which FlopCounterMode leaves uncounted; causal attention counts
      half of the score and value products (the work a causal kernel does);
    - SVDs are never in those counts: :func:`svd_flops_per_refresh` gives them
      from Golub & Van Loan's formula so callers can amortise them over tau;
    - saved bytes are the bytes of the distinct storages saved for backward
      that are not parameters or buffers of the model (those are resident
      anyway): the activation memory held at the end of a forward;
    - gradient errors compare *aggregated* gradients (group sum / group
      weight, as ``apply_reduced``), a group of weight zero counting as zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from unbroken.mecefo.adapter import LlamaAdapter, component_of
from unbroken.mecefo.gradients import GradLayout
from unbroken.mecefo.lowrank import svd_flops

__all__ = ["COMPONENTS", "SavedBytes", "count_flops", "relative_errors", "svd_flops_per_refresh"]

COMPONENTS = ("attention", "ffn", "rest", "total")

_aten = torch.ops.aten


def _causal_share(is_causal: bool) -> float:
    # A causal kernel skips the masked upper triangle of the T x T scores.
    return 0.5 if is_causal else 1.0


def _cpu_flash_forward(q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False,
                       *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(q, k, v) * _causal_share(is_causal))


def _cpu_flash_backward(g: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dropout_p: float = 0.0,
                        is_causal: bool = False, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(g, q, k, v) * _causal_share(is_causal))


_CPU_SDPA = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of running ``fn()`` (forward and backward if it runs both), SVDs excluded."""
    with FlopCounterMode(display=False, custom_mapping=_CPU_SDPA) as counter:
        fn()
    return int(counter.get_total_flops())


def svd_flops_per_refresh(adapter: LlamaAdapter) -> int:
    """FLOPs of refreshing every FFN basis of ``adapter``'s model once (one SVD per FFN weight)."""
    total = 0
    for parts in adapter.blocks():
        for name in parts.ffn_linears:
            m, n = tuple(getattr(adapter.model.get_submodule(name), "weight").shape)
            total += svd_flops(m, n)
    return total


def relative_errors(layout: GradLayout, approx: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    """``||g~ - g|| / ||g||`` per component (``COMPONENTS``) of two gradient-sum buffers of ``layout``."""
    ga, ge = _component_vectors(layout, approx), _component_vectors(layout, exact)
    return {c: float((ga[c] - ge[c]).norm() / ge[c].norm()) for c in COMPONENTS}


def _component_vectors(layout: GradLayout, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Aggregated gradient (sum / group weight) per component, flattened."""
    weights = layout.weights(buf)
    parts: dict[str, list[torch.Tensor]] = {c: [] for c in COMPONENTS}
    for i, name in enumerate(layout.names):
        w = float(weights[layout.groups[i]])
        view = layout.grad_view(buf, i).flatten()
        g = view / w if w > 0 else torch.zeros_like(view)
        parts[component_of(name)].append(g)
        parts["total"].append(g)
    return {c: torch.cat(v) for c, v in parts.items()}


class SavedBytes:
    """Context manager counting the activation bytes saved for backward inside it.

    Each distinct storage counts once (views and tensors saved by several ops
    share it); storages of ``model``'s parameters and buffers do not count.
    Saved tensors stay referenced until :meth:`reset`, so a storage address
    cannot be reused by another storage while counting.

    Args:
        model: whose parameters and buffers are excluded.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._resident = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        self._seen: dict[int, tuple[int, torch.Tensor]] = {}
        self._hooks: saved_tensors_hooks | None = None

    @property
    def bytes(self) -> int:
        """Activation bytes saved so far."""
        return sum(nbytes for nbytes, _ in self._seen.values())

    @property
    def count(self) -> int:
        """Distinct activation storages saved so far."""
        return len(self._seen)

    def reset(self) -> None:
        """Forget what was counted (and release the references kept)."""
        self._seen.clear()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._resident and key not in self._seen:
            self._seen[key] = (storage.nbytes(), t)
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks = saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
