"""The node's health check: a real shell command, its output kept, a hang killed with all it started."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.agent.health_check import OUTPUT_CHARS, check_node, run_health_check

pytestmark = pytest.mark.timeout(60)


def test_a_passing_check() -> None:
    check = run_health_check("echo GPU 0: healthy", 10.0)
    assert check.ok and check.code == 0 and not check.hung and check.output == "GPU 0: healthy\n"


def test_a_failing_check_keeps_its_output_and_code() -> None:
    check = run_health_check("echo 'GPU 1: Xid 79'; echo 'fallen off the bus' >&2; exit 3", 10.0)
    assert not check.ok and check.code == 3 and not check.hung
    assert check.output == "GPU 1: Xid 79\nfallen off the bus\n"
    assert "exited with code 3" in check.describe()


def test_a_hanging_check_is_killed_with_what_it_started(tmp_path) -> None:
    pid_file = tmp_path / "pid"
    check = run_health_check(f"echo waiting; sleep 600 & echo $! > {pid_file}; wait", 0.5)
    assert not check.ok and check.hung and check.code is None and check.output == "waiting\n"
    assert "did not finish within its timeout and was killed" in check.describe()
    pid = int(pid_file.read_text())  # its child held the output pipe the check's end waited on: it is dead
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("Z", "X", "gone")


def test_long_output_keeps_its_end() -> None:
    check = run_health_check(f"python3 -c \"print('x' * {3 * OUTPUT_CHARS}, end=''); print('END')\"", 10.0)
    assert check.ok and len(check.output) == OUTPUT_CHARS and check.output.endswith("END\n")


def test_check_node_writes_the_event() -> None:
    seen: list[tuple[str, int | None, dict]] = []
    assert check_node(None, 1.0, lambda e, w, **f: seen.append((e, w, f)), spare=False) is None and not seen
    check = check_node("echo bad; exit 1", 10.0, lambda e, w, **f: seen.append((e, w, f)), spare=True)
    assert check is not None and not check.ok
    [(event, worker, fields)] = seen
    assert event == "health_check" and worker is None
    assert fields["ok"] is False and fields["code"] == 1 and fields["output"] == "bad\n" and fields["spare"]
