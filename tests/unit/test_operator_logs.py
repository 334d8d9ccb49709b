"""The operator's log levels: an error line means something needs a person."""

from __future__ import annotations

import logging

from kubernetes.client import ApiException

from rft_operator.__main__ import RetryIsAWarning
from rft_operator.controller import RETRIES_BEFORE_ERROR, retry_level


def record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_a_request_kopf_will_retry_is_a_warning_and_the_last_attempt_stays_an_error():
    f = RetryIsAWarning()
    retried = record("kopf._cogs.clients.watching", logging.ERROR,
                     "Request attempt #1/9 failed; will retry: GET /apis -> APITooManyRequestsError(429)")
    assert f.filter(retried) and (retried.levelno, retried.levelname) == (logging.WARNING, "WARNING")
    reauth = record("kopf.objects", logging.ERROR, "Request attempt #2/9 failed; SSL closed; will re-authenticate: x")
    assert f.filter(reauth) and reauth.levelno == logging.WARNING
    last = record("kopf._cogs.clients.api", logging.ERROR, "Request attempt #9/9 failed; escalating: GET /apis")
    assert f.filter(last) and last.levelno == logging.ERROR
    ours = record("rft_operator", logging.ERROR, "something failed; will retry")  # our own words stay as said
    assert f.filter(ours) and ours.levelno == logging.ERROR


def test_the_filter_is_on_the_handlers_kopf_configures(monkeypatch):
    """As a handler filter, as main() installs it: a record kopf logs at error reaches the handler as a warning."""
    seen: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, r: logging.LogRecord) -> None:
            seen.append(r)

    handler = Capture()
    handler.addFilter(RetryIsAWarning())
    logger = logging.getLogger("kopf._cogs.clients.api.test")
    logger.addHandler(handler)
    try:
        logger.error("Request attempt #1/9 failed; will retry: GET /x -> TimeoutError()")
    finally:
        logger.removeHandler(handler)
    assert [r.levelname for r in seen] == ["WARNING"]


def test_a_failed_pass_is_a_warning_until_retrying_has_not_helped_for_a_while():
    api = ApiException(status=429, reason="Too Many Requests")
    assert [retry_level(n, api) for n in range(1, RETRIES_BEFORE_ERROR)] == [logging.WARNING] * (RETRIES_BEFORE_ERROR - 1)
    assert retry_level(RETRIES_BEFORE_ERROR, api) == retry_level(RETRIES_BEFORE_ERROR + 5, api) == logging.ERROR
    assert retry_level(1, ConnectionResetError()) == logging.WARNING
    assert retry_level(1, KeyError("phase")) == logging.ERROR  # a bug: an error at once
