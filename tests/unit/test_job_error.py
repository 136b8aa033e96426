"""The restore circuit breaker: a worker's death as the job's own error or a kill from outside, and when
whole-job restores of one step stop (:mod:`unbroken.agent._job_error`, :mod:`unbroken.agent._restore`)."""

from __future__ import annotations

import json
import signal

import pytest

from unbroken.agent._job_error import death_error, record_error
from unbroken.agent._restore import (MAX_BACKOFF_S, MAX_RESTORES_PER_STEP, JobRestore, recurring_error,
                                     restore_backoff)
from unbroken.store.view import View

pytestmark = pytest.mark.timeout(30)


def _fail_in_step() -> None:
    raise RuntimeError("a bug in the optimizer\nsecond line")


def _recorded(tmp_path, worker: int = 1) -> str | None:
    try:
        _fail_in_step()
    except RuntimeError as exc:
        record_error(tmp_path, worker, exc)
    return death_error(tmp_path, worker, code=1, sig=None)


def test_an_exception_is_recorded_with_its_place_and_named_the_same_in_every_incarnation(tmp_path):
    first = _recorded(tmp_path)
    assert first == f"RuntimeError at {__file__}:{_fail_in_step.__code__.co_firstlineno + 1} in _fail_in_step"
    (tmp_path / "events" / "w1.jsonl").open("a").write(json.dumps({"kind": "commit", "step": 3}) + "\n")
    assert _recorded(tmp_path) == first  # a later incarnation, the same fault: the same signature
    last = json.loads((tmp_path / "events" / "w1.jsonl").read_text().splitlines()[-1])
    assert (last["event"], last["error"], last["message"]) == ("worker_error", "RuntimeError", "a bug in the optimizer")


@pytest.mark.parametrize("code, sig, want", [
    (None, signal.SIGKILL, None),  # killed from outside (an operator, the OOM killer, fencing)
    (None, signal.SIGTERM, None),
    (None, signal.SIGSEGV, "signal SIGSEGV"),  # the process's own crash
    (None, signal.SIGABRT, "signal SIGABRT"),
    (3, None, None),  # fenced, no live worker left, store lost: consequences of another's failure
    (4, None, None),
    (6, None, None),
    (1, None, "exit code 1"),  # an error that left no record (it failed before it could write one)
])
def test_deaths_by_signal_from_outside_have_no_signature(tmp_path, code, sig, want):
    assert death_error(tmp_path, 0, code, sig) == want


def test_restores_back_off_and_stop_only_on_the_same_error_of_the_job():
    assert [restore_backoff(n) for n in range(8)] == [0, 1, 2, 4, 8, 16, MAX_BACKOFF_S, MAX_BACKOFF_S]
    bug = "RuntimeError at /job/opt.py:9 in step"
    assert MAX_RESTORES_PER_STEP == 3
    assert recurring_error([[bug], [bug]]) is None  # not yet
    assert recurring_error([[bug], [bug], [bug]]) == bug
    assert recurring_error([[], [bug], [bug], ["signal SIGSEGV", bug]]) == bug  # the last three share it
    assert recurring_error([[bug], [], [bug]]) is None  # a kill from outside in between: not a fault that recurs
    assert recurring_error([[]] * 20) is None  # workers killed by signal while they start: restores go on
    assert recurring_error([[bug], ["signal SIGSEGV"], [bug]]) is None


class _Store:
    """The two reads the breaker makes: dead marks and the committed steps."""

    def __init__(self, marks: dict[int, str], progress: int) -> None:
        self.marks, self.committed = marks, progress

    def dead_mark(self, worker: int) -> str | None:
        return self.marks.get(worker)

    def progress(self) -> int:
        return self.committed


def test_the_history_of_failed_restores_travels_in_the_restored_view(tmp_path):
    bug = "RuntimeError at /job/opt.py:9 in step"
    store = _Store({0: json.dumps({"by": "agent", "how": "exit", "code": 1, "signal": None, "error": bug}),
                    1: json.dumps({"by": 0, "how": "heartbeat", "silent_s": 3.1})}, progress=7)
    restorer = JobRestore(store, node=0, nnodes=1, workers_per_node=2, run_dir=tmp_path, config_hash="h",
                          event=lambda *args, **fields: None)
    assert restorer._failed_restores(View(gen=3, members=(0, 1), step=7)) == []  # a death in training: none yet
    restored = View(gen=4, members=(0, 1), step=7, restore={"step": 7, "failures": [["signal SIGSEGV"]]})
    assert restorer._failed_restores(restored) == [["signal SIGSEGV"], [bug]]
    store.committed = 8  # the restored view applied a step before every member died: a new story
    assert restorer._failed_restores(restored) == []
