"""Blended sources: a pure, proportional assignment of rows to sources, each source's epoch read once, bad weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from unbroken.data import BatchSampler
from unbroken.data.blend import training_sampler
from unbroken.data.blend import Blend, BlendSampler, parse_blend
from unbroken.data.prepare import prepare_data

pytestmark = pytest.mark.timeout(60)


def _blend(sizes: list[int], weights: list[float]) -> Blend:
    # Source s holds tokens s * 1000 + position, so every row tells where it came from.
    return Blend([np.arange(s * 1000, s * 1000 + n, dtype=np.int64) for s, n in enumerate(sizes)], weights,
                 [f"s{s}" for s in range(len(sizes))])


def _reference_source(g: int, shares: list[tuple[int, int]]) -> int:
    """Two-level tree over three sources, by hand: root splits {0} | {1, 2} at 2/10, the right node {1} | {2} at 3/8."""
    (p, q), (p2, q2) = shares
    if (g + 1) * p // q > g * p // q:
        return 0
    i = g - (g + 1) * p // q
    return 1 if (i + 1) * p2 // q2 > i * p2 // q2 else 2


def test_rows_go_to_sources_in_proportion() -> None:
    s = BlendSampler(_blend([401, 801, 1601], [0.2, 0.3, 0.5]), seed=1, n_slots=2, micro_batch=5, seq_len=4)
    source, _ = s.assign(np.arange(1000))
    assert source.tolist() == [_reference_source(g, [(1, 5), (3, 8)]) for g in range(1000)]
    assert np.bincount(source).tolist() == [200, 300, 500]


def test_each_source_reads_every_window_once_per_epoch() -> None:
    s = BlendSampler(_blend([41, 81], [0.5, 0.5]), seed=3, n_slots=2, micro_batch=5, seq_len=4)  # 10 and 20 windows
    x = torch.cat([s.batch(step, slot)[0] for step in range(4) for slot in range(2)])  # 40 rows: 20 from each
    starts = x[:, 0].tolist()
    for src, n in ((0, 10), (1, 20)):
        mine = [t - src * 1000 for t in starts if src * 1000 <= t < src * 1000 + 1000]
        assert len(mine) == 20
        epochs = [mine[i:i + n] for i in range(0, 20, n)]
        assert all(sorted(e) == list(range(0, 4 * n, 4)) for e in epochs)


def test_pure_and_row_ranges_reassemble() -> None:
    a = BlendSampler(_blend([401, 801], [0.7, 0.3]), seed=9, n_slots=3, micro_batch=8, seq_len=4)
    b = BlendSampler(_blend([401, 801], [0.7, 0.3]), seed=9, n_slots=3, micro_batch=8, seq_len=4)
    x, y = a.batch(7, 2)
    assert torch.equal(x, b.batch(7, 2)[0]) and torch.equal(x[:, 1:], y[:, :-1])
    parts = [a.batch(7, 2, r) for r in BatchSampler.split_rows(8, 3)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)


def test_prepare_data_blends_token_files(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.full(801, 7, dtype=np.uint16))
    np.save(tmp_path / "b.npy", np.full(801, 9, dtype=np.uint16))
    spec = json.dumps({str(tmp_path / "a.npy"): 3, str(tmp_path / "b.npy"): 1})
    data = prepare_data(source=spec, vocab_size=16, val_fraction=0.1)
    sampler = training_sampler(data.train, seed=0, n_slots=2, micro_batch=8, seq_len=8)
    assert isinstance(sampler, BlendSampler)
    firsts = torch.cat([sampler.batch(step, k)[0][:, 0] for step in range(4) for k in range(2)])
    assert (firsts == 7).sum().item() == 48 and (firsts == 9).sum().item() == 16


@pytest.mark.parametrize("source, match", [
    ('{"a.bin": -1, "b.bin": 2}', "weight of 'a.bin' is -1; give a finite number >= 0"),
    ('{"a.bin": 0, "b.bin": 0}', "sum to 0; give at least one positive weight"),
    ('{"a.bin": "x"}', "weight of 'a.bin' is 'x'"),
    ('{"a.bin": 1', "a blend is a JSON object of path: weight"),
    ("{}", "needs at least one path: weight pair"),
])
def test_bad_blends_refused(source: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_blend(source)


def test_text_source_in_a_blend_refused(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a .bin/.npy token file or a shard directory"):
        prepare_data(source=json.dumps({str(tmp_path / "t"): 1.0}))
