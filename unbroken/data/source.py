"""Training data a user brings: a source answering ``batch(step, slot, rows)``, or a map-style dataset of token rows.

The step protocol needs any worker to compute any rows of any slot of any
step, and a slot's rows split into ranges that reassemble exactly; so the
rows of ``(step, slot)`` must be a pure function of ``(step, slot, rows)``.

- A :class:`DataSource` promises exactly that itself (checked across workers on
  the first step, :mod:`unbroken.job.consistency`).
- A map-style dataset (``len(ds)`` and ``ds[i]``, each row ``seq_len + 1``
  token ids) is wrapped by :class:`MapDatasetSource`, which reads it in a
  seeded order: global row ``g = (step * n_slots + slot) * micro_batch + r`` is
  row ``pi_e(g mod N)`` of epoch ``e = g div N``, where ``pi_e`` is the
  permutation of the ``N`` rows keyed by ``(seed, e)``
  (:func:`unbroken.data.shuffle.shuffled`, computed per row in O(1) memory);
  every epoch visits every row once. Row ``i`` gives inputs ``ds[i][:-1]`` and targets ``ds[i][1:]``.

Invariant: ``batch(step, slot, (a, b))`` stacked over a partition of
``[0, micro_batch)`` equals ``batch(step, slot, (0, micro_batch))``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from unbroken.data.shuffle import shuffled

__all__ = ["DataSource", "MapDatasetSource", "as_source"]

@runtime_checkable
class DataSource(Protocol):
    """Rows ``[a, b)`` of slot ``slot``'s micro-batch of step ``step``, as ``(inputs_BT, targets_BT)`` int64.

    Must be deterministic: every worker, and every call, gives the same rows.
    Optionally a source may also define ``validation_batch(index) -> (inputs, targets)``
    (the run then reports a validation loss over ``train.val_batches`` of them).
    """

    def batch(self, step: int, slot: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        ...


class MapDatasetSource:
    """A map-style dataset of token rows, read in a seeded order (see the module docstring).

    Raises:
        ValueError: an empty dataset, or one whose rows are not 1-D sequences of at least 2 token ids.
    """

    def __init__(self, dataset: Any, *, seed: int, n_slots: int, micro_batch: int) -> None:
        n = len(dataset)
        if n < 1:
            raise ValueError("the dataset returned by data.factory is empty; give at least one row")
        self.dataset, self.seed, self.n_slots, self.micro_batch, self.n_rows = dataset, seed, n_slots, micro_batch, n
        self.vocab_size: int | None = getattr(dataset, "vocab_size", None)
        first = _row(dataset, 0)
        self.seq_len = int(first.numel()) - 1

    @property
    def tokens_per_step(self) -> int:
        return self.n_slots * self.micro_batch * self.seq_len

    def batch(self, step: int, slot: int, rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[a, b)`` (default: all) of ``(step, slot)``.

        Raises:
            ValueError: a bad step, slot or row range; a row of another length than the first.
        """
        a, b = (0, self.micro_batch) if rows is None else (int(rows[0]), int(rows[1]))
        if step < 0 or not 0 <= slot < self.n_slots or not 0 <= a < b <= self.micro_batch:
            raise ValueError(f"batch(step={step}, slot={slot}, rows={rows}): need step >= 0, "
                             f"0 <= slot < {self.n_slots}, 0 <= a < b <= {self.micro_batch}")
        g = (step * self.n_slots + slot) * self.micro_batch + np.arange(a, b, dtype=np.int64)
        epochs, pos = np.divmod(g, self.n_rows)
        picked = np.empty(len(g), dtype=np.int64)
        for e in np.unique(epochs):  # a micro-batch straddles at most a few epochs
            mask = epochs == e
            picked[mask] = shuffled(pos[mask], self.n_rows, self.seed, int(e))
        rows_BT = torch.stack([_row(self.dataset, i, self.seq_len + 1) for i in picked.tolist()])
        return rows_BT[:, :-1].contiguous(), rows_BT[:, 1:].contiguous()


def _row(dataset: Any, i: int, length: int | None = None) -> torch.Tensor:
    row = torch.from_numpy(np.asarray(dataset[i]).astype(np.int64)).reshape(-1)  # astype copies
    if row.numel() < 2 or (length is not None and row.numel() != length):
        want = f"{length}" if length is not None else "at least 2"
        raise ValueError(f"row {i} of the dataset has {row.numel()} token ids; every row needs {want} "
                         "(seq_len + 1: inputs and the next-token targets)")
    return row


def as_source(data: Any, *, seed: int, n_slots: int, micro_batch: int) -> DataSource:
    """``data`` itself when it answers ``batch``; a :class:`MapDatasetSource` when it is a map-style dataset.

    Raises:
        ValueError: ``data`` is neither (names its type and what is accepted).
    """
    if callable(getattr(data, "batch", None)):
        return data
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return MapDatasetSource(data, seed=seed, n_slots=n_slots, micro_batch=micro_batch)
    raise ValueError(f"data.factory returned a {type(data).__name__}; return an object with "
                     "batch(step, slot, rows) -> (inputs, targets), or a map-style dataset of token rows "
                     "(len() and [i])")
