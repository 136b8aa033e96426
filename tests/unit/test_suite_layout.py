"""The suite's own shape: pytest imports test files by their base name (the folders are not packages), so two
test files of one name in tests/unit and tests/integration fail to import, whichever runs second."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_name() -> None:
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "__init__.py" and p.name != "conftest.py")
    assert sorted(name for name, n in names.items() if n > 1) == []
