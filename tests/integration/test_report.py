"""``unbroken report`` on a real run with two failures: the picture, its data, the overlay, bad input.

One job (3 workers on one node, 16 steps, a warm standby so that a killed
worker is back within the run; one node, because every node starts a standby):
worker 1 kills itself in step 4 and is restarted once step 6 is committed;
worker 2 hangs (SIGSTOP) in step 10 and stays out. Its report is checked
against the run's ledger and events (through :class:`_faults.Job`), never
against log text. The overlay compares it with the simulator's failure-free
run of the same config.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
from pathlib import Path

import pytest

from _faults import MICRO_BATCH as MB
from _faults import Job, failover_config
from unbroken.agent.launcher import launch
from unbroken.report.run_report import build_report, summarize_run
from unbroken.cli import main as cli_main
from unbroken.config import config_from_dict
from unbroken.job.simulator import simulate
from unbroken.jsonl import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STEPS = 16
WORKERS = 3
KILL_STEP, BACK_STEP, HANG_STEP = 4, 6, 10
FAIL_AT = (f"step={KILL_STEP}:worker=1:kill:phase=forward:back={BACK_STEP},"
           f"step={HANG_STEP}:worker=2:stop:phase=forward:back={STEPS}")
"""The hang's ``back`` lies at the run's end: worker 2 is not restarted, so the story has one rejoin."""
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, corpus_overrides: list[str]) -> Job:
    cfg = failover_config(corpus_overrides, STEPS, f"train.workers={WORKERS}", "fault.heartbeat_timeout_s=1.0")
    run_dir = tmp_path_factory.mktemp("report") / "faulty"
    summary = launch(cfg, run_dir, nodes=1, workers_per_node=WORKERS, fail_at=FAIL_AT, standby=True,
                     restart="on-failure")
    return Job(run_dir=run_dir, cfg=cfg, summary=summary, pids=set(), wall_s=0.0)


@pytest.fixture(scope="module")
def reported(job: Job) -> dict:
    """``unbroken report RUN`` through the CLI: the report.json it wrote, and its text under ``"printed"``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["report", str(job.run_dir)]) == 0
    return {**json.loads((job.run_dir / "report.json").read_text()), "printed": out.getvalue()}


@pytest.fixture(scope="module")
def failure_free(job: Job) -> Path:
    """The simulator's failure-free run of the same config (one process: cheaper than a second job)."""
    out = job.run_dir.parent / "failure-free"
    simulate(config_from_dict(job.cfg.to_dict()), out)
    return out


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (which must come first), after checking the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    length, chunk, width, height = struct.unpack(">I4sII", head[8:24])
    assert chunk == b"IHDR" and length == 13, f"{path}: first chunk {chunk!r}"
    return width, height


def test_report_png_is_a_picture(job, reported):
    width, height = png_size(job.run_dir / "report.png")
    assert width >= 1000 and height >= 800, (width, height)
    assert reported["figure"] == str(job.run_dir / "report.png")


def test_series_have_one_value_per_step(reported):
    series = reported["series"]
    assert series["step"] == list(range(STEPS))
    for name in ("live_workers", "stall_s", "slots_covered_exact", "slots_covered_approx", "slots_own_approx",
                 "loss", "val_loss"):
        assert len(series[name]) == STEPS, name
    assert len(series["worker_states"]) == WORKERS and all(len(row) == STEPS for row in series["worker_states"])


def test_deaths_at_their_steps_by_kind(job, reported):
    assert [(d["worker"], d["step"], d["kind"]) for d in reported["deaths"]] == [
        (1, KILL_STEP, "crash"), (2, HANG_STEP, "hang")]
    assert [f["step"] for f in reported["failure_details"]] == [KILL_STEP, HANG_STEP]
    assert reported["failures"] == 2 and reported["ledger_ok"] is True and reported["lost_steps"] == 0
    stalls = reported["series"]["stall_s"]
    assert [s for s in range(STEPS) if stalls[s] is not None] == [KILL_STEP, HANG_STEP]


def test_worker_states_follow_the_ledger(job, reported):
    (rejoined,) = job.events("rejoined", worker=1)
    back = rejoined["step"]
    assert BACK_STEP <= back < STEPS
    assert reported["rejoin_steps"] == [{"worker": 1, "step": back}]
    (start,) = job.events("worker_start", worker=1, join=True)
    restarted = start["progress"]  # the step in flight when the standby took worker 1 over
    assert BACK_STEP <= restarted <= back
    states = reported["series"]["worker_states"]
    for w in range(WORKERS):
        for s in range(STEPS):
            assert (states[w][s] == "live") == (w in job.committers(s)), (w, s, states[w][s])
    assert states[1][KILL_STEP:back] == ["dead"] * (restarted - KILL_STEP) + ["rejoining"] * (back - restarted)
    assert states[2][HANG_STEP:] == ["dead"] * (STEPS - HANG_STEP)
    assert reported["series"]["live_workers"] == [len(job.committers(s)) for s in range(STEPS)]


def test_degraded_slots_follow_the_committed_items(job, reported):
    series = reported["series"]
    for s in range(STEPS):
        items = job.committed_items(s)
        covered = {i[1] for i in items if i[0] != i[1]}
        approx = {i[1] for i in items if i[0] != i[1] and i[4] == "approx"}
        own = {i[1] for i in items if i[0] == i[1] and i[4] == "approx"} - covered
        got = (series["slots_covered_exact"][s], series["slots_covered_approx"][s], series["slots_own_approx"][s])
        assert got == (len(covered - approx), len(approx), len(own)), s
    # Neighbour policy: worker 2 covers slot 1 approximately from the kill on, and approximates its own slot.
    assert job.slot_items(KILL_STEP, 1) == [(2, 1, 0, MB, "approx")]
    assert series["slots_covered_approx"][KILL_STEP] == 1 and series["slots_own_approx"][KILL_STEP + 1] == 1
    assert series["slots_covered_approx"][:KILL_STEP] == [0] * KILL_STEP


def test_losses_from_the_metrics(job, reported):
    train = {r["step"] - 1: r["loss"] for r in job.train_records()}
    assert reported["series"]["loss"] == [train[s] for s in range(STEPS)]
    val = reported["series"]["val_loss"]  # train.val_every=0: validation at the last step only
    assert [s for s in range(STEPS) if val[s] is not None] == [STEPS - 1]
    assert reported["final_val_loss"] == val[-1] == job.summary["val_loss"]


def test_text_output_and_json(job, reported, capsys):
    text = reported["printed"]
    assert f"{STEPS}/{STEPS} steps committed" in text and "failures: 2" in text and "ledger OK" in text
    assert f"picture: {job.run_dir / 'report.png'}" in text
    assert cli_main(["report", str(job.run_dir), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["series"] == reported["series"] and printed["ledger_ok"] is True


def test_the_report_shows_what_the_snapshots_protect_against_from_the_start(job, reported):
    """The launch records it before any agent starts (``snapshot_protection``): one node has no other to hold
    parity, so the run is shown unprotected against a node loss."""
    guard = reported["snapshots"]["protection"]
    assert guard is not None and guard["protected"] is False and guard["nodes"] == 1
    assert f"UNPROTECTED: {guard['message']}" in reported["printed"]
    assert guard["t"] < min(e["t"] for e in read_jsonl(job.run_dir / "events" / "agent0.jsonl"))


def test_overlay_with_a_failure_free_run(job, reported, failure_free, capsys):
    assert cli_main(["report", str(job.run_dir), str(failure_free)]) == 0
    text = capsys.readouterr().out
    path = job.run_dir / "report-vs-failure-free.png"
    width, height = png_size(path)
    assert width >= 1000 and height >= 600
    assert f"picture: {path}" in text
    rows = {line.split("  ")[0]: line.split() for line in text.splitlines()}
    assert rows["failures"][-2:] == ["2", "0"] and rows["ledger"][-2:] == ["OK", "n/a"]
    free = build_report(failure_free)
    assert free["simulated"] and free["series"]["live_workers"] == [WORKERS] * STEPS and free["deaths"] == []


def test_bad_input(job, tmp_path, capsys):
    with pytest.raises(ValueError, match=f"{tmp_path}.*no config.json"):
        build_report(tmp_path)
    with pytest.raises(ValueError, match="no such directory"):
        summarize_run(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps(job.cfg.to_dict()))
    with pytest.raises(ValueError, match="no metrics.jsonl and no events/"):
        build_report(tmp_path)
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert cli_main(["report", str(job.run_dir), str(job.run_dir), str(job.run_dir)]) == 2
    assert "at most 2 run directories" in capsys.readouterr().err


def test_a_warm_standby_records_what_its_start_cost(job):
    (start,) = job.events("worker_start", worker=1, join=True)
    assert start["standby"] is True
    mine = job.events("standby_ready", pid=start["pid"])  # the standby that became worker 1
    assert len(mine) == 1 and mine[0]["node"] == 0
    # Forked from the node's template: the imports, data and model (seconds of CPU) were the template's.
    assert mine[0]["forked"] is True and 0.0 <= mine[0]["cpu_s"] < 0.5
    # The template itself is a fork of its agent, and the agent of the launcher's server, which imported what
    # a worker needs: what is left for the template is its config and data, each phase timed.
    (template,) = job.events("template_ready", node=0)
    assert set(template["phases"]) == {"imports", "config", "prepare"} and template["prepared"] is True
    assert 0.0 <= template["cpu_s"] < 120.0 and template["phases"]["imports"] < 0.5
    merged = read_jsonl(job.run_dir / "events.jsonl")
    assert [e["pid"] for e in merged if e.get("event") == "standby_ready"] == [
        e["pid"] for e in job.events("standby_ready")]
    assert all(e["source"] == "events/standby0.jsonl" for e in merged if e.get("event") == "standby_ready")
