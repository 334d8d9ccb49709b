"""A failed container's log as status and Events quote it: terminal escapes and what looks
like a credential cut out (`redact`), then its last lines (`log_tail`) or line (`last_line`).
"""

from __future__ import annotations

import re

LOG_TAIL_CHARS = 1024
LAST_LINE_CHARS = 200


# A failed container's log reaches status and Events, which outlive the pod and which more
# people may read than the pod's logs: credentials a program printed are cut out first.
_HIDDEN = "[redacted]"
_SECRETS = (
    # Presigned URLs and signed requests: the signature, credential and session token.
    (re.compile(r"(?i)\b(x-amz-(?:signature|credential|security-token)|signature|awsaccesskeyid"
                r"|access_token|id_token|refresh_token|token|sig)=[^&\s'\"]+"), rf"\1={_HIDDEN}"),
    # key = value, key: value, "key": "value" for names that hold credentials.
    (re.compile(r"(?i)\b([\w.-]*?(?:password|passwd|secret|secret[_-]?key|api[_-]?key|access[_-]?key(?:[_-]?id)?"
                r"|token|authorization))\b"
                r"(['\"]?\s*[:=]\s*['\"]?)(?:(?:bearer|basic|aws4-hmac-sha256)\s+)?[^\s'\",&]+"), rf"\1\2{_HIDDEN}"),
    (re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"), _HIDDEN),  # AWS access key ids
    (re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@"), rf"\1{_HIDDEN}@"),  # user:password@ in URLs
)
_TERMINAL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # colours, controls


def redact(text: str) -> str:
    """`text` without terminal escapes, control characters and what looks like a credential."""
    text = _TERMINAL.sub("", text)
    for pattern, hidden in _SECRETS:
        text = pattern.sub(hidden, text)
    return text


def log_tail(text: str, limit: int = LOG_TAIL_CHARS) -> str:
    """The last whole lines of `text` that fit in `limit` characters (the last line cut to
    its end when it alone is longer), trailing blank lines dropped."""
    lines = text.rstrip().splitlines()
    out: list[str] = []
    size = 0
    for line in reversed(lines):
        if out and size + len(line) + 1 > limit:
            break
        out.append(line[-limit:])
        size += len(line) + 1
    return "\n".join(reversed(out))


def last_line(text: str) -> str:
    """The last non-blank line, cut to LAST_LINE_CHARS: what a failure's message quotes."""
    line = next((x.strip() for x in reversed(text.splitlines()) if x.strip()), "")
    return line if len(line) <= LAST_LINE_CHARS else line[:LAST_LINE_CHARS - 3] + "..."
