"""A tensor's part on this rank: a DTensor sharded by FSDP2 (HSDP) holds one chunk, any other tensor all of it.

One place for what the gradient layout, the checkpoint and the worker ask of a parameter that may be
sharded: its local part (:func:`local_of`), the part of a whole tensor it holds (:func:`local_part`,
FSDP2's ``torch.chunk`` rule), a local tensor laid out as it (:func:`laid_out_as`). Nothing here gathers a
whole tensor: an HSDP checkpoint holds each rank's local parts.
"""

from __future__ import annotations

import torch

__all__ = ["is_sharded", "laid_out_as", "local_of", "local_part"]


def is_sharded(t: torch.Tensor) -> bool:
    """Is ``t`` a DTensor (a parameter, gradient or moment sharded by FSDP2)?"""
    return hasattr(t, "to_local")


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local part of ``t``: its shard for a DTensor, else ``t``."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]  # a DTensor


def local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of the whole tensor ``full`` that ``like`` holds: all of it, or for a DTensor sharded on
    dim ``d`` over a mesh of ``k`` (FSDP2's ``Shard(d)``), chunk ``i`` of ``torch.chunk(full, k, d)``
    (empty past the last chunk), ``i`` this rank's place in the mesh."""
    if not is_sharded(like):
        return full
    (placement,) = like.placements  # type: ignore[attr-defined]
    dim = placement.dim
    mesh = like.device_mesh  # type: ignore[attr-defined]
    chunks = torch.chunk(full, mesh.size(), dim)
    i = mesh.get_local_rank()
    return chunks[i] if i < len(chunks) else full.narrow(dim, 0, 0)


def laid_out_as(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (shaped as ``p``'s local part) laid out as ``p``: a DTensor with ``p``'s mesh, placements,
    shape and stride for a sharded ``p``, else ``local`` itself."""
    if not is_sharded(p):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,  # type: ignore[attr-defined]
                              stride=p.stride(), run_check=False)

