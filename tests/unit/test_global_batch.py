"""``train.global_batch``: slots per step, what is refused with which fix, and the config hash."""

from __future__ import annotations

import pytest

from unbroken.config import config_hash, load_config

pytestmark = pytest.mark.timeout(60)


def test_default_is_one_micro_batch_per_worker():
    cfg = load_config(overrides=["train.workers=3", "data.micro_batch=4"])
    assert cfg.train.global_batch == 0 and cfg.n_slots == 3


def test_global_batch_sets_the_slots_whatever_the_workers():
    for workers in (1, 2, 4, 8):
        cfg = load_config(overrides=[f"train.workers={workers}", "data.micro_batch=4", "train.global_batch=32"])
        assert cfg.n_slots == 8


@pytest.mark.parametrize("overrides, message", [
    (["train.global_batch=30", "data.micro_batch=4"],
     "train.global_batch=30 is not a multiple of data.micro_batch=4: a step is whole micro-batches; give "
     "train.global_batch=28 or a data.micro_batch that divides 30"),
    (["train.global_batch=8", "data.micro_batch=4", "train.workers=4"],
     "train.global_batch=8 is 2 micro-batch(es) of data.micro_batch=4, fewer than train.workers=4 (every worker "
     "computes at least one); give train.global_batch >= 16 or data.micro_batch <= 2"),
    (["train.global_batch=-4"], "train.global_batch=-4: must be >= 0 (0: train.workers x data.micro_batch)"),
    (["train.global_batch=24", "data.micro_batch=4", "train.workers=4", "train.shard_degree=4"],
     "train.global_batch=24 is 6 micro-batches, not a multiple of train.shard_degree=4 (each rank of a replica "
     "computes one of its micro-batches); give train.global_batch=32"),
])
def test_bad_global_batch_is_refused_with_the_fix(overrides, message):
    with pytest.raises(ValueError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)


def test_the_hash_names_the_global_batch_not_the_workers():
    """A job is its global batch: 4 workers x 1 micro-batch and 2 x 2 train the same rows (a resume on other
    workers is the same job); a default run hashes as it always did."""
    four = load_config(overrides=["train.workers=4", "data.micro_batch=4"])
    two = load_config(overrides=["train.workers=2", "data.micro_batch=4", "train.global_batch=16"])
    other = load_config(overrides=["train.workers=2", "data.micro_batch=4", "train.global_batch=32"])
    assert config_hash(four) == config_hash(two) != config_hash(other)
    assert config_hash(load_config(overrides=["train.workers=2"])) != config_hash(load_config())
