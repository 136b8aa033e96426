"""unbroken.faults: failure traces and fault-injection specs.

Traces (``traces``) say which worker is down at which step, drawn from a seeded
failure model (its regimes in ``trace_presets``) whose long-run fractions
``analytics`` computes; specs (``fail_at``) say which process to kill, stop or
terminate at which step, or which worker to make slow or silently wrong (a
gray failure, which ``gray`` inflicts from inside the worker); ``injector``
schedules them. Those three are pure data. ``chaos`` is the one module that acts: it sends real signals to a running
job's processes (``unbroken chaos``); importing the package does not load it.
"""

from unbroken.faults.analytics import expected_degraded_fraction, expected_down_fraction
from unbroken.faults.fail_at import FaultSpec, fail_at, format_fail_at, parse_fail_at, trace_to_faults
from unbroken.faults.trace_presets import TRACE_PRESETS, TracePreset, trace_preset
from unbroken.faults.traces import FailureTrace, Outage, generate_trace, step_time_for

__all__ = [
    "TRACE_PRESETS",
    "FailureTrace",
    "FaultSpec",
    "Outage",
    "TracePreset",
    "expected_degraded_fraction",
    "expected_down_fraction",
    "fail_at",
    "format_fail_at",
    "generate_trace",
    "parse_fail_at",
    "step_time_for",
    "trace_preset",
    "trace_to_faults",
]
