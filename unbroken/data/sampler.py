"""Batch samplers: ``batch(step, slot)`` as a pure function.

The token stream is cut into ``n_windows = (len(tokens) - 1) // seq_len``
non-overlapping windows of ``seq_len + 1`` tokens with stride ``seq_len``:
window ``w`` covers tokens ``[w * seq_len, w * seq_len + seq_len + 1)``, its
first ``seq_len`` tokens are the inputs and its last ``seq_len`` the targets.

Row ``r`` of the micro-batch of ``(step, slot)`` has the global index
``g = (step * n_slots + slot) * micro_batch + r``, lies in epoch
``e = g // n_windows`` at position ``g % n_windows``, and reads window
``pi_e(g % n_windows)``, where ``pi_e`` is the permutation of the windows
keyed by ``(seed, e)`` (:func:`unbroken.data.shuffle.shuffled`, a Feistel
network with cycle-walking): computed for the rows asked for, never stored, so
a sampler costs O(1) memory whatever the corpus size.

Invariants (what the fault-tolerant runtime builds on):

- ``batch(step, slot)`` depends only on (tokens, seed, n_slots, micro_batch,
  seq_len, step, slot): any process computes the same rows, and training
  resumes at any step with no sampler state to save.
- Within one epoch distinct ``(step, slot, row)`` triples read distinct
  windows, so no sample is seen twice per epoch.
- Rows can be split: ``batch(s, k, (0, a))`` and ``batch(s, k, (a, B))``
  concatenated equal ``batch(s, k)`` exactly, so a dead slot's micro-batch can
  be shared among survivors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from unbroken.data.shards import ShardedTokens
from unbroken.data.shuffle import shuffled, shuffled_range


def _check_tokens(tokens: np.ndarray | ShardedTokens) -> None:
    if isinstance(tokens, ShardedTokens):
        return
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype.kind not in "ui":
        raise ValueError(f"tokens must be a 1-D integer numpy array, got "
                         f"{type(tokens).__name__} {getattr(tokens, 'dtype', '')} {getattr(tokens, 'shape', '')}")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _gather(tokens: np.ndarray | ShardedTokens, windows: np.ndarray,
            seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (int64, ``[len(windows), seq_len]``) of the given windows."""
    # A window is a contiguous run of tokens: one slice copy each beats fancy indexing several times over.
    rows = np.empty((len(windows), seq_len + 1), dtype=np.int64)
    read = tokens.read if isinstance(tokens, ShardedTokens) else (lambda a, b: tokens[a:b])
    for i, w in enumerate(windows.tolist()):
        rows[i] = read(w * seq_len, w * seq_len + seq_len + 1)
    rows_BT = torch.from_numpy(rows)
    return rows_BT[:, :-1].contiguous(), rows_BT[:, 1:].contiguous()


class BatchSampler:
    """Deterministic, stateless training batches per (step, slot).

    Args:
        tokens: the training token stream (1-D integer array, memmap welcome, or a
            :class:`~unbroken.data.shards.ShardedTokens` over many shards).
        seed: selects the shuffling of every epoch.
        n_slots: data-parallel slots per step.
        micro_batch: rows per (step, slot).
        seq_len: tokens per row.

    Raises:
        ValueError: a non-positive size, or fewer than ``n_slots *
            micro_batch`` windows in ``tokens``.
    """

    def __init__(self, tokens: np.ndarray | ShardedTokens, *, seed: int, n_slots: int, micro_batch: int,
                 seq_len: int) -> None:
        _check_tokens(tokens)
        _check_positive(seq_len=seq_len, micro_batch=micro_batch, n_slots=n_slots)
        self.tokens = tokens
        self.seed = int(seed)
        self.n_slots = int(n_slots)
        self.micro_batch = int(micro_batch)
        self.seq_len = int(seq_len)
        self._n_windows = max(0, (len(tokens) - 1) // self.seq_len)
        rows_per_step = self.n_slots * self.micro_batch
        if self._n_windows < rows_per_step:
            raise ValueError(
                f"corpus too small: {len(tokens)} tokens give {self._n_windows} windows of seq_len={seq_len}, "
                f"but one global batch needs {rows_per_step} (n_slots={n_slots} x micro_batch={micro_batch}), "
                f"i.e. at least {rows_per_step * self.seq_len + 1} tokens; use more data or smaller sizes")

    @property
    def n_windows(self) -> int:
        """Windows per epoch."""
        return self._n_windows

    @property
    def tokens_per_step(self) -> int:
        """Input tokens in one global batch (all slots)."""
        return self.n_slots * self.micro_batch * self.seq_len

    def _row_range(self, rows: tuple[int, int] | None) -> tuple[int, int]:
        if rows is None:
            return 0, self.micro_batch
        try:
            a, b = (int(v) for v in rows)
        except (TypeError, ValueError) as e:
            raise ValueError(f"rows must be a pair (a, b) of ints, got {rows!r}") from e
        if not 0 <= a < b <= self.micro_batch:
            raise ValueError(f"rows {rows!r} must satisfy 0 <= a < b <= micro_batch={self.micro_batch} "
                             "(a non-empty range)")
        return a, b

    def windows(self, step: int, slot: int, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Window ids of rows ``[a, b)`` (default: all rows) of ``(step, slot)``.

        Raises:
            ValueError: ``step < 0``, ``slot`` outside ``[0, n_slots)``, or a bad row range.
        """
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.n_slots:
            raise ValueError(f"slot must be an integer in [0, {self.n_slots}), got {slot!r}")
        a, b = self._row_range(rows)
        g0 = (int(step) * self.n_slots + int(slot)) * self.micro_batch + a
        e0, p0 = divmod(g0, self._n_windows)
        if p0 + (b - a) <= self._n_windows:  # the common case: all rows in one epoch
            return shuffled_range(p0, p0 + b - a, self._n_windows, self.seed, e0)
        g = g0 + np.arange(b - a, dtype=np.int64)
        epochs, pos = np.divmod(g, self._n_windows)
        out = np.empty(len(g), dtype=np.int64)
        for e in np.unique(epochs):  # a micro-batch straddles at most a few epochs
            mask = epochs == e
            out[mask] = shuffled(pos[mask], self._n_windows, self.seed, int(e))
        return out

    def batch(self, step: int, slot: int, rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs ``x_BT`` and targets ``y_BT`` (int64) of ``(step, slot)``, rows ``[a, b)`` if given.

        ``y_BT[:, t]`` is the token following ``x_BT[:, t]``.
        """
        return _gather(self.tokens, self.windows(step, slot, rows), self.seq_len)

    @staticmethod
    def split_rows(micro_batch_rows: int, parts: int) -> list[tuple[int, int]]:
        """Cut ``micro_batch_rows`` rows into ``parts`` contiguous near-equal ranges.

        The first ``micro_batch_rows % parts`` ranges get one row more. When
        ``parts > micro_batch_rows`` the trailing ranges are empty (``a == b``);
        callers skip those, since ``batch`` accepts only non-empty ranges.

        Raises:
            ValueError: ``parts < 1`` or ``micro_batch_rows < 1``.
        """
        _check_positive(parts=parts, micro_batch_rows=micro_batch_rows)
        base, extra = divmod(int(micro_batch_rows), int(parts))
        ranges, a = [], 0
        for i in range(parts):
            b = a + base + (1 if i < extra else 0)
            ranges.append((a, b))
            a = b
        return ranges


class ValidationSampler:
    """Fixed validation batches: the first windows of the validation split, in order.

    Batch ``i`` holds windows ``[i * batch_size, (i + 1) * batch_size)``. A
    last partial batch is dropped so every batch has the same shape.

    Args:
        tokens: the validation token stream.
        seq_len: tokens per row.
        batch_size: rows per batch.
        max_batches: use at most this many batches (None: all full batches).

    Raises:
        ValueError: non-positive sizes, or fewer than ``batch_size`` windows.
    """

    def __init__(self, tokens: np.ndarray | ShardedTokens, *, seq_len: int, batch_size: int,
                 max_batches: int | None = None) -> None:
        _check_tokens(tokens)
        _check_positive(seq_len=seq_len, batch_size=batch_size)
        if max_batches is not None:
            _check_positive(max_batches=max_batches)
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        n_windows = max(0, (len(tokens) - 1) // self.seq_len)
        available = n_windows // self.batch_size
        if available == 0:
            raise ValueError(f"validation split too small: {len(tokens)} tokens give {n_windows} windows of "
                             f"seq_len={seq_len}, one batch needs {batch_size} "
                             f"(at least {batch_size * self.seq_len + 1} tokens); raise val_fraction")
        self.n_batches = available if max_batches is None else min(available, int(max_batches))

    def __len__(self) -> int:
        return self.n_batches

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of validation batch ``i`` (``0 <= i < len(self)``)."""
        if not isinstance(i, (int, np.integer)) or not 0 <= i < self.n_batches:
            raise ValueError(f"validation batch index must be in [0, {self.n_batches}), got {i!r}")
        windows = np.arange(i * self.batch_size, (i + 1) * self.batch_size, dtype=np.int64)
        return _gather(self.tokens, windows, self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.n_batches):
            yield self.batch(i)
