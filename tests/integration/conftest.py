"""The cluster fixtures live in tests/conftest.py (shared with tests/e2e); `wait_for`
stays importable from here for the integration tests."""

from tests.conftest import wait_for  # noqa: F401
