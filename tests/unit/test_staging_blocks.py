"""The staging buffer in blocks (:mod:`unbroken.snapshot.staging`): bytes cross block boundaries exactly,
both ways, and a landing copies a block at a time."""

from __future__ import annotations

import pytest
import torch

from unbroken.snapshot.staging import Staging

pytestmark = pytest.mark.timeout(60)


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(37, generator=gen), "b": torch.randint(0, 100, (11, 3), generator=gen),
            "c": torch.randn(5, generator=gen).to(torch.bfloat16)}


def _flat(state: dict[str, torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in state.values())


def test_blocks_cover_the_buffer_and_pieces_split_at_their_edges():
    s = Staging(100, block=32)
    assert [b.numel() for b in s.blocks] == [32, 32, 32, 4]
    assert [(p.numel(), before) for p, before in s.pieces(30, 40)] == [(2, 0), (32, 2), (6, 34)]
    assert [(p.numel(), before) for p, before in s.pieces(64, 36)] == [(32, 0), (4, 32)]
    assert list(s.pieces(50, 0)) == []
    assert Staging(0).blocks == []
    with pytest.raises(ValueError, match=r"bytes \[90, 101\) of a 100-byte staging buffer"):
        list(s.pieces(90, 11))
    with pytest.raises(ValueError, match="in blocks of 0"):
        Staging(10, block=0)


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 20])
def test_ranges_of_the_flat_state_staged_in_blocks_read_back_exactly(block: int):
    state = _state()
    flat = _flat(state)  # 148 + 264 + 10 bytes
    ranges = [(3, 150), (200, 201), (300, len(flat))]
    s = Staging(sum(hi - lo for lo, hi in ranges), block=block)
    index = s.copy_in(state, ranges)
    assert index == [(3, 150, 0), (200, 201, 147), (300, len(flat), 148)]
    read = s.reader(index)
    for a, b in [(3, 150), (10, 149), (200, 201), (300, len(flat)), (301, 377), (5, 5)]:
        out = bytearray(b - a)
        read(memoryview(out), a, b)
        assert bytes(out) == flat[a:b], (a, b)


def test_a_landing_copies_a_block_at_a_time_and_refuses_another_size():
    src = Staging(1000, block=1000)
    src.blocks[0].copy_(torch.arange(1000).to(torch.uint8))
    dst, waits = Staging(1000, block=300), []
    dst.land(src, lambda: waits.append(sum(int(b[0]) for b in dst.blocks)))
    assert len(waits) == 4, "one wait after each block"
    assert b"".join(b.numpy().tobytes() for b in dst.blocks) == src.blocks[0].numpy().tobytes()
    with pytest.raises(ValueError, match="landing 1000 bytes in a 999-byte staging buffer"):
        Staging(999).land(src, lambda: None)


def test_a_share_is_cut_after_its_first_bytes_across_and_between_ranges():
    from unbroken.snapshot.staging import split_ranges

    ranges = [(0, 10), (20, 30), (40, 45)]
    assert split_ranges(ranges, 25) == ([(0, 10), (20, 30), (40, 45)], [])
    assert split_ranges(ranges, 0) == ([], ranges)
    assert split_ranges(ranges, 10) == ([(0, 10)], [(20, 30), (40, 45)])
    assert split_ranges(ranges, 14) == ([(0, 10), (20, 24)], [(24, 30), (40, 45)])


def test_the_spill_is_what_a_window_cannot_carry_at_most_the_cap():
    from unbroken.snapshot.staging import WINDOW_MARGIN, Stager

    st = Stager()
    assert st.spill_for(10_000, 0, 0.1) == 0, "a cap of 0: no device staging at all"
    assert st.spill_for(10_000, 4_000, 0.1) == 4_000, "nothing measured yet: as much as the cap allows"
    st.rate = 50_000.0  # bytes per second off the device
    carried = int(WINDOW_MARGIN * 50_000 * 0.1)
    assert st.spill_for(10_000, 8_000, 0.1) == 10_000 - carried
    assert st.spill_for(10_000, 1_000, 0.1) == 1_000, "never more than the cap (the step then waits the rest)"
    assert st.spill_for(3_000, 8_000, 0.1) == 0, "a share the window carries whole: nothing on the device"


def test_a_buffer_lands_at_an_offset_a_block_at_a_time():
    src = Staging(10, block=4)
    src.copy_in({"x": torch.arange(10, dtype=torch.uint8)}, [(0, 10)])
    dst = Staging(25, block=8)
    waits = []
    dst.land_at(13, src, lambda: waits.append(1))
    flat = torch.cat(dst.blocks)
    assert torch.equal(flat[13:23], torch.arange(10, dtype=torch.uint8))
    assert len(waits) == 2, "the destination's blocks [8, 16) and [16, 24): one wait after each"
    with pytest.raises(ValueError, match="landing 10 bytes at 20 of a 25-byte staging buffer"):
        dst.land_at(20, src, lambda: None)
