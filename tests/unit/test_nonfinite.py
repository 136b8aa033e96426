"""Non-finite steps: the decision rule, the check, the count in the reduction's word, and the rule run by the
step protocol on a real store and a real two-process gloo group (this process hosts the store; child processes
play workers 0 and 1, each making its sums of step 1 non-finite in its first few computations)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unbroken.jsonl import read_jsonl
from unbroken.mecefo.gradients import GradLayout
from unbroken.runtime.membership import EXIT_FENCED
from unbroken.runtime.nonfinite import decide, finite
from unbroken.store.job_store import JobStore
from unbroken.store.view import View

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("earlier, culprits, want", [
    (0, None, "retry"),  # the first time: a transient, the same rows again
    (0, 1, "retry"),
    (1, 1, "fence"),  # again, and one member's rows only: that member is corrupt
    (1, 2, "stop"),  # again on several members' rows
    (1, 0, "stop"),  # again, though every member's own sums were finite (their sum overflowed)
    (1, None, "stop"),  # again, and nobody can tell whose rows (not counted)
    (2, 1, "stop"),  # again after a member was fenced for it: the rows themselves
    (2, 0, "stop"),
])
def test_decision_rule(earlier: int, culprits: int | None, want: str) -> None:
    assert decide(earlier, culprits) == want


def test_finite_is_exact_for_every_element() -> None:
    buf = torch.ones(1000)
    assert finite(buf)
    for bad in (math.nan, math.inf, -math.inf):
        buf[417] = bad
        assert not finite(buf)
    buf[0], buf[417] = math.inf, -math.inf  # a sum of NaN, not of infinity
    assert not finite(buf)
    big = torch.full((8,), 3e38)  # every element finite, their float32 sum not
    assert not math.isfinite(float(big.sum())) and finite(big)


class OneGroup:
    group_names = ("all",)

    def group_of(self, name: str) -> int:
        return 0


def test_the_count_of_nonfinite_members_leaves_the_leaders_bits_alone() -> None:
    layout = GradLayout(torch.nn.Linear(2, 1), OneGroup())
    bufs = [layout.new_buffer() for _ in range(3)]
    layout.write_word(bufs[0], admit=True, stop=True)  # the leader
    for b in bufs[1:]:
        layout.write_word(b, admit=False, stop=False)
    for b in bufs[:2]:
        layout.count_nonfinite(b)
    reduced = bufs[0] + bufs[1] + bufs[2]
    assert layout.nonfinite_count(reduced) == 2 and layout.admitted(reduced) and layout.stopping(reduced)
    assert layout.nonfinite_count(bufs[2]) == 0


def test_the_cost_benchmark_times_the_check_beside_one_slots_compute(tmp_path: Path,
                                                                    corpus_overrides: list[str]) -> None:
    from benchmarks.nonfinite_check import main

    result = main(["--presets", "debug", "--steps", "1", "--out", str(tmp_path / "out.json"), *corpus_overrides])
    (row,) = result["rows"]
    assert row["preset"] == "debug" and row["buffer_floats"] > 0 and row["check_s"] > 0 < row["compute_one_slot_s"]
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == [row]


WORKER = """
import json, os, sys, torch
from pathlib import Path
from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.gradients import GradLayout
from unbroken.mecefo.takeover import takeover_policy
from unbroken.runtime.membership import EXIT_FENCED, Fenced, Membership
from unbroken.runtime.nonfinite import NonFiniteStop
from unbroken.runtime.protocol import StepProtocol
from unbroken.store.job_store import JobStore

port, me, out, bad = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])


class OneGroup:
    group_names = ("all",)

    def group_of(self, name):
        return 0


class Job:
    n_slots, micro_batch, device = 2, 4, torch.device("cpu")
    n_workers = n_slots
    model, optimizer = torch.nn.Linear(2, 1), None
    layout = GradLayout(model, OneGroup())
    computed = 0
    bad = bad  # this worker's first computations of step 1 that come out non-finite

    def gradient_sums(self, step, items):
        Job.computed += 1
        buf = self.layout.new_buffer()
        for it in items:  # each row of each slot adds (slot + 1) * (step + 1): the sums say which rows
            buf[: self.layout.n_grad] += (it.slot + 1) * (step + 1) * (it.rows[1] - it.rows[0])
        if step == 1 and Job.bad > 0:
            Job.bad -= 1
            buf[1] = float("nan")
        return buf


store = JobStore.connect(f"127.0.0.1:{port}", timeout_s=20, secret="test")
m = Membership(store, me, heartbeat_timeout_s=2.0, heartbeat_store=JobStore.connect(f"127.0.0.1:{port}",
               timeout_s=20, secret="test"))
m.start_heartbeat()
job = Job()
p = StepProtocol(m, job, policy=takeover_policy("spread"), events=JsonlWriter(out / f"w{me}.jsonl"), timeout_s=20,
                 announcer=job.layout)
p.adopt(store.current_view())
sums, end = [], "done"
try:
    for step in range(3):
        reduced, _ = p.run_step(step)
        sums.append(reduced[: job.layout.n_grad].tolist())
except Fenced as exc:
    end = "fenced"
except NonFiniteStop as exc:
    end = "stopped"
    store.fail(f"stopped: {exc}")
(out / f"w{me}.json").write_text(json.dumps({"sums": sums, "computed": Job.computed, "gen": p.view.gen,
                                             "end": end}))
m.stop()
os._exit(EXIT_FENCED if end == "fenced" else 0)
"""


def run_pair(tmp_path: Path, bad: tuple[int, int]) -> tuple[list[dict], list[list[dict]], str | None]:
    """Workers 0 and 1 for three steps, ``bad[w]`` of worker ``w``'s computations of step 1 non-finite; returns
    their results, their event files and the job's recorded failure."""
    store = JobStore.host("127.0.0.1", 0, clients=6, secret="test")
    store.publish_initial(View(gen=0, members=(0, 1), step=0))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(store.port), str(w), str(tmp_path), str(bad[w])])
             for w in (0, 1)]
    try:
        codes = [p.wait(90) for p in procs]
        failure = store.failure()
    finally:
        for p in procs:
            p.kill()
        store.close()
    got = [json.loads((tmp_path / f"w{w}.json").read_text()) for w in (0, 1)]
    for w, code in enumerate(codes):
        assert code == (EXIT_FENCED if got[w]["end"] == "fenced" else 0), (w, code, got[w])
    return got, [read_jsonl(tmp_path / f"w{w}.jsonl") for w in (0, 1)], failure


def events(log: list[dict], name: str) -> list[dict]:
    return [r for r in log if r.get("kind") == "event" and r.get("event") == name]


def work(log: list[dict], step: int) -> list[tuple[int, list]]:
    return [(r["gen"], r["items"]) for r in log if r.get("kind") == "work" and r["step"] == step]


def test_a_transient_is_done_again_with_the_same_rows_and_recorded_once(tmp_path: Path) -> None:
    got, logs, failure = run_pair(tmp_path, (0, 1))
    want = [[(1 * 4 + 2 * 4) * (step + 1)] * 3 for step in range(3)]  # slot 0's rows x 1, slot 1's x 2
    assert got[0]["sums"] == got[1]["sums"] == want, "step 1 applied the sums of its retry, bit for bit"
    assert got[0]["computed"] == got[1]["computed"] == 4, "step 1 was computed twice by each member"
    assert got[0]["gen"] == got[1]["gen"] == 0 and failure is None, "in the same view"
    for w, log in enumerate(logs):
        assert work(log, 1) == [(0, [[w, 0, 4, "exact"]])], "the ledger has the one record of the rows"
        assert [(e["decision"], e["culprits"], e["own"]) for e in events(log, "nonfinite_step")] == [
            ("retry", None, None)]
        assert [(e["step"], e["gen"], e["nonfinite"]) for e in events(log, "attempt_aborted")] == [(1, 0, True)]


def test_a_member_whose_rows_stay_nonfinite_is_fenced_and_its_rows_taken_over(tmp_path: Path) -> None:
    got, logs, failure = run_pair(tmp_path, (0, 2))
    assert [g["end"] for g in got] == ["done", "fenced"] and failure is None
    assert got[0]["gen"] == 1, "worker 0 went on in the view without worker 1"
    want = [[(1 * 4 + 2 * 4) * (step + 1)] * 3 for step in range(3)]  # with worker 1's rows, computed by 0
    assert got[0]["sums"] == want
    assert [(e["decision"], e["culprits"], e["own"]) for e in events(logs[0], "nonfinite_step")] == [
        ("retry", None, None), ("fence", 1, False)]
    assert [(e["decision"], e["culprits"], e["own"]) for e in events(logs[1], "nonfinite_step")] == [
        ("retry", None, None), ("fence", 1, True)]
    (fenced,) = events(logs[1], "nonfinite_fenced")
    assert (fenced["step"], fenced["items"]) == (1, [[1, 0, 4, "exact"]]) and "twice" in fenced["reason"]
    assert work(logs[0], 1) == [(0, [[0, 0, 4, "exact"]]), (1, [[0, 0, 4, "exact"], [1, 0, 4, "exact"]])]
    (view,) = [e for e in events(logs[0], "view_adopted") if e["gen"] == 1]
    assert view["members"] == [0] and view["reason"] == "dead [1]"


def test_nonfinite_rows_of_two_members_stop_the_job_naming_the_step_and_slots(tmp_path: Path) -> None:
    got, logs, failure = run_pair(tmp_path, (2, 2))
    assert [g["end"] for g in got] == ["stopped", "stopped"]
    assert failure is not None and failure.startswith("stopped: step 1's reduced gradient was not finite again")
    assert "from the rows of 2 member(s)" in failure and "slot" in failure, failure
    assert [g["sums"] for g in got] == [[want := [(1 * 4 + 2 * 4) * 1.0] * 3], [want]], "step 0 only"
    for log in logs:
        assert [e["decision"] for e in events(log, "nonfinite_step")] == ["retry", "stop"]
        assert len(events(log, "nonfinite_stop")) == 1


def test_a_leader_whose_rows_stay_nonfinite_is_fenced_like_any_member(tmp_path: Path) -> None:
    got, logs, failure = run_pair(tmp_path, (2, 0))
    assert [g["end"] for g in got] == ["fenced", "done"] and failure is None
    assert got[1]["gen"] == 1 and got[1]["sums"] == [[(1 * 4 + 2 * 4) * (step + 1)] * 3 for step in range(3)]
    (view,) = [e for e in events(logs[1], "view_adopted") if e["gen"] == 1]
    assert view["members"] == [1] and view["reason"] == "dead [0]", "worker 1 went on alone, leading"
