"""HSDP with unbroken's cross-replica reduction equals torch's own HSDP on the same batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unbroken.bench.hsdp import SEQ, SHARDS, VOCAB, run_job
from unbroken.models.factory import build_model
from unbroken.sharding.hsdp import shard_bytes

pytestmark = pytest.mark.timeout(300)


def test_unbroken_hsdp_equals_torch_hsdp_on_the_same_batches(tmp_path):
    """2 replicas x 2 ranks, 4 steps of the debug model with clipping and AdamW: FSDP2 inside each replica's
    own world and the gradient shards summed across replicas on unbroken's view group of each shard index
    give, on every rank, the parameters torch's ``fully_shard`` over a (replicate, shard) mesh gives; and a
    replica that rejoins receives its shards (parameters and moments) from a live one, rank by rank."""
    ours, reference = run_job("unbroken", tmp_path, steps=4), run_job("torch", tmp_path, steps=4)
    rejoined = run_job("unbroken-rejoin", tmp_path, steps=4)
    for r in range(1, 4):
        assert np.array_equal(ours[r]["params"], ours[0]["params"]), f"rank {r}'s parameters differ from rank 0's"
    np.testing.assert_allclose(ours[0]["params"], reference[0]["params"], rtol=1e-4, atol=1e-5)
    # A replica rebuilt from scratch after step 2, its shards received rank by rank from the live one, trains
    # on exactly as if nothing had happened: all four ranks equal each other and the same job's 4 steps.
    for r in range(4):
        assert np.array_equal(rejoined[r]["params"], ours[0]["params"]), f"rank {r} after the rejoin"
    init = build_model("debug", vocab_size=VOCAB, seq_len=SEQ, seed=0)
    start = torch.cat([p.detach().reshape(-1) for p in init.parameters()]).numpy()
    moved = np.abs(ours[0]["params"] - start)
    assert moved.max() > 1e-2 and np.median(moved) > 1e-3, "four AdamW steps moved the parameters past the tolerance"
    # Each rank's flat gradient buffer is its FSDP2 shard: the projection's chunk rule, to the element.
    shapes = [tuple(p.shape) for p in init.parameters()]
    assert max(r["local_numel"] for r in ours) * 4 == shard_bytes(shapes, SHARDS)
    assert sum(r["local_numel"] for r in ours[:SHARDS]) == start.size
