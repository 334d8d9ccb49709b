"""The operator's environment knobs are read once, at start (handlers.settings_from_env), and a
bad value stops it with the variable's name."""

from __future__ import annotations

import pytest

from rft_operator import handlers
from rft_operator.__main__ import main


def test_knobs_are_read_once_into_the_memo():
    assert handlers.settings_from_env({}) == {}
    memo = handlers.Memo(**handlers.settings_from_env({"RFT_RESYNC_SECONDS": "0.5", "RFT_WORKERS": "8"}))
    assert (memo.resync_seconds, memo.workers) == (0.5, 8)
    assert (handlers.Memo().resync_seconds, handlers.Memo().workers) == (60.0, 48)


@pytest.mark.parametrize("var, value, message", [
    ("RFT_WORKERS", "many", "RFT_WORKERS='many': expected an integer"),
    ("RFT_WORKERS", "0", "RFT_WORKERS='0': must be at least 1"),
    ("RFT_RESYNC_SECONDS", "1m", "RFT_RESYNC_SECONDS='1m': expected a number of seconds"),
    ("RFT_RESYNC_SECONDS", "nan", "RFT_RESYNC_SECONDS='nan': must be a finite number above 0"),
    ("RFT_RESYNC_SECONDS", "0", "RFT_RESYNC_SECONDS='0': must be a finite number above 0"),
])
def test_a_bad_value_stops_the_operator_naming_the_variable(var, value, message, monkeypatch, capsys):
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as e:
        main(["--namespace", "default"])
    assert e.value.code == 2 and message in capsys.readouterr().err
