"""The failure-action axis: the contract's catalogue (rft_contract.failures) names each verdict
the failure policy gives; the gang acts on it through one handler per entry (JobSet's action
-> handler map), with the entry's reason and message, and as the entry's `restarts` and
`uses_budget` say."""

from __future__ import annotations

import itertools
import textwrap

import pytest

from rft_contract import names
from rft_contract.failures import FAILURE_ACTIONS
from rft_contract.spec import parse_spec
from rft_operator import failure_policy, gang

from tests.fixtures import catalogues

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


FAILED_POD = {  # a trainer pod whose end the policy classifies as each verdict
    "fatal": pod(1, 1, "Failed", 78),
    "retryable": pod(1, 1, "Failed", 1),
    "disrupted": pod(1, 1, "Failed", 143, disruption="EvictionByEvictionAPI"),
}


@pytest.mark.parametrize("name", list(FAILURE_ACTIONS))
def test_each_handler_does_what_its_entry_says(name):
    action = FAILURE_ACTIONS[name]
    g = gang.compute_gang(REF, parse_spec(SPEC), "", status(names.RUNNING, disruptions=0),
                          [pod(1, 0), FAILED_POD[name]], NOW)
    assert g.phase == (names.RESTARTING if action.restarts else names.FAILED)
    assert g.status["restarts"] == (1 if action.uses_budget else 0)
    assert g.status["disruptions"] == (1 if action.restarts and not action.uses_budget else 0)
    assert g.events[-1].reason == action.reason
    assert g.status["lastFailure"]["pod"] == FAILED_POD[name].name


NEW_ACTION = '''
    FailureAction("parked", restarts=False, uses_budget=False, reason="Parked",
                  message="parked by spec.failurePolicy (exit code {exit_code})"),
'''

DRIVER = textwrap.dedent('''
    from rft_contract import names
    from rft_contract.failures import FAILURE_ACTIONS
    from rft_contract.spec import parse_spec
    from rft_operator import failure_policy, gang
    from tests.unit.testing import NOW, REF, SPEC, pod, status

    # The one handler (here the fatal one's), and the classification that gives the verdict.
    gang.ACTIONS["parked"] = gang.ACTIONS["fatal"]
    real = failure_policy.classify_failure
    failure_policy.classify_failure = lambda code, *rest: "parked" if code == 42 else real(code, *rest)
    g = gang.compute_gang(REF, parse_spec(SPEC), "", status(names.RUNNING), [pod(1, 0), pod(1, 1, "Failed", 42)], NOW)
    print(g.phase, g.failed_reason, g.status["lastFailure"]["exitCode"], "|", g.events[-1].message)
''')


def test_a_new_action_is_one_catalogue_line_and_one_handler(tmp_path):
    out = catalogues.run(catalogues.with_entry(tmp_path, "failures", NEW_ACTION), "-c", DRIVER)
    phase_reason_code, message = out.strip().split(" | ")
    assert phase_reason_code == f"{names.FAILED} Parked 42"
    assert message.endswith("; parked by spec.failurePolicy (exit code 42)")
