"""The public face of the child-object builders: an RFTJob -> the objects it should have.

One concept per module behind it: what all children share (`objects`), the static
children (`children`), the trainer gang's pods (`trainer_pods`) and the inference and
explorer pods (`rollout_pods`). Tests and the trainer's config tests import the builders
from here, so the split stays an internal detail.
"""

from __future__ import annotations

from .children import (
    build_configmap,
    build_headless_service,
    build_inference_service,
    build_rbac,
    build_reader_role,
    build_service_account,
    build_static_children,
    build_status_role,
    build_trainer_config,
)
from .objects import (
    IMAGE_UID,
    JobRef,
    Obj,
    build_container_security_context,
    build_meta,
    build_placement,
    build_pod,
    build_pod_security_context,
    build_resources,
    build_s3_env,
    labels,
    owner_reference,
    pod_roles,
    spec_hash,
)
from .rollout_pods import build_explorer_pod, build_inference_pod, build_rollout_pods, inference_endpoints
from .trainer_pods import (
    build_torchrun_args,
    build_trainer_container,
    build_trainer_env,
    build_trainer_pod,
    build_trainer_pods,
)

__all__ = [
    "IMAGE_UID", "JobRef", "Obj",
    "build_configmap", "build_container_security_context", "build_explorer_pod",
    "build_headless_service", "build_inference_pod", "build_inference_service", "build_meta",
    "build_placement", "build_pod", "build_pod_security_context", "build_rbac", "build_reader_role",
    "build_resources", "build_rollout_pods", "build_s3_env", "build_service_account",
    "build_static_children", "build_status_role", "build_torchrun_args",
    "build_trainer_config", "build_trainer_container", "build_trainer_env", "build_trainer_pod",
    "build_trainer_pods", "inference_endpoints", "labels", "owner_reference", "pod_roles", "spec_hash",
]
