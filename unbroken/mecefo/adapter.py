"""Model adapter: which submodules of a model are attention and which are FFN.

The MeCeFO approximations reach a model only through this adapter, so model code
stays free of fault-tolerance concerns. Switching a micro-batch between exact
and approximate mode is a context manager; it never rebuilds or copies the model.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch

GROUP_NAMES = ("rest", "attention")


class ModelAdapter(Protocol):
    """What the gradient code needs to know about a model."""

    group_names: tuple[str, ...]

    def group_of(self, param_name: str) -> int:
        """Index into ``group_names`` of the aggregation group of a parameter."""

    def dropped_in_approx(self, group_name: str) -> bool:
        """True when approximate mode leaves this group without gradient."""

    def mode(self, mode: str, *, step: int) -> contextlib.AbstractContextManager[None]:
        """Run forward and backward of one micro-batch in ``mode``."""


class LlamaAdapter:
    """Adapter for :mod:`unbroken.models.llama` (exact mode)."""

    group_names = GROUP_NAMES

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def group_of(self, param_name: str) -> int:
        return 1 if component_of(param_name) == "attention" else 0

    def dropped_in_approx(self, group_name: str) -> bool:
        return group_name == "attention"

    @contextlib.contextmanager
    def mode(self, mode: str, *, step: int) -> Iterator[None]:
        if mode != "exact":
            raise ValueError(f"mode {mode!r} is not supported by this adapter; use 'exact'")
        yield


def component_of(param_name: str) -> str:
    """``attention``, ``ffn`` or ``rest`` for a LLaMA parameter name."""
    parts = param_name.split(".")
    if "attention" in parts or "attention_norm" in parts:
        return "attention"
    if "feed_forward" in parts:
        return "ffn"
    return "rest"
