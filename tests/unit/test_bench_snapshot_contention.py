"""The snapshot memory studies (``benchmarks/``): contention (the snapshotter's reader writes the staged bytes
exactly) and first writes."""

from __future__ import annotations

import mmap

import pytest
import torch

from benchmarks.snapshot_contention import _torch_reader, contention
from unbroken.snapshot.staging import Staging

pytestmark = pytest.mark.timeout(60)


def test_both_readers_copy_the_staged_ranges_exactly_into_a_mapping():
    data = torch.arange(3000, dtype=torch.int64).to(torch.uint8)
    staged = Staging(3000, block=256)  # in blocks: the reads cross their edges
    for piece, before in staged.pieces(0, 3000):
        piece.copy_(data[before:before + piece.numel()])
    # two staged ranges of the flat state, [100, 1100) at 0 and [2000, 4000) at 1000
    index = [(100, 1100, 0), (2000, 4000, 1000)]
    with mmap.mmap(-1, 700) as mem:
        view = memoryview(mem)
        staged.reader(index)(view[:600], 2100, 2700)
        assert bytes(view[:600]) == bytes(data[1100:1700].numpy())
        _torch_reader(staged)(view[600:700], 5, 105)
        assert bytes(view[600:700]) == bytes(data[5:105].numpy())
        del view


def test_the_part_reports_each_writer_against_the_loop_alone():
    r = contention(mb=8, threads=1, iters=2000, rounds=2)
    assert set(r["loop_s_rounds"]) == {"alone", "snapshot", "torch_copy"}
    assert all(len(v) == 2 and all(s > 0 for s in v) for v in r["loop_s_rounds"].values())
    assert set(r["slowdown"]) == set(r["write_gb_s"]) == {"snapshot", "torch_copy"}
    assert all(g > 0 for g in r["write_gb_s"].values())


def test_the_first_writes_part_times_both_modes_and_says_which_writes_were_steady():
    from benchmarks.snapshot_first_writes import first_writes

    r = first_writes(mb=4, threads=2, writes=3, rounds=2)
    assert (r["write_threads"], r["state_mb"], r["writes"], r["rounds"]) == (2, 4, 3, 2)
    # in turn, each buffer is mapped by its own first write: the third write is the first steady one
    assert r["in_turn"]["steady"] == [False, False, True] and r["in_turn"]["first_steady_write"] == [3, 3]
    # ahead, the second buffer is mapped beside the first write: the second write is steady unless it still
    # had to wait for that mapping (a loaded machine)
    assert r["map_ahead"]["steady"][0] is False and all(w in (2, 3) for w in r["map_ahead"]["first_steady_write"])
    assert all(len(v) == 3 and all(s > 0 for s in v) for m in ("map_ahead", "in_turn") for v in r[m]["write_s_rounds"])
    assert r["first_two_ratio"] > 0
    assert all(r[m]["longest_python_pause_ms"] > 0 for m in ("map_ahead", "in_turn"))


def test_the_first_writes_part_refuses_an_empty_state():
    from benchmarks.snapshot_first_writes import first_writes

    with pytest.raises(ValueError, match="give --first-writes-mb of at least 1"):
        first_writes(mb=0, threads=2)
