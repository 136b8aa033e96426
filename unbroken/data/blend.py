"""Blending pre-tokenized sources by weight: ``data.source='{"web/": 0.7, "code.bin": 0.3}'``.

Global row ``g`` (as in :mod:`unbroken.data.sampler`) is assigned to a source
by a binary tree over the sources: at a node whose left group has the share
``p / q`` of its rows (weights as exact fractions), the node's ``i``-th row goes
left iff ``floor((i + 1) p / q) > floor(i p / q)``, and is then the left
group's row ``floor(i p / q)``, else the right group's row ``i - floor((i + 1) p / q)``.
At a leaf, the source's ``j``-th row reads window ``pi_e(j mod n)`` of the
source's own ``n`` windows, ``e = j div n``, with ``pi_e`` the keyed bijection
of :mod:`unbroken.data.shuffle` keyed by ``(seed * 1000003 + source index, e)``.

Invariants:

- Pure: rows depend only on (sources, weights, seed, n_slots, micro_batch,
  seq_len, step, slot, rows); row ranges reassemble exactly.
- Proportional: among the first ``g`` rows, a source of share ``w`` gets
  ``g * w`` rows give or take one per tree level; within a source each epoch
  reads every window once. Memory is O(number of sources).
"""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from unbroken.data.sampler import BatchSampler, _gather, _check_positive
from unbroken.data.shards import ShardedTokens
from unbroken.data.shuffle import shuffled

__all__ = ["Blend", "BlendSampler", "parse_blend"]

_DENOMINATOR = 1 << 20  # weights as fractions of at most 2**20: g * p stays below 2**63 up to 8e12 rows


def parse_blend(source: str) -> dict[str, float] | None:
    """The ``{path: weight}`` of a blend source (a JSON object), or None for any other source.

    Raises:
        ValueError: bad JSON, an empty object, a weight that is not a number >= 0, or weights summing to 0.
    """
    if not source.lstrip().startswith("{"):
        return None
    try:
        spec = json.loads(source)
    except json.JSONDecodeError as e:
        raise ValueError(f"data.source={source!r}: a blend is a JSON object of path: weight ({e}); "
                         'write e.g. \'{"web/": 0.7, "code.bin": 0.3}\'') from e
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"data.source={source!r}: a blend needs at least one path: weight pair")
    for path, w in spec.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0 or w == float("inf"):
            raise ValueError(f"data.source blend weight of {path!r} is {w!r}; give a finite number >= 0")
    if sum(spec.values()) <= 0:
        raise ValueError(f"data.source blend weights {spec} sum to 0; give at least one positive weight")
    return {str(p): float(w) for p, w in spec.items()}


class Blend:
    """Token streams with weights (zero-weight sources dropped); ``len`` is their total."""

    def __init__(self, parts: list[np.ndarray | ShardedTokens], weights: list[float], names: list[str]) -> None:
        kept = [i for i, w in enumerate(weights) if w > 0]
        self.parts = [parts[i] for i in kept]
        self.weights = [weights[i] for i in kept]
        self.names = [names[i] for i in kept]

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)


def _tree(indices: list[int], weights: list[float]) -> Any:
    """A leaf (source index) or ``(p, q, left, right)``: the left group's share ``p / q`` of the node's rows."""
    if len(indices) == 1:
        return indices[0]
    half = len(indices) // 2
    left = sum(weights[i] for i in indices[:half])
    share = Fraction(left / (left + sum(weights[i] for i in indices[half:]))).limit_denominator(_DENOMINATOR)
    return (share.numerator, share.denominator, _tree(indices[:half], weights), _tree(indices[half:], weights))


class BlendSampler:
    """``batch(step, slot, rows)`` over a :class:`Blend` (see the module docstring).

    Raises:
        ValueError: non-positive sizes, or a source with fewer than one window.
    """

    def __init__(self, blend: Blend, *, seed: int, n_slots: int, micro_batch: int, seq_len: int) -> None:
        _check_positive(seq_len=seq_len, micro_batch=micro_batch, n_slots=n_slots)
        self.blend, self.seed, self.n_slots = blend, int(seed), int(n_slots)
        self.micro_batch, self.seq_len = int(micro_batch), int(seq_len)
        self.n_windows = [(len(p) - 1) // self.seq_len for p in blend.parts]
        for name, n in zip(blend.names, self.n_windows):
            if n < 1:
                raise ValueError(f"blend source {name}: fewer than seq_len + 1 = {seq_len + 1} tokens; "
                                 "drop it or give it more data")
        self._root = _tree(list(range(len(blend.parts))), blend.weights)

    @property
    def tokens_per_step(self) -> int:
        return self.n_slots * self.micro_batch * self.seq_len

    def assign(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, row within the source) of global rows ``g``."""
        source, index = np.empty(len(g), np.int64), np.asarray(g, np.int64).copy()
        stack = [(self._root, np.arange(len(g)))]
        while stack:
            node, at = stack.pop()
            if isinstance(node, int):
                source[at] = node
                continue
            p, q, left, right = node
            i = index[at]
            before, after = (i * p) // q, ((i + 1) * p) // q
            goes_left = after > before
            index[at] = np.where(goes_left, before, i - after)
            stack += [(left, at[goes_left]), (right, at[~goes_left])]
        return source, index

    def batch(self, step: int, slot: int, rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (int64) of rows ``[a, b)`` (default: all) of ``(step, slot)``.

        Raises:
            ValueError: a bad step, slot or row range.
        """
        a, b = (0, self.micro_batch) if rows is None else (int(rows[0]), int(rows[1]))
        if step < 0 or not 0 <= slot < self.n_slots or not 0 <= a < b <= self.micro_batch:
            raise ValueError(f"batch(step={step}, slot={slot}, rows={rows}): need step >= 0, "
                             f"0 <= slot < {self.n_slots}, 0 <= a < b <= {self.micro_batch}")
        g = (int(step) * self.n_slots + int(slot)) * self.micro_batch + np.arange(a, b, dtype=np.int64)
        source, index = self.assign(g)
        x = torch.empty((b - a, self.seq_len), dtype=torch.int64)
        y = torch.empty_like(x)
        for s in np.unique(source).tolist():
            at = np.flatnonzero(source == s)
            epochs, pos = np.divmod(index[at], self.n_windows[s])
            windows = np.empty(len(at), np.int64)
            for e in np.unique(epochs).tolist():
                mask = epochs == e
                windows[mask] = shuffled(pos[mask], self.n_windows[s], self.seed * 1000003 + s, e)
            xs, ys = _gather(self.blend.parts[s], windows, self.seq_len)
            x[torch.from_numpy(at)], y[torch.from_numpy(at)] = xs, ys
        return x, y


def training_sampler(tokens: np.ndarray | ShardedTokens | Blend, *, seed: int, n_slots: int, micro_batch: int,
                     seq_len: int) -> BatchSampler | BlendSampler:
    """The sampler of a token stream, or of a weighted blend of several (same ``batch(step, slot, rows)``)."""
    if isinstance(tokens, Blend):
        return BlendSampler(tokens, seed=seed, n_slots=n_slots, micro_batch=micro_batch, seq_len=seq_len)
    return BatchSampler(tokens, seed=seed, n_slots=n_slots, micro_batch=micro_batch, seq_len=seq_len)
