"""batch(step, slot): purity, epoch coverage, row splits, validation batches, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unbroken.data import BatchSampler, ValidationSampler
from unbroken.data.shuffle import shuffled

pytestmark = pytest.mark.timeout(120)


def _tokens(n: int = 1001, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 500, size=n).astype(np.uint16)


def _sampler(tokens: np.ndarray | None = None, **kw: int) -> BatchSampler:
    args = dict(seed=7, n_slots=3, micro_batch=4, seq_len=10) | kw
    return BatchSampler(_tokens() if tokens is None else tokens, **args)


def test_window_layout_and_sizes() -> None:
    s = _sampler()
    assert s.n_windows == 100  # (1001 - 1) // 10
    assert s.tokens_per_step == 3 * 4 * 10
    tokens = np.arange(41, dtype=np.uint32)
    s = BatchSampler(tokens, seed=0, n_slots=1, micro_batch=4, seq_len=10)
    x, y = s.batch(0, 0)
    for row, w in zip(x, s.windows(0, 0)):
        assert row.tolist() == list(range(w * 10, w * 10 + 10))  # window w starts at w * seq_len


def test_same_inputs_same_rows_across_instances() -> None:
    a, b = _sampler(), _sampler(tokens=_tokens().copy())
    for step in (0, 1, 8, 123):
        for slot in range(3):
            xa, ya = a.batch(step, slot)
            xb, yb = b.batch(step, slot)
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_resumes_at_any_step_without_state() -> None:
    a = _sampler()
    ahead = [a.batch(s, 1)[0] for s in range(20)]
    fresh = _sampler()
    assert torch.equal(fresh.batch(13, 1)[0], ahead[13])


def test_shapes_dtype_and_targets_shifted() -> None:
    tokens = _tokens()
    s = _sampler(tokens)
    x, y = s.batch(5, 2)
    assert x.shape == y.shape == (4, 10) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y, w in zip(x, y, s.windows(5, 2)):
        assert row_y[-1].item() == tokens[w * 10 + 10]
        assert row_x.tolist() == tokens[w * 10: w * 10 + 10].tolist()


def test_epoch_covers_every_window_exactly_once() -> None:
    s = BatchSampler(_tokens(601), seed=3, n_slots=3, micro_batch=5, seq_len=10)  # 60 windows, 15 rows/step
    seen = [w for step in range(4) for slot in range(3) for w in s.windows(step, slot)]
    assert sorted(seen) == list(range(60))


def test_epochs_straddle_and_reshuffle() -> None:
    s = BatchSampler(_tokens(71), seed=3, n_slots=2, micro_batch=2, seq_len=10)  # 7 windows, 4 rows/step
    rows = np.concatenate([s.windows(step, slot) for step in range(7) for slot in range(2)])  # 28 rows = 4 epochs
    epochs = rows.reshape(4, 7)
    for e in range(4):
        assert sorted(epochs[e]) == list(range(7))
        assert epochs[e].tolist() == shuffled(np.arange(7), 7, 3, e).tolist()  # the keyed order of epoch e
    assert len({tuple(e) for e in epochs}) > 1


def test_row_ranges_reassemble_exactly() -> None:
    s = _sampler(micro_batch=8)
    x, y = s.batch(3, 1)
    xa, ya = s.batch(3, 1, (0, 3))
    xb, yb = s.batch(3, 1, (3, 8))
    assert torch.equal(torch.cat([xa, xb]), x) and torch.equal(torch.cat([ya, yb]), y)
    for parts in (1, 2, 3, 5, 8):
        pieces = [s.batch(3, 1, r)[0] for r in BatchSampler.split_rows(8, parts)]
        assert torch.equal(torch.cat(pieces), x)


def test_split_rows() -> None:
    assert BatchSampler.split_rows(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert BatchSampler.split_rows(7, 7) == [(i, i + 1) for i in range(7)]
    assert BatchSampler.split_rows(5, 1) == [(0, 5)]
    assert BatchSampler.split_rows(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]  # empty tails for callers to skip
    with pytest.raises(ValueError, match="parts"):
        BatchSampler.split_rows(8, 0)


def test_different_seeds_different_order() -> None:
    a, b = _sampler(seed=1), _sampler(seed=2)
    assert not np.array_equal(np.concatenate([a.windows(0, k) for k in range(3)]),
                              np.concatenate([b.windows(0, k) for k in range(3)]))


def test_distinct_slots_disjoint_within_step() -> None:
    s = _sampler()
    ws = [set(s.windows(4, k).tolist()) for k in range(3)]
    assert not (ws[0] & ws[1] or ws[0] & ws[2] or ws[1] & ws[2])


def test_memmap_tokens(tmp_path) -> None:
    tokens = _tokens()
    tokens.tofile(tmp_path / "t.bin")
    mm = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
    assert torch.equal(_sampler(mm).batch(2, 0)[0], _sampler(tokens).batch(2, 0)[0])


@pytest.mark.parametrize("kw, match", [
    (dict(seq_len=0), "seq_len must be an integer >= 1, got 0"),
    (dict(micro_batch=0), "micro_batch must be"),
    (dict(n_slots=-1), "n_slots must be"),
    (dict(micro_batch=40), r"corpus too small: 1001 tokens give 100 windows.*needs 120.*at least 1201 tokens"),
])
def test_bad_construction(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _sampler(**kw)


def test_bad_tokens() -> None:
    with pytest.raises(ValueError, match="1-D integer"):
        _sampler(tokens=np.zeros((10, 10), dtype=np.uint16))
    with pytest.raises(ValueError, match="1-D integer"):
        _sampler(tokens=np.zeros(1000, dtype=np.float32))


@pytest.mark.parametrize("args, match", [
    ((-1, 0), "step must be an integer >= 0, got -1"),
    ((0, 3), r"slot must be an integer in \[0, 3\), got 3"),
    ((0, -1), "slot must be"),
    ((0, 0, (2, 2)), "non-empty"),
    ((0, 0, (3, 5)), "micro_batch=4"),
    ((0, 0, (-1, 2)), "0 <= a < b"),
    ((0, 0, (1,)), "pair"),
])
def test_bad_batch_arguments(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _sampler().batch(*args)


def test_validation_sampler_is_fixed_and_in_order() -> None:
    tokens = np.arange(95, dtype=np.uint16)
    v = ValidationSampler(tokens, seq_len=10, batch_size=4)  # 9 windows -> 2 full batches
    assert len(v) == 2
    batches = list(v)
    assert batches[0][0][0].tolist() == list(range(10))
    assert batches[1][0][0].tolist() == list(range(40, 50))
    assert torch.equal(batches[1][1][-1], torch.arange(71, 81))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, ValidationSampler(tokens, seq_len=10, batch_size=4)))
    assert len(ValidationSampler(tokens, seq_len=10, batch_size=4, max_batches=1)) == 1
    with pytest.raises(ValueError, match="validation split too small: 95 tokens give 9 windows"):
        ValidationSampler(tokens, seq_len=10, batch_size=10)
    with pytest.raises(ValueError, match="index"):
        v.batch(2)
