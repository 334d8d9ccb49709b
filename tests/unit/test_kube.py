"""`Kube`'s requests as the API server sees them: method, path, query, content type, the
bearer token, the JSON body; and what each status code becomes. The client's REST layer
is replaced by a recorder (the integration tests talk to a real API server)."""

from __future__ import annotations

import json

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from rft_operator.kube import Conflict, Kube, api_message


class Response:
    def __init__(self, status: int, body: dict):
        self.status, self.reason, self.data, self.headers = status, "R", json.dumps(body).encode(), {}

    def read(self):
        return self.data


def kube_answering(*answers: tuple[int, dict]):
    config = kubernetes.client.Configuration()
    config.host = "https://api.example:6443"
    config.api_key = {"authorization": "Bearer t0ken"}
    kube = Kube(kubernetes.client.ApiClient(config))
    sent = []
    queue = list(answers)

    def request(method, url, headers=None, body=None, post_params=None, _request_timeout=None):
        sent.append({"method": method, "url": url, "headers": headers, "body": body})
        return Response(*queue.pop(0))

    kube.client.rest_client.request = request
    return kube, sent


POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p-0", "namespace": "team-a"},
       "spec": {"containers": [{"name": "trainer", "image": "x", "unknownField": 1}]}}


def test_create_posts_the_object_as_is_with_the_token():
    kube, sent = kube_answering((201, {}))
    assert kube.create(POD) is True
    assert sent[0]["method"] == "POST"
    assert sent[0]["url"] == "https://api.example:6443/api/v1/namespaces/team-a/pods"
    assert sent[0]["headers"]["authorization"] == "Bearer t0ken"
    assert sent[0]["headers"]["Content-Type"] == "application/json"
    assert sent[0]["body"] == POD  # not run through the typed models: unknown fields stay
    assert kube.requests == 1


def test_a_name_taken_is_false_and_a_refusal_carries_the_servers_message():
    kube, sent = kube_answering((409, {"message": "exists"}), (422, {"message": "spec.containers[0].image: Required"}))
    assert kube.create(POD) is False
    with pytest.raises(ApiException) as e:
        kube.create(POD)
    assert e.value.status == 422 and api_message(e.value) == "spec.containers[0].image: Required"


def test_rbac_children_and_drift_patches():
    kube, sent = kube_answering((200, {}))
    role = {"kind": "Role", "metadata": {"name": "r", "namespace": "ns"}, "rules": []}
    kube.merge_patch(role)
    assert sent[0]["method"] == "PATCH"
    assert sent[0]["url"].endswith("/apis/rbac.authorization.k8s.io/v1/namespaces/ns/roles/r")
    assert sent[0]["headers"]["Content-Type"] == "application/merge-patch+json"


def test_status_patch_carries_the_resource_version_and_a_conflict_says_so():
    kube, sent = kube_answering((200, {"metadata": {"resourceVersion": "43"}}), (409, {"message": "changed"}))
    assert kube.patch_status("ns", "demo", {"phase": "Running"}, "42") == "43"
    assert sent[0]["url"].endswith("/apis/rft.dev/v1alpha1/namespaces/ns/rftjobs/demo/status")
    assert sent[0]["body"] == {"metadata": {"resourceVersion": "42"}, "status": {"phase": "Running"}}
    with pytest.raises(Conflict):
        kube.patch_status("ns", "demo", {}, "42")


def test_deletes_gone_already_are_fine_and_force_deletion_sets_the_grace_period():
    kube, sent = kube_answering((404, {}), (200, {}), (404, {}))
    kube.delete_pod("ns", "p-0")
    kube.delete_pod("ns", "p-1", grace_period_seconds=0)
    kube.delete({"kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ns"}})
    assert [x["method"] for x in sent] == ["DELETE"] * 3
    assert sent[1]["url"].endswith("/api/v1/namespaces/ns/pods/p-1?gracePeriodSeconds=0")
    assert sent[2]["url"].endswith("/api/v1/namespaces/ns/configmaps/c")


def test_reads_return_plain_dicts_and_a_missing_node_is_none():
    kube, sent = kube_answering((200, {"kind": "ConfigMap", "data": {"a": "b"}}), (404, {}), (403, {}))
    assert kube.read("ConfigMap", "ns", "c") == {"kind": "ConfigMap", "data": {"a": "b"}}
    assert kube.read_node("gone") is None
    with pytest.raises(ApiException):
        kube.read_node("forbidden")
    assert sent[0]["method"] == "GET" and sent[1]["url"].endswith("/api/v1/nodes/gone")
