"""Pod views and the delete list the concerns share (rft_operator.model)."""

import pytest

from rft_operator.model import PodView, compute_deletions


def v(name, phase="Running", deleting=False):
    return PodView(name, 1, 0, phase, deleting)


@pytest.mark.parametrize("phase, deleting, active", [
    ("Pending", False, True), ("Running", False, True), ("Running", True, False),
    ("Succeeded", False, False), ("Failed", False, False), ("Unknown", False, False),
])
def test_active(phase, deleting, active):
    assert v("p", phase, deleting).active is active


@pytest.mark.parametrize("already, pods, want", [
    ((), [], ()),
    ((), [v("a"), v("b")], ("a", "b")),
    (("a",), [v("b"), v("a")], ("a", "b")),            # each once, first position kept
    ((), [v("a", deleting=True), v("b")], ("b",)),      # already going: no second delete
    ((), [v("a"), v("a")], ("a",)),
])
def test_compute_deletions(already, pods, want):
    assert compute_deletions(already, pods) == want
