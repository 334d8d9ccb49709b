"""The failure-action axis: the contract's catalogue (rft_contract.failures) names each verdict
the failure policy gives; the gang acts on it through one handler per entry (JobSet's action
-> handler map), with the entry's reason and message."""

from __future__ import annotations

import itertools

from rft_contract import names
from rft_contract.failures import FAILURE_ACTIONS, FailureAction
from rft_contract.spec import parse_spec
from rft_operator import failure_policy, gang

from .testing import NOW, REF, SPEC, pod, status


def test_every_verdict_has_an_entry_and_every_entry_a_handler():
    assert list(gang.ACTIONS) == list(FAILURE_ACTIONS)
    policy = parse_spec(SPEC).failure_policy
    verdicts = {failure_policy.classify_failure(code, disruption, policy, reason)
                for code, disruption, reason in itertools.product(
                    (None, 0, 1, 78, 137, 143), (None, "EvictionByEvictionAPI", failure_policy.TERMINATION_BY_KUBELET),
                    (None, "Evicted", "Terminated"))}
    assert verdicts == set(FAILURE_ACTIONS)
    for a in FAILURE_ACTIONS.values():
        for template in filter(None, (a.message, a.exhausted)):
            said = template.format(exit_code=78, restarts=1, disruptions=2, max_restarts=3)
            assert "spec.failurePolicy" in said, a.name  # the message names what decided it
        assert (a.exhausted is not None) == a.uses_budget, a.name


def test_a_new_action_is_one_catalogue_line_and_one_handler(monkeypatch):
    """An action that ends the job without counting it a failure (a made-up one), wired the
    way the real ones are: the gang records the failure and hands it to the handler."""
    parked = FailureAction("parked", restarts=False, uses_budget=False, reason="Parked",
                           message="parked by spec.failurePolicy (exit code {exit_code})")
    monkeypatch.setitem(FAILURE_ACTIONS, parked.name, parked)
    monkeypatch.setitem(gang.ACTIONS, parked.name, lambda g, spec, failure, action, gang_pods, pods, now, exhausted:
                        gang._fail(g, pods, now, action.reason, gang._say(action, failure, action.message, spec, g)))
    real = failure_policy.classify_failure
    monkeypatch.setattr(failure_policy, "classify_failure",
                        lambda code, *rest: parked.name if code == 42 else real(code, *rest))
    g = gang.compute_gang(REF, parse_spec(SPEC), "", status(names.RUNNING), [pod(1, 0), pod(1, 1, "Failed", 42)], NOW)
    assert g.phase == names.FAILED and g.failed_reason == "Parked"
    assert g.status["lastFailure"]["exitCode"] == 42
    assert [e.message for e in g.events][-1].endswith("; parked by spec.failurePolicy (exit code 42)")
