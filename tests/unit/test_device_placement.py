"""A CUDA job that NCCL could not form is refused before anything starts, naming the devices."""

from __future__ import annotations

import pytest
import torch

from unbroken.models.factory import check_placement, placement_problem

pytestmark = pytest.mark.timeout(30)


def test_one_worker_per_gpu_is_accepted():
    assert placement_problem([0, 1, 2, 3], 4) is None
    assert placement_problem([8, 9, 10, 11, 12, 13, 14, 15], 8) is None, "node 1 of 2 x 8 on its own machine"


def test_two_workers_on_one_gpu_are_refused_naming_them_and_the_device():
    assert placement_problem([0, 1], 1) == (
        "workers 0 and 1 would both run on cuda:0: NCCL cannot hold two ranks of one group on one GPU, and this "
        "machine has 1 visible (cuda:0..cuda:0) for 2 workers; run at most 1 workers on it "
        "(--workers / --workers-per-node), set train.device=cpu, or train.backend=gloo to share the GPUs (a test "
        "topology: gloo reduces through the host)")
    assert placement_problem([0, 1, 2], 2).startswith("workers 0 and 2 would both run on cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_a_visible_gpu_is_refused_and_cpu_or_auto_pass():
    with pytest.raises(ValueError, match=r"train.device='cuda' but no GPU is visible to the workers"):
        check_placement("cuda", [0])
    check_placement("cpu", range(64))
    check_placement("auto", range(64))
