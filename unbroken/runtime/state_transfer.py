"""Training state as one flat float32 tensor, for handing it to a joining worker.

Layout (identical on every worker, since all build the same model and
optimizer): for each trainable parameter in ``named_parameters()`` order: the
parameter, AdamW ``exp_avg``, ``exp_avg_sq`` and ``step``; then the CPU RNG
state (bytes as floats, exact). It crosses the process group as raw tensor
bytes: no pickle. The data position needs no transfer: batches are a pure
function of the step, which the joiner reads from its view.
"""

from __future__ import annotations

import torch


def pack_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    parts: list[torch.Tensor] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        st = optimizer.state.get(p, {})
        parts.append(p.detach().reshape(-1).float().cpu())
        for key in ("exp_avg", "exp_avg_sq"):
            parts.append(st[key].reshape(-1).float().cpu() if key in st else torch.zeros(p.numel()))
        parts.append(torch.tensor([float(st["step"]) if "step" in st else 0.0]))
    parts.append(torch.get_rng_state().float())
    return torch.cat(parts)


def state_size(model: torch.nn.Module) -> int:
    """Number of values :func:`pack_state` produces for this model."""
    n = sum(3 * p.numel() + 1 for p in model.parameters() if p.requires_grad)
    return n + torch.get_rng_state().numel()


def unpack_state(flat: torch.Tensor, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a state made by :func:`pack_state` on an identically built worker.

    Raises:
        ValueError: the state was made for a different model.
    """
    if flat.numel() != state_size(model):
        raise ValueError(f"state of {flat.numel()} values does not match this model ({state_size(model)} expected)")
    flat = flat.cpu()
    pos = 0

    def take(n: int) -> torch.Tensor:
        nonlocal pos
        out = flat[pos : pos + n]
        pos += n
        return out

    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                continue
            n = p.numel()
            p.copy_(take(n).view_as(p))
            exp_avg, exp_avg_sq, step = take(n), take(n), float(take(1))
            if step > 0:
                optimizer.state[p] = {"step": torch.tensor(step), "exp_avg": exp_avg.view_as(p).clone().to(p.device),
                                      "exp_avg_sq": exp_avg_sq.view_as(p).clone().to(p.device)}
    rng = torch.get_rng_state()
    torch.set_rng_state(take(rng.numel()).to(torch.uint8))
