"""The owner webhook's answers (rft_operator.ownerhook.review), without a server; the API
server calling it is tests/integration/test_owner_webhook.py."""

from __future__ import annotations

from rft_contract import names as c
from rft_operator import ownerhook

UID = "0b5c1f3e-real"
JOBS = {("ns", "real"): {"metadata": {"name": "real", "uid": UID}}}


def get_job(namespace: str, name: str):
    return JOBS.get((namespace, name))


def request(obj: dict, resource: str = "pods", operation: str = "CREATE") -> dict:
    return {"request": {"uid": "r1", "operation": operation, "namespace": "ns",
                        "resource": {"resource": resource}, "object": obj}}


def child(job: str, *uids: str) -> dict:
    return {"metadata": {"labels": {c.LABEL_JOB: job, c.LABEL_MANAGED_BY: c.MANAGED_BY},
                         "ownerReferences": [{"kind": c.KIND, "name": job, "uid": u} for u in uids]}}


def answer(body: dict, lookup=get_job) -> dict:
    out = ownerhook.review(body, lookup)
    assert out["kind"] == "AdmissionReview" and out["response"]["uid"] == "r1"
    return out["response"]


def test_a_real_jobs_child_is_admitted():
    assert answer(request(child("real", UID))) == {"uid": "r1", "allowed": True}


def test_a_made_up_job_is_refused_by_name():
    got = answer(request(child("ghost", "some-uid")))
    assert not got["allowed"] and got["status"]["code"] == 403
    assert "there is no RFTJob ns/ghost" in got["status"]["message"]


def test_another_uid_or_a_second_owner_is_refused():
    for obj in (child("real", "forged"), child("real", UID, "forged"), child("real")):
        got = answer(request(obj))
        assert not got["allowed"] and f"has uid {UID}" in got["status"]["message"], obj


def test_events_are_checked_by_their_object():
    event = {"metadata": {"labels": {c.LABEL_JOB: "real"}}, "involvedObject": {"name": "real", "uid": UID}}
    assert answer(request(event, "events"))["allowed"]
    event["involvedObject"]["uid"] = "forged"
    assert not answer(request(event, "events"))["allowed"]
    regarding = {"metadata": {"labels": {c.LABEL_JOB: "real"}}, "regarding": {"name": "real", "uid": UID}}
    assert answer(request(regarding, "events"))["allowed"]


def test_no_job_label_is_refused():
    got = answer(request({"metadata": {"labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY}}}))
    assert not got["allowed"] and c.LABEL_JOB in got["status"]["message"]


def test_a_failed_lookup_fails_closed_and_says_why():
    def broken(namespace: str, name: str):
        raise TimeoutError("read timed out")

    got = answer(request(child("real", UID)), broken)
    assert not got["allowed"] and "TimeoutError: read timed out" in got["status"]["message"]


def test_only_creates_are_checked():
    assert answer(request(child("ghost", "x"), operation="UPDATE"))["allowed"]


def test_the_configuration_fails_closed_for_the_operators_labelled_objects_only():
    config = ownerhook.webhook_configuration(b"CA", url="https://127.0.0.1:1")
    hook = config["webhooks"][0]
    assert hook["failurePolicy"] == "Fail" and hook["clientConfig"]["url"] == "https://127.0.0.1:1/validate-owner"
    assert hook["objectSelector"] == {"matchLabels": {c.LABEL_MANAGED_BY: c.MANAGED_BY}}
    assert [m["name"] for m in hook["matchConditions"]] == ["operator-identity"]
    assert {p for r in hook["rules"] for p in r["resources"]} == set(ownerhook.RESOURCES)
    assert all(r["operations"] == ["CREATE"] for r in hook["rules"])
