"""What the non-finite check costs a step without a failure: ``python -m benchmarks.nonfinite_check``.

For each preset, on one device (``--device``, default the CPU with one thread), the job's own reduction buffer
of one slot's gradient sums is built as a worker builds it; then, in one run, the median of ``--steps`` computes
of one slot (forward and backward, :meth:`~unbroken.job.Job.gradient_sums`) beside the median of the check every
member runs after each reduction (:func:`~unbroken.runtime.nonfinite.finite`, its wait for the device included).
The ratio is the check's share of one slot's compute; a worker computing more than one slot per step pays it
once, so its share is smaller. The check adds no collective and no store round trip (nothing to time).
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks import _step_check
from unbroken.job import Job
from unbroken.runtime.nonfinite import finite

CHECKS_PER_STEP = 20
"""Checks timed per compute (the median of their mean: a single check is below the clock's resolution)."""


def _check(job: Job, buf: torch.Tensor, step: int) -> None:
    if not finite(buf):
        raise AssertionError(f"step {step}'s sums are not finite")


def measure(preset_name: str, device: torch.device, steps: int, overrides: list[str]) -> dict[str, Any]:
    """One preset's buffer size, median compute of one slot and median check, and their ratio."""
    _, buf, compute_s, check_s = _step_check.measure(preset_name, device, steps, overrides, _check, CHECKS_PER_STEP)
    return {"preset": preset_name, "buffer_floats": buf.numel(), "compute_one_slot_s": compute_s,
            "check_s": check_s, "check_share_of_one_slot": check_s / compute_s,
            "check_gb_s": 4 * buf.numel() / check_s / 1e9}


def _line(r: dict[str, Any]) -> str:
    return (f"{r['preset']}: buffer {r['buffer_floats']:,} floats, check {r['check_s'] * 1e3:.3f} ms "
            f"({r['check_gb_s']:.1f} GB/s), one slot's compute {r['compute_one_slot_s'] * 1e3:.1f} ms -> "
            f"{100 * r['check_share_of_one_slot']:.3f} %")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return _step_check.main(argv, prog="python -m benchmarks.nonfinite_check", description=__doc__.splitlines()[0],
                            benchmark="nonfinite-check", row=measure, line=_line)


if __name__ == "__main__":
    main()
