"""The contention part of ``bench snapshot``: the snapshotter's reader writes the staged bytes exactly."""

from __future__ import annotations

import mmap

import pytest
import torch

from unbroken.bench.snapshot_contention import _torch_reader, contention
from unbroken.snapshot.snapshotter import _reader

pytestmark = pytest.mark.timeout(60)


def test_both_readers_copy_the_staged_ranges_exactly_into_a_mapping():
    staged = torch.arange(3000, dtype=torch.int64).to(torch.uint8)
    # two staged ranges of the flat state, [100, 1100) at 0 and [2000, 4000) at 1000
    index = [(100, 1100, 0), (2000, 4000, 1000)]
    with mmap.mmap(-1, 700) as mem:
        view = memoryview(mem)
        _reader(staged, index)(view[:600], 2100, 2700)
        assert bytes(view[:600]) == bytes(staged[1100:1700].numpy())
        _torch_reader(staged)(view[600:700], 5, 105)
        assert bytes(view[600:700]) == bytes(staged[5:105].numpy())
        del view


def test_the_part_reports_each_writer_against_the_loop_alone():
    r = contention(mb=8, threads=1, iters=2000, rounds=2)
    assert set(r["loop_s_rounds"]) == {"alone", "snapshot", "torch_copy"}
    assert all(len(v) == 2 and all(s > 0 for s in v) for v in r["loop_s_rounds"].values())
    assert set(r["slowdown"]) == set(r["write_gb_s"]) == {"snapshot", "torch_copy"}
    assert all(g > 0 for g in r["write_gb_s"].values())
