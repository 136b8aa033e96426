"""How a model is made fast from outside: activation checkpointing, then ``torch.compile``, per block.

As torchtitan's ``parallelize_llama``: the model code stays plain and one
recipe, applied once when a job is built (before MeCeFO's adapter installs its
dispatch), wraps each transformer block's forward:

1. activation checkpointing (``train.activation_checkpointing``): ``full``
   recomputes every block's activations in the backward pass, ``selective``
   every second block (torchtitan's per-layer selective), ``none`` keeps them;
2. ``torch.compile`` (``train.compile``) of that forward. The adapter then
   calls it for exact micro-batches; its approximate mode (skipped attention
   backward, recomputed FFN, low-rank FFN gradients) is compiled too, as a
   graph of its own (:mod:`unbroken.mecefo.compiled`: the model is marked
   here, the adapter built on it later compiles), so switching modes never
   recompiles; a block whose approximation cannot compile runs it eager.

Invariants: applied at most once per model; the parameters are the model's own
(nothing is copied or re-registered, an optimizer or a state transfer sees the
same tensors); a model with no known blocks is compiled whole, and refuses
activation checkpointing. Recompilation is bounded: shapes that change with
the rows a worker computes (a takeover splits a slot's rows) make dynamo mark
the batch dimension dynamic after the second size; :func:`compile_stats`
counts the frames compiled.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import shutil
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from unbroken.mecefo.adapter import transformer_blocks
from unbroken.mecefo.compiled import compile_approximations

__all__ = ["AC_MODES", "check_compile_toolchain", "compile_stats", "parallelize", "resolve_compile"]

logger = logging.getLogger(__name__)

AC_MODES = ("none", "selective", "full")
_APPLIED = "_unbroken_parallelized"


def resolve_compile(choice: bool | None, device: torch.device) -> bool:
    """``train.compile``: None means on for CUDA, off elsewhere."""
    return device.type == "cuda" if choice is None else bool(choice)


def check_compile_toolchain(device_type: str) -> None:
    """Refuse ``train.compile`` where inductor cannot build kernels, before any worker starts.

    Raises:
        ValueError: no Triton for CUDA, or no C++ compiler for CPU kernels (the fix named).
    """
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ValueError("train.compile is on for CUDA, but Triton is not installed (torch.compile builds GPU "
                         "kernels with it): install the triton that matches your torch, or set train.compile=false")
    if device_type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        raise ValueError("train.compile=true on CPU needs a C++ compiler (g++ or clang++) on PATH for inductor's "
                         "kernels: install one, or set train.compile=false")


def parallelize(model: torch.nn.Module, *, compile: bool, activation_checkpointing: str = "none",
                backend: str = "inductor") -> torch.nn.Module:
    """Apply activation checkpointing, then ``torch.compile``, to each block of ``model`` (in place).

    Returns ``model``. A no-op when neither is asked for, or when already applied.

    Raises:
        ValueError: an unknown activation checkpointing mode, or one asked of a model without known blocks.
    """
    if activation_checkpointing not in AC_MODES:
        raise ValueError(f"train.activation_checkpointing={activation_checkpointing!r}: expected one of "
                         f"{', '.join(AC_MODES)}")
    if getattr(model, _APPLIED, False) or (not compile and activation_checkpointing == "none"):
        return model
    blocks = transformer_blocks(model)
    if not blocks:
        if activation_checkpointing != "none":
            raise ValueError(f"train.activation_checkpointing={activation_checkpointing!r} needs transformer "
                             f"blocks (our LLaMA or Hugging Face's); {type(model).__name__} has none: set it to none")
        if compile:
            model.compile(backend=backend)
    for i, block in enumerate(blocks):
        if "forward" in block.__dict__:
            raise AssertionError("parallelize runs before anything installs a forward on a block")
        forward: Callable[..., Any] = block.forward
        if activation_checkpointing == "full" or (activation_checkpointing == "selective" and i % 2 == 0):
            forward = _checkpointed(forward)
        if compile:
            forward = torch.compile(forward, backend=backend)
        block.forward = forward
    if compile and blocks:
        compile_approximations(model, backend=backend)
    setattr(model, _APPLIED, True)
    logger.info("blocks: %d, activation checkpointing %s, compile %s", len(blocks), activation_checkpointing,
                f"on ({backend})" if compile else "off")
    return model


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def compile_stats() -> dict[str, int]:
    """Frames torch.compile has compiled in this process (a recompile is one more), graph breaks, and graphs
    captured (``graphs``: unlike ``compiled_frames`` it counts ``fullgraph`` compiles too, such as MeCeFO's
    approximate blocks, which dynamo leaves out of its frame count)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return {}
    return {"compiled_frames": int(sum(counters["frames"].get(k, 0) for k in ("ok",))),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "graphs": int(counters["stats"].get("unique_graphs", 0))}
