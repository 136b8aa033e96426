"""The Python API end to end: ``examples/bring_your_own.py`` trains Hugging Face's LlamaForCausalLM
(``model.family = hf-llama``, loaded from a directory written here by ``save_pretrained``) on the
example's own map-style dataset with its own optimizer, 2 nodes x 2 workers spawned by the script
itself, through a worker SIGKILL; one run, several assertions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from unbroken.models import model_args  # noqa: E402
from unbroken.models.hf_llama import build_hf_llama  # noqa: E402
from unbroken.runtime.ledger import check_ledger  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "bring_your_own.py"
STEPS, KILL_STEP, MB = 20, 8, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    tmp = tmp_path_factory.mktemp("byo")
    hf_dir = tmp / "llama"
    build_hf_llama(model_args("debug", vocab_size=256), seed=0).save_pretrained(hf_dir, safe_serialization=True)
    run_dir = tmp / "run"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--run-dir", str(run_dir), "--steps", str(STEPS), "--hf-path", str(hf_dir),
         "--fail-at", f"step={KILL_STEP}:worker=1:kill:phase=forward"],  # dies inside that step: taken over in it
        capture_output=True, text=True, timeout=220, env=env, cwd=tmp)
    return proc, run_dir, hf_dir


def test_the_example_trains_the_hf_model_through_a_kill(run: tuple[subprocess.CompletedProcess[str], Path, Path]) -> None:
    proc, run_dir, hf_dir = run  # (on a failure, conftest shows the stacks of any worker fenced as hung)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    assert verdict == {**verdict, "steps": STEPS, "workers_agree": True, "ledger_ok": True, "rows_never": 0,
                       "rows_twice": 0}
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["model"]["family"] == "hf-llama" and cfg["model"]["hf_path"] == str(hf_dir)
    assert cfg["data"]["factory"] == f"{EXAMPLE}:build_data" and cfg["optim"]["factory"] == f"{EXAMPLE}:build_optimizer"
    # Checked again here, from the workers' ledgers: every (step, slot, row) trained exactly once.
    ledger = check_ledger(run_dir, n_slots=4, micro_batch=MB, steps=STEPS)
    assert ledger.ok and ledger.degraded_steps >= 1
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "fault_self" and e.get("worker") == 1 for e in events)  # it killed itself
    takeovers = [e for e in events if e.get("event") == "takeover" and e["step"] == KILL_STEP]
    assert sorted(i[0] for e in takeovers for i in e["items"]) == [1, 1, 1]  # spread over the 3 survivors
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "loaded LlamaForCausalLM" in logs
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in train if r["kind"] == "train"]
    assert len(losses) == STEPS and losses[-1] < losses[0]
