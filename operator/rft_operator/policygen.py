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

What no policy can do cheaply is look the RFTJob up by the name an object claims: a
policy with parameters (`paramRef.selector`) is evaluated once per RFTJob of the
namespace, for every request, which made each wave of jobs quadratic (issue 38), and still
cannot see that *no* RFTJob has a made-up name. The owner webhook (ownerhook.py, in every
install) does that with one lookup: the RFTJob exists with the uid the object's one
controller reference carries, and a pod is one its spec renders (Secrets, model cache,
host path, capabilities, seccomp profile), in a privileged namespace too.

The field lists come from the status model (`rft_contract.status`), so a new status field
is covered without editing CEL by hand; the test suite fails when the committed file
differs from this output.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from rft_contract import names
from rft_contract.checks import BASELINE_CAPABILITIES
from rft_contract.status import RFTJobStatus, WeightSyncStatus

from .queueing import GROUP as KUEUE_GROUP, VERSION as KUEUE_VERSION

SA_PREFIX = "system:serviceaccount:"
OPERATOR_SA = "rftjob-operator"
PROTECTED_NAMESPACES = ("kube-system", "kube-public", "kube-node-lease")
POD_ROLES = (names.ROLE_TRAINER, names.ROLE_INFERENCE, names.ROLE_EXPLORER)
# A cluster admin's consent, on a namespace, to job pods beyond the Pod Security baseline.
POD_SECURITY_LABEL = "rft.dev/pod-security"
MODEL_CACHE_VOLUME = "model-cache"
# The Pod Security levels a job namespace must enforce (c.PSA_ENFORCE_LABEL): the API
# server's own PodSecurity plugin then checks every field of that standard.
PSA_LEVELS = ("baseline", "restricted")
STATUS_POLICY = "rftjob-status-writers"
OPERATOR_POLICY = "rftjob-operator-scope"
OPERATOR_STATUS_POLICY = "rftjob-operator-status"
OPERATOR_IDENTITY = {"name": "operator-identity", "expression":
                     f"request.userInfo.username.startsWith('{SA_PREFIX}') && "
                     f"request.userInfo.username.endsWith(':{OPERATOR_SA}')"}
# The operator's status writes: it seeds status.trainer once (kubectl's columns) with these.
OPERATOR_SEEDED_TRAINER_FIELDS = ("totalSteps", "progress")


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
    prefix = f"'{SA_PREFIX}' + request.namespace + ':' + object.metadata.name + '{names.SA_INFIX}'"
    return _policy(STATUS_POLICY, [{
        "apiGroups": [names.GROUP], "apiVersions": ["*"], "operations": ["UPDATE"],
        "resources": [f"{names.PLURAL}/status"],
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
            _rule(f"variables.role in {_list([names.ROLE_TRAINER, names.ROLE_INFERENCE])}",
                  "this identity may read the RFTJob but not write its status"),
            _rule(f"variables.role != '{names.ROLE_TRAINER}' || (variables.operatorKept && variables.syncTargetKept "
                  "&& variables.replicas == variables.oldReplicas)",
                  "the trainer's identity may change only status.trainer"),
            _rule(f"variables.role != '{names.ROLE_INFERENCE}' || "
                  f"variables.pod.startsWith(object.metadata.name + '-{names.ROLE_INFERENCE}-')",
                  "a sync agent must use its pod's bound token (the pod name keys its entry)"),
            _rule(f"variables.role != '{names.ROLE_INFERENCE}' || (variables.operatorKept && variables.trainerKept "
                  "&& variables.syncTargetKept && variables.replicasKeptBut)",
                  "a sync agent may change only its own pod's entry, status.weightSync.replicas[<pod>]"),
        ],
    })


def operator_status_policy() -> dict[str, Any]:
    """The operator's identity writes only its own parts of the status: never the trainer's
    subtree (but for seeding it once) or a sync agent's entry (it only prunes entries of
    pods that are no longer replicas)."""
    seeded = _list(OPERATOR_SEEDED_TRAINER_FIELDS)
    return _policy(OPERATOR_STATUS_POLICY, [{
        "apiGroups": [names.GROUP], "apiVersions": ["*"], "operations": ["UPDATE"],
        "resources": [f"{names.PLURAL}/status"],
    }], {
        "matchConditions": [OPERATOR_IDENTITY],
        "variables": [
            {"name": "replicas", "expression": "object.?status.?weightSync.?replicas.orValue({})"},
            {"name": "oldReplicas", "expression": "oldObject.?status.?weightSync.?replicas.orValue({})"},
        ],
        "validations": [
            _rule("object.?status.?trainer == oldObject.?status.?trainer || "
                  "(!has(oldObject.status) || !has(oldObject.status.trainer) || "
                  "oldObject.status.trainer.?progress.orValue('') == '') && "
                  f"object.status.trainer.all(k, k in {seeded})",
                  "the rftjob-operator's identity may not write status.trainer (the trainer's; it only seeds "
                  "totalSteps and progress once)"),
            _rule("variables.replicas.all(k, k in variables.oldReplicas && "
                  "variables.replicas[k] == variables.oldReplicas[k])",
                  "the rftjob-operator's identity may not write status.weightSync.replicas entries (each sync "
                  "agent's own; it only removes those of pods that are gone)"),
        ],
    })


def operator_policy() -> dict[str, Any]:
    job_label = f"variables.obj.metadata.?labels[?'{names.LABEL_JOB}'].orValue('')"
    managed = (
        f"obj.metadata.?labels[?'{names.LABEL_MANAGED_BY}'].orValue('') == '{names.MANAGED_BY}' && "
        f"obj.metadata.?labels[?'{names.LABEL_JOB}'].orValue('') != '' && "
        f"obj.metadata.?ownerReferences.orValue([]).exists(r, r.kind == '{names.KIND}' && "
        f"r.apiVersion.startsWith('{names.GROUP}/') && r.?controller.orValue(false) && "
        f"r.name == obj.metadata.labels['{names.LABEL_JOB}'])"
    )
    writes = "request.operation != 'DELETE'"
    kind = lambda plural: f"request.resource.resource == '{plural}'"  # noqa: E731
    pod_write = f"({kind('pods')} && {writes})"
    privileged_namespace = f"namespaceObject.metadata.?labels[?'{POD_SECURITY_LABEL}'].orValue('') == 'privileged'"
    sa_prefix = f"variables.job + '{names.SA_INFIX}'"
    events = f"({kind('events')})"
    return _policy(OPERATOR_POLICY, [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE", "DELETE"],
         "resources": ["pods", "services", "configmaps", "serviceaccounts"]},
        {"apiGroups": ["rbac.authorization.k8s.io"], "apiVersions": ["v1"],
         "operations": ["CREATE", "UPDATE", "DELETE"], "resources": ["roles", "rolebindings"]},
        {"apiGroups": ["", "events.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
         "resources": ["events"]},
        # Kueue's Workloads of queued jobs (queueing.py), their status included.
        {"apiGroups": [KUEUE_GROUP], "apiVersions": [KUEUE_VERSION], "operations": ["CREATE", "UPDATE", "DELETE"],
         "resources": ["workloads", "workloads/status"]},
    ], {
        # Any ServiceAccount named like the operator's: matching more identities only
        # narrows more, and the install's namespace may be renamed by kustomize.
        "matchConditions": [OPERATOR_IDENTITY],
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
            {"name": "owners", "expression": "variables.obj.metadata.?ownerReferences.orValue([])"},
            # An Event's object: core/v1 `involvedObject`, events.k8s.io/v1 `regarding`.
            {"name": "about", "expression": f"!{events} ? {{}} : "
                                            "(has(variables.obj.involvedObject) ? variables.obj.involvedObject : "
                                            "variables.obj.?regarding.orValue({}))"},
        ],
        "validations": [
            _rule(f"!(request.namespace in {_list(PROTECTED_NAMESPACES)})",
                  "the rftjob-operator does not act in the kube-* namespaces"),
            _rule(f"{events} || (variables.managed && variables.wasManaged)",
                  f"the rftjob-operator may only touch objects it manages: labels {names.LABEL_MANAGED_BY}="
                  f"{names.MANAGED_BY} and {names.LABEL_JOB}=<job>, controlled by that RFTJob"),
            _rule(f"{events} || request.operation == 'DELETE' || variables.owners.size() == 1",
                  "the rftjob-operator's objects have exactly one owner reference, their RFTJob's "
                  "(another owner would outlive the job for the garbage collector)"),
            # Labelled like its children, so that the owner webhook checks them too.
            _rule(f"!{events} || (variables.about.?kind.orValue('') == '{names.KIND}' && "
                  f"variables.about.?apiVersion.orValue('').startsWith('{names.GROUP}/') && "
                  "variables.about.?namespace.orValue(request.namespace) == request.namespace && "
                  f"variables.obj.metadata.?labels[?'{names.LABEL_MANAGED_BY}'].orValue('') == '{names.MANAGED_BY}' && "
                  f"variables.job == variables.about.?name.orValue(''))",
                  "the rftjob-operator posts Events only about the RFTJobs of the namespace (labelled "
                  f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY} and {names.LABEL_JOB}=<the job>)"),
            _rule(f"!({kind('pods')} && {writes}) || (variables.obj.metadata.?labels[?'{names.LABEL_ROLE}']"
                  f".orValue('') in {_list(POD_ROLES)} && variables.obj.spec.?serviceAccountName.orValue('') == "
                  f"{sa_prefix} + variables.obj.metadata.labels['{names.LABEL_ROLE}'])",
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
                  f"variables.obj.metadata.labels['{names.LABEL_ROLE}'] == '{names.ROLE_TRAINER}'))",
                  "the rftjob-operator mounts a host path only as a trainer pod's model cache"),
            _rule(f"!{pod_write} || {privileged_namespace} || variables.containers.all(x, "
                  "x.?securityContext.?procMount.orValue('Default') == 'Default')",
                  "the rftjob-operator's containers see a masked /proc (procMount Default; Pod Security's "
                  "baseline allows Unmasked in a user namespace, no job needs it)", reason="Invalid"),
            _rule(_volumes_rendered(),
                  "the rftjob-operator mounts only what the job's spec renders: emptyDirs, the ConfigMap "
                  "<job>-config, the model cache (the hostPath or PersistentVolumeClaim spec.model.cache "
                  "names) and the projected ServiceAccount token"),
            _rule(f"!{pod_write} || {privileged_namespace} || namespaceObject.metadata.?labels"
                  f"[?'{names.PSA_ENFORCE_LABEL}'].orValue('') in {_list(PSA_LEVELS)}",
                  f"job pods run only in namespaces whose Pod Security level is enforced: a cluster admin "
                  f"labels the namespace {names.PSA_ENFORCE_LABEL}=baseline (or restricted), and the API server's "
                  f"PodSecurity admission then checks every field of that standard",
                  reason="Invalid"),
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
            _rule(f"!({kind('roles')} && {writes}) || variables.obj.rules.all(r, r.apiGroups == ['{names.GROUP}'] "
                  f"&& r.?resourceNames.orValue([]) == [variables.job] && r.resources.all(x, x in "
                  f"{_list([names.PLURAL, names.PLURAL + '/status'])}) && r.verbs.all(v, v in "
                  f"{_list(['get', 'list', 'watch', 'patch'])}))",
                  "the rftjob-operator's Roles reach only the RFTJob they belong to"),
            _rule(f"!({kind('rolebindings')} && {writes}) || (variables.obj.roleRef.kind == 'Role' && "
                  "variables.obj.roleRef.name.startsWith(variables.job + '-status-') && "
                  "variables.obj.?subjects.orValue([]).all(s, s.kind == 'ServiceAccount' && "
                  f"s.?namespace.orValue('') == request.namespace && s.name.startsWith({sa_prefix})))",
                  "the rftjob-operator binds only the job's own Roles to the job's own ServiceAccounts"),
        ],
    })


def _volumes_rendered() -> str:
    """CEL: every volume of a pod being written is of a kind the operator renders. The
    ServiceAccount admission plugin adds `kube-api-access-*` (a projected token, the
    cluster's CA ConfigMap `kube-root-ca.crt` and the namespace by downward API) before
    validation, so that projection is allowed too."""
    projected = ("v.projected.sources.all(s, has(s.serviceAccountToken) || has(s.downwardAPI) || "
                 "(has(s.configMap) && s.configMap.name == 'kube-root-ca.crt'))")
    # The claim's name, and a host path's, are checked against the job's spec by the owner
    # webhook (ownerhook.check_pod).
    return ("variables.volumes.all(v, has(v.emptyDir) || has(v.hostPath) || has(v.downwardAPI) || "
            "(has(v.configMap) && v.configMap.name == variables.job + '-config') || "
            f"(has(v.projected) && {projected}) || "
            f"(has(v.persistentVolumeClaim) && v.name == '{MODEL_CACHE_VOLUME}'))")


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
              "# See the module's docstring and docs/security.md.\n")
    docs = [status_policy(), _binding(STATUS_POLICY), operator_policy(), _binding(OPERATOR_POLICY),
            operator_status_policy(),
            _binding(OPERATOR_STATUS_POLICY)]
    return header + yaml.safe_dump_all(docs, sort_keys=False, width=100)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
