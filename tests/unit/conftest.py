"""Fixtures of the unit tests of the state layer."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def job_id():
    """A fresh job id; its snapshot segments are removed afterwards, and none may be left."""
    from unbroken.snapshot.segment import job_segments, remove_segments

    ident = os.urandom(6).hex()
    yield ident
    remove_segments(ident)
    assert not job_segments(ident)
