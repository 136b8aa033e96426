"""What the snapshot unit tests share: a trained state to snapshot, and a view's members as threads."""

from __future__ import annotations

import threading
from typing import Callable

import torch

from unbroken.models import build_model


def trained_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The debug model after one AdamW step on gradients drawn from ``seed`` (moments and all set)."""
    torch.manual_seed(0)
    model = build_model("debug", vocab_size=512, seq_len=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()
    return model, optimizer


class ThreadBroadcasts:
    """The members of one view as threads of this process: ``broadcast(t, src)`` copies rank ``src``'s tensor."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=60)
        self.sent: torch.Tensor | None = None

    def of(self, rank: int) -> Callable[[torch.Tensor, int], None]:
        def broadcast(t: torch.Tensor, src: int) -> None:
            if rank == src:
                self.sent = t.clone()
            self.barrier.wait()
            if rank != src:
                assert self.sent is not None
                t.copy_(self.sent)
            self.barrier.wait()
        return broadcast
