"""The package type-checks: mypy over ``unbroken`` with the settings of ``pyproject.toml``, every module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_the_package_type_checks():
    pytest.importorskip("mypy", reason="install the test extras: pip install -e '.[test]'")
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")], cwd=ROOT,
                       capture_output=True, text=True, timeout=850)
    assert r.returncode == 0, f"mypy found errors:\n{r.stdout[-8000:]}{r.stderr[-2000:]}"
