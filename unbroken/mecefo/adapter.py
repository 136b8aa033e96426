"""Model adapter: which submodules of a model are attention and which are FFN.

The MeCeFO approximations reach a model only through this adapter, so model code
stays free of fault-tolerance concerns. Switching a micro-batch between exact
and approximate mode is a context manager; it never rebuilds or copies the model.

Two block kinds are known (:class:`BlockKind`): our ``TransformerBlock``
(``attention``, ``feed_forward`` with ``w1 w2 w3``) and Hugging Face's
``LlamaDecoderLayer`` (``self_attn``, ``mlp`` with ``gate_proj down_proj
up_proj``); both run the same approximations. A model with neither trains
exactly through :class:`ExactOnlyAdapter`, which refuses approximate mode.

Mechanism: at construction the adapter gives every transformer block an
instance attribute ``forward`` (a :class:`_BlockForward`) that reads a switch
shared by the model's blocks. Outside ``mode("approx", ...)`` it calls the
block's original forward, so exact mode is bit-identical to the plain model;
inside, it runs the approximate block of :mod:`unbroken.mecefo.approx`
(:func:`approx_block`), compiled when the job compiles (:mod:`unbroken.mecefo.compiled`).

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
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

from unbroken.mecefo.approx import recomputed_residual, skip_connected
from unbroken.mecefo.compiled import ApproxPath, compile_backend_of
from unbroken.mecefo.lowrank import LowRankBasis, lowrank_linear
from unbroken.models.llama import TransformerBlock

__all__ = ["GROUP_NAMES", "BlockKind", "BlockParts", "ExactOnlyAdapter", "LlamaAdapter", "ModelAdapter",
           "NoAdapter", "adapter_for", "approx_block", "component_of", "has_blocks", "linear_weight",
           "transformer_blocks"]

GROUP_NAMES: tuple[str, ...] = ("rest", "attention")
MODES = ("exact", "approx")
FFN_LINEARS = ("w1", "w2", "w3")


class NoAdapter(ValueError):
    """Approximate mode was asked of a model whose blocks no adapter knows."""


@dataclass(frozen=True)
class BlockKind:
    """Where one kind of pre-norm transformer block keeps its parts (attribute names on the block).

    Attributes:
        name: the kind's name in messages.
        attention, attention_norm, ffn_norm, feed_forward: the sub-layers.
        ffn_linears: the SwiGLU linears in the roles ``(gate, down, up)``,
            i.e. ``out = down(act(gate z) * up z)``.
        run_attention: ``(attention, z, args, kwargs) -> y``: the attention
            sub-layer on its normed input ``z``, given the block's own call
            arguments after the hidden state.
    """

    name: str
    attention: str
    attention_norm: str
    ffn_norm: str
    feed_forward: str
    ffn_linears: tuple[str, str, str]
    run_attention: Callable[[torch.nn.Module, torch.Tensor, tuple[Any, ...], dict[str, Any]], torch.Tensor]

    def activation(self, feed_forward: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The FFN's gate activation (SiLU for ours; the module's own ``act_fn`` for Hugging Face's)."""
        return getattr(feed_forward, "act_fn", F.silu)


LLAMA_BLOCK = BlockKind(
    name="llama", attention="attention", attention_norm="attention_norm", ffn_norm="ffn_norm",
    feed_forward="feed_forward", ffn_linears=FFN_LINEARS,
    run_attention=lambda attn, z, args, kwargs: attn(z, *args, **kwargs))
HF_LLAMA_BLOCK = BlockKind(
    name="hf-llama", attention="self_attn", attention_norm="input_layernorm", ffn_norm="post_attention_layernorm",
    feed_forward="mlp", ffn_linears=("gate_proj", "down_proj", "up_proj"),
    # LlamaAttention returns (output, attention weights).
    run_attention=lambda attn, z, args, kwargs: attn(z, *args, **kwargs)[0])
_ATTENTION_NAMES = frozenset({"attention", "attention_norm", "self_attn", "input_layernorm"})
_FFN_NAMES = frozenset({"feed_forward", "mlp"})


def _kind_of(module: torch.nn.Module) -> BlockKind | None:
    if isinstance(module, TransformerBlock):
        return LLAMA_BLOCK
    # By name: transformers stays an optional dependency, never imported here.
    if type(module).__name__ == "LlamaDecoderLayer" and hasattr(module, "self_attn") and hasattr(module, "mlp"):
        return HF_LLAMA_BLOCK
    return None


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
        kind: the block's kind (its attribute names).
        index: position of the block in the model.
        block: the block itself, e.g. ``layers.3``.
        attention: attention sub-layer (dropped from backward in approx mode).
        attention_norm: its pre-norm (also dropped).
        ffn_norm: the FFN pre-norm (recomputed in approx mode).
        feed_forward: the FFN sub-layer (recomputed in approx mode).
        ffn_linears: the FFN linear maps whose weight gradients go low-rank.
    """

    kind: BlockKind
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

    def __init__(self, block: torch.nn.Module, parts: BlockParts, switch: _Switch) -> None:
        self.block = block
        self.parts = parts
        self.switch = switch
        # The bound forward found before installation (normally the class's).
        self.exact_forward = block.forward

    def __call__(self, x_BTD: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        run = self.switch.active
        if run is None:
            return self.exact_forward(x_BTD, *args, **kwargs)
        return run.adapter._approx_block_forward(self.block, self.parts, x_BTD, args, kwargs, run.step)


class LlamaAdapter:
    """Adapter for LLaMA-shaped models (ours, or Hugging Face's ``LlamaForCausalLM``): groups, blocks, both modes.

    Args:
        model: a module whose blocks are ``TransformerBlock`` or ``LlamaDecoderLayer``.
        rank: r of the low-rank FFN weight gradients (``MecefoConfig.rank``).
        tau: steps between refreshes of the FFN singular vectors (``MecefoConfig.tau``).
        recompute: recompute FFN intermediates in backward (False only for ablations).
        compile_backend: run approximate blocks under ``torch.compile`` with this backend; by default the one
            :func:`~unbroken.mecefo.compiled.compile_approximations` marked the model with (none: eager).
            A block that cannot compile runs eager (:class:`~unbroken.mecefo.compiled.ApproxPath`).

    Raises:
        ValueError: ``rank`` or ``tau`` below 1; ``rank`` above ``min(m, n)`` of
            an FFN weight (the message names it, its shape and the largest valid
            rank); a model without transformer blocks; FFN linears with a bias.
    """

    group_names = GROUP_NAMES

    def __init__(self, model: torch.nn.Module, *, rank: int = 32, tau: int = 50, recompute: bool = True,
                 compile_backend: str | None = None) -> None:
        self.model = model
        self.recompute = recompute
        self.approx_path = ApproxPath(approx_block, backend=compile_backend or compile_backend_of(model))
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
                self.basis.get(name, linear_weight(self.model, name), step=step)
        return self.basis.svd_count - before

    def _approx_block_forward(self, block: torch.nn.Module, parts: BlockParts, x_BTD: torch.Tensor,
                              args: tuple[Any, ...], kwargs: dict[str, Any], step: int) -> torch.Tensor:
        """One block in approximate mode; same value as ``block.forward``."""
        kind = parts.kind
        ff = getattr(block, kind.feed_forward)
        # Bases fetched here, eagerly (a cache keyed by step), and passed in: the graph never sees the step,
        # and the recomputation in backward reuses the forward's bases.
        v1, v2, v3 = (self.basis.get(name, getattr(ff, w).weight, step=step)
                      for name, w in zip(parts.ffn_linears, kind.ffn_linears))
        return self.approx_path(block, kind, self.recompute, x_BTD, v1, v2, v3, args, kwargs)


def approx_block(block: torch.nn.Module, kind: BlockKind, recompute: bool, x_BTD: torch.Tensor,
                 v1: torch.Tensor, v2: torch.Tensor, v3: torch.Tensor,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """One block of ``kind`` in approximate mode with the FFN bases ``v1 v2 v3`` (gate, down, up).

    Same value as the block's forward; traceable by dynamo as one graph (no step, no cache, no Python state).
    """
    ff = getattr(block, kind.feed_forward)
    w1, w2, w3 = (getattr(ff, name).weight for name in kind.ffn_linears)
    act = kind.activation(ff)
    attention, attention_norm = getattr(block, kind.attention), getattr(block, kind.attention_norm)
    ffn_norm = getattr(block, kind.ffn_norm)

    def attention_branch(x: torch.Tensor) -> torch.Tensor:
        return kind.run_attention(attention, attention_norm(x), args, kwargs)

    def ffn_gate(h: torch.Tensor) -> torch.Tensor:
        z = ffn_norm(h)
        return act(lowrank_linear(z, w1, v1)) * lowrank_linear(z, w3, v3)

    def ffn_out(gate_BTF: torch.Tensor) -> torch.Tensor:
        # Outside the recomputed region: it keeps gate @ V2 (r wide), so
        # backward never redoes w2's product.
        return lowrank_linear(gate_BTF, w2, v2)

    h_BTD = skip_connected(attention_branch, x_BTD)
    return recomputed_residual(ffn_gate, h_BTD, recompute=recompute, tail=ffn_out)


def component_of(param_name: str) -> str:
    """``attention``, ``ffn`` or ``rest`` for a parameter name of ours or of Hugging Face's Llama."""
    parts = set(param_name.split("."))
    if parts & _ATTENTION_NAMES:
        return "attention"
    if parts & _FFN_NAMES:
        return "ffn"
    return "rest"


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks of a known kind (ours or Hugging Face's Llama), in order."""
    return [m for m in model.modules() if _kind_of(m) is not None]


def has_blocks(model: torch.nn.Module) -> bool:
    """True when :class:`LlamaAdapter` knows ``model``'s blocks (ours or Hugging Face's Llama)."""
    return any(_kind_of(m) is not None for m in model.modules())


def linear_weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The weight of linear ``name`` of ``model``."""
    weight = model.get_submodule(name).weight
    assert isinstance(weight, torch.Tensor), f"{name}.weight is not a tensor"
    return weight


def _find_blocks(model: torch.nn.Module) -> list[BlockParts]:
    """Every block of a known kind in ``model`` with its parts' qualified names."""
    found: list[BlockParts] = []
    for name, module in model.named_modules():
        kind = _kind_of(module)
        if kind is None:
            continue
        p = f"{name}." if name else ""
        found.append(BlockParts(
            kind=kind, index=len(found), block=name, attention=f"{p}{kind.attention}",
            attention_norm=f"{p}{kind.attention_norm}", ffn_norm=f"{p}{kind.ffn_norm}",
            feed_forward=f"{p}{kind.feed_forward}",
            ffn_linears=tuple(f"{p}{kind.feed_forward}.{w}" for w in kind.ffn_linears),
        ))
    if not found:
        raise NoAdapter(f"{type(model).__name__} has no TransformerBlock or LlamaDecoderLayer; "
                        "LlamaAdapter needs a LLaMA-shaped model")
    return found


def _check_ffn_weights(model: torch.nn.Module, blocks: list[BlockParts], rank: int) -> None:
    """Reject ranks no FFN weight can supply and biases the low-rank path would drop."""
    shapes: dict[str, tuple[int, ...]] = {}
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
    forwards = [f for f in installed if isinstance(f, _BlockForward)]
    if len(forwards) == len(installed):
        switches = {id(f.switch) for f in forwards}
        assert len(switches) == 1, "blocks of one model dispatch through different switches"
        return forwards[0].switch
    assert not any(isinstance(f, _BlockForward) for f in installed), "partially adapted model"
    switch = _Switch()
    for parts in blocks:
        block = model.get_submodule(parts.block)
        block.forward = _BlockForward(block, parts, switch)
    return switch


class ExactOnlyAdapter:
    """Adapter of a model with no known transformer blocks: exact mode only, every parameter in ``rest``.

    Such a model trains under the ``spread`` policy (exact) unchanged; a policy
    that approximates needs :class:`LlamaAdapter`, and :meth:`mode` says so.
    """

    group_names = GROUP_NAMES

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def group_of(self, param_name: str) -> int:
        return 0

    def dropped_in_approx(self, group_name: str) -> bool:
        return False

    def blocks(self) -> list[BlockParts]:
        return []

    def prepare(self, step: int) -> int:
        return 0

    @contextlib.contextmanager
    def mode(self, mode: str, *, step: int) -> Iterator[None]:
        """Exact mode only.

        Raises:
            NoAdapter: ``mode`` is ``approx`` (names the model and the fix).
        """
        if mode != "exact":
            raise NoAdapter(_no_adapter_message(self.model, f"mode {mode!r}"))
        yield


def _no_adapter_message(model: torch.nn.Module, what: str) -> str:
    return (f"{what} needs a MeCeFO adapter, and {type(model).__name__} has no block it knows "
            "(TransformerBlock or LlamaDecoderLayer with self_attn and mlp); train it with "
            "mecefo.policy='spread' (exact), or build the model from such blocks")


def adapter_for(model: torch.nn.Module, *, rank: int, tau: int, approximates: bool,
                policy: str = "") -> LlamaAdapter | ExactOnlyAdapter:
    """:class:`LlamaAdapter` for a LLaMA-shaped model, else :class:`ExactOnlyAdapter`.

    Raises:
        NoAdapter: the model has no known blocks but ``approximates`` (the policy needs approximate mode).
    """
    if has_blocks(model):
        return LlamaAdapter(model, rank=rank, tau=tau)
    if approximates:
        raise NoAdapter(_no_adapter_message(model, f"mecefo.policy={policy!r}"))
    return ExactOnlyAdapter(model)
