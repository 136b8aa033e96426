"""GPU check: a peer that dies while an NCCL view group forms does not hang the survivor.

Run on a machine with CUDA: ``python scripts/gpu/nccl_setup_death.py``. Rank 0 builds a two-rank
NCCL group whose rank 1 exits after one second without connecting; the group's construction is
watched, so the survivor gives up within about a second (not the group's timeout), then builds a
one-rank group for the next view and all-reduces on it. Prints one JSON line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import CollectiveFailed, ViewGroup

PEER = """
import sys, time
from unbroken.store.job_store import JobStore
store = JobStore.connect(f"127.0.0.1:{sys.argv[1]}", timeout_s=20, secret="gpu-check")
time.sleep(1.0)  # dies without ever joining the group
"""


class PeerGone(Exception):
    pass


def main() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = JobStore.host("127.0.0.1", 0, clients=2, secret="gpu-check")
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(store.port)])

    def check() -> None:
        if peer.poll() is not None:
            raise PeerGone(f"peer exited with {peer.returncode}")

    t0 = time.perf_counter()
    outcome = "built"
    try:
        ViewGroup(store.group_store(0), gen=0, rank=0, size=2, device=device, timeout_s=60, check=check)
    except (PeerGone, CollectiveFailed) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    gave_up_s = time.perf_counter() - t0
    solo = ViewGroup(store.group_store(1), gen=1, rank=0, size=1, device=device, timeout_s=10)
    total = solo.allreduce(torch.ones(4, device=device), lambda: None)
    print(json.dumps({"outcome": outcome, "gave_up_s": round(gave_up_s, 3), "next_view_sum": total.sum().item(),
                      "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}))


if __name__ == "__main__":
    main()
