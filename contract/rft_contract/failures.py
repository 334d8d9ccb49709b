"""The failure-action catalogue: what the operator does with each verdict the failure policy
gives a failed attempt (torch-free; the single place these facts live).

`rft_operator.failure_policy` classifies a failure into one of these names;
`rft_operator.gang.ACTIONS` maps each name to its handler, as JobSet's `actionFunctionMap`
does, and the handler's message and reason come from the entry (tests/unit/
test_failure_actions.py checks that each handler does what its entry's `restarts` and
`uses_budget` say). Adding an action is one
line here, one handler in `gang.ACTIONS`, and the classification that gives it
(docs/design.md, "How to add").
"""

from __future__ import annotations

from dataclasses import dataclass

from . import names


@dataclass(frozen=True)
class FailureAction:
    name: str  # the verdict (failure_policy.classify_failure)
    restarts: bool  # the gang restarts after spec.failurePolicy.backoffSeconds; else the job fails
    uses_budget: bool  # counted in status.restarts against spec.failurePolicy.maxRestarts
    reason: str  # the reason of the Restarting or Failed condition and its Warning event
    # What the message adds to the failure's own, naming the spec's fields that decided it;
    # formatted with exit_code, restarts, disruptions and max_restarts.
    message: str
    exhausted: str | None = None  # the same when the budget is spent (uses_budget only): the job fails


FAILURE_ACTIONS: dict[str, FailureAction] = {a.name: a for a in (
    FailureAction("fatal", restarts=False, uses_budget=False, reason=names.REASON_FATAL_EXIT,
                  message="exit code {exit_code} is fatal under spec.failurePolicy (fatalExitCodes/"
                          "retryableExitCodes); fix the cause and create the job again"),
    FailureAction("retryable", restarts=True, uses_budget=True, reason=names.REASON_RESTARTING,
                  message="restart {restarts}/{max_restarts} (spec.failurePolicy.maxRestarts)",
                  exhausted="restart budget exhausted after {restarts} restarts "
                            "(spec.failurePolicy.maxRestarts={max_restarts})"),
    FailureAction("disrupted", restarts=True, uses_budget=False, reason=names.REASON_POD_DISRUPTED,
                  message="disruption {disruptions}, restarting without using spec.failurePolicy.maxRestarts"),
)}

# The verdicts the failure policy gives today (failure_policy.classify_failure).
FATAL, RETRYABLE, DISRUPTED = "fatal", "retryable", "disrupted"
assert {FATAL, RETRYABLE, DISRUPTED} <= set(FAILURE_ACTIONS)
