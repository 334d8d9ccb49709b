"""Generate the ValidatingAdmissionPolicies that narrow what RBAC alone cannot.

    python -m rft_operator.policygen > manifests/base/admission-policies.yaml

RBAC grants verbs on resources; it cannot say "only the trainer's subtree of the status"
or "only objects this operator manages". Two policies (built into the API server since
1.30, evaluated in it, no webhook to run) close that gap:

* `rftjob-status-writers`: a job's pods patch its status as their role's ServiceAccount
  `<job>-rft-<role>`. The trainer may change only `status.trainer`; a sync agent only
  its own pod's entry `status.weightSync.replicas[<pod>]` (the pod name comes from the
  bound token, not from the request); explorers nothing.
* `rftjob-operator-scope`: the operator's identity may create, change and delete only
  objects it manages (labelled, controlled by the RFTJob its label names), run pods only
  as that job's own ServiceAccounts, never privileged, on host namespaces or ports, bound
  to a node by name or given a whole Secret, a host path only as a trainer's model cache,
  and nothing beyond the Pod Security baseline unless a cluster admin labelled the
  namespace `rft.dev/pod-security=privileged`; create only ClusterIP Services without
  external IPs, Roles that reach no further than the job itself, and nothing in the
  kube-* namespaces.

The field lists come from the status model (`rft_contract.status`), so a new status field
is covered without editing CEL by hand; the test suite fails when the committed file
differs from this output.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from rft_contract import names as c
from rft_contract.checks import BASELINE_CAPABILITIES
from rft_contract.status import RFTJobStatus, WeightSyncStatus

SA_PREFIX = "system:serviceaccount:"
OPERATOR_SA = "rftjob-operator"
PROTECTED_NAMESPACES = ("kube-system", "kube-public", "kube-node-lease")
POD_ROLES = (c.ROLE_TRAINER, c.ROLE_INFERENCE, c.ROLE_EXPLORER)
# A cluster admin's consent, on a namespace, to job pods beyond the Pod Security baseline.
POD_SECURITY_LABEL = "rft.dev/pod-security"
MODEL_CACHE_VOLUME = "model-cache"
STATUS_POLICY = "rftjob-status-writers"
OPERATOR_POLICY = "rftjob-operator-scope"


def _aliases(model: type) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _kept(path: str, fields: list[str]) -> str:
    """CEL: each field under `path` is the same before and after (absent stays absent)."""
    return " && ".join(f"object.{path}.?{f} == oldObject.{path}.?{f}" for f in fields)


def _list(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(f"'{x}'" for x in items) + "]"


def _policy(name: str, resource_rules: list[dict[str, Any]], body: dict[str, Any]) -> dict[str, Any]:
    """A ValidatingAdmissionPolicy that fails closed, matching `resource_rules`; `body` holds
    its matchConditions, variables and validations."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": resource_rules}, **body},
    }


def _rule(expression: str, message: str, reason: str = "Forbidden") -> dict[str, str]:
    return {"expression": expression, "message": message, "reason": reason}


def status_policy() -> dict[str, Any]:
    status_fields = _aliases(RFTJobStatus)
    others = lambda *keep: [f for f in status_fields if f not in keep]  # noqa: E731
    sync_fields = [f for f in _aliases(WeightSyncStatus) if f != "replicas"]
    prefix = f"'{SA_PREFIX}' + request.namespace + ':' + object.metadata.name + '{c.SA_INFIX}'"
    return _policy(STATUS_POLICY, [{
        "apiGroups": [c.GROUP], "apiVersions": ["*"], "operations": ["UPDATE"],
        "resources": [f"{c.PLURAL}/status"],
    }], {
        # Only the job's own pod identities; the operator and people are not narrowed here.
        "matchConditions": [{"name": "job-pod-identity",
                             "expression": f"request.userInfo.username.startsWith({prefix})"}],
        "variables": [
            {"name": "role", "expression": f"request.userInfo.username.substring(({prefix}).size())"},
            # Set by the API server on tokens bound to a pod; absent otherwise.
            {"name": "pod", "expression": "request.userInfo.?extra[?'authentication.kubernetes.io/pod-name']"
                                          ".orValue(['']).join(',')"},
            {"name": "trainerKept", "expression": _kept("?status", ["trainer"])},
            {"name": "operatorKept", "expression": _kept("?status", others("trainer", "weightSync"))},
            {"name": "syncTargetKept", "expression": _kept("?status.?weightSync", sync_fields)},
            {"name": "replicas", "expression": "object.?status.?weightSync.?replicas.orValue({})"},
            {"name": "oldReplicas", "expression": "oldObject.?status.?weightSync.?replicas.orValue({})"},
            # Every replica entry but `variables.pod`'s is unchanged (none added or removed).
            {"name": "replicasKeptBut", "expression":
             "variables.replicas.all(k, k == variables.pod || (k in variables.oldReplicas && "
             "variables.replicas[k] == variables.oldReplicas[k])) && "
             "variables.oldReplicas.all(k, k == variables.pod || k in variables.replicas)"},
        ],
        "validations": [
            _rule(f"variables.role in {_list([c.ROLE_TRAINER, c.ROLE_INFERENCE])}",
                  "this identity may read the RFTJob but not write its status"),
            _rule(f"variables.role != '{c.ROLE_TRAINER}' || (variables.operatorKept && variables.syncTargetKept "
                  "&& variables.replicas == variables.oldReplicas)",
                  "the trainer's identity may change only status.trainer"),
            _rule(f"variables.role != '{c.ROLE_INFERENCE}' || "
                  f"variables.pod.startsWith(object.metadata.name + '-{c.ROLE_INFERENCE}-')",
                  "a sync agent must use its pod's bound token (the pod name keys its entry)"),
            _rule(f"variables.role != '{c.ROLE_INFERENCE}' || (variables.operatorKept && variables.trainerKept "
                  "&& variables.syncTargetKept && variables.replicasKeptBut)",
                  "a sync agent may change only its own pod's entry, status.weightSync.replicas[<pod>]"),
        ],
    })


def operator_policy() -> dict[str, Any]:
    job_label = f"variables.obj.metadata.?labels[?'{c.LABEL_JOB}'].orValue('')"
    managed = (
        f"obj.metadata.?labels[?'{c.LABEL_MANAGED_BY}'].orValue('') == '{c.MANAGED_BY}' && "
        f"obj.metadata.?labels[?'{c.LABEL_JOB}'].orValue('') != '' && "
        f"obj.metadata.?ownerReferences.orValue([]).exists(r, r.kind == '{c.KIND}' && "
        f"r.apiVersion.startsWith('{c.GROUP}/') && r.?controller.orValue(false) && "
        f"r.name == obj.metadata.labels['{c.LABEL_JOB}'])"
    )
    writes = "request.operation != 'DELETE'"
    kind = lambda plural: f"request.resource.resource == '{plural}'"  # noqa: E731
    pod_write = f"({kind('pods')} && {writes})"
    privileged_namespace = f"namespaceObject.metadata.?labels[?'{POD_SECURITY_LABEL}'].orValue('') == 'privileged'"
    sa_prefix = f"variables.job + '{c.SA_INFIX}'"
    return _policy(OPERATOR_POLICY, [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE", "DELETE"],
         "resources": ["pods", "services", "configmaps", "serviceaccounts"]},
        {"apiGroups": ["rbac.authorization.k8s.io"], "apiVersions": ["v1"],
         "operations": ["CREATE", "UPDATE", "DELETE"], "resources": ["roles", "rolebindings"]},
    ], {
        # Any ServiceAccount named like the operator's: matching more identities only
        # narrows more, and the install's namespace may be renamed by kustomize.
        "matchConditions": [{"name": "operator-identity", "expression":
                             f"request.userInfo.username.startsWith('{SA_PREFIX}') && "
                             f"request.userInfo.username.endsWith(':{OPERATOR_SA}')"}],
        "variables": [
            {"name": "obj", "expression": "request.operation == 'DELETE' ? oldObject : object"},
            {"name": "job", "expression": job_label},
            {"name": "managed", "expression": managed.replace("obj.", "variables.obj.")},
            {"name": "wasManaged", "expression": "request.operation != 'UPDATE' || ("
                                                 + managed.replace("obj.", "oldObject.") + ")"},
            # A pod being created: its containers (ephemeral ones come through a
            # subresource the operator holds no right to), else nothing.
            {"name": "containers", "expression": f"{pod_write} ? variables.obj.spec.containers + "
                                                 "variables.obj.spec.?initContainers.orValue([]) : []"},
            {"name": "volumes", "expression": f"{pod_write} ? variables.obj.spec.?volumes.orValue([]) : []"},
        ],
        "validations": [
            _rule(f"!(request.namespace in {_list(PROTECTED_NAMESPACES)})",
                  "the rftjob-operator does not act in the kube-* namespaces"),
            _rule("variables.managed && variables.wasManaged",
                  f"the rftjob-operator may only touch objects it manages: labels {c.LABEL_MANAGED_BY}="
                  f"{c.MANAGED_BY} and {c.LABEL_JOB}=<job>, controlled by that RFTJob"),
            _rule(f"!({kind('pods')} && {writes}) || (variables.obj.metadata.?labels[?'{c.LABEL_ROLE}']"
                  f".orValue('') in {_list(POD_ROLES)} && variables.obj.spec.?serviceAccountName.orValue('') == "
                  f"{sa_prefix} + variables.obj.metadata.labels['{c.LABEL_ROLE}'])",
                  "the rftjob-operator runs a job's pods only as that job's own ServiceAccount "
                  "<job>-rft-<role>"),
            _rule(f"!{pod_write} || !(has(variables.obj.spec.nodeName) || "
                  "variables.obj.spec.?hostNetwork.orValue(false) || variables.obj.spec.?hostPID.orValue(false) || "
                  "variables.obj.spec.?hostIPC.orValue(false) || variables.containers.exists(x, "
                  "x.?securityContext.?privileged.orValue(false) || "
                  "x.?ports.orValue([]).exists(p, p.?hostPort.orValue(0) != 0)))",
                  "the rftjob-operator never creates privileged pods, pods in the host's namespaces or "
                  "on its ports, or pods bound to a node by name"),
            _rule("variables.volumes.all(v, !has(v.secret) && v.?projected.?sources.orValue([]).all(s, "
                  "!has(s.secret))) && variables.containers.all(x, x.?envFrom.orValue([]).all(e, "
                  "!has(e.secretRef)))",
                  "the rftjob-operator passes a Secret to pods only key by key (secretKeyRef), "
                  "never whole"),
            _rule(f"variables.volumes.all(v, !has(v.hostPath) || (v.name == '{MODEL_CACHE_VOLUME}' && "
                  f"variables.obj.metadata.labels['{c.LABEL_ROLE}'] == '{c.ROLE_TRAINER}'))",
                  "the rftjob-operator mounts a host path only as a trainer pod's model cache"),
            _rule(f"!{pod_write} || {privileged_namespace} || (variables.volumes.all(v, !has(v.hostPath)) && "
                  f"{_unconfined('variables.obj.spec')} && variables.containers.all(x, "
                  f"{_unconfined('x')} && x.?securityContext.?capabilities.?add.orValue([]).all(cap, "
                  f"cap in {_list(BASELINE_CAPABILITIES)})))",
                  f"pod settings beyond the Pod Security baseline profile (spec.trainer.securityContext."
                  f"allowPrivileged: hostPath model cache, Unconfined seccomp, other capabilities) need "
                  f"the namespace label {POD_SECURITY_LABEL}=privileged, which a cluster admin sets",
                  reason="Invalid"),
            _rule(f"!({kind('services')} && {writes}) || (variables.obj.spec.?type.orValue('ClusterIP') == "
                  "'ClusterIP' && variables.obj.spec.?externalIPs.orValue([]).size() == 0)",
                  "the rftjob-operator creates only ClusterIP Services without externalIPs"),
            _rule(f"!({kind('serviceaccounts')} && {writes}) || "
                  f"variables.obj.metadata.name.startsWith({sa_prefix})",
                  "the rftjob-operator names ServiceAccounts <job>-rft-<role>"),
            _rule(f"!({kind('configmaps')} && {writes}) || variables.obj.metadata.name == variables.job + "
                  "'-config'",
                  "the rftjob-operator creates only the ConfigMap <job>-config"),
            _rule(f"!({kind('roles')} && {writes}) || variables.obj.rules.all(r, r.apiGroups == ['{c.GROUP}'] "
                  f"&& r.?resourceNames.orValue([]) == [variables.job] && r.resources.all(x, x in "
                  f"{_list([c.PLURAL, c.PLURAL + '/status'])}) && r.verbs.all(v, v in "
                  f"{_list(['get', 'list', 'watch', 'patch'])}))",
                  "the rftjob-operator's Roles reach only the RFTJob they belong to"),
            _rule(f"!({kind('rolebindings')} && {writes}) || (variables.obj.roleRef.kind == 'Role' && "
                  "variables.obj.roleRef.name.startsWith(variables.job + '-status-') && "
                  "variables.obj.?subjects.orValue([]).all(s, s.kind == 'ServiceAccount' && "
                  f"s.?namespace.orValue('') == request.namespace && s.name.startsWith({sa_prefix})))",
                  "the rftjob-operator binds only the job's own Roles to the job's own ServiceAccounts"),
        ],
    })


def _unconfined(owner: str) -> str:
    """CEL: `owner`'s securityContext does not ask for an Unconfined seccomp profile."""
    return f"{owner}.?securityContext.?seccompProfile.?type.orValue('') != 'Unconfined'"


def _binding(policy: str) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy},
        "spec": {"policyName": policy, "validationActions": ["Deny"]},
    }


def render() -> str:
    header = ("# Generated by `python -m rft_operator.policygen` from rft_contract/status.py. Do not edit.\n"
              "# See the module's docstring and README's Security section.\n")
    docs = [status_policy(), _binding(STATUS_POLICY), operator_policy(), _binding(OPERATOR_POLICY)]
    return header + yaml.safe_dump_all(docs, sort_keys=False, width=100)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
