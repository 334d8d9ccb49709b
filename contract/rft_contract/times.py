"""Times as Kubernetes writes them in objects ("2026-11-30T12:00:00Z": RFC 3339, UTC, whole
seconds), formatted and read here once for the operator, the trainer and the sync agents."""

from __future__ import annotations

from datetime import datetime, timezone

API_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def format_time(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime(API_TIME_FORMAT)


def now_text() -> str:
    """Now, formatted."""
    return format_time(datetime.now(timezone.utc))


def parse_time(value: object) -> datetime | None:
    """An RFC 3339 time (fractions and offsets too); None when absent or unreadable: a
    time another writer left that cannot be read is no time at all."""
    if not isinstance(value, str) or not value:
        return None
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)
