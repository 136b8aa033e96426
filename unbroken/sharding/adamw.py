"""AdamW over one flat range of the parameters, out of place: the sharded optimizer's arithmetic.

:class:`ShardedAdamW` is a ``torch.optim.Optimizer`` with AdamW's groups
(matrices and embeddings decay, norm gains do not), hyper-parameters and
per-parameter ``step`` counts (replicated: every member counts every
parameter), but it keeps ``exp_avg`` and ``exp_avg_sq`` only for its range
``[lo, hi)`` of the flat parameter vector (:mod:`unbroken.sharding.ranges`).

:meth:`ShardedAdamW.propose` computes the range's new parameters and moments
from the parameters' ``.grad`` into new tensors, touching nothing; the step
protocol all-gathers the new parameters and, once the step is committed,
:meth:`ShardedAdamW.commit` installs them. An aborted step leaves the
parameters and moments of the last committed step intact, which is what the
survivors re-shard from.

Invariant: per element, the operations are those of
``torch.optim.AdamW(foreach=False)`` in the same order (decoupled weight
decay, ``lerp_``, ``mul_().addcmul_()``, bias corrections from the float step,
``addcdiv_``), so sharded and replicated training agree to float tolerance,
and every member ends a step with bit-identical parameters (each element is
computed by exactly one owner, then gathered).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["Proposal", "ShardedAdamW"]


@dataclasses.dataclass
class Proposal:
    """The update of one step on one range, not yet installed."""

    lo: int
    hi: int
    params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    stepped: list[int]
    """Indices of the parameters that had a gradient (their ``step`` advances at commit)."""


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW whose moments cover ``[lo, hi)`` of the flat parameters (all of them until :meth:`set_range`)."""

    def __init__(self, model: torch.nn.Module, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float) -> None:
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.flat = [p for _, p in self._named]
        decay = [p for p in self.flat if p.dim() >= 2]
        no_decay = [p for p in self.flat if p.dim() < 2]
        super().__init__([{"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}],
                         {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.offsets, offset = [], 0
        for p in self.flat:
            self.offsets.append(offset)
            offset += p.numel()
        self.total = offset
        self._group = {id(p): g for g in self.param_groups for p in g["params"]}
        device = self.flat[0].device if self.flat else torch.device("cpu")
        self.lo, self.hi = 0, self.total
        self.exp_avg = torch.zeros(self.total, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(self.total, dtype=torch.float32, device=device)

    # -- the range --------------------------------------------------------------

    def set_range(self, lo: int, hi: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Keep the moments of ``[lo, hi)`` only (given as flat tensors of ``hi - lo`` elements)."""
        if exp_avg.numel() != hi - lo or exp_avg_sq.numel() != hi - lo:
            raise ValueError(f"moments of {exp_avg.numel()} elements for range [{lo}, {hi})")
        self.lo, self.hi, self.exp_avg, self.exp_avg_sq = lo, hi, exp_avg, exp_avg_sq

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """``[(param index, start, stop, at)]``: the part ``[start, stop)`` of each parameter's flat view
        that falls in ``[lo, hi)``, at offset ``at`` from ``lo``."""
        out = []
        for i, (p, off) in enumerate(zip(self.flat, self.offsets)):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                out.append((i, a - off, b - off, a - lo))
        return out

    def moments_of(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the held moments of ``[lo, hi)`` (inside the held range)."""
        if not self.lo <= lo <= hi <= self.hi:
            raise ValueError(f"range [{lo}, {hi}) is not inside the held range [{self.lo}, {self.hi})")
        return self.exp_avg[lo - self.lo:hi - self.lo], self.exp_avg_sq[lo - self.lo:hi - self.lo]

    # -- a step -----------------------------------------------------------------

    def propose(self) -> Proposal:
        """The held range's parameters and moments after one AdamW step on the current ``.grad``."""
        lo, hi = self.lo, self.hi
        params = torch.empty(hi - lo, dtype=torch.float32, device=self.exp_avg.device)
        m, v = self.exp_avg.clone(), self.exp_avg_sq.clone()
        stepped = [i for i, p in enumerate(self.flat) if p.grad is not None]
        with torch.no_grad():
            for i, a, b, at in self.pieces(lo, hi):
                p, n = self.flat[i], b - a
                out = params[at:at + n]
                out.copy_(p.detach().reshape(-1)[a:b])
                if p.grad is None:
                    continue
                group = self._group[id(p)]
                lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
                step = self._step_of(p) + 1.0
                if wd != 0:
                    out.mul_(1 - lr * wd)
                g = p.grad.reshape(-1)[a:b]
                mi, vi = m[at:at + n], v[at:at + n]
                _moments(mi, vi, g, beta1, beta2)
                bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
                denom = (vi.sqrt() / bias2 ** 0.5).add_(eps)
                out.addcdiv_(mi, denom, value=-(lr / bias1))
        return Proposal(lo=lo, hi=hi, params=params, exp_avg=m, exp_avg_sq=v, stepped=stepped)

    def commit(self, proposal: Proposal, flat_params: torch.Tensor) -> None:
        """Install a committed step: every parameter from the gathered flat vector, the range's moments."""
        if (proposal.lo, proposal.hi) != (self.lo, self.hi):
            raise ValueError(f"proposal for [{proposal.lo}, {proposal.hi}) but the range is [{self.lo}, {self.hi})")
        with torch.no_grad():
            for p, off in zip(self.flat, self.offsets):
                p.copy_(flat_params[off:off + p.numel()].view_as(p))
        self.exp_avg, self.exp_avg_sq = proposal.exp_avg, proposal.exp_avg_sq
        for i in proposal.stepped:
            p = self.flat[i]
            st = self.state[p]
            st["step"] = st.get("step", torch.tensor(0.0)) + 1.0

    def range_grads(self, lo: int, hi: int) -> list[torch.Tensor | None]:
        """A copy of the current ``.grad`` over ``[lo, hi)``, one tensor per piece (:meth:`pieces`; None where
        the parameter has no gradient): what :meth:`replay_moments` needs of a step, and nothing more."""
        return [None if (g := self.flat[i].grad) is None else g.detach().reshape(-1)[a:b].clone()
                for i, a, b, _ in self.pieces(lo, hi)]

    def replay_moments(self, lo: int, hi: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       grads: list[torch.Tensor | None] | None = None) -> None:
        """Advance the moments of ``[lo, hi)`` by one step, in place (a replica one step behind catches up),
        on ``grads`` (:meth:`range_grads` of that step, kept by the replica's holder), by default the current
        ``.grad``."""
        grads = self.range_grads(lo, hi) if grads is None else grads
        with torch.no_grad():
            for (i, a, b, at), g in zip(self.pieces(lo, hi), grads, strict=True):
                if g is None:
                    continue
                beta1, beta2 = self._group[id(self.flat[i])]["betas"]
                _moments(exp_avg[at:at + b - a], exp_avg_sq[at:at + b - a], g, beta1, beta2)

    def _step_of(self, p: torch.Tensor) -> float:
        st = self.state.get(p)
        return float(st["step"]) if st and "step" in st else 0.0

    def step(self, closure=None):  # type: ignore[override]
        """A whole step on one process (the held range must be everything)."""
        if (self.lo, self.hi) != (0, self.total):
            raise RuntimeError("ShardedAdamW.step() needs the whole range; a sharded step goes through "
                               "propose(), an all-gather and commit()")
        proposal = self.propose()
        self.commit(proposal, proposal.params)

    # -- state as flat tensors ------------------------------------------------------

    def load_full(self, by_name: dict[str, tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]
                     ) -> None:
        """Hold the whole range again, loaded per parameter name: ``(exp_avg, exp_avg_sq, step)``
        (a checkpoint or a snapshot; missing moments are zeros, a missing step leaves none)."""
        names = {id(p): n for n, p in self._named}
        m = torch.zeros(self.total, dtype=torch.float32, device=self.exp_avg.device)
        v = torch.zeros_like(m)
        self.state.clear()
        for p, off in zip(self.flat, self.offsets):
            exp_avg, exp_avg_sq, step = by_name.get(names[id(p)], (None, None, None))
            if exp_avg is not None:
                m[off:off + p.numel()].copy_(exp_avg.reshape(-1))
            if exp_avg_sq is not None:
                v[off:off + p.numel()].copy_(exp_avg_sq.reshape(-1))
            if step is not None:
                self.state[p] = {"step": step.detach().clone().float().cpu()}
        self.set_range(0, self.total, m, v)

    def full_moments(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per parameter index, views of its moments (only when the whole range is held)."""
        if (self.lo, self.hi) != (0, self.total):
            raise RuntimeError(f"the moments of [{self.lo}, {self.hi}) only are held here")
        return {i: (self.exp_avg[off:off + p.numel()].view_as(p), self.exp_avg_sq[off:off + p.numel()].view_as(p))
                for i, (p, off) in enumerate(zip(self.flat, self.offsets))}


def _moments(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta1: float, beta2: float) -> None:
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
