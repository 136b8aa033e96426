"""Model adapter: which submodules of a model are attention and which are FFN.

The MeCeFO approximations reach a model only through this adapter, so model code
stays free of fault-tolerance concerns. Switching a micro-batch between exact
and approximate mode is a context manager; it never rebuilds or copies the model.

Mechanism: at construction the adapter gives every ``TransformerBlock`` an
instance attribute ``forward`` (a :class:`_BlockForward`) that reads a switch
shared by the model's blocks. Outside ``mode("approx", ...)`` it calls the
block's original forward, so exact mode is bit-identical to the plain model;
inside, it runs the approximate block of :mod:`unbroken.mecefo.approx`.

Invariants:
    - exact mode executes exactly the model's own code: same values, same
      gradients, same saved tensors;
    - approximate mode gives the same forward values as exact mode; attention
      parameters (``attention.*``, ``attention_norm``) get no gradient and FFN
      weights get low-rank gradients (rank ``rank``, bases refreshed when
      ``step // tau`` changes);
    - several adapters on one model share the switch: the innermost active
      ``mode`` context decides, and leaving it restores the previous mode;
    - the low-rank bases used by a micro-batch's backward are those captured
      by its forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from unbroken.mecefo.approx import recomputed_residual, skip_connected
from unbroken.mecefo.lowrank import LowRankBasis, lowrank_linear
from unbroken.models.llama import Rope, TransformerBlock

__all__ = ["GROUP_NAMES", "BlockParts", "LlamaAdapter", "ModelAdapter", "component_of"]

GROUP_NAMES = ("rest", "attention")
MODES = ("exact", "approx")
FFN_LINEARS = ("w1", "w2", "w3")


class ModelAdapter(Protocol):
    """What the gradient code needs to know about a model."""

    group_names: tuple[str, ...]

    def group_of(self, param_name: str) -> int:
        """Index into ``group_names`` of the aggregation group of a parameter."""

    def dropped_in_approx(self, group_name: str) -> bool:
        """True when approximate mode leaves this group without gradient."""

    def mode(self, mode: str, *, step: int) -> contextlib.AbstractContextManager[None]:
        """Run forward and backward of one micro-batch in ``mode``."""


@dataclass(frozen=True)
class BlockParts:
    """Qualified module names of one transformer block's parts (``model.get_submodule`` keys).

    Attributes:
        index: position of the block in the model.
        block: the block itself, e.g. ``layers.3``.
        attention: attention sub-layer (dropped from backward in approx mode).
        attention_norm: its pre-norm (also dropped).
        ffn_norm: the FFN pre-norm (recomputed in approx mode).
        feed_forward: the FFN sub-layer (recomputed in approx mode).
        ffn_linears: the FFN linear maps whose weight gradients go low-rank.
    """

    index: int
    block: str
    attention: str
    attention_norm: str
    ffn_norm: str
    feed_forward: str
    ffn_linears: tuple[str, ...]


@dataclass(frozen=True)
class _ApproxRun:
    """An active approximate mode: whose settings and bases, and which step."""

    adapter: LlamaAdapter
    step: int


class _Switch:
    """The mode shared by the dispatching forwards of one model's blocks."""

    def __init__(self) -> None:
        self.active: _ApproxRun | None = None


class _BlockForward:
    """Instance-level ``forward`` of a block: exact, or the active adapter's approximation."""

    def __init__(self, block: TransformerBlock, parts: BlockParts, switch: _Switch) -> None:
        self.block = block
        self.parts = parts
        self.switch = switch
        # The bound forward found before installation (normally the class's).
        self.exact_forward = block.forward

    def __call__(self, x_BTD: torch.Tensor, rope: Rope) -> torch.Tensor:
        run = self.switch.active
        if run is None:
            return self.exact_forward(x_BTD, rope)
        return run.adapter._approx_block_forward(self.block, self.parts, x_BTD, rope, run.step)


class LlamaAdapter:
    """Adapter for :mod:`unbroken.models.llama`: groups, blocks and both modes.

    Args:
        model: a ``Transformer`` (or any module whose blocks are ``TransformerBlock``).
        rank: r of the low-rank FFN weight gradients (``MecefoConfig.rank``).
        tau: steps between refreshes of the FFN singular vectors (``MecefoConfig.tau``).
        recompute: recompute FFN intermediates in backward (False only for ablations).

    Raises:
        ValueError: ``rank`` or ``tau`` below 1; ``rank`` above ``min(m, n)`` of
            an FFN weight (the message names it, its shape and the largest valid
            rank); a model without transformer blocks; FFN linears with a bias.
    """

    group_names = GROUP_NAMES

    def __init__(self, model: torch.nn.Module, *, rank: int = 32, tau: int = 50, recompute: bool = True) -> None:
        self.model = model
        self.recompute = recompute
        self.basis = LowRankBasis(rank=rank, tau=tau)
        self._parts = _find_blocks(model)
        _check_ffn_weights(model, self._parts, rank)
        self._switch = _install_dispatch(model, self._parts)

    def group_of(self, param_name: str) -> int:
        return 1 if component_of(param_name) == "attention" else 0

    def dropped_in_approx(self, group_name: str) -> bool:
        return group_name == "attention"

    def blocks(self) -> list[BlockParts]:
        """Names of every block's attention / FFN parts, in model order."""
        return list(self._parts)

    @contextlib.contextmanager
    def mode(self, mode: str, *, step: int) -> Iterator[None]:
        """Run the forward (and the backward) of a micro-batch in ``mode`` at ``step``.

        Backward should run inside the context too, as ``compute_gradient_sums``
        does; the approximate backward itself does not depend on it.

        Raises:
            ValueError: ``mode`` is neither ``exact`` nor ``approx``.
        """
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not supported; use one of {MODES}")
        previous = self._switch.active
        self._switch.active = _ApproxRun(self, step) if mode == "approx" else None
        try:
            yield
        finally:
            self._switch.active = previous

    def prepare(self, step: int) -> int:
        """Make every FFN basis current for ``step`` now (e.g. before timing a step).

        Returns:
            The number of SVDs this computed.
        """
        before = self.basis.svd_count
        for parts in self._parts:
            for name in parts.ffn_linears:
                self.basis.get(name, self.model.get_submodule(name).weight, step=step)
        return self.basis.svd_count - before

    def _approx_block_forward(
        self, block: TransformerBlock, parts: BlockParts, x_BTD: torch.Tensor, rope: Rope, step: int
    ) -> torch.Tensor:
        """One block in approximate mode; same value as ``block.forward``."""
        ff = block.feed_forward
        # Bases fetched before the checkpoint, so the recomputation reuses them.
        v1, v2, v3 = (self.basis.get(name, getattr(ff, name.rsplit(".", 1)[1]).weight, step=step)
                      for name in parts.ffn_linears)

        def attention_branch(x: torch.Tensor) -> torch.Tensor:
            return block.attention(block.attention_norm(x), rope)

        def ffn_gate(h: torch.Tensor) -> torch.Tensor:
            z = block.ffn_norm(h)
            return F.silu(lowrank_linear(z, ff.w1.weight, v1)) * lowrank_linear(z, ff.w3.weight, v3)

        def ffn_out(gate_BTF: torch.Tensor) -> torch.Tensor:
            # Outside the recomputed region: it keeps gate @ V2 (r wide), so
            # backward never redoes w2's product.
            return lowrank_linear(gate_BTF, ff.w2.weight, v2)

        h_BTD = skip_connected(attention_branch, x_BTD)
        return recomputed_residual(ffn_gate, h_BTD, recompute=self.recompute, tail=ffn_out)


def component_of(param_name: str) -> str:
    """``attention``, ``ffn`` or ``rest`` for a LLaMA parameter name."""
    parts = param_name.split(".")
    if "attention" in parts or "attention_norm" in parts:
        return "attention"
    if "feed_forward" in parts:
        return "ffn"
    return "rest"


def _find_blocks(model: torch.nn.Module) -> list[BlockParts]:
    """Every ``TransformerBlock`` of ``model`` with its parts' qualified names."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, TransformerBlock):
            p = f"{name}." if name else ""
            found.append(BlockParts(
                index=len(found), block=name, attention=f"{p}attention", attention_norm=f"{p}attention_norm",
                ffn_norm=f"{p}ffn_norm", feed_forward=f"{p}feed_forward",
                ffn_linears=tuple(f"{p}feed_forward.{w}" for w in FFN_LINEARS),
            ))
    if not found:
        raise ValueError(f"{type(model).__name__} has no TransformerBlock; LlamaAdapter needs a llama model")
    return found


def _check_ffn_weights(model: torch.nn.Module, blocks: list[BlockParts], rank: int) -> None:
    """Reject ranks no FFN weight can supply and biases the low-rank path would drop."""
    shapes = {}
    for parts in blocks:
        for name in parts.ffn_linears:
            linear = model.get_submodule(name)
            if linear.bias is not None:
                raise ValueError(f"{name} has a bias; the low-rank path supports bias-free linears only")
            shapes[f"{name}.weight"] = tuple(linear.weight.shape)
    max_rank = min(min(s) for s in shapes.values())
    if rank > max_rank:
        name, shape = next((n, s) for n, s in shapes.items() if min(s) < rank)
        raise ValueError(
            f"rank={rank} exceeds min(m, n)={min(shape)} of {name} (shape {shape}); "
            f"use a rank <= {max_rank} (MecefoConfig.rank)"
        )


def _install_dispatch(model: torch.nn.Module, blocks: list[BlockParts]) -> _Switch:
    """Give each block a dispatching forward, or join the switch already installed."""
    installed = [model.get_submodule(p.block).__dict__.get("forward") for p in blocks]
    if all(isinstance(f, _BlockForward) for f in installed):
        switches = {id(f.switch) for f in installed}
        assert len(switches) == 1, "blocks of one model dispatch through different switches"
        return installed[0].switch
    assert not any(isinstance(f, _BlockForward) for f in installed), "partially adapted model"
    switch = _Switch()
    for parts in blocks:
        block = model.get_submodule(parts.block)
        block.forward = _BlockForward(block, parts, switch)
    return switch
