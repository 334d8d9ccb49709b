"""The static children of an RFTJob: everything but the pods. Pure, no I/O.

They live as long as the job, across trainer attempts: the ConfigMap with the resolved
trainer config, the job's own ServiceAccount (unless the user names one), the Role and
RoleBinding that let the job's pods write its status, and the headless Services that give
trainer and inference pods stable DNS names. The reconcile creates the missing ones and
replaces a ConfigMap whose spec hash drifted.
"""

from __future__ import annotations

import json

from rft_contract import names as c
from rft_contract.spec import RFTJobSpec

from .objects import JobRef, Obj, build_meta, labels, spec_hash, trainer_service_account


def build_trainer_config(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """The resolved config the trainer reads (defaults applied; no secrets)."""
    data = spec.model_dump(mode="json", exclude={"suspend", "failure_policy"})
    data["checkpoint"].pop("credentials_secret", None)
    data["job"] = {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid}
    return data


def build_configmap(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """The config, annotated with its hash so a spec change is seen as drift."""
    config = build_trainer_config(ref, spec)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": build_meta(
            ref,
            c.configmap_name(ref.name),
            labels(ref.name, c.ROLE_TRAINER),
            {c.ANNOTATION_SPEC_HASH: spec_hash(config)},
        ),
        "data": {c.CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True)},
    }


# ------------------------------------------------------------------ RBAC


def build_service_account(ref: JobRef) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": build_meta(ref, c.own_service_account_name(ref.name), labels(ref.name)),
    }


def build_status_role(ref: JobRef) -> Obj:
    """The job's pods may read and merge-patch the status of this one RFTJob, nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": build_meta(ref, c.status_role_name(ref.name), labels(ref.name)),
        "rules": [
            {
                "apiGroups": [c.GROUP],
                "resources": [f"{c.PLURAL}/status"],
                "resourceNames": [ref.name],
                "verbs": ["get", "patch"],
            },
            {
                # Sync agents watch their job (list/watch need a metadata.name field
                # selector to match resourceNames).
                "apiGroups": [c.GROUP],
                "resources": [c.PLURAL],
                "resourceNames": [ref.name],
                "verbs": ["get", "list", "watch"],
            },
        ],
    }


def build_status_role_binding(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """Binds the status Role to the account every pod of the job runs as."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": build_meta(ref, c.status_role_name(ref.name), labels(ref.name)),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": c.status_role_name(ref.name),
        },
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": trainer_service_account(ref.name, spec),
                "namespace": ref.namespace,
            }
        ],
    }


# ------------------------------------------------------------------ services


def _headless(ref: JobRef, name: str, role: str, port_name: str, port: int,
              publish_not_ready: bool = False) -> Obj:
    spec: Obj = {"clusterIP": "None"}
    if publish_not_ready:
        spec["publishNotReadyAddresses"] = True
    spec["selector"] = {c.LABEL_JOB: ref.name, c.LABEL_ROLE: role}
    spec["ports"] = [{"name": port_name, "port": port, "targetPort": port}]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": build_meta(ref, name, labels(ref.name, role)), "spec": spec}


def build_headless_service(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """Gives each trainer pod a stable DNS name `<pod>.<job>-trainer` for rendezvous;
    torchrun must resolve rank 0 before any pod is Ready (publishNotReadyAddresses)."""
    return _headless(ref, c.service_name(ref.name), c.ROLE_TRAINER, "rendezvous",
                     spec.trainer.master_port, publish_not_ready=True)


def build_inference_service(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """Headless: DNS names per replica (`<pod>.<job>-inference`) for explorers, and the
    Service for anything else that wants to query the policy."""
    return _headless(ref, c.inference_service_name(ref.name), c.ROLE_INFERENCE, "http", spec.inference.port)


def build_static_children(ref: JobRef, spec: RFTJobSpec) -> list[Obj]:
    """Everything but the pods: these live as long as the job, across attempts."""
    out = []
    if not spec.trainer.service_account_name:
        out.append(build_service_account(ref))
    out += [
        build_status_role(ref),
        build_status_role_binding(ref, spec),
        build_configmap(ref, spec),
        build_headless_service(ref, spec),
    ]
    if spec.inference is not None:
        out.append(build_inference_service(ref, spec))
    return out
