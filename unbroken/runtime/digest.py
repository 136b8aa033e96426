"""Whether workers hold the same parameters: a digest of their bytes, computed where they lie.

:func:`param_digest` is what a worker's report carries (``workers_agree`` compares them): on the CPU the
sha256 of the parameters' bytes read in place; on a GPU :func:`device_digest`, computed on the device, so a
large model's exit copies nothing to the host.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["device_digest", "param_digest"]


def param_digest(params: list[torch.Tensor]) -> str:
    """A digest of ``params``' bytes, in order (see the module docstring)."""
    if params and params[0].device.type == "cuda":
        return device_digest(params)
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def device_digest(tensors: list[torch.Tensor], chunk: int = 1 << 26) -> str:
    """``device:`` and the sha256 of, per tensor, two 64-bit sums computed on its device: of its bytes read as
    32-bit words (zero-padded), each multiplied by an odd constant that depends on its position, and of the
    words themselves. Integer sums wrap and do not depend on the order of the reduction, so equal bytes give
    equal digests; any single changed word changes the first sum. For telling whether workers hold the same
    parameters, not a cryptographic hash."""
    h = hashlib.sha256()
    for t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        pad = -raw.numel() % 4
        if pad:
            raw = torch.cat([raw, raw.new_zeros(pad)])
        words = raw.view(torch.int32)
        weighted = plain = torch.zeros((), dtype=torch.int64, device=t.device)
        for lo in range(0, words.numel(), chunk):
            w = words[lo:lo + chunk].to(torch.int64)
            pos = torch.arange(lo, lo + w.numel(), dtype=torch.int64, device=t.device)
            weighted = weighted + (w * (pos * -7046029254386353131 | 1)).sum()  # 0x9E3779B97F4A7C15, odd
            plain = plain + w.sum()
        h.update(f"{t.dtype}{tuple(t.shape)}:{int(weighted)}:{int(plain)};".encode())
    return "device:" + h.hexdigest()
