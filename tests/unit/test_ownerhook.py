"""The owner webhook's answers (rft_operator.ownerhook.review), without a server; the API
server calling it is tests/integration/test_owner_webhook.py."""

from __future__ import annotations

import http.client
import json
import os
import ssl
import urllib.error
import urllib.request

import pytest

from rft_contract import names
from rft_operator import ownerhook

UID = "0b5c1f3e-real"
JOBS = {("ns", "real"): {"metadata": {"name": "real", "uid": UID}}}


def get_job(namespace: str, name: str):
    return JOBS.get((namespace, name))


def request(obj: dict, resource: str = "pods", operation: str = "CREATE") -> dict:
    return {"request": {"uid": "r1", "operation": operation, "namespace": "ns",
                        "resource": {"resource": resource}, "object": obj}}


def child(job: str, *uids: str) -> dict:
    return {"metadata": {"labels": {names.LABEL_JOB: job, names.LABEL_MANAGED_BY: names.MANAGED_BY},
                         "ownerReferences": [{"kind": names.KIND, "name": job, "uid": u} for u in uids]}}


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
        assert not got["allowed"] and "is not RFTJob ns/real's" in got["status"]["message"], obj
    # Only what the caller sent comes back: nothing about the real job to whoever asks.
    assert UID not in answer(request(child("real", "forged")))["status"]["message"]


def test_events_are_checked_by_their_object():
    event = {"metadata": {"labels": {names.LABEL_JOB: "real"}}, "involvedObject": {"name": "real", "uid": UID}}
    assert answer(request(event, "events"))["allowed"]
    event["involvedObject"]["uid"] = "forged"
    assert not answer(request(event, "events"))["allowed"]
    regarding = {"metadata": {"labels": {names.LABEL_JOB: "real"}}, "regarding": {"name": "real", "uid": UID}}
    assert answer(request(regarding, "events"))["allowed"]


def test_no_job_label_is_refused():
    got = answer(request({"metadata": {"labels": {names.LABEL_MANAGED_BY: names.MANAGED_BY}}}))
    assert not got["allowed"] and names.LABEL_JOB in got["status"]["message"]


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
    assert hook["objectSelector"] == {"matchLabels": {names.LABEL_MANAGED_BY: names.MANAGED_BY}}
    assert [m["name"] for m in hook["matchConditions"]] == ["operator-identity"]
    assert {p for r in hook["rules"] for p in r["resources"]} == {*ownerhook.RESOURCES, "workloads"}  # + Kueue's
    assert all(r["operations"] == ["CREATE"] for r in hook["rules"])


def _post(port: int, ca: bytes, body: bytes, path: str = ownerhook.PATH) -> tuple[int, bytes]:
    context = ssl.create_default_context(cadata=ca.decode())
    context.verify_flags |= ssl.VERIFY_X509_STRICT  # Python 3.13's default
    request = urllib.request.Request(f"https://127.0.0.1:{port}{path}", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_server_answers_refuses_junk_and_presents_a_rotated_pair(tmp_path):
    ca, cert, key = ownerhook.serving_pair(["127.0.0.1"])
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    server = ownerhook.OwnerWebhook(0, tmp_path, get_job, addr="127.0.0.1")
    try:
        code, body = _post(server.port, ca, json.dumps(request(child("ghost", "x"))).encode())
        assert code == 200 and not json.loads(body)["response"]["allowed"]
        assert _post(server.port, ca, b"[]")[0] == 400
        assert _post(server.port, ca, b"{}", path="/other")[0] == 404
        # A body too large is refused from its header, before a byte of it is read.
        context = ssl.create_default_context(cadata=ca.decode())
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=context, timeout=10)
        conn.putrequest("POST", ownerhook.PATH)
        conn.putheader("Content-Length", str(ownerhook.MAX_BODY + 1))
        conn.endheaders()
        assert conn.getresponse().status == 413
        conn.close()
        # A new pair on disk is what the next handshake presents; the old CA no longer verifies.
        ca2, cert2, key2 = ownerhook.serving_pair(["127.0.0.1"])
        (tmp_path / "tls.key").write_bytes(key2)
        (tmp_path / "tls.crt").write_bytes(cert2)
        os.utime(tmp_path / "tls.crt", (1, 1))  # a different stamp even within one clock tick
        assert _post(server.port, ca2, json.dumps(request(child("real", UID))).encode())[0] == 200
        with pytest.raises(urllib.error.URLError):
            _post(server.port, ca, b"{}")
    finally:
        server.stop()
