"""The keyed shuffle: a bijection per (seed, epoch), equal to its written-out definition, O(1) memory."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pytest

from unbroken.data import BatchSampler
from unbroken.data.shuffle import shuffled, shuffled_range

pytestmark = pytest.mark.timeout(60)

_M = (1 << 64) - 1


def _reference(p: int, n: int, seed: int, epoch: int) -> int:
    """The module docstring's definition, written out independently, one value at a time."""
    digest = hashlib.blake2b(f"unbroken-shuffle:{seed}:{epoch}".encode(), digest_size=48).digest()
    keys = [int.from_bytes(digest[i:i + 8], "little") for i in range(0, 48, 8)]
    h = 1
    while 4 ** h < n:
        h += 1

    def mix(x: int, k: int) -> int:
        z = ((x ^ k) + 0x9E3779B97F4A7C15) % 2 ** 64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2 ** 64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2 ** 64
        return z ^ (z >> 31)

    while True:
        left, right = p // 2 ** h, p % 2 ** h
        for k in keys:
            left, right = right, left ^ (mix(right, k) % 2 ** h)
        p = left * 2 ** h + right
        if p < n:
            return p


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 16, 17, 100, 1000, 4097])
def test_a_permutation_equal_to_its_definition_in_any_chunks(n: int) -> None:
    for seed, epoch in ((0, 0), (3, 1), (2 ** 40, 7)):
        whole = shuffled(np.arange(n), n, seed, epoch)  # numpy path from 64 positions on, plain ints below
        assert sorted(whole.tolist()) == list(range(n))
        assert whole.tolist() == [_reference(p, n, seed, epoch) for p in range(n)]
        chunks = [shuffled(np.arange(a, min(a + 5, n)), n, seed, epoch) for a in range(0, n, 5)]
        assert np.array_equal(np.concatenate(chunks), whole)
        ranges = [shuffled_range(a, min(a + 3, n), n, seed, epoch) for a in range(0, n, 3)]
        assert np.array_equal(np.concatenate(ranges), whole)


def test_epochs_and_seeds_differ() -> None:
    orders = {tuple(shuffled(np.arange(100), 100, s, e).tolist()) for s in range(3) for e in range(3)}
    assert len(orders) == 9


def test_large_domain_and_bad_positions() -> None:
    n = 488_281_250  # 1 T tokens in windows of 2,048
    pos = np.array([0, 1, n // 2, n - 1])
    got = shuffled(pos, n, 11, 3)
    assert got.tolist() == [_reference(int(p), n, 11, 3) for p in pos] and ((got >= 0) & (got < n)).all()
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 7\)"):
        shuffled(np.array([7]), 7, 0, 0)
    with pytest.raises(ValueError, match="n=0"):
        shuffled(np.array([0]), 0, 0, 0)


def test_sampler_memory_does_not_grow_with_the_corpus() -> None:
    # 2e10 tokens (1e7 windows of 2,048) that cost 2 bytes: a zero-stride view stands in for a huge memmap.
    tokens = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint16), shape=(2048 * 10 ** 7 + 1,), strides=(0,))
    s = BatchSampler(tokens, seed=1, n_slots=4, micro_batch=8, seq_len=2048)
    tracemalloc.start()
    try:
        for step in (0, 1_250_000, 2_500_000):  # epochs 0, 4 and 8
            s.batch(step, 3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # One micro-batch's rows (8 x 2,049 int64 twice over) and no per-window table (that was 80 MB here).
    assert peak < 4 << 20, peak
