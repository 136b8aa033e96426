"""What the parameter check costs a step without a failure: ``python -m benchmarks.param_check``.

For each preset, on one device (``--device``, default the CPU with one thread), the job is built as a worker
builds it; then, in one run, the median of ``--steps`` computes of one slot (forward and backward,
:meth:`~unbroken.job.Job.gradient_sums`) beside the median of the checksum every member computes before each
reduction that carries the check (:func:`~unbroken.runtime.param_check.checksum` over its parameters, its wait for
the device included). The ratio is the check's share of one slot's compute; a worker computing more than one slot
per step pays it once, so its share is smaller. The comparison after the reduction reads one float per worker and
the check adds no collective and no store round trip (nothing to time).
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks import _step_check
from unbroken.job import Job
from unbroken.runtime.param_check import checksum

CHECKS_PER_STEP = 10
"""Checksums timed per compute (the median of their mean)."""


def _check(job: Job, buf: torch.Tensor, step: int) -> None:
    int(checksum(job.layout.params))  # the value lands in the buffer; int() waits for it


def measure(preset_name: str, device: torch.device, steps: int, overrides: list[str]) -> dict[str, Any]:
    """One preset's parameter count, median compute of one slot and median checksum, and their ratio."""
    job, _, compute_s, check_s = _step_check.measure(preset_name, device, steps, overrides, _check, CHECKS_PER_STEP)
    n_bytes = sum(p.numel() * p.element_size() for p in job.layout.params)
    return {"preset": preset_name, "param_bytes": n_bytes, "compute_one_slot_s": compute_s,
            "check_s": check_s, "check_share_of_one_slot": check_s / compute_s, "check_gb_s": n_bytes / check_s / 1e9}


def _line(r: dict[str, Any]) -> str:
    return (f"{r['preset']}: parameters {r['param_bytes'] / 1e6:.1f} MB, checksum {r['check_s'] * 1e3:.3f} ms "
            f"({r['check_gb_s']:.1f} GB/s), one slot's compute {r['compute_one_slot_s'] * 1e3:.1f} ms -> "
            f"{100 * r['check_share_of_one_slot']:.3f} %")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return _step_check.main(argv, prog="python -m benchmarks.param_check", description=__doc__.splitlines()[0],
                            benchmark="param-check", row=measure, line=_line)


if __name__ == "__main__":
    main()
