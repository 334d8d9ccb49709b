from __future__ import annotations

import pytest

# The job and its clock live in testing.py; NOW and SPEC stay importable from here too.
from .testing import NOW, SPEC, make_job

__all__ = ["NOW", "SPEC", "make_job"]


@pytest.fixture
def job():
    return make_job()
