"""GPU check: when is an NCCL collective finished, and does ``ViewGroup`` wait for that?

Run on a machine with CUDA: ``python scripts/gpu/completion.py``. On a one-rank NCCL group
(one GPU is enough) an all-reduce is queued behind about a second of matrix products on the
compute stream, so it cannot start before they end. Measured from the post:

- when ``work.get_future()``'s callback fires (NCCL: at enqueue),
- when ``work.is_completed()`` turns True (the collective ran),
- when ``ViewGroup._poll`` (the wait every vote of the step protocol follows) returns, and how
  often the failure check ran meanwhile.

Prints one JSON line; ``ok`` is True when the wait returned only after the collective completed.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from unbroken.agent.worker_process import survive_nccl_failures
from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import ViewGroup

MB = 256


def _delay(dev: torch.device, seconds: float) -> None:
    """Queue about ``seconds`` of matrix products on the current stream (calibrated once)."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 10
    for _ in range(max(1, int(seconds / per))):
        a @ a


def _raw(pg: dist.ProcessGroup, dev: torch.device, buf: torch.Tensor) -> dict[str, float]:
    _delay(dev, 1.0)
    fired: dict[str, float] = {}
    t0 = time.perf_counter()
    work = pg.allreduce([buf])
    work.get_future().add_done_callback(lambda _: fired.setdefault("future_s", time.perf_counter() - t0))
    while not work.is_completed():
        time.sleep(0.001)
    done = time.perf_counter() - t0
    result = work.get_future_result()  # c10d's WorkResult: SUCCESS comes from the watchdog, a little later
    at_completion = result.done()
    result.wait()
    work.wait()
    torch.cuda.synchronize()
    return {"future_s": fired.get("future_s", float("nan")), "is_completed_s": done,
            "work_result_set_at_completion": at_completion, "work_result": int(result.value())}


def _protocol(g: ViewGroup, dev: torch.device, buf: torch.Tensor) -> dict[str, float]:
    _delay(dev, 1.0)
    checks: list[bool] = []
    t0 = time.perf_counter()
    work = g.pg.allreduce([buf])
    g._poll(work, lambda: checks.append(work.is_completed()), "all-reduce")
    returned = time.perf_counter() - t0
    return {"poll_returned_s": returned, "completed_at_return": bool(work.is_completed()),
            "checks_while_in_flight": len(checks), "checks_saw_it_complete": sum(checks)}


def main() -> None:
    survive_nccl_failures()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = JobStore.host("127.0.0.1", 0, clients=1, secret="gpu-check")
    g = ViewGroup(store.group_store(0), gen=0, rank=0, size=1, device=dev, timeout_s=60)
    buf = torch.ones(MB << 18, device=dev)  # MB MiB of fp32
    raw = _raw(g.pg, dev, buf)
    proto = _protocol(g, dev, buf)
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    ok = raw["future_s"] < raw["is_completed_s"] and proto["completed_at_return"] and \
        proto["poll_returned_s"] >= raw["is_completed_s"] * 0.5
    print(json.dumps({"check": "completion", "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                      "nccl": nccl, "allreduce_mb": MB, **raw, **proto, "ok": bool(ok)}))
    g.abandon()
    os._exit(0)  # no teardown of the NCCL communicator at interpreter exit


if __name__ == "__main__":
    main()
