"""The checks every start of a job makes (:mod:`unbroken.agent.launch_checks`): one function for the launcher,
a cluster run's preparation and each agent, with the same messages."""

from __future__ import annotations

import re

import pytest
import torch

from unbroken.agent.launch_checks import check_launch
from unbroken.config import load_config


def _cfg(*overrides: str):
    return load_config(preset_name="debug", overrides=["mecefo.policy=spread", *overrides])


def test_a_job_that_fits_gets_its_replicas():
    replicas = check_launch(_cfg("train.workers=4", "train.shard_degree=2"), 2, standby=False, placed=range(4))
    assert (replicas.replicas, replicas.replica_of(3), replicas.replica_members(1)) == (2, 1, (2, 3))
    plain = check_launch(_cfg("train.workers=3"), 3, standby=True, placed=range(3))
    assert (plain.replicas, plain.shard_degree) == (3, 1), "without HSDP a replica is one worker"


@pytest.mark.parametrize("workers_per_node, standby, message", [
    (1, False, "train.shard_degree=2 does not divide the 1 workers per node: a replica's ranks must be on one node"),
    (2, True, "a warm standby with train.shard_degree=2: a standby is one worker, HSDP restarts whole replicas; "
              "drop --standby"),
])
def test_replicas_cut_across_nodes_and_a_standby_under_hsdp_are_refused(workers_per_node, standby, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_launch(_cfg("train.workers=4", "train.shard_degree=2"), workers_per_node, standby=standby)


def test_workers_that_cannot_share_the_machines_devices_are_refused():
    n = torch.cuda.device_count() + 1  # more NCCL workers than GPUs: two would share one (or there is none)
    cfg = _cfg(f"train.workers={n}", "train.device=cuda", "train.backend=nccl")
    with pytest.raises(ValueError, match="GPU"):
        check_launch(cfg, n, standby=False, placed=range(n))
    check_launch(cfg, n, standby=False)  # a cluster's preparation: each agent checks its own machine's devices
