"""When a persistent checkpoint is due: by steps, by time (the default: every 1800 s), and at the end."""

from __future__ import annotations

import os
import time

import pytest

from unbroken.config import Config, config_hash, load_config
from unbroken.checkpoint.files import COMMIT_FILE, checkpoint_dir
from unbroken.checkpoint.schedule import CheckpointSchedule, newest_checkpoint_age_s

pytestmark = pytest.mark.timeout(30)


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_by_default_a_checkpoint_is_due_every_half_hour_of_training_and_at_the_end():
    t = Config().train
    assert (t.checkpoint_every, t.checkpoint_every_s) == (0, 1800.0)
    clock = _Clock()
    s = CheckpointSchedule(every=t.checkpoint_every, every_s=t.checkpoint_every_s, steps=10, clock=clock)
    clock.t += 1799.0
    assert s.due(3) is None
    clock.t += 1.0
    assert s.due(4) == "time"
    s.taken()
    clock.t += 1000.0
    assert s.due(5) is None and s.due(10) == "step"  # the last step, whatever the clock


def test_steps_and_time_together_and_none_but_the_last():
    clock = _Clock()
    s = CheckpointSchedule(every=4, every_s=60.0, steps=100, clock=clock)
    assert [s.due(d) for d in (1, 4, 8)] == [None, "step", "step"]
    clock.t += 61.0
    assert s.due(9) == "time"
    none = CheckpointSchedule(every=0, every_s=0.0, steps=100, clock=clock)
    clock.t += 1e6
    assert [none.due(d) for d in (1, 50, 99, 100)] == [None, None, None, "step"]


def test_a_joiner_counts_from_the_newest_committed_checkpoint(tmp_path):
    assert newest_checkpoint_age_s(tmp_path) == 0.0
    for step, age in ((4, 900.0), (8, 300.0)):
        d = checkpoint_dir(tmp_path, step)
        d.mkdir(parents=True)
        (d / COMMIT_FILE).write_text("{}")
        os.utime(d / COMMIT_FILE, (time.time() - age, time.time() - age))
    checkpoint_dir(tmp_path, 12).mkdir()  # not committed: not counted
    assert 299.0 <= newest_checkpoint_age_s(tmp_path) <= 310.0
    clock = _Clock()
    s = CheckpointSchedule(every=0, every_s=600.0, steps=100, age_s=newest_checkpoint_age_s(tmp_path), clock=clock)
    clock.t += 290.0
    assert s.due(1) is None
    clock.t += 15.0
    assert s.due(2) == "time"


def test_the_time_rule_is_checked_and_changes_nothing_that_is_trained():
    with pytest.raises(ValueError, match=r"train.checkpoint_every_s=-1.0: must be >= 0 seconds"):
        load_config(overrides=["train.checkpoint_every_s=-1"])
    assert config_hash(load_config(overrides=["train.checkpoint_every_s=0"])) == config_hash(load_config())
