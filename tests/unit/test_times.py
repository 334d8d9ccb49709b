"""Times as the API writes them (`rft_contract.times`)."""

from rft_contract import times

from .testing import NOW


def test_time_roundtrip():
    assert times.parse_time(times.format_time(NOW)) == NOW
    assert times.parse_time(None) is None and times.parse_time("not a time") is None
    assert times.parse_time("2026-11-30T12:00:00.250+01:00") == NOW.replace(hour=11, microsecond=250000)
