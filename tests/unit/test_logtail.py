"""A failed container's log as status quotes it (`logtail`): credentials cut out, the last
whole lines kept."""

import pytest

from rft_operator import logtail

from .testing import failed, gang_for, pod_dict


@pytest.mark.parametrize("text, want", [
    ("", ""),
    ("one\n\n", "one"),
    ("a\nb\nc", "a\nb\nc"),
    ("x" * 30 + "\n" + "y" * 10, "y" * 10),  # the older line does not fit whole
    ("z" * 40, "z" * 16),  # one line longer than the limit: its end
])
def test_log_tail_keeps_the_last_whole_lines_within_the_limit(text, want):
    assert logtail.log_tail(text, limit=16) == want


def test_last_line_is_the_last_non_blank_line_cut_short():
    assert logtail.last_line("a\nRuntimeError: boom\n\n  ") == "RuntimeError: boom"
    assert len(logtail.last_line("e" * 500)) == logtail.LAST_LINE_CHARS


@pytest.mark.parametrize("line, kept, hidden", [
    ("GET https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F2026&X-Amz-Signature=0badc0ffee"
     "&X-Amz-Expires=60 403", "X-Amz-Expires=60 403", ("AKIAIOSFODNN7EXAMPLE", "0badc0ffee")),
    ("headers: {'Authorization': 'Bearer eyJhbGciOi.xyz', 'Accept': '*/*'}", "'Accept': '*/*'", ("eyJhbGciOi",)),
    ("connect postgres://trainer:hunter2@db:5432/x failed", "@db:5432/x failed", ("hunter2", "trainer:")),
    ("env AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG and HF_TOKEN: hf_abc123 set", "set",
     ("wJalrXUtnFEMI", "hf_abc123")),
    ("key ASIAY34FZKBOKMUTVV7A in use", "in use", ("ASIAY34FZKBOKMUTVV7A",)),
    ("client_secret: 's3cr3t', max_tokens=512 tokenizer=gpt2", "max_tokens=512 tokenizer=gpt2", ("s3cr3t",)),
    ("\x1b[31mRuntimeError\x1b[0m: boom\x07", "RuntimeError: boom", ("\x1b", "\x07")),
])
def test_credentials_in_a_failed_pods_log_do_not_reach_status(line, kept, hidden):
    g = gang_for([pod_dict(1, 0), failed(1, 1, -30, said=f"[rank1] INFO step 3\n{line}\n")])
    failure = g.status["lastFailure"]
    for text in (failure["message"], failure["log"], g.status["message"]):
        assert kept in text and not any(h in text for h in hidden), text
    assert "[redacted]" in failure["message"] or not hidden[0].isalnum()
