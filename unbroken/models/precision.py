"""Mixed precision: bfloat16 autocast around forward and backward, float32 everywhere else.

``train.precision = bf16`` runs each micro-batch's forward (and so its
backward) under ``torch.autocast(device_type, torch.bfloat16)``. Parameters
stay float32 (the master weights), so their gradients, the optimizer's moments,
the flat gradient buffer that is all-reduced and the loss (computed from
``logits.float()``) are float32; only the matrix products and what autograd
saves for them are bfloat16.

Invariant: ``fp32`` enters no autocast region at all, so it is bit-identical to
code that never heard of precision.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["PRECISIONS", "autocast", "check_precision"]

PRECISIONS = ("fp32", "bf16")


def check_precision(precision: str, device: torch.device) -> None:
    """Raise ValueError when ``precision`` cannot run on ``device`` (unknown, or bf16 on a GPU without it)."""
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"train.precision='bf16' but {name} ({device}) has no bfloat16 support "
                         "(compute capability 8.0 or newer needed); use train.precision='fp32'")


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[object]:
    """The region a micro-batch's forward and backward run in: bf16 autocast, or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
