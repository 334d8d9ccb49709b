"""The static children of an RFTJob: everything but the pods. Pure, no I/O.

They live as long as the job, across trainer attempts: the ConfigMap with the resolved
trainer config, one ServiceAccount per pod role with the Roles and RoleBindings that let
the trainer and sync agents write the job's status and explorers read it, and the
headless Services that give trainer and inference pods stable DNS names. The reconcile
creates the missing ones, patches back one whose spec hash drifted (the spec changed what
it renders) or that was edited by hand, and recreates one whose immutable field drifted
(reconcile.compute_static_children).
"""

from __future__ import annotations

import json

from rft_contract import names, podconfig
from rft_contract.spec import RFTJobSpec

from .objects import JobRef, Obj, build_meta, labels, pod_roles, spec_hash


def build_trainer_config(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """The config the trainer, explorer and sync-agent pods read: the spec's fields in
    `rft_contract.podconfig.POD_CONFIG` (defaults applied; no secrets, nothing only the pod
    spec needs), and who the job is."""
    return podconfig.render(spec, {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid})


def build_configmap(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """The config, annotated with its hash so a spec change is seen as drift."""
    config = build_trainer_config(ref, spec)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": build_meta(
            ref,
            names.configmap_name(ref.name),
            labels(ref.name, names.ROLE_TRAINER),
            {names.ANNOTATION_SPEC_HASH: spec_hash(config)},
        ),
        "data": {names.CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True)},
    }


# ------------------------------------------------------------------ RBAC
#
# One ServiceAccount per pod role (`<job>-rft-trainer`, `-inference`, `-explorer`): RBAC
# lets the trainer and the sync agents patch this job's status and explorers only read it;
# the status admission policy (manifests/base/admission-policies.yaml) then narrows each
# writer to its own subtree, which it can do because the username names the role.


def build_service_account(ref: JobRef, spec: RFTJobSpec, role: str) -> Obj:
    meta = build_meta(ref, names.service_account_name(ref.name, role), labels(ref.name, role),
                      dict(spec.service_account_annotations) or None)
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}


def _read_own_job(ref: JobRef) -> Obj:
    # Sync agents and explorers watch their job (list/watch need a metadata.name field
    # selector to match resourceNames).
    return {"apiGroups": [names.GROUP], "resources": [names.PLURAL], "resourceNames": [ref.name],
            "verbs": ["get", "list", "watch"]}


def build_status_role(ref: JobRef) -> Obj:
    """Read and merge-patch the status of this one RFTJob, nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": build_meta(ref, names.status_role_name(ref.name), labels(ref.name)),
        "rules": [
            {"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/status"], "resourceNames": [ref.name],
             "verbs": ["get", "patch"]},
            _read_own_job(ref),
        ],
    }


def build_reader_role(ref: JobRef) -> Obj:
    """Read this one RFTJob (explorers throttle on the trainer's reported progress)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": build_meta(ref, names.status_reader_role_name(ref.name), labels(ref.name)),
        "rules": [_read_own_job(ref)],
    }


def _role_binding(ref: JobRef, role_name: str, pod_roles: list[str]) -> Obj:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": build_meta(ref, role_name, labels(ref.name)),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": names.service_account_name(ref.name, r),
                      "namespace": ref.namespace} for r in pod_roles],
    }


def build_rbac(ref: JobRef, spec: RFTJobSpec) -> list[Obj]:
    """The job's identities and what each may do: the trainer and the inference pods'
    sync agents write status, explorers read the job."""
    roles = pod_roles(spec)
    writers = [r for r in roles if r != names.ROLE_EXPLORER]
    out = [build_service_account(ref, spec, r) for r in roles]
    out += [build_status_role(ref), _role_binding(ref, names.status_role_name(ref.name), writers)]
    if names.ROLE_EXPLORER in roles:
        out += [build_reader_role(ref),
                _role_binding(ref, names.status_reader_role_name(ref.name), [names.ROLE_EXPLORER])]
    return out


# ------------------------------------------------------------------ services


def _headless(ref: JobRef, name: str, role: str, port_name: str, port: int,
              publish_not_ready: bool = False) -> Obj:
    spec: Obj = {"clusterIP": "None"}
    if publish_not_ready:
        spec["publishNotReadyAddresses"] = True
    spec["selector"] = {names.LABEL_JOB: ref.name, names.LABEL_ROLE: role}
    spec["ports"] = [{"name": port_name, "port": port, "targetPort": port}]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": build_meta(ref, name, labels(ref.name, role)), "spec": spec}


def build_headless_service(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """Gives each trainer pod a stable DNS name `<pod>.<job>-trainer` for rendezvous;
    torchrun must resolve rank 0 before any pod is Ready (publishNotReadyAddresses)."""
    return _headless(ref, names.service_name(ref.name), names.ROLE_TRAINER, "rendezvous",
                     spec.trainer.master_port, publish_not_ready=True)


def build_inference_service(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """Headless: DNS names per replica (`<pod>.<job>-inference`) for explorers, and the
    Service for anything else that wants to query the policy."""
    return _headless(ref, names.inference_service_name(ref.name), names.ROLE_INFERENCE, "http", spec.inference.port)


def build_static_children(ref: JobRef, spec: RFTJobSpec) -> list[Obj]:
    """Everything but the pods: these live as long as the job, across attempts."""
    out = build_rbac(ref, spec)
    out += [build_configmap(ref, spec), build_headless_service(ref, spec)]
    if spec.inference is not None:
        out.append(build_inference_service(ref, spec))
    return out
